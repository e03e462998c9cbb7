"""echo: a task family defined outside training/tasks, in this one module, to show what adding a family takes.

The question asks the policy to search for the word its context shows, then to answer that word. No data files:
the words are below, the same on every split. The expert searches once with the word and answers it. Reward:
the share of the word's letters the answer holds (graded, so a random policy's answers differ and a training
step on it has a gradient); success: the word itself, whatever its case and surrounding spaces.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path

from main_agent.types import Turn
from training.tasks.family import Family
from training.tasks.task import Task, TaskMeta, answer_text, call_text, context_lines

NAME = "echo"
TOOLS = ("search",)
WORDS = ("apple", "river", "stone", "cloud")
QUESTION = "Search for the word below, then answer with that word."


def load(data_dir: Path, split: str, *, limit: int | None = None) -> list[Task]:
    """One task a word, in WORDS' order; every split holds them all (the family ships no data)."""
    del data_dir
    tasks = [Task(f"echo-{w}", NAME, QUESTION, TOOLS, w, f"Word: {w}", TaskMeta(split=split)) for w in WORDS]
    return tasks[:limit]


def reward(answer: str, reference: str) -> float:
    """The share of the reference's distinct letters that appear in the answer (case-insensitive)."""
    letters = set(reference.lower())
    return len(letters & set(answer.lower())) / len(letters)


def success(answer: str, reference: str) -> bool:
    return answer.strip().lower() == reference.lower()


@contextlib.contextmanager
def prepared(tasks: Sequence[Task], work_dir: Path, *, data_dir: Path | None = None) -> Iterator[list[Task]]:
    """Nothing to prepare: the context holds the word."""
    del work_dir, data_dir
    yield list(tasks)


def oracle_reply(task: Task, turns: list[Turn], *, trust_reference: bool) -> str:
    """Turn 0: search for the word the context shows. Then: answer it (the policy saw it)."""
    del trust_reference
    [word] = context_lines(task, "Word")
    return call_text("search", query=word) if not turns else answer_text(word)


FAMILY = Family(
    name=NAME, tools=TOOLS, load=load, reward=reward, success=success, prepared=prepared,
    oracle_reply=oracle_reply,
)  # fmt: skip
