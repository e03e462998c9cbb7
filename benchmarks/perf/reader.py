"""Where a page_qa "extract" call's time goes with the 0.5B reader, and what each change buys, in one run.

    python -m benchmarks.perf.reader [--model qwen2.5-coder-0.5b-instruct] [--n 24] [--out ...]

On the first `--n` questions of bench_reader's tune split (pages as page_qa reads them), each path scores what
page_qa's "extract" scores. Every question runs through each path in turn, so a machine that gets busier
mid-run slows them alike. Each path adds one change to the one above it:

- before: float32, the rule before (SmolLM2's: 32 candidates and "not in the page" under the question's prompt
  and under the page's prompt without the question), each prompt alone (the page twice), every position of the
  replies' row through the 152k-token output head (`score_batch` as of commit d73757e, kept here)
- shared page: both prompts in one call, the page once, only the rows that predict a scored token through the
  head (`TransformersLLM.score`)
- bfloat16: the same in bfloat16 weights (`dtype = "auto"` on a CPU with AVX512-BF16 or AMX)
- chosen rule: the rule chosen for this reader on tune (spans.RULES: no prior, so one prompt; 48 candidates),
  in bfloat16: what page_qa's default call scores

For each path: p50 / p90 per call and the share of the time in the output head (timed by hooks on it). Then,
for the last path, 8 calls in flight against the same 8 one at a time (throughput), and the RSS a process adds
by loading the reader in each dtype (a fresh process each). Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks import ROOT
from benchmarks.common.records import summary_path, write_summary
from benchmarks.studies.reader import items as reader_items
from benchmarks.studies.reader.bench import HOTPOTQA_N
from subagents import page_qa, spans
from subagents.llm import BackendConfig, Message
from subagents.transformers_llm import TransformersLLM
from training.tasks.task import data_root

READER = "qwen2.5-coder-0.5b-instruct"
IN_FLIGHT = 8  # the concurrency: a training group's page_qa calls arrive about this many at once


@dataclass
class Call:
    """One question as page_qa's "extract" scores it."""

    prompts: list[list[Message]]
    replies: list[str]


@dataclass
class HeadClock:
    """Seconds spent in the output head, from hooks on it."""

    spent: float = 0.0
    _start: float = field(default=0.0, repr=False)

    def attach(self, llm: TransformersLLM) -> None:
        head = llm.model.get_output_embeddings()
        head.register_forward_pre_hook(lambda *_: setattr(self, "_start", time.perf_counter()))
        head.register_forward_hook(
            lambda *_: setattr(self, "spent", self.spent + time.perf_counter() - self._start)
        )


def calls(n: int, rule: spans.Choice) -> list[Call]:
    """The first `n` tune questions' prompts and replies under `rule` (writes bench_reader's pages if missing)."""
    pages = ROOT / "runs" / "bench_reader" / "pages"
    todo = reader_items.split_items(data_root(None), pages, "tune", n=n, hotpotqa_n=HOTPOTQA_N)[:n]
    cfg = page_qa.Config()
    media = {".html": "text/html", ".md": "text/markdown", ".txt": "text/plain"}
    out = []
    for item in todo:
        path = pages / item.page
        prep = page_qa.prepare(path.read_bytes(), media[path.suffix], question=item.question, cfg=cfg)
        chunks = ["\n".join(chunk) for chunk in prep.top]
        found = spans.candidates(page_qa.page_sentences(prep.top), item.question, limit=rule.max_candidates)
        prompts = [page_qa.build_prompt(chunks, item.question)]
        prompts += [page_qa.prior_prompt(chunks)] if rule.pmi_weight else []
        out.append(Call(prompts, [c.span.text for c in found] + [page_qa.NOT_FOUND]))
    return out


