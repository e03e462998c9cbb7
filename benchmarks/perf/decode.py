"""Decoding benchmark: the in-process sampler's `generate` against fixed-shape decoders, the same prompts, one run.

    python -m benchmarks.perf.decode [--out benchmarks/results/perf/decode/summary.json]

SmolLM2-135M-Instruct (the built-in policy, float32, on cuda when visible, else cpu) samples the policy's real
first prompts (the system prompt over the real tool schemas, then one of QUESTIONS: ~370 tokens, ~350 of them
shared) at temperature 1, per case (rows x new tokens), with each decoder:

    generate        the path before: `model.generate`, a DynamicCache grown a step at a time, the shared prefix once
                    (still a GPU's default)
    generate static transformers' own fixed shapes: generate(cache_implementation="static"), no shared prefix
                    (a prefix cache is dynamic); on a GPU generate compiles its step itself
    static          main_agent/decode.py: a hand-written loop over a preallocated StaticCache, the prefix once
                    (a CPU's default since this benchmark: [sampling] decoder "auto")
    compiled        that loop with its step through torch.compile (the first call per shape compiles: its
                    seconds are reported apart, and left out of tokens/s); in the first case only (CASES)

Rounds interleave the decoders (the machine's other work spreads over all of them); each decoder's seconds are
the median over ROUNDS, from the same seed, on `clock`: this process's CPU time on a CPU (wall time beside it),
wall time on a GPU. Tokens/s counts kept tokens (up to a row's first EOS, at most the limit), the ones an
episode uses. Per decoder and case: tokens/s, its ratio to generate's, the largest |log-prob - the teacher-forced
forward's| (training.loss.token_logprobs over prompt + kept tokens: what the importance ratio's numerator
recomputes), and whether its greedy tokens equal generate's (temperature 0, the same prompts).
"idle rows" bounds what refilling finished rows could win: the share of generate's row-steps spent on rows that
had already written EOS. Prints a table, writes JSON. Numbers from a machine busy with other work are noisy.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.common.records import summary_path, write_summary
from benchmarks.perf.sampler import installed
from conductor.batching import left_pad
from main_agent.policy import SamplingConfig
from main_agent.transformers_policy import TransformersPolicy, generated

DECODERS = ("generate", "generate static", "static", "compiled")


@dataclass(frozen=True)
class Case:
    rows: int
    new_tokens: int
    decoders: tuple[str, ...]
    greedy: bool
    """Also decode greedily with each decoder and compare the tokens with generate's."""


# A group of 4 and a short turn with every decoder; two groups and a longer turn with today's and the static loop
# only (the compiled step's minute of compiling, generate static's known cost and the greedy pass again would
# take the run past ten minutes on one busy thread).
CASES = (Case(4, 96, DECODERS, greedy=True), Case(8, 128, ("generate", "static"), greedy=False))
SEED = 0
ROUNDS = 3  # timed samples per decoder and case (the median); each is 10-40 s on one busy CPU thread
QUESTIONS = (
    "Which city hosted the 1992 Summer Olympics, and who lit the cauldron?",
    "What is the plate number on the car in img_1?",
    "Summarise the video v_3 and say when the speaker first mentions the budget.",
    "Who wrote the novel that the film described in d_2 was based on?",
    "How many moons does the planet discussed on page d_7 have?",
    "In which year was the bridge in the photo img_4 opened to traffic?",
    "Which two authors of the paper cited in d_4 share an affiliation?",
    "What colour is the bus that passes at 0:42 in v_9?",
)

Rows = list[tuple[list[int], list[float]]]


@dataclass(frozen=True)
class Measure:
    decoder: str
    rows: int
    new_tokens: int
    seconds: list[float]  # one per round, on `clock`
    wall_seconds: list[float]  # the same rounds' wall time
    tokens: int  # kept tokens of the (seeded) sample
    compile_s: (
        float | None
    )  # the compiled decoder's first call beyond a timed one, wall (the compiler's own processes)
    max_logprob_diff: float
    greedy_identical: bool | None  # None: not compared (generate itself, or a case without the greedy pass)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / statistics.median(self.seconds)

    @property
    def wall_tokens_per_s(self) -> float:
        return self.tokens / statistics.median(self.wall_seconds)


