"""The long-horizon study: plate_audit at N photos per episode x credit mode, at equal sampled-token budgets.

    python -m benchmarks.studies.horizon.bench --sampler vllm  # N 1 4 8, 2 seeds at N = 8
                                                               # -> results/horizon/main/summary.json
    python -m benchmarks.studies.horizon.bench --recorded      # the table and plot of the stages so far
    python -m benchmarks.studies.horizon.bench --ns 1 4 --steps 3 --tag quick --sampler vllm

From one SFT warm start (`--policy`, made as examples/train_audit.toml says), for every N and credit mode, through
the `conductor` CLI exactly as a user would run it:

  1. `conductor train examples/train_audit.toml` with the horizon fixed at N (no curriculum) -> runs/horizon*/n<N>-<credit>-s<seed>
  2. `conductor eval` of its last checkpoint, greedy, on the first dev audits at the same N (--n audits)

Equal budgets: outcome and turn credit play G = 4 episodes per audit; branch credit plays G = 2 and continues one
chosen turn per episode once from before it and once from after it (branch_k = 1, branch_turns = 1), about two
episodes' worth of sampling more per episode: the same sampled tokens per step by design. The table shows what
each mode really sampled per step (episodes and branches), and the plot puts per-item accuracy of the training
episodes against cumulative sampled tokens, so no mode can look better by sampling more.

Each finished stage (one N, credit mode and seed: trained, then evaluated) writes a small record to
results/horizon/main/records/<stage>.json: its settings, the SHA-256 of the warm start's weights, the evaluation and the
training summary. The study resumes from those records, so it can be spread over machines and clean checkouts: a
stage with a record made under the same settings is not run again, a run cut short before its record resumes from
its last checkpoint (`--resume`), and a record from another warm start is reported as such, not silently mixed.
The default size (2 RL steps of 1 audit x 4 episodes, 3 dev audits) is what a 2-core CPU affords: about 20 min a
stage at N = 8, so the 12 stages take about four hours, over more than one sitting. Prints one table: N x credit -> success, per-item accuracy, calls per
episode, peak main context, sub-agent tokens read, sampled tokens per step, wall time; writes JSON and a PNG.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks import ROOT
from benchmarks.common.records import summary_path, write_summary
from benchmarks.common.stages import conductor, train_to, warm_start_sha
from conductor.stopping import stop_like_ctrl_c
from training.checkpoint import find_latest
from training.metrics import read_metrics
from training.plot import save_figure

CONFIG = ROOT / "examples" / "train_audit.toml"
CREDITS = {  # credit mode -> its settings at equal sampled-token budgets (see the module docstring)
    "outcome": ("credit.mode=outcome", "group_size=4"),
    "turn": ("credit.mode=turn", "credit.baseline=anchor", "group_size=4"),
    "branch": ("credit.mode=branch", "credit.branch_k=1", "credit.branch_turns=1", "group_size=2"),
}


@dataclass(frozen=True)
class Options:
    """The command line, shared by every run."""

    policy: str
    steps: int
    batch_tasks: int
    eval_n: int
    sampler: str
    runs: Path
    records: Path
    recorded_only: bool

    def settings(self) -> dict:
        """What a stage's record must match to be reused."""
        return {
            "steps": self.steps,
            "batch_tasks": self.batch_tasks,
            "eval_n": self.eval_n,
            "sampler": self.sampler,
        }


def train(n: int, credit: str, seed: int, opts: Options) -> Path:
    """A finished run of `opts.steps` steps (trained, resumed or reused)."""
    run_dir = opts.runs / f"n{n}-{credit}-s{seed}-b{opts.batch_tasks}"
    sets = [
        f"policy={opts.policy}",
        f"steps={opts.steps}",
        f"seed={seed}",
        f"run_dir={run_dir}",
        f"save_every={opts.steps}",
        f"batch_tasks={opts.batch_tasks}",
        f"horizon.items={n}",
        "horizon.max_items=0",
        f"sampling.backend={opts.sampler}",
        *CREDITS[credit],
    ]
    return train_to(CONFIG, run_dir, sets, opts.steps)