def score_before(llm: TransformersLLM, call: Call) -> list[list[float]]:
    """The scoring before this change (commit d73757e): each prompt alone, every reply position through the head."""
    import torch
    from transformers.cache_utils import DynamicCache

    from conductor.models import past_key_values_accepted

    eos = llm.tokenizer.eos_token_id
    replies = [llm.tokenizer.encode(r, add_special_tokens=False) + [eos] for r in call.replies]
    flat = torch.tensor([t for r in replies for t in r])
    owner = torch.repeat_interleave(torch.arange(len(replies)), torch.tensor([len(r) for r in replies]))
    starts = torch.tensor([0, *itertools.accumulate(len(r) for r in replies)][:-1])
    offset = torch.arange(len(flat)) - starts[owner]
    rows = []
    for messages in call.prompts:
        prompt = llm.render(messages)
        with torch.inference_mode(), past_key_values_accepted():
            cache = DynamicCache(config=llm.model.config)
            out = llm.model(
                input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True, logits_to_keep=1
            )
            first = torch.log_softmax(out.logits[0, -1].float(), -1)
            place = torch.arange(len(owner))
            own = (owner[:, None] == owner[None, :]) & (place[None, :] <= place[:, None])
            seen = torch.cat([torch.ones(len(owner), len(prompt), dtype=torch.bool), own], 1)
            mask = torch.zeros(seen.shape).masked_fill(~seen, torch.finfo(torch.float32).min)[None, None]
            logits = (
                llm.model(
                    input_ids=flat[None],
                    position_ids=(len(prompt) + offset)[None],
                    past_key_values=cache,
                    attention_mask=mask,
                )
                .logits[0]
                .float()
            )
            later = offset[1:] > 0
            scored = logits[:-1][later]
            logp = scored.gather(1, flat[1:][later, None])[:, 0] - torch.logsumexp(scored, -1)
            rows.append(first[flat[starts]].index_add(0, owner[1:][later], logp).tolist())
    return rows


def timed(fn, clock: HeadClock) -> tuple[float, float, object]:
    """(seconds, seconds in the head, result) of `fn()`."""
    head, start = clock.spent, time.perf_counter()
    result = fn()
    return time.perf_counter() - start, clock.spent - head, result


def summary(seconds: list[float], head: list[float]) -> dict:
    ordered = sorted(seconds)
    return {
        "p50_s": statistics.median(seconds),
        "p90_s": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
        "mean_s": statistics.mean(seconds),
        "head_share": sum(head) / sum(seconds),
    }


