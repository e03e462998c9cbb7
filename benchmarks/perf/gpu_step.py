"""One training step on whatever device this machine has: sampling, update, weight sync, tokens/s and the update's
share of the device's peak FLOP/s, for a few batch sizes and micro-batch sizes.

    python -m benchmarks.perf.gpu_step [--tiny] [--episodes 64 256] [--micro-batch-tokens default 65536]
                                       [--steps 3] [--out benchmarks/results/perf/gpu_step/summary.json]

The real loop (`training.loop.train`, sync, on cuda when visible, else cpu) with the built-in policy's shape
(SmolLM2-135M-Instruct's config, random weights: weights do not change speed, and nothing is downloaded; its
tokenizer and config.json must be in the model cache), the transformers sampler, precision "auto" (bf16 on a
GPU), full fine-tuning. The tasks are stub questions that need no data; the tools are benchmarks/perf/train.py's
stub server (the real schemas, every call answered at once). Each episode's first turn opens with a complete
search call, so every episode plays 2 turns of `max_new_tokens` sampled tokens (a random policy almost never
writes EOS); the reward is the share of even token ids, so groups vary and every step updates. Both replace the
family's loader and the scorer in this process only.

Per configuration (episodes per step x micro_batch_tokens; "default" leaves it unset, so the device rule of
training/config.py `device_sizes` picks it, and the run's checkpoint says what it picked), the means over
steps 2..N (step 1 also warms up): sampling s, update s, weight sync s, step s, sampled tokens/s, and the
update's MFU = its FLOPs / update s / the peak of its dtype (`PEAK_TFLOPS` by GPU name; on a CPU, or a GPU not
listed, the best of a few matmuls timed here). FLOPs by the 6·N·tokens rule: 6 x the body's parameters x the
unique tokens (a prefix the episodes share counted once), plus 6 x the output head's x the trained tokens (the
update runs the head nowhere else); attention's own FLOPs left out. An estimate, as MFU always is.

`--tiny` (the test suite's form, seconds on a CPU): 2 layers of width 64, 4 episodes of 2 turns x 4 tokens,
2 steps, the default micro-batch and 64 tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import math
import statistics
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch

from benchmarks.common.records import summary_path, write_summary
from benchmarks.perf.throughput import unique_tokens
from benchmarks.perf.train import stub_tools
from main_agent.rollout import RolloutConfig
from training.config import RunSettings, TrainConfig

PEAK_TFLOPS = {  # dense (no sparsity) bf16 tensor-core and plain fp32 (no TF32) peaks, from the vendors' sheets
    "H200": {"bf16": 989.0, "fp32": 67.0},
    "H100 PCIe": {"bf16": 756.0, "fp32": 51.0},
    "H100": {"bf16": 989.0, "fp32": 67.0},  # SXM
    "A100": {"bf16": 312.0, "fp32": 19.5},
    "L40S": {"bf16": 362.0, "fp32": 91.6},
    "L4": {"bf16": 121.0, "fp32": 30.3},
}
"""Matched against the device's name, longest key first ("H100 PCIe" before "H100")."""
FIRST_CALL = '<tool_call>{"name": "search", "arguments": {"query": "plus one"}}</tool_call>'
GROUP = 8  # episodes per task: the group whose rewards are each other's baseline


@dataclass(frozen=True)
class Shape:
    """What one invocation measures."""

    episodes: tuple[int, ...]
    """Episodes per step (batch_tasks x group_size)."""
    micro_batch_tokens: tuple[int | None, ...]
    """None: left unset, the device's size."""
    steps: int
    max_new_tokens: int
    group_size: int
    layers: dict[str, int] | None = None
    """Changes to the built-in model's config (the tiny form's); None: its own shape."""


FULL = Shape(
    episodes=(64, 256), micro_batch_tokens=(None, 65_536), steps=3, max_new_tokens=128, group_size=GROUP
)
TINY = Shape(
    episodes=(4,), micro_batch_tokens=(None, 64), steps=2, max_new_tokens=4, group_size=2,
    layers={"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
            "num_key_value_heads": 4, "head_dim": 16},
)  # fmt: skip