def policy_prompts(tokenizer) -> list[list[int]]:
    """The first prompt of an episode per question: the real system prompt over the real tool schemas."""
    from main_agent.prompts import render_prompt
    from subagents import image_ops, page_qa, search, video_summary
    from tool_server.host import tool_schema

    schemas = [tool_schema(m) for m in (page_qa, image_ops, video_summary, search)]
    return [render_prompt(tokenizer, q, schemas, max_calls_per_turn=1) for q in QUESTIONS]


def sampler(policy: TransformersPolicy, decoder: str) -> Callable[[list[list[int]], int], Rows]:
    """A blocking (prompts, new tokens) -> rows for `decoder`, on the policy's model and settings."""
    if decoder == "generate static":
        return lambda prompts, new: generate_static(policy, prompts, new)
    twin = TransformersPolicy(
        policy.model, policy.tokenizer, cfg=dataclasses.replace(policy.cfg, decoder=decoder)
    )
    return twin._sample_batch


def generate_static(policy: TransformersPolicy, prompts: list[list[int]], new: int) -> Rows:
    """transformers' own fixed-shape decoding: generate with a static cache, every prompt whole."""
    ids, mask = left_pad(prompts, pad_id=policy.eos_token_id)
    config = policy.generation_config(new)
    config.cache_implementation = "static"
    with torch.inference_mode():
        out = policy.model.generate(
            input_ids=ids.to(policy.model.device),
            attention_mask=mask.to(policy.model.device),
            generation_config=config,
        )
    return generated(out, prompt_width=ids.shape[1], temperature=policy.cfg.temperature)


def clock() -> float:
    """The seconds a decoder is charged: on a CPU this process's CPU time, the work it did whatever else the
    machine runs (wall time on this shared 2-core machine varied 1.5x between rounds of one decoder); on a GPU
    wall time (the device works asynchronously: the process's CPU time says nothing about it)."""
    return time.perf_counter() if torch.cuda.is_available() else time.process_time()


def timed(
    sample: Callable[[list[list[int]], int], Rows], prompts: list[list[int]], new: int
) -> tuple[float, float, Rows]:
    """(seconds on `clock`, wall seconds, rows) of one seeded sample."""
    torch.manual_seed(SEED)
    start, wall = clock(), time.perf_counter()
    rows = sample(prompts, new)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return clock() - start, time.perf_counter() - wall, rows


def kept(policy: TransformersPolicy, rows: Rows, new: int) -> list[tuple[list[int], list[float]]]:
    """Each row cut as an episode cuts it: up to its first EOS, at most `new` tokens."""
    return [(s.ids, s.logprobs) for s in (policy._cut(ids, lp, new) for ids, lp in rows)]


def logprob_gap(policy: TransformersPolicy, prompts: list[list[int]], rows: Rows) -> float:
    """The largest |sampler log-prob - teacher-forced forward's| over the kept tokens: one right-padded forward."""
    from training.loss import token_logprobs

    full = [prompt + ids for prompt, (ids, _) in zip(prompts, rows, strict=True)]
    width = max(len(f) for f in full)
    ids = torch.tensor([f + [policy.eos_token_id] * (width - len(f)) for f in full])  # [B, T], right-padded
    mask = torch.tensor([[1] * len(f) + [0] * (width - len(f)) for f in full])
    device = policy.model.device
    with torch.inference_mode():
        forward = token_logprobs(
            policy.model, ids.to(device), mask.to(device), temperature=policy.cfg.temperature
        )
    gaps = [
        (forward[i, len(prompt) : len(prompt) + len(lp)].cpu() - torch.tensor(lp)).abs().max()
        for i, (prompt, (_, lp)) in enumerate(zip(prompts, rows, strict=True))
        if lp
    ]
    return float(max(gaps))


def idle_share(rows: Rows, kept_rows: Rows) -> float:
    """Share of the batch's row-steps spent on rows already finished: 1 - kept / (rows x steps run)."""
    steps = max(len(ids) for ids, _ in rows)
    return 1 - sum(len(ids) for ids, _ in kept_rows) / (len(rows) * steps)


