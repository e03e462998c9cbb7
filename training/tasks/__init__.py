"""Task families: one module each, with the same five names, listed in `FAMILIES`.

    load(data_dir, split, *, limit=None) -> list[Task]     the split's tasks in a fixed order
    reward(answer, reference) -> float                      final reward in [0, 1]
    success(answer, reference) -> bool                      whether the answer is right
    prepared(tasks, work_dir, *, data_dir=None)             context manager: the tasks ready to play
    oracle_reply(task, turns, *, trust_reference) -> str    the scripted expert's next reply (SFT)

Item families (plate_audit, multihop_batch: N tasks of another family in one episode, training/tasks/batch.py;
listed in `ITEM_FAMILIES`) also take `load(..., items=N)` and have `item_reward(text, item_reference)`, the score
of one recorded item.

    tasks = load_family("plate_reading", "dev", limit=16)
    with prepared(tasks, work_dir) as ready:               # pages served, clips subtitled, as each family needs
        ...

Families whose reward is all-or-nothing per answer also have `graded_reward(answer, reference)`, partial credit
in [0, 1] (listed in `GRADED`); the QA families' reward is graded already (token F1). The plate families' experts
can also make a policy's typical mistake, for demonstrations of the recovery (`MISTAKES`).

Adding a family is one module and one entry here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path

from training.tasks import corpus_qa, multihop, multihop_batch, plate_audit, plates, research_corpus, video
from training.tasks.task import SPLITS, Task, TaskMeta, data_root, hash_split, load_tasks, save_tasks

__all__ = [
    "FAMILIES",
    "GAVE_UP",
    "GRADED",
    "ITEM_FAMILIES",
    "MISTAKES",
    "SPLITS",
    "Task",
    "TaskMeta",
    "data_root",
    "family_of",
    "gave_up",
    "hash_split",
    "item_reward",
    "load_family",
    "load_tasks",
    "prepared",
    "reward_for",
    "save_tasks",
    "success",
]

FAMILIES = {
    multihop.NAME: multihop,
    plates.NAME: plates,
    video.NAME: video,
    plate_audit.NAME: plate_audit,
    multihop_batch.NAME: multihop_batch,
    corpus_qa.NAME: corpus_qa,
    research_corpus.NAME: research_corpus,
}

GRADED = {plates.NAME: plates.graded_reward, plate_audit.NAME: plate_audit.graded_reward}
"""The graded score of the families whose own reward is exact; `reward_for(..., kind="graded")` uses it."""

MISTAKES = {plates.NAME: plates.mistake_reply, plate_audit.NAME: plate_audit.mistake_reply}
"""The families whose expert can make a policy's typical mistake where it fits (`mistake_reply(task, turns) ->
str | None`): refused by the tool, never trained on, it lets a demonstration show the recovery
(`SFTConfig.mistakes`)."""

GAVE_UP = {plates.NAME: plates.GAVE_UP}
"""What a family's expert answers, in plain words, when its attempts ran out without a result: a demonstration
that ends so is worth imitating though never right (training/experts.py `worth_imitating`)."""

ITEM_FAMILIES = frozenset({plate_audit.NAME, multihop_batch.NAME})
"""The item families: their `load` takes `items=N` (items per task), and they score each item (`item_reward`)."""


def load_family(
    name: str, split: str, *, data_dir: Path | None = None, limit: int | None = None, items: int | None = None
) -> list[Task]:
    """The tasks of one family and split, in a fixed order; `limit` keeps the first ones; `items`: items per
    task of an item family (None: the family's default; other families ignore it)."""
    if name not in FAMILIES:
        raise ValueError(f"unknown task family {name!r}; known: {sorted(FAMILIES)}")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; known: {SPLITS}")
    family = FAMILIES[name]
    if items is not None and name in ITEM_FAMILIES:
        return family.load(data_root(data_dir), split, limit=limit, items=items)
    return family.load(data_root(data_dir), split, limit=limit)


def item_reward(task: Task, item: int, text: str) -> float:
    """The item family's score of `text` recorded for item `item` (1-based) of an item task."""
    return family_of(task).item_reward(text, task.items[item - 1].reference)


def family_of(task: Task):
    """The module of the task's family; ValueError naming the known ones for any other."""
    if task.family not in FAMILIES:
        raise ValueError(f"task {task.task_id}: unknown family {task.family!r}; known: {sorted(FAMILIES)}")
    return FAMILIES[task.family]


def reward_for(task: Task, answer: str | None, *, kind: str = "task") -> float:
    """The family's final reward in [0, 1] ("graded": its `GRADED` score where it has one); no answer (a budget
    ran out) scores 0."""
    if answer is None:
        return 0.0
    if kind == "graded" and task.family in GRADED:
        return GRADED[task.family](answer, task.reference)
    return family_of(task).reward(answer, task.reference)


def gave_up(task: Task, answer: str | None) -> bool:
    """Whether `answer` is the family's plain give-up (`GAVE_UP`), whatever its case and surrounding spaces."""
    phrase = GAVE_UP.get(task.family)
    return phrase is not None and answer is not None and answer.strip().lower() == phrase


def success(task: Task, answer: str | None) -> bool:
    """Whether the answer is right by the family's rule; no answer is wrong."""
    return answer is not None and family_of(task).success(answer, task.reference)


@contextlib.contextmanager
def prepared(tasks: Sequence[Task], work_dir: Path, *, data_dir: Path | None = None) -> Iterator[list[Task]]:
    """Every task ready to play, in the given order: each family present prepares its own (multihop pages
    served on loopback while this is open, GRID clips subtitled under `work_dir`)."""
    ready = {t.task_id: t for t in tasks}
    with contextlib.ExitStack() as stack:
        for name in sorted({t.family for t in tasks}):
            mine = [t for t in tasks if t.family == name]
            done = stack.enter_context(family_of(mine[0]).prepared(mine, work_dir, data_dir=data_dir))
            ready.update((t.task_id, t) for t in done)
        yield [ready[t.task_id] for t in tasks]
