"""Item tasks: N tasks of one family asked in one episode, one answer per line, recorded item by item.

plate_audit (N plate photos) and multihop_batch (K multihop questions) are bundles of another family's tasks, its
**items** (`Task.items`). What they share lives here:

- `bundle`: the items of one split, shuffled once by a fixed seed and cut into consecutive groups of N, so a
  bundle's id (`<family>-<split>-n<N>-<index>`) names its items and items never cross splits.
- reward: the mean of the item family's reward over the lines of the answer (a missing line scores 0); success:
  every line right by the item family's rule; `item_reward` scores one recorded item, the exact per-item progress
  the trainer pays as a turn reward (training/rewards.py `recorded_item`).
- `prepared`: the item family prepares the items (pages served, clips subtitled) and the bundle's context is
  rebuilt from what they became.
- the expert: the item family's expert plays item 1, then item 2, ..., each on the turns since its item began;
  when it would answer, the bundle expert records that answer instead (`<record item="i">...</record>`), alone in
  its turn: the acknowledgement names the next item and its handle ("next: item 3 (Image 3: img_8bf8dd), 30 of
  32 left"), which the next turn opens, or says every item is recorded, and the expert answers. The final answer
  is the ledger (main_agent.rollout), so the closing `<answer>` only ends the episode.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from main_agent.parse import ANSWER_CLOSE, ANSWER_OPEN
from main_agent.types import Turn
from training.tasks.family import Family
from training.tasks.task import Task, TaskMeta, answer_text

BUNDLE_SEED = 20_261_201  # fixes which items share a bundle; changing it changes every bundle's items
ItemLines = Callable[
    [int, Task], str
]  # (1-based item number, item task) -> its lines in the bundle's context


def bundle(
    family: str,
    items: Sequence[Task],
    n: int,
    *,
    question: str,
    item_lines: ItemLines,
    limit: int | None = None,
) -> list[Task]:
    """Bundles of `n` items each from one split's `items` (a fixed shuffle, cut in order; a remainder under
    `n` is left out), the first `limit` of them."""
    if n < 1:
        raise ValueError(f"items per {family} task must be >= 1, got {n}")
    order = list(items)
    random.Random(BUNDLE_SEED).shuffle(order)
    split = order[0].meta.split if order else ""
    groups = [order[i : i + n] for i in range(0, len(order) - n + 1, n)]
    tasks = [
        _bundle_task(family, f"{family}-{split}-n{n}-{k:03d}", g, question, item_lines)
        for k, g in enumerate(groups)
    ]
    return tasks[:limit]


def _bundle_task(
    family: str, task_id: str, items: Sequence[Task], question: str, item_lines: ItemLines
) -> Task:
    context = "\n".join(item_lines(i, item) for i, item in enumerate(items, start=1))
    tools = tuple(dict.fromkeys(tool for item in items for tool in item.tools))
    reference = "\n".join(item.reference for item in items)
    meta = TaskMeta(split=items[0].meta.split)
    question = question.format(n=len(items))
    return Task(task_id, family, question, tools, reference, context, meta, tuple(items), attached(items))


def attached(items: Sequence[Task]) -> tuple:
    """Every item's attachments, once each, in item order."""
    return tuple(dict.fromkeys(a for item in items for a in item.attachments))


def reward(answer: str, reference: str, item_family: Family) -> float:
    """Mean item reward over the reference's lines."""
    return mean_item_score(answer, reference, item_family.reward)


def mean_item_score(answer: str, reference: str, score: Callable[[str, str], float]) -> float:
    """Mean of `score(line, item reference)` over the reference's lines; a missing or blank line scores 0."""
    references = reference.splitlines()
    lines = answer.splitlines()
    scores = [
        score(lines[i], ref) if i < len(lines) and lines[i].strip() else 0.0
        for i, ref in enumerate(references)
    ]
    return sum(scores) / len(scores)


def success(answer: str, reference: str, item_family: Family) -> bool:
    """Every line right by the item family's rule."""
    references = reference.splitlines()
    lines = answer.splitlines()
    return len(lines) >= len(references) and all(
        item_family.success(line, ref) for line, ref in zip(lines, references, strict=False)
    )


@contextlib.contextmanager
def prepared(
    tasks: Sequence[Task],
    work_dir: Path,
    item_family: Family,
    item_lines: ItemLines,
    *,
    data_dir: Path | None,
) -> Iterator[list[Task]]:
    """The bundles with their items prepared by the item family and the context rebuilt from them."""
    items = list({item.task_id: item for task in tasks for item in task.items}.values())
    with item_family.prepared(items, work_dir, data_dir=data_dir) as ready:
        by_id = {item.task_id: item for item in ready}
        yield [_with_items(task, [by_id[i.task_id] for i in task.items], item_lines) for task in tasks]


def _with_items(task: Task, items: list[Task], item_lines: ItemLines) -> Task:
    context = "\n".join(item_lines(i, item) for i, item in enumerate(items, start=1))
    return dataclasses.replace(task, context=context, items=tuple(items), attachments=attached(items))


# ---------------------------------------------------------------- the expert


def oracle_reply(task: Task, turns: list[Turn], item_family: Family, *, trust_reference: bool) -> str:
    """The item expert's next reply for the current item; its answer becomes a record, alone in its turn (the
    acknowledgement names the next item and its handle, or says every item is recorded); after the last, the
    closing answer."""
    item, since = _current_item(turns)
    if item > len(task.items):
        return answer_text("done")
    reply = item_family.oracle_reply(task.items[item - 1], turns[since:], trust_reference=trust_reference)
    if reply.startswith(ANSWER_OPEN):
        return f'<record item="{item}">{_answer_of(reply)}</record>'
    return reply


def mistake_reply(task: Task, turns: list[Turn], item_family: Family) -> str | None:
    """The item family's mistake for the current item, judged on that item's turns alone; None after the last."""
    if item_family.mistake_reply is None:
        raise ValueError(
            f"{item_family.name}'s expert makes no mistakes, so {task.family}'s has none to offer"
        )
    item, since = _current_item(turns)
    if item > len(task.items):
        return None
    return item_family.mistake_reply(task.items[item - 1], turns[since:])


def _current_item(turns: list[Turn]) -> tuple[int, int]:
    """The item being worked on (one past the last recorded) and the index of the turn where it began (the one
    after that record's turn)."""
    for index in range(len(turns) - 1, -1, -1):
        if turns[index].records:
            return max(r.item for r in turns[index].records) + 1, index + 1
    return 1, 0


def _answer_of(reply: str) -> str:
    """The text of an `<answer>...</answer>` reply, on one line (a record is one line of the ledger)."""
    text = reply[len(ANSWER_OPEN) :]
    return " ".join(text.split(ANSWER_CLOSE, 1)[0].split())