def run_case(policy: TransformersPolicy, prompts: list[list[int]], case: Case) -> tuple[list[Measure], float]:
    """The case's decoders on its first `rows` prompts: rounds of sampling, interleaved; the greedy pass."""
    batch, new = prompts[: case.rows], case.new_tokens
    samplers = {d: sampler(policy, d) for d in case.decoders}
    first = timed(samplers["compiled"], batch, new)[1] if "compiled" in samplers else 0.0  # compiles (wall)
    seconds: dict[str, list[float]] = {d: [] for d in case.decoders}
    walls: dict[str, list[float]] = {d: [] for d in case.decoders}
    outputs: dict[str, Rows] = {}
    for _ in range(ROUNDS):
        for d in case.decoders:
            s, wall, outputs[d] = timed(samplers[d], batch, new)
            seconds[d].append(s)
            walls[d].append(wall)
    same = greedy_same(policy, batch, case) if case.greedy else {}
    measures = []
    for d in case.decoders:
        rows_kept = kept(policy, outputs[d], new)
        compile_s = first - statistics.median(walls[d]) if d == "compiled" else None
        tokens = sum(len(ids) for ids, _ in rows_kept)
        gap = logprob_gap(policy, batch, rows_kept)
        measures.append(Measure(d, case.rows, new, seconds[d], walls[d], tokens, compile_s, gap, same.get(d)))
    return measures, idle_share(outputs["generate"], kept(policy, outputs["generate"], new))


def greedy_same(policy: TransformersPolicy, batch: list[list[int]], case: Case) -> dict[str, bool]:
    """Per decoder but generate: whether its greedy tokens (cut as an episode cuts them) equal generate's."""
    greedy = TransformersPolicy(policy.model, policy.tokenizer, cfg=SamplingConfig(temperature=0.0))
    new = case.new_tokens
    tokens = {}
    for d in case.decoders:
        tokens[d] = [ids for ids, _ in kept(greedy, timed(sampler(greedy, d), batch, new)[2], new)]
    return {d: tokens[d] == tokens["generate"] for d in case.decoders if d != "generate"}


def table(measures: list[Measure], idle: dict[str, float]) -> str:
    """One line per decoder and case: tokens/s on `clock` and its ratio to generate's, wall tokens/s beside."""
    heads = ("rows", "new", "tokens/s", "vs gen", "wall t/s", "max|dlogp|", "greedy", "compile s")
    lines = [f"{'decoder':<16} " + " ".join(f"{h:>10}" for h in heads)]
    base = {(m.rows, m.new_tokens): m.tokens_per_s for m in measures if m.decoder == "generate"}
    for m in measures:
        same = "-" if m.greedy_identical is None else ("same" if m.greedy_identical else "DIFF")
        compiled = "-" if m.compile_s is None else f"{m.compile_s:.0f}"
        ratio = m.tokens_per_s / base[(m.rows, m.new_tokens)]
        cells = (m.rows, m.new_tokens, f"{m.tokens_per_s:.1f}", f"{ratio:.2f}", f"{m.wall_tokens_per_s:.1f}")
        cells += (f"{m.max_logprob_diff:.1e}", same, compiled)
        lines.append(f"{m.decoder:<16} " + " ".join(f"{c:>10}" for c in cells))
    lines += [f"idle rows in generate's batches, {case}: {share:.0%}" for case, share in idle.items()]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=summary_path("perf", "decode"))
    args = parser.parse_args()
    from conductor.models import ensure_default_model
    from main_agent.transformers_policy import load_model

    start = time.monotonic()
    model, tokenizer = load_model(ensure_default_model())
    policy = TransformersPolicy(model, tokenizer, cfg=SamplingConfig(temperature=1.0))
    prompts = policy_prompts(tokenizer)
    measures, idle = [], {}
    for case in CASES:
        found, idle[f"{case.rows} x {case.new_tokens}"] = run_case(policy, prompts, case)
        measures += found
        print(table(found, {}), flush=True)
    print(table(measures, idle))
    report = {
        "machine": platform.platform(),
        "device": str(model.device),
        "threads": torch.get_num_threads(),
        "clock": "wall" if torch.cuda.is_available() else "process CPU time",
        "packages": {p: installed(p) for p in ("torch", "transformers")},
        "prompt_tokens": [len(p) for p in prompts],
        "rounds": ROUNDS,
        "cases": [dataclasses.asdict(c) for c in CASES],
        "results": [
            dataclasses.asdict(m) | {"tokens_per_s": m.tokens_per_s, "wall_tokens_per_s": m.wall_tokens_per_s}
            for m in measures
        ],
        "idle_rows": idle,
        "wall_s": time.monotonic() - start,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_summary(args.out, report)
    print(f"wrote {args.out} ({report['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
