"""Base vs SFT vs RL (outcome and turn credit) on a dev split: the whole training chain, unattended.

    python benchmarks/bench_rl.py --families plate_reading multihop_pages --n 16   # -> results/bench_rl_plates_multihop.json

For each task family, through the `conductor` CLI exactly as a user would run it:

  1. `conductor sft` on the family's train split                    -> runs/sft-<short>/model
  2. `conductor train examples/train_<short>.toml`, credit=outcome and credit=turn -> runs/rl-<short>-<credit>/
  3. `conductor eval` of the base model, the SFT model and both RL models on the same first n dev tasks (greedy)
  4. `conductor plot` of both RL runs                               -> runs/rl-<short>-<credit>/plots/*.png
     and both runs' training reward in one PNG                       -> results/bench_rl_<short>_reward.png

A stage whose output already exists is skipped (an interrupted benchmark continues where it stopped; delete the
folder to redo one). Then one table per family is printed and everything, with each stage's wall time, is written
to JSON. RL wall time is the sum of the run's step times from its metrics.jsonl, so it is known for reused runs too.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from training.checkpoint import find_latest  # noqa: E402
from training.config import load_train_config  # noqa: E402
from training.metrics import read_metrics  # noqa: E402

CREDITS = ("outcome", "turn")


@dataclass(frozen=True)
class Family:
    """How one task family is warm-started and trained here."""

    name: str
    short: str
    sft_settings: tuple[str, ...]
    """`conductor sft --set` values: the expert episodes and epochs that fit a 2-core CPU in well under an hour."""


FAMILIES = {
    "plate_reading": Family("plate_reading", "plates", ("limit=48", "epochs=3", "lr=3e-5", "eval_n=0")),
    "multihop_pages": Family("multihop_pages", "multihop", ("limit=24", "epochs=3", "lr=3e-5", "eval_n=0")),
}


def conductor(*args: str, log: Path) -> float:
    """Run one `conductor` command with its output in `log`; its wall time, or exit on failure."""
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"$ conductor {' '.join(args)}   (log: {log})", flush=True)
    start = time.monotonic()
    with log.open("w", encoding="utf-8") as out:
        code = subprocess.call(["conductor", *args], stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    if code != 0:
        sys.exit(f"conductor {args[0]} failed with exit code {code}; see {log}")
    return time.monotonic() - start


def run_sft(family: Family, runs: Path) -> tuple[Path, float | None]:
    """The SFT checkpoint and the time it took (None when an earlier run's checkpoint was reused)."""
    out = runs / f"sft-{family.short}"
    if (out / "model" / "config.json").exists():
        return out / "model", None
    sets = [f'tasks=["{family.name}"]', *family.sft_settings, f"out_dir={out}"]
    seconds = conductor("sft", *[a for s in sets for a in ("--set", s)], log=runs / f"sft-{family.short}.log")
    return out / "model", seconds


def run_rl(family: Family, credit: str, sft_model: Path, runs: Path, steps: int | None) -> Path:
    """A finished RL run directory for this credit mode (trained now unless already complete)."""
    config = ROOT / "examples" / f"train_{family.short}.toml"
    run_dir = runs / f"rl-{family.short}-{credit}"
    sets = [f"credit={credit}", f"run_dir={run_dir}", f"policy={sft_model}"]
    if steps is not None:
        sets.append(f"steps={steps}")
    want = load_train_config(config, sets).steps
    latest = find_latest(run_dir) if run_dir.exists() else None
    if latest is None or latest.name != f"step_{want}":
        resume = ("--resume", str(run_dir)) if latest is not None else ()
        args = ["train", str(config), *[a for s in sets for a in ("--set", s)], *resume]
        conductor(*args, log=runs / f"rl-{family.short}-{credit}.log")
    if not list((run_dir / "plots").glob("*.png")):
        conductor("plot", str(run_dir), log=runs / f"rl-{family.short}-{credit}.plot.log")
    return run_dir


def run_eval(name: str, policy: str, family: Family, n: int, runs: Path) -> dict:
    """`conductor eval` of one policy on the first n dev tasks; its JSON report (reused when present)."""
    out = runs / "eval" / f"{family.short}-{name}-n{n}.json"
    if not out.exists():
        args = ["eval", "--policy", policy, "--task", family.name, "--split", "dev", "--n", str(n)]
        conductor(*args, "--out", str(out), log=out.with_suffix(".log"))
    return json.loads(out.read_text(encoding="utf-8"))


def rl_summary(run_dir: Path) -> dict:
    """Wall time and the first/last training reward of a run, from its metrics.jsonl."""
    rows = read_metrics(run_dir / "metrics.jsonl")
    seconds = sum(r.get("time/rollout", 0.0) + r.get("time/train", 0.0) for r in rows)
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
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def bench_family(family: Family, n: int, runs: Path, steps: int | None, results: Path) -> dict:
    """Every stage for one family; the evaluation reports keyed by policy name."""
    sft_model, sft_seconds = run_sft(family, runs)
    rl_dirs = {credit: run_rl(family, credit, sft_model, runs, steps) for credit in CREDITS}
    policies = {"base": "smollm2-135m-instruct", "sft": str(sft_model)}
    for credit, run_dir in rl_dirs.items():
        policies[f"rl-{credit}"] = str(find_latest(run_dir) / "model")
    evals = {name: run_eval(name, policy, family, n, runs) for name, policy in policies.items()}
    return {
        "family": family.name,
        "n": n,
        "sft_wall_s": sft_seconds,
        "rl": {credit: rl_summary(run_dir) for credit, run_dir in rl_dirs.items()},
        "reward_plot": str(plot_rewards(family, rl_dirs, results / f"bench_rl_{family.short}_reward.png")),
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
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--n", type=int, default=16, help="dev tasks per evaluation (the first n)")
    parser.add_argument("--steps", type=int, default=None, help="RL steps (default: the example config's)")
    parser.add_argument("--runs", type=Path, default=ROOT / "runs", help="where every stage writes")
    parser.add_argument("--out", type=Path, help="JSON report (default: results/bench_rl_<families>.json)")
    args = parser.parse_args()
    shorts = "_".join(FAMILIES[name].short for name in args.families)
    args.out = args.out or ROOT / "benchmarks" / "results" / f"bench_rl_{shorts}.json"
    start = time.monotonic()
    results = [
        bench_family(FAMILIES[name], args.n, args.runs, args.steps, args.out.parent) for name in args.families
    ]
    for result in results:
        print("\n" + table(result))
    total = time.monotonic() - start
    print(f"\nbenchmark wall time (stages run now): {total / 60:.1f} min")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"results": results, "wall_s": total}, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
