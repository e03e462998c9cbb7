"""Base vs SFT vs RL (outcome and turn credit) on a dev split: the whole training chain, unattended.

    python -m benchmarks.studies.rl.bench --families plate_reading multihop_pages --n 16
                                                  # -> results/rl/plates_multihop/summary.json
    python -m benchmarks.studies.rl.bench --families plate_reading --n 49 --tag g8 --sampler vllm \
        --set group_size=8 --set steps=12         # -> results/rl/plates_g8/, runs/rl-plates-g8-*

For each task family, through the `conductor` CLI exactly as a user would run it:

  1. `conductor sft` on the family's train split                    -> runs/sft-<short>/model
  2. `conductor train examples/train_<short>.toml`, credit.mode=outcome and =turn -> runs/rl-<short>-<credit>/
  3. `conductor eval` of the base model, the SFT model and both RL models on the same first n dev tasks (greedy),
     and the scripted expert the warm start imitates on the same tasks (through the same real tools)
  4. `conductor plot` of both RL runs                               -> runs/rl-<short>-<credit>/plots/*.png
     and both runs' training reward in one PNG                       -> results/rl/<run>/<short>_reward.png

`--set` overrides the example config of the RL runs (`--set group_size=8`, `--set rollout.max_turns=6`),
`--sampler vllm` samples training and evaluation through vLLM (passed on as `--set sampling.backend=vllm`; the
`vllm` extra), and `--tag` names those runs and results apart from the default ones.
A stage whose output already exists is skipped (an interrupted benchmark continues where it stopped; delete the
folder to redo one). Then one table per family is printed and everything, with each stage's wall time, is written
to JSON. RL wall time is the sum of the run's step times from its metrics.jsonl, so it is known for reused runs too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks import ROOT
from benchmarks.common.records import summary_path, write_summary
from benchmarks.common.stages import conductor
from conductor.models import DEFAULT_MODEL, resolve_model
from conductor.stopping import stop_like_ctrl_c
from main_agent.transformers_policy import tokenizer_dir
from training import tasks as task_data
from training.checkpoint import find_latest
from training.config import load_train_config
from training.evaluate import EvalConfig, in_flight, summarise
from training.experts import play_experts
from training.metrics import read_metrics
from training.play import tool_session
from training.plot import save_figure

CREDITS = ("outcome", "turn")


@dataclass(frozen=True)
class Options:
    """What every stage of one benchmark run shares (the command line)."""

    n: int
    runs: Path
    results: Path
    sets: tuple[str, ...]  # RL config overrides
    sampler: str  # sampling.backend of the RL runs and the evaluations
    tag: str

    def label(self, family: Family) -> str:
        """The family's short name with the tag: names the RL runs, their evaluations and the reward PNG."""
        return f"{family.short}-{self.tag}" if self.tag else family.short


@dataclass(frozen=True)
class Family:
    """How one task family is warm-started and trained here."""

    name: str
    short: str
    sft_settings: tuple[str, ...]
    """`conductor sft --set` values: the expert episodes and epochs that fit a 2-core CPU in well under an hour."""


FAMILIES = {
    "plate_reading": Family("plate_reading", "plates", ("limit=160", "epochs=2", "lr=3e-5", "eval_n=0")),
    "multihop_pages": Family("multihop_pages", "multihop", ("limit=24", "epochs=3", "lr=3e-5", "eval_n=0")),
}


def run_sft(family: Family, runs: Path) -> tuple[Path, float | None]:
    """The SFT checkpoint and the time it took (None when an earlier run's checkpoint was reused)."""
    out = runs / f"sft-{family.short}"
    if (out / "model" / "config.json").exists():
        return out / "model", None
    sets = [f'tasks=["{family.name}"]', *family.sft_settings, f"out_dir={out}"]
    seconds = conductor("sft", *[a for s in sets for a in ("--set", s)], log=runs / f"sft-{family.short}.log")
    return out / "model", seconds


