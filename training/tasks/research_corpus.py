"""research_corpus: questions about the project's example corpus (examples/corpus), the evaluation of `conductor ask`.

36 questions, 6 about each page, written once with a short gold answer and the sentence of the page that holds it
(research_corpus.jsonl beside this file). They are **kept out of training**: the train split is empty and loading
it is an error; dev and test are the same 36 questions (the set is small and held out whole). The task shows only
the question, as `conductor ask` does with no attachment: the policy has to search the corpus, open a hit with
page_qa and answer.

Reward: SQuAD token F1; success: normalised exact match (as multihop_pages). Expert: corpus_qa's, one step with
the question's source page.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Sequence
from pathlib import Path

from training.tasks import corpus_qa, multihop
from training.tasks.family import Family
from training.tasks.task import REPO, Task, TaskMeta

NAME = "research_corpus"
QUESTIONS = Path(__file__).with_name("research_corpus.jsonl")
CORPUS = REPO / "examples" / "corpus"

reward = multihop.reward
success = multihop.success
oracle_reply = corpus_qa.oracle_reply


def load(data_dir: Path, split: str, *, limit: int | None = None) -> list[Task]:
    """The questions (every split but train, which is kept empty on purpose: see the module docstring)."""
    del data_dir  # the questions ship with the project; the corpus is examples/corpus
    if split == "train":
        raise ValueError("research_corpus is evaluation-only: its questions are kept out of training")
    rows = [json.loads(line) for line in QUESTIONS.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [_task(row, split) for row in rows][:limit]


def _task(row: dict, split: str) -> Task:
    title = row["source"].removesuffix(".html")
    meta = TaskMeta(page_titles=(title,), page_paths=(row["source"],), split=split, corpus=str(CORPUS))
    return Task(row["id"], NAME, row["question"], corpus_qa.TOOLS, row["answer"], "", meta)


@contextlib.contextmanager
def prepared(tasks: Sequence[Task], work_dir: Path, *, data_dir: Path | None = None) -> Iterator[list[Task]]:
    """Nothing to prepare: the corpus is in the repository."""
    del work_dir, data_dir
    if not CORPUS.is_dir():
        raise FileNotFoundError(f"research_corpus needs the example corpus at {CORPUS}")
    yield list(tasks)


FAMILY = Family(
    name=NAME, tools=corpus_qa.TOOLS, load=load, reward=reward, success=success, prepared=prepared,
    oracle_reply=oracle_reply,  # one page a question: corpus_qa's two plans agree on it (no unchained_reply)
)  # fmt: skip
