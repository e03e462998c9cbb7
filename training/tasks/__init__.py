"""Task families: one module each, ending with its `FAMILY`, a frozen `Family` (training/tasks/family.py) listed
in `FAMILIES`, a literal dict. The dataclass holds everything the loop, the expert, the rewards and the benchmarks
need about the family, each field documented there:

    name, tools                                              its key; the sub-agents its tasks may call
    load(data_dir, split, *, limit=None) -> list[Task]       the split's tasks in a fixed order
    reward(answer, reference) -> float                       final reward in [0, 1]
    success(answer, reference) -> bool                       whether the answer is right
    prepared(tasks, work_dir, *, data_dir=None)              context manager: the tasks ready to play
    oracle_reply(task, turns, *, trust_reference) -> str     the scripted expert's next reply (SFT)

and, None where a family has none: `unchained_reply` (the expert's other plan, `SFTConfig.chain = false`:
corpus_qa), `graded_reward` (partial credit where `reward` is all-or-nothing: the plate families), `mistake_reply`
(a policy's typical mistake, for demonstrations of the recovery: the plate families), `gave_up` (the expert's
plain give-up: plate_reading) and `item_reward` (item families, N tasks of another family in one episode,
training/tasks/batch.py: plate_audit, multihop_batch; their `load` also takes `items=N`).

    tasks = load_family("plate_reading", "dev", limit=16)
    with prepared(tasks, work_dir) as ready:               # pages served, clips subtitled, as each family needs
        ...

The functions below read the fields of the task's family; nothing about a family is kept anywhere else. Adding a
family is one module and one entry here (docs/extending.md; tests/test_task_family_contract.py adds one and
trains a step on it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import cast

from training.tasks import corpus_qa, multihop, multihop_batch, plate_audit, plates, research_corpus, video
from training.tasks.family import Family, ItemLoad
from training.tasks.task import SPLITS, Task, TaskMeta, data_root, hash_split, load_tasks, save_tasks

__all__ = [
    "FAMILIES",
    "SPLITS",
    "Family",
    "Task",
    "TaskMeta",
    "data_root",
    "family_named",
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

FAMILIES: dict[str, Family] = {
    multihop.NAME: multihop.FAMILY,
    plates.NAME: plates.FAMILY,
    video.NAME: video.FAMILY,
    plate_audit.NAME: plate_audit.FAMILY,
    multihop_batch.NAME: multihop_batch.FAMILY,
    corpus_qa.NAME: corpus_qa.FAMILY,
    research_corpus.NAME: research_corpus.FAMILY,
}


def family_named(name: str) -> Family:
    """The family called `name`; ValueError naming the known ones for any other."""
    if name not in FAMILIES:
        raise ValueError(f"unknown task family {name!r}; known: {sorted(FAMILIES)}")
    return FAMILIES[name]


def family_of(task: Task) -> Family:
    """The task's family; ValueError naming the known ones for any other."""
    if task.family not in FAMILIES:
        raise ValueError(f"task {task.task_id}: unknown family {task.family!r}; known: {sorted(FAMILIES)}")
    return FAMILIES[task.family]


def load_family(
    name: str, split: str, *, data_dir: Path | None = None, limit: int | None = None, items: int | None = None
) -> list[Task]:
    """The tasks of one family and split, in a fixed order; `limit` keeps the first ones; `items`: items per
    task of an item family (None: the family's default; other families ignore it)."""
    family = family_named(name)
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; known: {SPLITS}")
    if items is not None and family.has_items:
        load = cast(ItemLoad, family.load)  # the contract: an item family's load takes items=N
        return load(data_root(data_dir), split, limit=limit, items=items)
    return family.load(data_root(data_dir), split, limit=limit)


def item_reward(task: Task, item: int, text: str) -> float:
    """The item family's score of `text` recorded for item `item` (1-based) of an item task."""
    score = family_of(task).item_reward
    if score is None:
        raise ValueError(f"task {task.task_id}: {task.family} is not an item family, it scores no items")
    return score(text, task.items[item - 1].reference)


def reward_for(task: Task, answer: str | None, *, kind: str = "task") -> float:
    """The family's final reward in [0, 1] ("graded": its `graded_reward` where it has one); no answer (a budget
    ran out) scores 0."""
    if answer is None:
        return 0.0
    family = family_of(task)
    if kind == "graded" and family.graded_reward is not None:
        return family.graded_reward(answer, task.reference)
    return family.reward(answer, task.reference)


def gave_up(task: Task, answer: str | None) -> bool:
    """Whether `answer` is the family's plain give-up (`Family.gave_up`), whatever its case and surrounding
    spaces."""
    phrase = family_of(task).gave_up
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