def run_rl(family: Family, credit: str, sft_model: Path, opts: Options) -> Path:
    """A finished RL run directory for this credit mode (trained now unless already complete)."""
    config = ROOT / "examples" / f"train_{family.short}.toml"
    runs, label = opts.runs, opts.label(family)
    run_dir = runs / f"rl-{label}-{credit}"
    sets = [
        *opts.sets,
        f"sampling.backend={opts.sampler}",
        f"credit.mode={credit}",
        f"run_dir={run_dir}",
        f"policy={sft_model}",
    ]
    want = load_train_config(config, sets).steps
    latest = find_latest(run_dir) if run_dir.exists() else None
    if latest is None or latest.name != f"step_{want}":
        resume = ("--resume", str(run_dir)) if latest is not None else ()
        args = ["train", str(config), *[a for s in sets for a in ("--set", s)], *resume]
        conductor(*args, log=runs / f"rl-{label}-{credit}.log")
    if not list((run_dir / "plots").glob("*.png")):
        conductor("plot", str(run_dir), log=runs / f"rl-{label}-{credit}.plot.log")
    return run_dir


def run_eval(name: str, policy: str, family: Family, opts: Options) -> dict:
    """`conductor eval` of one policy on the first n dev tasks; its JSON report (reused when present)."""
    n = opts.n
    out = opts.runs / "eval" / f"{family.short}-{name}-n{n}.json"
    if not out.exists():
        args = ["eval", "--policy", policy, "--task", family.name, "--split", "dev", "--n", str(n)]
        args += ["--set", f"sampling.backend={opts.sampler}"]  # greedy stays: evaluation's [sampling] default
        conductor(*args, "--out", str(out), log=out.with_suffix(".log"))
    return json.loads(out.read_text(encoding="utf-8"))


def run_expert_eval(family: Family, opts: Options) -> dict:
    """The scripted expert on the same first n dev tasks, under evaluation's budgets: its report (reused when
    present). It is what a policy that imitated the demonstrations perfectly would score."""
    out = opts.runs / "eval" / f"{family.short}-expert-n{opts.n}.json"
    if not out.exists():
        print(f"$ scripted expert on {family.name} dev, first {opts.n}   (-> {out})", flush=True)
        report = asyncio.run(_play_expert(family.name, opts.n))
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(report.to_json() + "\n", encoding="utf-8")
    return json.loads(out.read_text(encoding="utf-8"))


async def _play_expert(family: str, n: int):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        tokenizer_dir(resolve_model(DEFAULT_MODEL)), local_files_only=True
    )
    cfg = in_flight(EvalConfig(task=family))
    tasks = task_data.load_family(family, "dev", limit=n)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-expert-") as work:
        async with tool_session(tasks, work_dir=Path(work), access=cfg.tools) as (tools, ready):
            episodes = await play_experts(
                ready, tools, tokenizer, rollout=cfg.rollout, max_concurrent=cfg.max_concurrent_episodes
            )
    return summarise(ready, episodes, policy="expert", wall_s=time.monotonic() - start)


def rl_summary(run_dir: Path) -> dict:
    """Wall time and the first/last training reward of a run, from its metrics.jsonl."""
    rows = read_metrics(run_dir / "metrics.jsonl")
    seconds = sum(
        r.get("time/rollout", 0.0) + r.get("time/train", 0.0) + r.get("time/weight_sync", 0.0) for r in rows
    )
    rewards = [r["reward/final"] for r in rows if not math.isnan(r.get("reward/final", math.nan))]
    plots = sorted(str(p) for p in (run_dir / "plots").glob("*.png"))
    return {
        "steps": len(rows),
        "wall_s": seconds,
        "reward_first": rewards[:1],
        "reward_last": rewards[-1:],
        "plots": plots,
    }


def plot_rewards(family: Family, rl_dirs: dict[str, Path], out: Path) -> Path:
    """Training reward per step of both credit modes in one PNG (sampled episodes, so noisy: 8 per step)."""
    import matplotlib

    matplotlib.use("Agg")  # files only
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for credit, run_dir in rl_dirs.items():
        rows = read_metrics(run_dir / "metrics.jsonl")
        ax.plot(
            [r["step"] for r in rows], [r["reward/final"] for r in rows], marker=".", label=f"credit={credit}"
        )
    ax.set(title=f"{family.name}: final reward of the training episodes", xlabel="step", ylabel="reward")
    ax.grid(alpha=0.3)
    ax.legend()
    return save_figure(fig, out)