def rss_added(model: str, dtype: str) -> float:
    """GB of RSS a fresh process adds by loading the reader in `dtype` and scoring once (VmRSS after minus
    before, the libraries already imported)."""
    code = (
        "import re\n"
        "def rss(): return int(re.search(r'VmRSS:\\s+(\\d+)', open('/proc/self/status').read())[1]) / 1e6\n"
        "import torch, transformers, subagents.transformers_llm as t\n"
        "from subagents.llm import BackendConfig\n"
        "before = rss()\n"
        f"llm = t.TransformersLLM(BackendConfig(model={model!r}, dtype={dtype!r}))\n"
        "from subagents.llm import Message\n"
        "llm.score_batch([llm.render([Message('user', 'Hi')])], [[llm.tokenizer.eos_token_id]])\n"  # all weights read
        "print(rss() - before)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    return float(out.stdout.split()[-1])


async def in_flight(llm: TransformersLLM, todo: list[Call]) -> dict:
    """Wall time of `todo` scored one at a time, then all at once."""
    start = time.perf_counter()
    for call in todo:
        await llm.score(call.prompts, call.replies)
    alone = time.perf_counter() - start
    start = time.perf_counter()
    await asyncio.gather(*(llm.score(call.prompts, call.replies) for call in todo))
    together = time.perf_counter() - start
    return {
        "calls": len(todo),
        "one_at_a_time_s": alone,
        "in_flight_s": together,
        "throughput_ratio": alone / together,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=READER)
    parser.add_argument("--n", type=int, default=24, help="tune questions timed (after one warm-up)")
    parser.add_argument("--out", type=Path, default=summary_path("perf", "reader"))
    args = parser.parse_args()
    before = calls(args.n + 1, spans.RULES["smollm2-135m-instruct"])
    chosen = calls(args.n + 1, spans.RULES.get(args.model, spans.Choice()))
    f32 = TransformersLLM(BackendConfig(model=args.model, dtype="float32"))
    b16 = TransformersLLM(BackendConfig(model=args.model, dtype="auto"))
    clocks = {id(f32): HeadClock(), id(b16): HeadClock()}
    for llm in (f32, b16):
        clocks[id(llm)].attach(llm)
    paths = {
        "before": (f32, lambda k: score_before(f32, before[k])),
        "shared page": (f32, lambda k: f32.score_batch(*tokenised(f32, before[k]))),
        "bfloat16": (b16, lambda k: b16.score_batch(*tokenised(b16, before[k]))),
        "chosen rule": (b16, lambda k: b16.score_batch(*tokenised(b16, chosen[k]))),
    }
    times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in paths}
    agree = []
    for k in range(len(before)):
        results = {}
        for name, (llm, fn) in paths.items():
            seconds, head, results[name] = timed(lambda fn=fn, k=k: fn(k), clocks[id(llm)])
            if k:  # the first question warms every path up
                times[name][0].append(seconds)
                times[name][1].append(head)
        agree.append(_same_choice(results["before"], results["bfloat16"]))
        print(
            f"[{k}/{args.n}] " + "  ".join(f"{n} {times[n][0][-1]:.2f}s" for n in paths if times[n][0]),
            flush=True,
        )
    rows = {name: summary(*times[name]) for name in paths}
    base = rows["before"]["p50_s"]
    for row in rows.values():
        row["speedup_p50"] = base / row["p50_s"]
    report = {
        "model": args.model,
        "questions": args.n,
        "threads": __import__("torch").get_num_threads(),
        "cpu_count": os.cpu_count(),
        "paths": rows,
        "best_reply_same_as_before": statistics.mean(agree),
        "in_flight": asyncio.run(in_flight(b16, chosen[1 : 1 + IN_FLIGHT])),
        "rss_added_gb": {dtype: rss_added(args.model, dtype) for dtype in ("float32", "auto")},
    }
    _print(report)
    write_summary(args.out, report)
    print(f"wrote {args.out}")


def tokenised(llm: TransformersLLM, call: Call) -> tuple[list[list[int]], list[list[int]]]:
    eos = llm.tokenizer.eos_token_id
    replies = [llm.tokenizer.encode(r, add_special_tokens=False) + [eos] for r in call.replies]
    return [llm.render(m) for m in call.prompts], replies


def _same_choice(a: list[list[float]], b: list[list[float]]) -> bool:
    """Whether the PMI-weighted best reply (the shipped rule's value, without its other terms) is the same."""
    w = page_qa.Config().extract.pmi_weight

    def best(rows: list[list[float]]) -> int:
        values = [q - w * p for q, p in zip(rows[0], rows[1], strict=True)]
        return values.index(max(values))

    return best(a) == best(b)


def _print(report: dict) -> None:
    print(f"\n{report['model']}, {report['questions']} tune questions, {report['threads']} threads")
    print(f"{'path':<12} {'p50 s':>7} {'p90 s':>7} {'head':>6} {'x before':>9}")
    for name, row in report["paths"].items():
        print(
            f"{name:<12} {row['p50_s']:7.2f} {row['p90_s']:7.2f} {row['head_share']:6.0%} {row['speedup_p50']:9.2f}"
        )
    flight = report["in_flight"]
    print(
        f"{flight['calls']} calls one at a time {flight['one_at_a_time_s']:.1f} s, in flight "
        f"{flight['in_flight_s']:.1f} s: {flight['throughput_ratio']:.2f}x"
    )
    print(f"best reply as before (bfloat16 vs float32): {report['best_reply_same_as_before']:.2f}")
    print(
        "RSS added by the reader: " + ", ".join(f"{k} {v:.2f} GB" for k, v in report["rss_added_gb"].items())
    )


if __name__ == "__main__":
    main()
