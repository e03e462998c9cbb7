"""Main-context size with and without page_qa: delegating page reading vs the raw pages in the prompt.

    python -m benchmarks.perf.context [--n 50] [--max-turns 4] [--policy NAME_OR_DIR] [--no-prefix]
                                      [--max-new-tokens 96] [--out benchmarks/results/perf/context/summary.json]

On the first `n` HotpotQA dev questions, one greedy policy plays two modes, one after the other, sharing one
micro-batched `TransformersPolicy`:
- delegated: a rollout with tools set up exactly as training does (`training.play.tool_session`: pages over loopback, an
  in-process tool server); the policy sees one "Page: <title> <url>" line per paragraph and must call page_qa.
  Main-context tokens are the episode's `context_tokens`. The untrained policy writes no call by itself, so by
  default its first turn opens with a page_qa call (`--no-prefix` for a warm-started policy).
- in_context: no tools, one generation over the 10 raw paragraphs (the texts the pages serve), built through
  the chat template directly (`render_prompt` needs a tool). Main-context tokens are prompt + completion.

Scoring: the `<answer>` text, or "" (exact match, token F1), plus F1 counting untagged final text, because a
small model often answers without the tag. The point is the context size with an honest accuracy beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import html
import logging
import re
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from benchmarks.common.records import summary_path, write_summary
from main_agent.backends import load_policy
from main_agent.parse import ANSWER_CLOSE, ANSWER_OPEN, parse_completion
from main_agent.policy import Policy, SamplingConfig
from main_agent.rollout import RolloutConfig
from main_agent.types import Episode
from tool_server.embedded import ToolAccess
from training.play import play, tool_session
from training.rewards import exact_match, token_f1
from training.tasks import Task, load_family
from training.tasks.multihop import write_pages

logger = logging.getLogger("bench_context")


IN_CONTEXT_SYSTEM = (
    "Answer the user's question from the pages below.\n"
    f"When you know the answer, write {ANSWER_OPEN}your answer{ANSWER_CLOSE}."
)
LAST_COMPLETION_CHARS = 300  # enough to see what the policy wrote instead of a tagged answer
_PARAGRAPH = re.compile(r"<p>(.*?)</p>", re.DOTALL)  # training.tasks.page_html puts the text in one <p>


@dataclass(frozen=True)
class BenchConfig:
    """What the benchmark plays and with which budgets."""

    n: int = 50
    """Questions: the first n of the HotpotQA dev split."""
    policy: str = "smollm2-135m-instruct"
    """The main policy (built-in name or checkpoint dir), decoded greedily in both modes."""
    max_turns: int = 4
    """Delegated mode: policy turns per episode (read a page or two, then answer)."""
    max_calls_per_turn: int = 4
    """Delegated mode: page_qa calls per turn (training's default)."""
    max_new_tokens: int = 96
    """Tokens per generation in both modes: a short answer, or one page_qa call (~91 tokens with a loopback URL;
    two calls in one turn need ~185). Keeps a 4-turn episode's decoding, the delegated mode's main cost, small."""
    observation_tokens: int = 128
    """Delegated mode: each page_qa result is cut to this (an answer plus a one-sentence quote fits)."""
    max_context_tokens: int = 2048
    """Delegated mode: the main context budget (training's default)."""
    max_concurrent: int = 8
    """Questions in flight per mode; also the policy's micro-batch size (memory-bound on CPU)."""
    seed: int = 0
    """Seeds torch (greedy decoding needs no randomness; kept for repeatability)."""
    first_turn_prefix: str = '<tool_call>{"name": "page_qa", "arguments": {"url": "'
    """Delegated mode: text opening the first turn, so the policy does delegate (tool_choice="required" naming
    page_qa); the untrained policy writes no calls on its own. Set "" (--no-prefix) for an SFT/RL policy."""

    def rollout_config(self) -> RolloutConfig:
        return RolloutConfig(
            max_turns=self.max_turns,
            max_calls_per_turn=self.max_calls_per_turn,
            max_new_tokens=self.max_new_tokens,
            max_context_tokens=self.max_context_tokens,
            observation_tokens=self.observation_tokens,
            first_turn_prefix=self.first_turn_prefix,
            # 8 episodes share 2 cores with page_qa's model; 900 s is far above a 4-turn episode's need.
            wall_clock_s=900.0,
        )


@dataclass(frozen=True)
class QuestionResult:
    """One question in one mode."""

    task_id: str
    reference: str
    answer: str | None  # None: no answer was given
    exact_match: float
    f1: float
    lenient_f1: float  # F1 of the tagged answer, else of the final completion's whole text
    context_tokens: int
    subagent_tokens_read: int
    wall_s: float  # from the question's start to its end, queueing for the shared policy included
    stop_reason: str
    turns: int
    calls: int  # page_qa calls made (always 0 in_context)
    tool_errors: int  # calls whose result came back not ok
    clean_turns: int  # turns whose completion parsed without any error (format validity)
    last_completion: str  # the final completion's text, cut to LAST_COMPLETION_CHARS: why there was no answer


@dataclass(frozen=True)
class ModeReport:
    """The summary of one mode over all questions."""

    mode: str
    n: int
    n_infra_failed: int
    answer_rate: float
    exact_match: float
    f1: float
    lenient_f1: float
    context_tokens_median: float
    context_tokens_p90: float
    subagent_tokens_read_mean: float
    calls_mean: float
    tool_error_rate: float
    format_validity: float
    wall_s: float
    wall_s_per_question: float
    stop_reasons: dict[str, int]


def scored(task: Task, answer: str | None) -> tuple[float, float]:
    """Exact match and token F1 of the answer, "" standing in for no answer."""
    text = answer or ""
    return exact_match(text, task.reference), token_f1(text, task.reference)


def lenient(task: Task, answer: str | None, final_text: str) -> float:
    """Token F1 counting an untagged final text as the answer (a small model often answers without tags)."""
    return token_f1(answer if answer is not None else final_text, task.reference)


def from_episode(task: Task, episode: Episode) -> QuestionResult:
    em, f1 = scored(task, episode.answer)
    final_text = episode.turns[-1].completion_text if episode.turns else ""
    return QuestionResult(
        task_id=task.task_id,
        reference=task.reference,
        answer=episode.answer,
        exact_match=em,
        f1=f1,
        lenient_f1=lenient(task, episode.answer, final_text),
        context_tokens=episode.context_tokens,
        subagent_tokens_read=episode.subagent_tokens_read,
        wall_s=episode.wall_s,
        stop_reason=episode.stop_reason,
        turns=len(episode.turns),
        calls=sum(len(t.calls) for t in episode.turns),
        tool_errors=sum(not r.ok for t in episode.turns for r in t.results),
        clean_turns=sum(not t.parse_errors for t in episode.turns),
        last_completion=episode.turns[-1].completion_text[:LAST_COMPLETION_CHARS] if episode.turns else "",
    )


async def run_delegated(
    tasks: list[Task], policy: Policy, tokenizer, cfg: BenchConfig, *, work_dir: Path
) -> tuple[list[QuestionResult], float]:
    """Mode (a): rollouts that read pages through page_qa. Returns the results and the mode's wall time."""
    async with tool_session(tasks, work_dir=work_dir, access=ToolAccess()) as (tools, ready):
        start = time.monotonic()
        groups = await play(
            ready,
            lambda _: policy,
            tools=tools,
            tokenizer=tokenizer,
            cfg=cfg.rollout_config(),
            max_concurrent=cfg.max_concurrent,
        )
        episodes = [group[0] for group in groups]
        wall = time.monotonic() - start
    return [from_episode(t, e) for t, e in zip(ready, episodes, strict=True)], wall


def page_texts(task: Task, pages_root: Path) -> list[tuple[str, str]]:
    """(title, text) of each page `write_pages` wrote for the task, in page order."""
    texts = []
    for title, rel in zip(task.meta.page_titles, task.meta.page_paths, strict=True):
        match = _PARAGRAPH.search((pages_root / rel).read_text(encoding="utf-8"))
        if match is None:
            raise ValueError(f"{pages_root / rel}: no <p> paragraph (has training.tasks.page_html changed?)")
        texts.append((title, html.unescape(match.group(1))))
    return texts


def in_context_prompt(tokenizer, question: str, pages: Sequence[tuple[str, str]]) -> list[int]:
    """The chat-template ids of: the answer instruction, then every page and the question (question last)."""
    blocks = [f"Page: {title}\n{text}" for title, text in pages]
    user = "\n\n".join([*blocks, f"Question: {question}"])
    messages = [{"role": "system", "content": IN_CONTEXT_SYSTEM}, {"role": "user", "content": user}]
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return list(ids)


async def answer_in_context(
    task: Task, pages: Sequence[tuple[str, str]], policy: Policy, tokenizer, *, max_new_tokens: int
) -> QuestionResult:
    """Mode (b) for one question: one generation over the raw pages."""
    start = time.monotonic()
    prompt = in_context_prompt(tokenizer, task.question, pages)
    sample = await policy.sample(prompt, max_new_tokens=max_new_tokens)
    parsed = parse_completion(sample.text, tool_names=())
    answer = parsed.answer
    em, f1 = scored(task, answer)
    return QuestionResult(
        task_id=task.task_id,
        reference=task.reference,
        answer=answer,
        exact_match=em,
        f1=f1,
        lenient_f1=lenient(task, answer, sample.text),
        context_tokens=len(prompt) + len(sample.ids),
        subagent_tokens_read=0,
        wall_s=time.monotonic() - start,
        stop_reason="answer" if answer is not None else f"no_answer_{sample.finish_reason}",
        turns=1,
        calls=0,
        tool_errors=0,
        clean_turns=int(not parsed.errors),
        last_completion=sample.text[:LAST_COMPLETION_CHARS],
    )


async def run_in_context(
    tasks: list[Task], policy: Policy, tokenizer, cfg: BenchConfig, *, work_dir: Path
) -> tuple[list[QuestionResult], float]:
    """Mode (b): every question answered from its raw pages, up to `max_concurrent` at once."""
    pages_root = work_dir / "raw_pages"
    write_pages(tasks, pages_root)
    slots = asyncio.Semaphore(cfg.max_concurrent)

    async def one(task: Task) -> QuestionResult:
        async with slots:
            pages = page_texts(task, pages_root)
            return await answer_in_context(task, pages, policy, tokenizer, max_new_tokens=cfg.max_new_tokens)

    start = time.monotonic()
    results = list(await asyncio.gather(*(one(t) for t in tasks)))
    return results, time.monotonic() - start


def summarise(mode: str, results: Sequence[QuestionResult], wall_s: float) -> ModeReport:
    tokens = [r.context_tokens for r in results]
    n, calls = len(results), sum(r.calls for r in results)
    return ModeReport(
        mode=mode,
        n=n,
        n_infra_failed=sum(r.stop_reason == "infra_failed" for r in results),
        answer_rate=sum(r.answer is not None for r in results) / n,
        exact_match=statistics.fmean(r.exact_match for r in results),
        f1=statistics.fmean(r.f1 for r in results),
        lenient_f1=statistics.fmean(r.lenient_f1 for r in results),
        context_tokens_median=float(statistics.median(tokens)),
        context_tokens_p90=float(np.percentile(tokens, 90)),  # linear interpolation between ranks
        subagent_tokens_read_mean=statistics.fmean(r.subagent_tokens_read for r in results),
        calls_mean=calls / n,
        tool_error_rate=sum(r.tool_errors for r in results) / calls if calls else 0.0,
        format_validity=sum(r.clean_turns for r in results) / max(1, sum(r.turns for r in results)),
        wall_s=wall_s,
        wall_s_per_question=wall_s / n,
        stop_reasons=dict(sorted(Counter(r.stop_reason for r in results).items())),
    )


def format_table(reports: Sequence[ModeReport]) -> str:
    """One row per measure, one column per mode, then the ratio of median context tokens."""
    rows = [
        ("questions (infra failed)", [f"{r.n} ({r.n_infra_failed})" for r in reports]),
        ("answer rate", [f"{r.answer_rate:.3f}" for r in reports]),
        ("exact match", [f"{r.exact_match:.3f}" for r in reports]),
        ("token F1", [f"{r.f1:.3f}" for r in reports]),
        ("token F1, untagged text counted", [f"{r.lenient_f1:.3f}" for r in reports]),
        ("context tokens median", [f"{r.context_tokens_median:.0f}" for r in reports]),
        ("context tokens p90", [f"{r.context_tokens_p90:.0f}" for r in reports]),
        ("sub-agent tokens read", [f"{r.subagent_tokens_read_mean:.0f}" for r in reports]),
        ("page_qa calls / question", [f"{r.calls_mean:.2f}" for r in reports]),
        ("tool error rate", [f"{r.tool_error_rate:.3f}" for r in reports]),
        ("format validity", [f"{r.format_validity:.3f}" for r in reports]),
        ("wall time s", [f"{r.wall_s:.1f}" for r in reports]),
        ("wall s / question", [f"{r.wall_s_per_question:.1f}" for r in reports]),
    ]
    header = ("mode", [r.mode for r in reports])
    head = max(len(name) for name, _ in [header, *rows])
    widths = [max(len(cells[i]) for _, cells in [header, *rows]) for i in range(len(reports))]
    lines = [
        f"{name:<{head}} | " + " | ".join(f"{c:>{w}}" for c, w in zip(cells, widths, strict=True))
        for name, cells in [header, *rows]
    ]
    return "\n".join(lines)


def context_ratio(delegated: ModeReport, in_context: ModeReport) -> float:
    """Median main-context tokens with the raw pages over those with page_qa."""
    return in_context.context_tokens_median / delegated.context_tokens_median


@dataclass(frozen=True)
class BenchResult:
    """Both modes' summaries and per-question results, on the same questions in the same order."""

    config: BenchConfig
    delegated: ModeReport
    in_context: ModeReport
    delegated_questions: list[QuestionResult]
    in_context_questions: list[QuestionResult]

    def summary(self) -> dict:
        return {
            "config": dataclasses.asdict(self.config),
            "reports": [dataclasses.asdict(self.delegated), dataclasses.asdict(self.in_context)],
            "median_context_ratio_in_context_over_delegated": context_ratio(self.delegated, self.in_context),
            "questions": {
                "delegated": [dataclasses.asdict(r) for r in self.delegated_questions],
                "in_context": [dataclasses.asdict(r) for r in self.in_context_questions],
            },
        }

    def table(self) -> str:
        ratio = context_ratio(self.delegated, self.in_context)
        table = format_table([self.delegated, self.in_context])
        return f"{table}\nmedian context tokens, in_context / delegated: {ratio:.2f}"


async def bench(cfg: BenchConfig) -> BenchResult:
    """Play both modes on the same questions with one greedy policy."""
    tasks = load_family("multihop_pages", "dev", limit=cfg.n)
    if not tasks:
        raise ValueError("no multihop_pages dev tasks found")
    torch.manual_seed(cfg.seed)
    greedy = SamplingConfig(temperature=0.0)
    policy, tokenizer = load_policy(cfg.policy, greedy, max_batch=cfg.max_concurrent, seed=cfg.seed)
    try:
        with tempfile.TemporaryDirectory(prefix="conductor-bench-context-") as work:
            logger.info("delegated mode: %d questions", len(tasks))
            delegated, wall_a = await run_delegated(tasks, policy, tokenizer, cfg, work_dir=Path(work))
            logger.info("delegated mode done in %.0f s; in-context mode", wall_a)
            in_context, wall_b = await run_in_context(tasks, policy, tokenizer, cfg, work_dir=Path(work))
            logger.info("in-context mode done in %.0f s", wall_b)
    finally:
        await policy.aclose()
    return BenchResult(
        config=cfg,
        delegated=summarise("delegated", delegated, wall_a),
        in_context=summarise("in_context", in_context, wall_b),
        delegated_questions=delegated,
        in_context_questions=in_context,
    )


def parse_args(argv: Sequence[str]) -> tuple[BenchConfig, Path]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=BenchConfig.n, help="questions (first n of HotpotQA dev)")
    parser.add_argument(
        "--out",
        type=Path,
        default=summary_path("perf", "context"),
        help="JSON report path",
    )
    parser.add_argument("--max-turns", type=int, default=BenchConfig.max_turns, help="delegated mode's turns")
    parser.add_argument(
        "--policy", default=BenchConfig.policy, help="built-in name, checkpoint or adapter dir"
    )
    parser.add_argument("--no-prefix", action="store_true", help="no page_qa call prefix (trained policies)")
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=BenchConfig.max_new_tokens,
        help="tokens per turn (2 calls ~185)",
    )
    args = parser.parse_args(argv)
    if args.n < 1 or args.max_turns < 1:
        parser.error("--n and --max-turns must be at least 1")
    prefix = "" if args.no_prefix else BenchConfig.first_turn_prefix
    cfg = BenchConfig(
        n=args.n,
        max_turns=args.max_turns,
        policy=args.policy,
        first_turn_prefix=prefix,
        max_new_tokens=args.max_new_tokens,
    )
    return cfg, args.out


def main(argv: Sequence[str]) -> None:
    cfg, out = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per tool call otherwise
    result = asyncio.run(bench(cfg))
    print(result.table())
    write_summary(out, result.summary())
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