def evaluate(run_dir: Path, n: int, opts: Options) -> dict:
    """`conductor eval` of the run's last checkpoint on the first dev audits of N photos (reused when present)."""
    latest = find_latest(run_dir)
    out = run_dir / f"eval-dev-n{n}-{latest.name}-first{opts.eval_n}.json"  # a longer run is evaluated anew
    if not out.exists():
        policy = str(latest / "model")
        args = [
            "eval",
            "--policy",
            policy,
            "--task",
            "plate_audit",
            "--split",
            "dev",
            "--n",
            str(opts.eval_n),
        ]
        args += ["--set", f"items={n}", "--set", f"sampling.backend={opts.sampler}"]
        args += [
            a for s in ("rollout.fold_at_tokens=1792", "rollout.max_new_tokens=128") for a in ("--set", s)
        ]
        args += ["--set", "rollout.wall_clock_s=3600"]
        conductor(*args, "--out", str(out), log=out.with_suffix(".log"))
    return json.loads(out.read_text(encoding="utf-8"))


def training_summary(run_dir: Path) -> dict:
    """Sampled tokens and wall time per step, and the per-item accuracy curve, from metrics.jsonl."""
    rows = read_metrics(run_dir / "metrics.jsonl")
    sampled = [r.get("tokens/sampled", 0.0) + r.get("branch/sampled_tokens", 0.0) for r in rows]
    cumulative = [sum(sampled[: i + 1]) for i in range(len(sampled))]
    return {
        "steps": len(rows),
        "wall_s": sum(r["time/rollout"] + r["time/train"] + r["time/weight_sync"] for r in rows),
        "sampled_tokens_per_step": statistics.mean(sampled) if sampled else math.nan,
        "branch_tokens_per_step": statistics.mean([r.get("branch/sampled_tokens", 0.0) for r in rows]),
        "branch_cache_hit_rate": statistics.mean([r.get("branch/cache_hit_rate", math.nan) for r in rows]),
        "curve": [(c, r.get("items/right", math.nan)) for c, r in zip(cumulative, rows, strict=True)],
    }


@functools.cache
def stage(n: int, credit: str, seed: int, opts: Options) -> dict | None:
    """One stage's record: read when it was made under the same settings, else trained, evaluated and written
    (None when only recorded stages are wanted and this one has none)."""
    path = opts.records / f"n{n}-{credit}-s{seed}.json"
    if path.exists():
        record = json.loads(path.read_text(encoding="utf-8"))
        if record["settings"] == opts.settings():
            return record
        then = "left out" if opts.recorded_only else "running it again"
        print(f"{path.name}: made with {record['settings']}, not {opts.settings()}: {then}", flush=True)
    if opts.recorded_only:
        return None
    sha = warm_start_sha(
        opts.policy, made_by=CONFIG.name
    )  # before training, so that a missing warm start stops the study at once
    run_dir = train(n, credit, seed, opts)
    record = {
        "stage": {"n": n, "credit": credit, "seed": seed},
        "settings": opts.settings(),
        "warm_start": {"policy": opts.policy, "sha256": sha},
        "eval": evaluate(run_dir, n, opts),
        "training": training_summary(run_dir),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return record


def row(n: int, credit: str, seeds: list[int], opts: Options) -> dict | None:
    """One table row: the mean over the seeds' records of the evaluations and the training costs."""
    records = [r for r in (stage(n, credit, seed, opts) for seed in seeds) if r is not None]
    if not records:
        return None
    evals = [r["eval"] for r in records]
    trained = [r["training"] for r in records]

    def avg(values: list[float]) -> float:
        return statistics.mean(values) if values else math.nan

    return {
        "n": n,
        "credit": credit,
        "seeds": [r["stage"]["seed"] for r in records],
        "warm_starts": sorted({r["warm_start"]["sha256"][:12] for r in records}),
        "success": avg([e["success_rate"] for e in evals]),
        "items_right": avg([e["items_right"] for e in evals]),
        "items_right_per_seed": [e["items_right"] for e in evals],
        "calls": avg([e["calls_mean"] for e in evals]),
        "peak_context": max(e["main_tokens_peak"] for e in evals),
        "segments": avg([e["segments_mean"] for e in evals]),
        "subagent_tokens": avg([e["subagent_tokens_read"] for e in evals]),
        "sampled_per_step": avg([t["sampled_tokens_per_step"] for t in trained]),
        "branch_per_step": avg([t["branch_tokens_per_step"] for t in trained]),
        "train_wall_s": avg([t["wall_s"] for t in trained]),
        "eval_wall_s": avg([e["wall_s"] for e in evals]),
        "curves": [t["curve"] for t in trained],
    }


def table(rows: list[dict]) -> str:
    head = (
        f"{'N':>3} {'credit':<8} | seeds | success | items right | calls/ep | peak ctx | segs | sub-agent tok | "
        f"sampled/step (branch) | train min | eval min"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['n']:>3} {r['credit']:<8} | {len(r['seeds']):5d} | {r['success']:7.3f} | {r['items_right']:11.3f} | "
            f"{r['calls']:8.1f} | {r['peak_context']:8.0f} | {r['segments']:4.1f} | {r['subagent_tokens']:13.0f} | "
            f"{r['sampled_per_step']:12.0f} ({r['branch_per_step']:5.0f}) | {r['train_wall_s'] / 60:9.1f} | "
            f"{r['eval_wall_s'] / 60:8.1f}"
        )
    return "\n".join(lines)


