"""Trainer benchmark: sync vs async episodes/s, and our update step vs TRL's GRPOTrainer update.

    python -m benchmarks.perf.train [--out benchmarks/results/perf/train/summary.json] [--quick]

1. Sync vs async (`training.loop.train` without and with `overlap` on one TrainConfig, LOOP): the
   real SmolLM2-135M-Instruct policy plays plate_reading train tasks (needs the shared data) against a stub tool
   server passed as `transport=` (as tests/test_train.py does): real tool schemas, every call answered after a
   fixed latency, so overlap matters as with real sub-agents while the numbers stay about the trainer. Untrained,
   the policy writes no valid call, so each episode's first turn opens with a complete image_ops call
   (`RolloutConfig.first_turn_prefix`, like tool_choice="required"). A thread stamps each metrics row as written:
   episodes/s "steady" = episodes of steps 2..N / (row N - row 1 time), which leaves out step 1 (model load,
   first generate, optimizer state; its own row); "all" = every episode / (row N - start). The one checkpoint
   comes after row N.
2. Update step on identical synthetic batches (random ids, seed 0; advantages ~ N(0, 1) per sequence; old
   log-probs = the starting model's own): ours = `training.update.update` (full [B, T, V] logits per micro-batch);
   TRL = `GRPOTrainer.training_step` (compute_loss + backward; a fused, chunked LM head over completion positions
   only, entropy computed) per micro-batch, then its `_clip_grad_norm` and the AdamW of its `create_optimizer`;
   `_prepare_inputs` (where TRL generates and scores) is the identity, so nothing is generated. Matched: micro-
   batches, fp32, CPU, no activation checkpointing, token-level loss ("dapo"), eps 0.2/0.28, beta 0, lr 1e-5, no
   weight decay, clip norm 1. Each side runs in its own spawned process (peak RSS = its ru_maxrss, "setup" = RSS
   before step 1): an untimed warm-up step (its loss and gradient norm, equal on both sides, show the same
   objective on the same batch), then `update_iters` timed steps; tokens/s from their median.

Prints two tables and writes JSON. Numbers from a machine busy with other work are not comparable.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import platform
import resource
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from importlib.metadata import version
from multiprocessing import get_context
from pathlib import Path

import httpx
import psutil
import torch

from benchmarks.common.records import summary_path, write_summary
from main_agent.rollout import RolloutConfig
from training.config import RunSettings, TrainConfig, config_to_dict
from training.tasks import load_family

POLLING_S = 0.05  # the row clock's file poll: well below any step's seconds
STEP_KEYS = ("step", "time/rollout", "time/train", "tools/calls_per_episode", "episodes/collected")
POLICY = "smollm2-135m-instruct"
LR = 1e-5  # TrainConfig's full fine-tuning default
MICRO_BATCH_TOKENS = 2048  # TrainConfig's default: sets both sides' micro-batch size
PACKAGES = ("torch", "transformers", "trl", "accelerate", "datasets", "psutil")  # versions in the JSON
FIRST_CALL = '<tool_call>{"name": "image_ops", "arguments": {"op": "load", "image": "photo.jpg"}}</tool_call>'
Ratios = dict[str, float | None]
Step = Callable[[], tuple[float, float]]  # one optimizer step, returning its loss and gradient norm
DIGITS = (2, 1, 1, 0, 0, 6, 5)  # decimals of the update table's columns


@dataclass(frozen=True)
class BenchConfig:
    """What both parts run."""

    steps: int = 3
    """Part 1: steps per loop; steady-state episodes/s needs at least 2."""
    tool_latency_s: float = 1.5
    """Part 1: every stub tool call sleeps this long (real sub-agent calls take seconds)."""
    sequences: int = 8
    """Part 2: sequences per update batch."""
    prompt_tokens: int = 256
    """Part 2: prompt tokens per sequence (not trained on)."""
    completion_tokens: int = 256
    """Part 2: completion tokens per sequence (trained on)."""
    update_iters: int = 3
    """Part 2: timed optimizer steps per side, after one untimed warm-up step."""


QUICK = BenchConfig(steps=1, sequences=2, prompt_tokens=128, completion_tokens=128, update_iters=1)


def in_child(fn, *args):
    """Run `fn(*args)` in a fresh spawned process (its own peak RSS, no state left by the other side)."""
    with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def rss_mb() -> tuple[float, float]:
    """(current, peak) resident set size of this process in MiB (Linux reports ru_maxrss in KiB)."""
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return psutil.Process().memory_info().rss / 2**20, peak_kib / 2**10


# ---------------------------------------------------------------- part 1: sync vs async


def stub_tools(latency_s: float) -> httpx.MockTransport:
    """GET /v1/tools: the real tool schemas; every POST answers ok with a fixed observation after `latency_s`."""
    from subagents import image_ops, page_qa, search, video_summary
    from tool_server.host import tool_schema

    schemas = [tool_schema(m) for m in (page_qa, image_ops, video_summary, search)]
    result = {"ok": True, "error": None, "observation": "Done: the plate reads 7ABC123 (stub result)."}
    result |= {"latency_ms": latency_s * 1e3, "tokens_read": 0, "tokens_returned": 12, "cached": False}

    async def respond(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/tools":
            return httpx.Response(200, json=schemas)
        await asyncio.sleep(latency_s)
        return httpx.Response(200, json=result)

    return httpx.MockTransport(respond)


# Part 1's runs: B = 2 tasks x G = 2 episodes per step, 2 turns of at most 48 new tokens (a short call or answer),
# each episode opening with FIRST_CALL already written (the prefix is prompt, not trained).
LOOP = TrainConfig(
    run=RunSettings(policy=POLICY),
    task="plate_reading",
    batch_tasks=2,
    group_size=2,
    lr=LR,
    rollout=RolloutConfig(max_turns=2, max_new_tokens=48, first_turn_prefix=FIRST_CALL),
)


class RowClock(threading.Thread):
    """Stamps (monotonic) the moment each new line of a metrics file appears."""

    def __init__(self, path: Path) -> None:
        super().__init__(daemon=True)
        self.path, self.stamps, self.done = path, [], threading.Event()

    def run(self) -> None:
        while not self.done.wait(POLLING_S):
            lines = self.path.read_text().count("\n") if self.path.is_file() else 0
            self.stamps += [time.monotonic()] * (lines - len(self.stamps))


@dataclass(frozen=True)
class LoopResult:
    mode: str
    steps: list[dict[str, float]]  # STEP_KEYS of each row, gap_s: since the previous row (or start)
    episodes_per_s_all: float  # every episode / (last row - start)
    episodes_per_s_steady: float | None  # steps 2..N only
    peak_rss_mb: float
    config: dict[str, object]  # the TrainConfig it ran (run_dir was a temporary folder)


def run_loop(mode: str, bench: BenchConfig) -> LoopResult:
    """One whole training run of `mode` ("sync"/"async") in this (child) process, timed row by row."""
    from training.loop import train
    from training.metrics import read_metrics

    with tempfile.TemporaryDirectory() as tmp:
        n, run_dir = bench.steps, Path(tmp) / "run"  # limit: B x n tasks, so each step gets new ones
        run = dataclasses.replace(LOOP.run, limit=LOOP.batch_tasks * n)
        cfg = dataclasses.replace(LOOP, run=run, steps=n, run_dir=run_dir, save_every=n)
        clock = RowClock(cfg.run_dir / "metrics.jsonl")
        clock.start()
        start = time.monotonic()
        train(cfg, overlap=mode == "async", transport=stub_tools(bench.tool_latency_s))
        time.sleep(2 * POLLING_S)  # the clock's last poll
        clock.done.set()
        clock.join()
        rows = read_metrics(cfg.run_dir / "metrics.jsonl")
    stamps = clock.stamps
    gaps = [b - a for a, b in zip([start, *stamps], stamps, strict=False)]
    steps = [{k: r[k] for k in STEP_KEYS} | {"gap_s": g} for r, g in zip(rows, gaps, strict=True)]
    episodes = [s["episodes/collected"] for s in steps]
    steady = sum(episodes[1:]) / (stamps[-1] - stamps[0]) if len(steps) > 1 else None
    all_rate = sum(episodes) / (stamps[-1] - start)
    return LoopResult(mode, steps, all_rate, steady, rss_mb()[1], config_to_dict(cfg))


# ---------------------------------------------------------------- part 2: our update vs TRL's


def prepare_batch(bench: BenchConfig, path: Path) -> None:
    """Random ids, the starting model's log-probs of the completions, advantages ~ N(0, 1); saved to `path`."""
    from conductor.models import resolve_model
    from main_agent.transformers_policy import load_model
    from training.loss import token_logprobs

    model, _ = load_model(resolve_model(POLICY))
    gen = torch.Generator().manual_seed(0)
    width = bench.prompt_tokens + bench.completion_tokens
    ids = torch.randint(0, model.config.vocab_size, (bench.sequences, width), generator=gen)
    with torch.no_grad():
        logps = torch.cat([token_logprobs(model, row, torch.ones_like(row)) for row in ids.split(1)])
    advantages = torch.randn(bench.sequences, generator=gen)
    torch.save({"ids": ids, "old": logps[:, bench.prompt_tokens :], "adv": advantages}, path)