@dataclass(frozen=True)
class Parameters:
    total: int
    head: int
    """The output head's (vocabulary x width): tied to the input embedding in SmolLM2, so counted once in total."""
    tied: bool

    def update_flops(self, unique_tokens: float, trained_tokens: float) -> float:
        """6 x parameters x tokens, the head's only where a token is trained (the update runs it nowhere else) and
        the input embedding's nowhere (a lookup). Attention's own FLOPs are left out (short sequences)."""
        body = self.total - self.head - (0 if self.tied else self.head)
        return 6 * (body * unique_tokens + self.head * trained_tokens)


def random_policy(folder: Path, layers: dict[str, int] | None) -> Parameters:
    """The built-in policy's config (with `layers` changed) with random weights and its tokenizer, saved to
    `folder`; its parameters."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from conductor.models import DEFAULT_MODEL, resolve_model

    source = resolve_model(DEFAULT_MODEL)
    config = AutoConfig.from_pretrained(source, local_files_only=True)
    for key, value in (layers or {}).items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(source, local_files_only=True).save_pretrained(folder)
    head = model.get_output_embeddings().weight
    tied = head is model.get_input_embeddings().weight
    return Parameters(sum(p.numel() for p in model.parameters()), head.numel(), tied)


def parity_reward(episode, task, weights, kind, *, evidence_weight: float = 0.0, gains=None) -> list:
    """The share of even ids among the sampled tokens: a random policy's rewards vary, so no group is all equal
    and no update is skipped. It stands in for `training.step.score`, whose keywords it takes and ignores (the
    recipe's settings are off here)."""
    ids = [i for t in episode.turns for i in t.completion_ids]
    episode.reward = sum(i % 2 == 0 for i in ids) / max(len(ids), 1)
    episode.turn_rewards = [0.0] * len(episode.turns)
    return []


@contextlib.contextmanager
def stub_tasks(n: int) -> Iterator[None]:
    """Every family loads `n` stub questions (no data), and episodes are scored by `parity_reward`."""
    from training import step as step_module
    from training import tasks as task_data
    from training.tasks import Task

    tasks = [
        Task(f"stub-{i}", "video_qa", f"What is {i} plus one?", ("search",), str(i + 1)) for i in range(n)
    ]
    with (
        mock.patch.object(task_data, "load_family", lambda *a, **k: tasks),
        mock.patch.object(step_module, "score", parity_reward),
    ):
        yield


def config(shape: Shape, episodes: int, micro: int | None, *, policy: Path, run_dir: Path) -> TrainConfig:
    group = min(shape.group_size, episodes)
    assert episodes % group == 0, f"{episodes} episodes are not whole groups of {group}"
    rollout = RolloutConfig(max_turns=2, max_new_tokens=shape.max_new_tokens, first_turn_prefix=FIRST_CALL)
    return TrainConfig(
        run=RunSettings(policy=str(policy)), task="video_qa", steps=shape.steps, batch_tasks=episodes // group,
        group_size=group, micro_batch_tokens=micro, rollout=rollout, run_dir=run_dir, save_every=shape.steps,
        keep_last=1,
    )  # fmt: skip


def measure(cfg: TrainConfig, params: Parameters) -> dict[str, object]:
    """One run of `cfg`; the means over steps 2..N and the settings its learner resolved."""
    from main_agent.tokens import segment_ids
    from training.checkpoint import find_latest, saved_config
    from training.loop import train
    from training.metrics import load_episodes, read_metrics

    with stub_tasks(cfg.batch_tasks * cfg.steps):
        train(cfg, transport=stub_tools(0.0))
    rows = read_metrics(cfg.run_dir / "metrics.jsonl")[1:]
    latest = find_latest(cfg.run_dir)
    assert latest is not None, f"no checkpoint in {cfg.run_dir}"
    resolved = saved_config(latest)
    unique = [
        unique_tokens([ids for e in load_episodes(cfg.run_dir / "rollouts" / f"step_{int(r['step'])}.jsonl")
                       for ids in segment_ids(e)])
        for r in rows
    ]  # fmt: skip

    def mean(key: str) -> float:
        return statistics.fmean(r[key] for r in rows)

    update_s = mean("time/train")
    return {
        "episodes": cfg.batch_tasks * cfg.group_size,
        "micro_batch_tokens": resolved["micro_batch_tokens"],
        "micro_batch_tokens_set": cfg.micro_batch_tokens is not None,
        "max_concurrent_episodes": resolved["max_concurrent_episodes"],
        "precision": resolved["precision"],
        "sampling_s": mean("time/rollout"),
        "update_s": update_s,
        "weight_sync_s": mean("time/weight_sync"),
        "step_s": mean("time/rollout") + update_s + mean("time/weight_sync"),
        "sampled_tokens": mean("tokens/sampled"),
        "sampled_tokens_per_s": mean("perf/tokens_per_s"),
        "update_unique_tokens": statistics.fmean(unique),
        "update_trained_tokens": mean("update/tokens"),
        "update_flops": params.update_flops(statistics.fmean(unique), mean("update/tokens")),
        "update_skipped": sum(r["update/skipped"] for r in rows),
        "steps_averaged": len(rows),
    }


def device_peak(device: str, precision: str) -> dict[str, object]:
    """The device's name and peak FLOP/s for `precision`'s matmuls: from `PEAK_TFLOPS` for a listed GPU, else
    measured here (`matmul_peak`)."""
    gpu = device.startswith("cuda")
    name = torch.cuda.get_device_name(device) if gpu else f"CPU, {torch.get_num_threads()} torch threads"
    known = sheet_name(name) if gpu else None
    if known is not None:
        return {
            "name": name,
            "peak_flops": PEAK_TFLOPS[known][precision] * 1e12,
            "peak_from": f"{known} sheet",
        }
    return {"name": name, "peak_flops": matmul_peak(device, precision), "peak_from": "measured matmul"}


def sheet_name(device_name: str) -> str | None:
    """The `PEAK_TFLOPS` entry for a GPU's name ("NVIDIA H100 PCIe" -> "H100 PCIe"), None when not listed."""
    return next((k for k in sorted(PEAK_TFLOPS, key=len, reverse=True) if k in device_name), None)


def matmul_peak(device: str, precision: str, size: int = 1024) -> float:
    """FLOP/s of the fastest of 6 timed `size` x `size` matmuls in `precision`'s dtype (the first warms up)."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    a, b = (torch.randn(size, size, dtype=dtype, device=device) for _ in range(2))
    best = math.inf
    for _ in range(6):  # the first is the warm-up: thread pool and kernel selection
        start = time.perf_counter()
        a @ b
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def measured_on(device: str, cfg: TrainConfig, params: Parameters) -> dict[str, object]:
    """`measure(cfg)` with, on a GPU, the most memory torch allocated during the run (None on a CPU), and the
    memory freed for the next configuration."""
    gpu = device.startswith("cuda")
    if gpu:
        torch.cuda.reset_peak_memory_stats(device)
    row = measure(cfg, params)
    row["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30 if gpu else None
    gc.collect()  # the run's models and optimizer, before the next one allocates
    if gpu:
        torch.cuda.empty_cache()
    return row


def run(shape: Shape) -> dict[str, object]:
    """Every configuration of `shape`, each a run of its own in a temporary folder."""
    from conductor.models import default_device, device_memory_gib

    device = default_device()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-gpu-step-") as tmp:
        policy = Path(tmp) / "policy"
        params = random_policy(policy, shape.layers)
        rows = []
        for episodes in shape.episodes:
            for micro in shape.micro_batch_tokens:
                run_dir = Path(tmp) / f"run-{episodes}-{micro}"
                rows.append(
                    measured_on(
                        device, config(shape, episodes, micro, policy=policy, run_dir=run_dir), params
                    )
                )
    peak = device_peak(device, str(rows[0]["precision"]))
    for row in rows:
        row["update_mfu"] = float(row["update_flops"]) / float(row["update_s"]) / float(peak["peak_flops"])
    return {
        "device": {"type": device, "memory_gib": device_memory_gib(device), **peak},
        "parameters": dataclasses.asdict(params),
        "shape": dataclasses.asdict(shape),
        "torch": torch.__version__,
        "rows": rows,
        "wall_s": time.monotonic() - started,
    }


COLUMNS = (  # header, key, format
    ("episodes/step", "episodes", "{:.0f}"),
    ("micro_batch_tokens", "micro_batch_tokens", "{:,}"),
    ("sampling s", "sampling_s", "{:.2f}"),
    ("update s", "update_s", "{:.2f}"),
    ("weight sync s", "weight_sync_s", "{:.3f}"),
    ("step s", "step_s", "{:.2f}"),
    ("sampled tok/s", "sampled_tokens_per_s", "{:,.0f}"),
    ("update MFU", "update_mfu", "{:.2%}"),
    ("peak GiB", "peak_memory_gib", "{:.1f}"),  # a GPU's; "-" on a CPU
)


def table(result: dict) -> str:
    """A markdown table of the rows, under a line naming the device, its peak and the model."""
    dev = result["device"]
    memory = f", {dev['memory_gib']:.0f} GiB" if dev["type"] != "cpu" else ""
    head = (
        f"{dev['name']} ({dev['type']}{memory}), peak {dev['peak_flops'] / 1e12:.3g} TFLOP/s "
        f"{result['rows'][0]['precision']} ({dev['peak_from']}); {result['parameters']['total'] / 1e6:.1f}M parameters"
    )
    lines = [head, "| " + " | ".join(c[0] for c in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in result["rows"]:
        cells = [fmt.format(row[key]) if row[key] is not None else "-" for _, key, fmt in COLUMNS]
        cells[1] += "" if row["micro_batch_tokens_set"] else " (default)"
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def arguments(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="the test suite's form: seconds on a CPU")
    parser.add_argument("--episodes", type=int, nargs="+", help="episodes per step (default 64 256)")
    parser.add_argument(
        "--micro-batch-tokens",
        nargs="+",
        help='"default" (the device\'s) or a number (default: default 65536)',
    )
    parser.add_argument("--steps", type=int, help="steps per run; the means leave out step 1 (default 3)")
    parser.add_argument("--max-new-tokens", type=int, help="sampled tokens per turn (default 128)")
    parser.add_argument(
        "--out", type=Path, help="default benchmarks/results/perf/gpu_step[_tiny]/summary.json"
    )
    return parser.parse_args(argv)


def shape_of(args: argparse.Namespace) -> Shape:
    """FULL or TINY, with what the command line changes."""
    shape = TINY if args.tiny else FULL
    micro = None
    if args.micro_batch_tokens:
        micro = tuple(None if m == "default" else int(m) for m in args.micro_batch_tokens)
    changes = {
        "episodes": tuple(args.episodes) if args.episodes else None,
        "micro_batch_tokens": micro,
        "steps": args.steps,
        "max_new_tokens": args.max_new_tokens,
    }
    shape = dataclasses.replace(shape, **{k: v for k, v in changes.items() if v is not None})
    if shape.steps < 2:
        raise SystemExit("--steps must be at least 2: step 1 also warms up and is left out")
    return shape


def main(argv: Sequence[str] | None = None) -> None:
    from transformers.utils import logging as hf_logging

    args = arguments(argv)
    hf_logging.disable_progress_bar()  # the policy is saved and loaded once per run: no bars between the rows
    result = run(shape_of(args))
    print(table(result))
    out = write_summary(
        args.out or summary_path("perf", "gpu_step_tiny" if args.tiny else "gpu_step"), result
    )
    print(f"wrote {out} ({result['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
