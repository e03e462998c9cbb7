"""Which read a chained question's answer comes from: answer rules scored on every expert episode, unfiltered.

    OMP_NUM_THREADS=1 python -m benchmarks.studies.research.answer_rule --start 240 --n 96
        # -> results/research/answer_rule/summary.json; episodes in runs/bench_research/expert-train-full-chain/

corpus_qa's chained expert as it was before v25 (`corpus_qa.full_chain_reply`: search, read the top hit, search
again with what it answered, read the two best unread hits, whatever the first read said) plays corpus_qa **train** questions start..start+n through the real tools in this process, and every
episode is kept, right or wrong: the rule is chosen here, and dev reports it through the policies (bench.py).
Demonstrations are a biased sample for this choice: SFT keeps only the questions the expert got right, so their
reads show the gold far more often than a policy's will. Questions 0-239 are the recipe's demonstrations
(examples/default_policy_sft.toml), hence the default start of 240.

Each rule reads what the policy saw, the answers of the first reading turn and of the second:

    first read             the first read's answer, "not in the page" included
    first useful           the first answer that is not "not in the page" (corpus_qa._first_useful)
    last useful            the last such answer
    second reads first     the first useful answer of the second reads, else the first read's
    any read right         the best answer any read gave: no rule reaches past it (the reads' ceiling)

Episodes are played in chunks that resume (benchmarks/common/chunks.py); the table gives EM and F1 per rule.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from benchmarks import ROOT
from benchmarks.common.chunks import EXPERT, claim, play_chunks, recorded
from benchmarks.common.records import summary_path, write_summary
from conductor.answers import exact_match, token_f1
from main_agent.types import Episode, Turn
from training import tasks as task_data
from training.evaluate import load_eval_config
from training.tasks import corpus_qa
from training.tasks.task import NO_ANSWER, payload_field

FAMILY, SPLIT = "corpus_qa", "train"
SETS = ("rollout.max_turns=8", "rollout.max_new_tokens=192")  # the recipe's budgets, as the demonstrations
CHUNK = 16  # questions a chunk: the unit of resuming (~2 min of the expert on 2 cores)


def _useful(answer: str) -> bool:
    return bool(answer) and "not in the page" not in answer.lower()


def _first(answers: list[str]) -> str:
    return next((a for a in answers if _useful(a)), NO_ANSWER)


RULES: dict[str, Callable[[list[str], list[str]], str]] = {
    "first read": lambda first, second: first[0] if first else NO_ANSWER,
    "first useful": lambda first, second: _first(first + second),
    "last useful": lambda first, second: _first(list(reversed(first + second))),
    "second reads first": lambda first, second: _first(second + first),
}
CEILING = "any read right"


def reads(episode: Episode) -> tuple[list[str], list[str]]:
    """The answers of the first reading turn and of the later ones, in order (served reads only)."""
    reading = [t for t in episode.turns if t.calls and t.calls[0].name == "page_qa"]

    def answers(turn: Turn) -> list[str]:
        return [str(payload_field(r, "answer") or "") for r in turn.results if r.ok]

    return (answers(reading[0]) if reading else []), [a for t in reading[1:] for a in answers(t)]


def score(episodes: list[tuple[str, Episode]]) -> dict[str, dict[str, float]]:
    """EM and F1 of each rule (and the ceiling) over (gold, episode) pairs."""
    sums = {name: [0.0, 0.0] for name in [*RULES, CEILING]}
    for gold, episode in episodes:
        first, second = reads(episode)
        for name, rule in RULES.items():
            answer = rule(first, second)
            sums[name][0] += exact_match(answer, gold)
            sums[name][1] += token_f1(answer, gold)
        sums[CEILING][0] += max([exact_match(a, gold) for a in first + second], default=0.0)
        sums[CEILING][1] += max([token_f1(a, gold) for a in first + second], default=0.0)
    n = max(len(episodes), 1)
    return {name: {"em": em / n, "f1": f1 / n} for name, (em, f1) in sums.items()}


def format_table(scores: dict[str, dict[str, float]]) -> str:
    rows = [f"| {name} | {s['em']:.3f} | {s['f1']:.3f} |" for name, s in scores.items()]
    return "\n".join(["| answer with | EM | F1 |", "|---|---|---|", *rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--start", type=int, default=240, help="the first train question (0-239: demonstrations)"
    )
    parser.add_argument("--n", type=int, default=96, help="questions from --start")
    parser.add_argument("--recorded", action="store_true", help="score what is recorded; play nothing")
    parser.add_argument(
        "--work", type=Path, default=ROOT / "runs" / "bench_research" / "expert-train-full-chain"
    )
    parser.add_argument("--out", type=Path, default=summary_path("research", "answer_rule"))
    args = parser.parse_args()
    every = task_data.load_family(FAMILY, SPLIT)
    if not (0 <= args.start and 0 < args.n and args.start + args.n <= len(every)):
        sys.exit(f"--start and --n must fall inside the {len(every)} {SPLIT} questions")
    tasks = every[args.start : args.start + args.n]
    if not args.recorded:
        claim(args.work, EXPERT, SETS)
        done = recorded(args.work)
        todo = [(args.start + i, t) for i, t in enumerate(tasks) if t.task_id not in done]
        parts = [todo[k : k + CHUNK] for k in range(0, len(todo), CHUNK)]
        cfg = load_eval_config(
            None, [f"policy={json.dumps(EXPERT)}", f"task={FAMILY}", f"split={SPLIT}", *SETS]
        )
        named = [(f"q{p[0][0]:04d}+{len(p)}", [t for _, t in p]) for p in parts]
        play_chunks(named, args.work, cfg=cfg, plan=corpus_qa.full_chain_reply)
    episodes = recorded(args.work)
    played = [(t.reference, episodes[t.task_id]) for t in tasks if t.task_id in episodes]
    scores = score(played)
    table = format_table(scores)
    print(
        f"\n## corpus_qa train {args.start}..{args.start + args.n - 1}: {len(played)} expert episodes\n{table}"
    )
    found = {
        "family": FAMILY,
        "split": SPLIT,
        "start": args.start,
        "n": len(played),
        "scores": scores,
        "table": table,
    }
    write_summary(args.out, found)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