@dataclass(frozen=True)
class SideResult:
    name: str
    method: str
    warmup_loss: float  # the warm-up step's loss: equal on both sides = the same objective on the same batch
    warmup_grad_norm: float  # its gradient norm before clipping
    warmup_s: float
    step_s: list[float]  # the timed steps
    setup_rss_mb: float  # model, optimizer object and batch loaded: before the first step
    peak_rss_mb: float


def layout(bench: BenchConfig) -> tuple[int, int]:
    """(sequences per micro-batch, micro-batches) as `micro_batches` cuts the batch: both sides use it."""
    per = max(1, MICRO_BATCH_TOKENS // (bench.prompt_tokens + bench.completion_tokens))
    return min(per, bench.sequences), -(-bench.sequences // per)


def measure(name: str, method: str, step: Step, bench: BenchConfig) -> SideResult:
    """One warm-up call of `step`, then `update_iters` timed calls."""
    setup = rss_mb()[0]
    t0 = time.perf_counter()
    loss, norm = step()
    warm = time.perf_counter() - t0
    times = []
    for _ in range(bench.update_iters):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return SideResult(name, method, loss, norm, warm, times, setup, rss_mb()[1])


def throughput(side: SideResult, bench: BenchConfig) -> dict[str, float]:
    """Tokens per second of the median timed step: all sequence tokens, and the trained (completion) ones."""
    per_s = bench.sequences / statistics.median(side.step_s)
    width = bench.prompt_tokens + bench.completion_tokens
    return {"tokens_per_s": per_s * width, "completion_tokens_per_s": per_s * bench.completion_tokens}


def our_side(bench: BenchConfig, path: Path) -> SideResult:
    """`training.update.update` on the saved batch, in this (child) process."""
    from conductor.models import resolve_model
    from main_agent.tokens import TrainSequence, micro_batches
    from main_agent.transformers_policy import load_model
    from training.update import update

    model, _ = load_model(resolve_model(POLICY))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)  # as training.run
    data, p, c = torch.load(path), bench.prompt_tokens, bench.completion_tokens
    sequences = [
        TrainSequence(ids.tolist(), [0] * p + [1] * c, [0.0] * p + old.tolist(), [0.0] * p + [adv] * c)
        for ids, old, adv in zip(data["ids"], data["old"], data["adv"].tolist(), strict=True)
    ]
    cfg = TrainConfig(lr=LR, micro_batch_tokens=MICRO_BATCH_TOKENS)
    assert len(micro_batches(sequences, max_tokens=MICRO_BATCH_TOKENS)) == layout(bench)[1], "TRL's layout"

    def step() -> tuple[float, float]:
        stats = update(model, optimizer, sequences, cfg)
        assert stats.skipped is None, stats.skipped
        return stats.pg_loss, stats.grad_norm

    return measure("ours", "training.update.update", step, bench)


def trl_side(bench: BenchConfig, path: Path) -> SideResult:
    """TRL's GRPOTrainer update on the saved batch, in this (child) process (see the module docstring)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from conductor.models import resolve_model
    from main_agent.transformers_policy import load_model

    model, tokenizer = load_model(resolve_model(POLICY))
    per, n_micro = layout(bench)
    with tempfile.TemporaryDirectory() as tmp:
        # Like-for-like: CPU and fp32 as ours (GRPOConfig defaults to bf16 and activation checkpointing); token-
        # level "dapo" normalisation over the step as ours; clip, KL, lr, weight decay and temperature as ours.
        # num_generations is unused (nothing is generated) but must divide the generation batch.
        args = GRPOConfig(
            output_dir=tmp, report_to="none", use_vllm=False, use_cpu=True, bf16=False,
            activation_checkpointing=False, per_device_train_batch_size=per, gradient_accumulation_steps=n_micro,
            num_generations=2, max_completion_length=bench.completion_tokens, loss_type="dapo", beta=0.0,
            epsilon=0.2, epsilon_high=0.28, learning_rate=LR, weight_decay=0.0, max_grad_norm=1.0,
            temperature=1.0, save_strategy="no", disable_tqdm=True,
        )  # fmt: skip
        dataset = Dataset.from_dict({"prompt": ["unused"] * bench.sequences})
        trainer = GRPOTrainer(model, no_reward, args, dataset, processing_class=tokenizer)
    assert not trainer.model.is_activation_checkpointing, "gradient checkpointing would not be like-for-like"
    trainer._prepare_inputs = lambda inputs: inputs  # the batch is ready: no generation, no scoring
    trainer.current_gradient_accumulation_steps = n_micro  # Trainer's own loop sets it before each step
    trainer.create_optimizer()
    micro = trl_inputs(torch.load(path), bench, per)

    def step() -> tuple[float, float]:
        loss = sum(float(trainer.training_step(trainer.model, m, m["num_items_in_batch"])) for m in micro)
        norm = float(trainer._clip_grad_norm(trainer.model))
        trainer.optimizer.step()
        trainer.model.zero_grad()
        return loss, norm

    method = "GRPOTrainer.training_step per micro-batch (no generation), _clip_grad_norm, its AdamW"
    return measure("trl", method, step, bench)


def no_reward(completions: list[str], **_: object) -> list[float]:
    return [0.0] * len(completions)  # never called: nothing is generated


def trl_inputs(data: dict[str, torch.Tensor], bench: BenchConfig, per: int) -> list[dict[str, torch.Tensor]]:
    """GRPOTrainer's post-generation batch layout, cut into micro-batches of `per` sequences."""
    prompt, completion = data["ids"][:, : bench.prompt_tokens], data["ids"][:, bench.prompt_tokens :]
    full = {"prompt_ids": prompt, "prompt_mask": torch.ones_like(prompt), "completion_ids": completion}
    full |= {"completion_mask": torch.ones_like(completion), "advantages": data["adv"]}
    full |= {"old_per_token_logps": data["old"]}
    n_items = {"num_items_in_batch": torch.tensor(float(completion.numel()))}  # dapo's step normaliser
    return [{k: v[i : i + per] for k, v in full.items()} | n_items for i in range(0, bench.sequences, per)]


# ---------------------------------------------------------------- report


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def fmt(x: float | None, width: int, digits: int) -> str:
    return "-".rjust(width) if x is None else f"{x:{width}.{digits}f}"


def show(loops: list[LoopResult], sides: list[SideResult], bench: BenchConfig, ratios: Ratios) -> None:
    print("\nsync vs async (step 1: model load + warm-up, gap since the call; steady = steps 2..N)")
    print(f"{'mode':>6} {'step':>4} {'rollout s':>9} {'train s':>8} {'gap s':>8} {'calls/ep':>8}")
    for r in loops:
        for s in r.steps:
            times = f"{s['time/rollout']:9.1f} {s['time/train']:8.1f} {s['gap_s']:8.1f}"
            print(f"{r.mode:>6} {int(s['step']):4d} {times} {s['tools/calls_per_episode']:8.2f}")
        rates = f"all {fmt(r.episodes_per_s_all, 0, 3)}, steady {fmt(r.episodes_per_s_steady, 0, 3)}"
        print(f"{r.mode:>6} episodes/s {rates} | peak RSS {r.peak_rss_mb:.0f} MiB")
    per, n_micro = layout(bench)
    shape = f"{bench.sequences} x ({bench.prompt_tokens} prompt + {bench.completion_tokens} completion)"
    print(f"\nupdate step: {shape} tokens, {n_micro} micro-batch(es) of {per}, {bench.update_iters} timed")
    head = ("step s", "tok/s", "compl tok/s", "setup MiB", "peak MiB", "warm-up loss", "grad norm")
    print(f"{'side':>5} " + " ".join(f"{h:>12}" for h in head))
    for side in sides:
        t = throughput(side, bench)
        cells = (statistics.median(side.step_s), t["tokens_per_s"], t["completion_tokens_per_s"])
        cells += (side.setup_rss_mb, side.peak_rss_mb, side.warmup_loss, side.warmup_grad_norm)
        print(f"{side.name:>5} " + " ".join(fmt(x, 12, d) for x, d in zip(cells, DIGITS, strict=True)))
    print("\nratios: " + ", ".join(f"{k} {fmt(v, 0, 2)}" for k, v in ratios.items()))


def ratios_of(loops: list[LoopResult], sides: list[SideResult], bench: BenchConfig) -> Ratios:
    sync, async_ = loops
    ours, trl = sides
    return {
        "async/sync episodes/s steady": ratio(async_.episodes_per_s_steady, sync.episodes_per_s_steady),
        "async/sync episodes/s all": ratio(async_.episodes_per_s_all, sync.episodes_per_s_all),
        "ours/trl tokens/s": ratio(*(throughput(s, bench)["tokens_per_s"] for s in (ours, trl))),
        "ours/trl peak RSS": ratio(ours.peak_rss_mb, trl.peak_rss_mb),
        "ours/trl RSS growth in the step": ratio(*(s.peak_rss_mb - s.setup_rss_mb for s in (ours, trl))),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=summary_path("perf", "train"))
    parser.add_argument("--quick", action="store_true", help="1 step per loop, a 2 x 256-token update batch")
    args = parser.parse_args()
    bench = QUICK if args.quick else BenchConfig()
    load_family("plate_reading", "train", limit=1)  # fails here, not in a child, when the data is missing
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may download; the children inherit it
    started, load = time.monotonic(), os.getloadavg()
    loops = [in_child(run_loop, mode, bench) for mode in ("sync", "async")]
    with tempfile.TemporaryDirectory() as tmp:
        batch = Path(tmp) / "batch.pt"
        in_child(prepare_batch, bench, batch)
        sides = [in_child(our_side, bench, batch), in_child(trl_side, bench, batch)]
    ratios = ratios_of(loops, sides, bench)
    show(loops, sides, bench, ratios)
    host = {"platform": platform.platform(), "cpus": os.cpu_count(), "loadavg_start": load,
            "loadavg_end": os.getloadavg(), "versions": {n: version(n) for n in PACKAGES}}  # fmt: skip
    report = {
        "machine": host,
        "settings": asdict(bench) | {"quick": args.quick, "micro_batch_layout": layout(bench)},
        "sync_vs_async": [asdict(r) for r in loops],
        "update_step": [asdict(s) | throughput(s, bench) for s in sides],
        "ratios": ratios,
        "total_s": time.monotonic() - started,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_summary(args.out, report)
    print(f"wrote {args.out} ({report['total_s']:.0f} s)")


if __name__ == "__main__":
    main()