def bench_family(family: Family, opts: Options) -> dict:
    """Every stage for one family; the evaluation reports keyed by policy name."""
    sft_model, sft_seconds = run_sft(family, opts.runs)
    rl_dirs = {credit: run_rl(family, credit, sft_model, opts) for credit in CREDITS}
    policies = {"base": "smollm2-135m-instruct", "sft": str(sft_model)}
    tag = f"-{opts.tag}" if opts.tag else ""
    for credit, run_dir in rl_dirs.items():
        policies[f"rl{tag}-{credit}"] = str(find_latest(run_dir) / "model")
    evals = {"expert": run_expert_eval(family, opts)}
    evals |= {name: run_eval(name, policy, family, opts) for name, policy in policies.items()}
    png = opts.results / f"{opts.label(family)}_reward.png"
    return {
        "family": family.name,
        "n": opts.n,
        "rl_settings": [*opts.sets, f"sampling.backend={opts.sampler}"],
        "sft_wall_s": sft_seconds,
        "rl": {credit: rl_summary(run_dir) for credit, run_dir in rl_dirs.items()},
        "reward_plot": str(plot_rewards(family, rl_dirs, png)),
        "policies": policies,
        "eval": evals,
    }


def table(result: dict) -> str:
    """One row per policy: what `conductor eval` measured on the same dev tasks."""
    head = f"{'policy':<11} | success | format valid | calls/ep | tool err | main tokens | wall s"
    lines = [f"{result['family']} dev, first {result['n']} tasks (greedy)", head, "-" * len(head)]
    for name, report in result["eval"].items():
        calls = sum(report["calls_per_tool"].values())
        lines.append(
            f"{name:<11} | {report['success_rate']:7.3f} | {report['format_validity']:12.3f} | "
            f"{calls:8.2f} | {report['tool_error_rate']:8.3f} | {report['main_tokens_median']:11.0f} | "
            f"{report['wall_s']:6.0f}"
        )
    for credit, rl in result["rl"].items():
        lines.append(
            f"rl-{credit}: {rl['steps']} steps in {rl['wall_s'] / 60:.1f} min, "
            f"train reward {rl['reward_first']} -> {rl['reward_last']}"
        )
    lines.append(f"reward curves: {result['reward_plot']}")
    return "\n".join(lines)


def main() -> None:
    stop_like_ctrl_c()  # `kill` stops the study as Ctrl-C does: its engine and commands close first
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--n", type=int, default=16, help="dev tasks per evaluation (the first n)")
    parser.add_argument("--steps", type=int, default=None, help="RL steps (default: the example config's)")
    parser.add_argument(
        "--set", action="append", default=[], help="RL config override key=value (repeatable)"
    )
    parser.add_argument(
        "--sampler",
        default="transformers",
        choices=("transformers", "vllm"),
        help="sampling.backend of the RL runs and evaluations",
    )
    parser.add_argument("--tag", default="", help="names the RL runs and results apart (e.g. g8)")
    parser.add_argument("--runs", type=Path, default=ROOT / "runs", help="where every stage writes")
    parser.add_argument(
        "--out", type=Path, help="JSON report (default: results/rl/<families>[_tag]/summary.json)"
    )
    args = parser.parse_args()
    shorts = "_".join(FAMILIES[name].short for name in args.families) + (f"_{args.tag}" if args.tag else "")
    args.out = args.out or summary_path("rl", shorts)
    sets = (*args.set, *([f"steps={args.steps}"] if args.steps is not None else []))
    opts = Options(args.n, args.runs, args.out.parent, sets, args.sampler, args.tag)
    start = time.monotonic()
    results = [bench_family(FAMILIES[name], opts) for name in args.families]
    for result in results:
        print("\n" + table(result))
    total = time.monotonic() - start
    print(f"\nbenchmark wall time (stages run now): {total / 60:.1f} min")
    write_summary(args.out, {"results": results, "wall_s": total})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
