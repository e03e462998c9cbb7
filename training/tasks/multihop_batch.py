"""multihop_batch: answer K multihop questions in one episode, one answer per line, in order.

The items are multihop_pages tasks of one split (training/tasks/batch.py bundles them), listed to the policy as
"Question i: ..." followed by that question's "Page: <title> <url>" lines. Reward: mean token F1 over the lines;
success: every line an exact match. Expert: the multihop expert question by question (hop by hop where MuSiQue
decomposes it), recording each answer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path

from main_agent.types import Turn
from training.tasks import batch, multihop
from training.tasks.family import Family
from training.tasks.task import Task

NAME = "multihop_batch"
QUESTION = "Answer each of these {n} questions; answer with one answer per line, in order."
DEFAULT_ITEMS = 4  # questions per task unless the run says otherwise (`[horizon] items`)


def item_lines(i: int, item: Task) -> str:
    return f"Question {i}: {item.question}" + (f"\n{item.context}" if item.context else "")


def load(data_dir: Path, split: str, *, limit: int | None = None, items: int = DEFAULT_ITEMS) -> list[Task]:
    """Bundles of `items` questions of the split (batch.bundle)."""
    questions = multihop.load(data_dir, split)
    return batch.bundle(NAME, questions, items, question=QUESTION, item_lines=item_lines, limit=limit)


def reward(answer: str, reference: str) -> float:
    return batch.reward(answer, reference, multihop.FAMILY)


def success(answer: str, reference: str) -> bool:
    return batch.success(answer, reference, multihop.FAMILY)


def item_reward(text: str, reference: str) -> float:
    return multihop.reward(text, reference)


@contextlib.contextmanager
def prepared(tasks: Sequence[Task], work_dir: Path, *, data_dir: Path | None = None) -> Iterator[list[Task]]:
    with batch.prepared(tasks, work_dir, multihop.FAMILY, item_lines, data_dir=data_dir) as ready:
        yield ready


def oracle_reply(task: Task, turns: list[Turn], *, trust_reference: bool) -> str:
    return batch.oracle_reply(task, turns, multihop.FAMILY, trust_reference=trust_reference)


FAMILY = Family(
    name=NAME, tools=multihop.TOOLS, load=load, reward=reward, success=success, prepared=prepared,
    oracle_reply=oracle_reply, item_reward=item_reward,
)  # fmt: skip
