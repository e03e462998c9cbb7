"""The task-family contract: one frozen `Family` per family, everything the loop, the expert, the rewards and the
benchmarks need to know about it.

Each family module ends with its entry, built from its own functions, and `training.tasks.FAMILIES` lists it:

    FAMILY = Family(name=NAME, tools=TOOLS, load=load, reward=reward, success=success, prepared=prepared,
                    oracle_reply=oracle_reply)

The optional fields are None where a family has no such thing (most have none); nothing about a family is kept
in a table elsewhere. The callables' signatures are the protocols and aliases below.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from main_agent.types import Turn
from training.tasks.task import Task

Score = Callable[[str, str], float]
"""(answer, reference) -> a score in [0, 1]."""
Judge = Callable[[str, str], bool]
"""(answer, reference) -> whether the answer is right."""
MistakeReply = Callable[[Task, list[Turn]], "str | None"]
"""(task, turns so far) -> a policy's typical mistake at this turn, or None where none fits."""


class Load(Protocol):
    """The split's tasks in a fixed order, the first `limit` of them."""

    def __call__(self, data_dir: Path, split: str, *, limit: int | None = None) -> list[Task]: ...


class ItemLoad(Protocol):
    """An item family's `load`: also takes `items`, the items per task (N tasks of another family each; the
    family's default when not given)."""

    def __call__(
        self, data_dir: Path, split: str, *, limit: int | None = None, items: int = ...
    ) -> list[Task]: ...


class Prepared(Protocol):
    """A context manager yielding the tasks ready to play, in order (pages served, clips subtitled, a corpus
    written under `work_dir`), released on exit."""

    def __call__(
        self, tasks: Sequence[Task], work_dir: Path, *, data_dir: Path | None = None
    ) -> AbstractContextManager[list[Task]]: ...


class OracleReply(Protocol):
    """The scripted expert's next reply in the policy's format, from the task and the turns so far; with
    `trust_reference` it answers the reference even where no observation showed it."""

    def __call__(self, task: Task, turns: list[Turn], *, trust_reference: bool) -> str: ...


@dataclass(frozen=True)
class Family:
    """One task family: its tasks, how they are scored and readied, and its scripted expert."""

    name: str
    """The key of `training.tasks.FAMILIES` and every `Task.family` of it; what `task = ...` names."""
    tools: tuple[str, ...]
    """The sub-agents its tasks may call (each task's `Task.tools` is among them): what a tool server must offer
    to play it."""
    load: Load | ItemLoad
    """The tasks of a split (training/tasks `load_family`: training's data order, SFT, evaluation, benchmarks);
    an item family's also takes `items=N` (`ItemLoad`)."""
    reward: Score
    """The final reward in [0, 1] that training, evaluation and the benchmarks report (`reward_for`)."""
    success: Judge
    """Whether an answer is right: logged by training, reported by evaluation, the SFT filter (`success`)."""
    prepared: Prepared
    """Readies the tasks before any episode plays them (training/play.py `tool_session`, via `prepared`)."""
    oracle_reply: OracleReply
    """The scripted expert (training/experts.py `OraclePolicy`): SFT's demonstrations, the benchmarks' expert
    rows."""
    unchained_reply: OracleReply | None = None
    """The expert's other plan, played where `SFTConfig.chain` is false (corpus_qa: a two-page question answers
    what its first read answered); None: the expert has one plan, played either way."""
    graded_reward: Score | None = None
    """Partial credit in [0, 1] where `reward` is all-or-nothing (the plate families: 1 - normalised edit
    distance), trained on with `reward_kind = "graded"` (`reward_for(..., kind="graded")`); None: `reward` is
    used."""
    mistake_reply: MistakeReply | None = None
    """A policy's typical mistake the expert can make first (`SFTConfig.mistakes`; refused or leading nowhere,
    never trained on), so a demonstration shows the recovery; None: the expert makes none."""
    gave_up: str | None = None
    """What the expert answers, lower case, when its attempts ran out without a result: an honest end worth
    imitating though never right (training/experts.py `worth_imitating`, `gave_up`); None: it has none."""
    item_reward: Score | None = None
    """Item families only (N tasks of another family in one episode, training/tasks/batch.py): the score of one
    recorded item's text against that item's reference, the per-item progress training pays (`item_reward`);
    set exactly when `load` takes `items=N`."""

    def __post_init__(self) -> None:
        if self.gave_up is not None and self.gave_up != self.gave_up.strip().lower():
            raise ValueError(f"{self.name}: gave_up must be stripped and lower case, got {self.gave_up!r}")

    @property
    def has_items(self) -> bool:
        """Whether it is an item family: its tasks bundle items, its `load` takes `items=N`."""
        return self.item_reward is not None