def plot(rows: list[dict], n: int, out: Path) -> Path:
    """Per-item accuracy of the training episodes against cumulative sampled tokens, each mode at N (one line per
    seed)."""
    import matplotlib

    matplotlib.use("Agg")  # files only
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for r in (r for r in rows if r["n"] == n):
        for seed, curve in zip(r["seeds"], r["curves"], strict=True):
            xs, ys = zip(*curve, strict=True) if curve else ((), ())
            ax.plot(xs, ys, marker=".", label=f"{r['credit']} (seed {seed})")
    ax.set(
        title=f"plate_audit N={n}: items right while training", xlabel="sampled tokens", ylabel="items right"
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return save_figure(fig, out)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", default="runs/sft-audit/model", help="the SFT warm start")
    parser.add_argument("--ns", type=int, nargs="+", default=[1, 4, 8], help="photos per episode")
    parser.add_argument("--credits", nargs="+", default=list(CREDITS), choices=list(CREDITS))
    parser.add_argument("--seeds", type=int, default=1, help="seeds per N (the longest N gets --long-seeds)")
    parser.add_argument("--long-seeds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2, help="RL steps per run")
    parser.add_argument(
        "--batch-tasks", type=int, default=1, help="audits per RL step (x group_size episodes)"
    )
    parser.add_argument("--eval-n", type=int, default=3, help="dev audits per evaluation (the first ones)")
    parser.add_argument("--sampler", default="transformers", choices=("transformers", "vllm", "auto"))
    parser.add_argument("--recorded", action="store_true", help="run nothing: tabulate the recorded stages")
    parser.add_argument("--tag", default="", help="names the runs and results apart")
    return parser.parse_args()


def main() -> None:
    stop_like_ctrl_c()  # `kill` stops the study as Ctrl-C does: its engine and commands close first
    args = parse_args()
    suffix = f"_{args.tag}" if args.tag else ""
    out = summary_path("horizon", args.tag or "main")
    opts = Options(
        args.policy,
        args.steps,
        args.batch_tasks,
        args.eval_n,
        args.sampler,
        ROOT / "runs" / f"horizon{suffix}",
        out.parent / "records",
        args.recorded,
    )
    start = time.monotonic()
    longest = max(args.ns)
    plan = [
        (n, c, range(args.long_seeds if n == longest else args.seeds))
        for n in sorted(args.ns)
        for c in args.credits
    ]
    # Seed by seed, so that a study cut short has every N and credit mode at the same seeds.
    for seed in range(max(args.seeds, args.long_seeds)):
        for n, credit, seeds in plan:
            if seed in seeds:
                stage(n, credit, seed, opts)
    rows = [r for r in (row(n, credit, list(seeds), opts) for n, credit, seeds in plan) if r is not None]
    if not rows:
        sys.exit(f"no stage recorded in {opts.records} under {opts.settings()}")
    png = plot(rows, max(r["n"] for r in rows), out.with_suffix(".png"))
    print("\n" + table(rows))
    warm_starts = sorted({sha for r in rows for sha in r["warm_starts"]})
    if len(warm_starts) > 1:
        print(
            f"\nNOTE: the stages come from {len(warm_starts)} warm starts ({', '.join(warm_starts)}); see 'warm_starts'"
        )
    total = time.monotonic() - start
    print(f"\nplot: {png}\nstudy wall time (stages run now): {total / 60:.1f} min")
    report = {
        "rows": rows,
        "settings": vars(args) | opts.settings(),
        "warm_starts": warm_starts,
        "plot": str(png.relative_to(ROOT)),
        "wall_s_now": total,
    }
    write_summary(out, report)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
