"""multihop_pages: multi-hop questions over Wikipedia paragraphs, each paragraph one page read with page_qa.

HotpotQA (RPT's 300/300/500 official dev questions as train/dev/test); train adds HippoRAG's HotpotQA and MuSiQue
train subsets. MuSiQue rows carry a decomposition: one sub-question per hop with `#k` standing for hop k's answer
and the paragraph that answers it (`TaskMeta.hops`). Each paragraph becomes one HTML page served over loopback
(the tool server needs `allow_private_cidrs=("127.0.0.0/8",)`), attached to the episode once `prepared` has
started the page server and listed in the task's context by handle, "Page: d_3fa9c1 <title>" (the handle
derives from the page's path, not the server's port: the same in every run).

Reward: SQuAD token F1 against the gold answer; success: normalised exact match.

Expert: with a decomposition it asks hop by hop, each sub-question to its page, filling `#k` from the answer it
observed for hop k (hops whose placeholders are filled go out together, concurrently); without one it asks every
supporting page the whole question in one turn. Then it answers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import html
import json
import logging
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from main_agent.types import Turn
from subagents.handles import Attachment
from training.rewards import contains_evidence, exact_match, token_f1
from training.tasks.family import Family
from training.tasks.task import (
    NO_ANSWER,
    Task,
    TaskMeta,
    answer_text,
    call_text,
    context_lines,
    data_root,
    payload_field,
    results,
)

logger = logging.getLogger(__name__)

NAME = "multihop_pages"
TOOLS = ("page_qa",)
MAX_PAGES_PER_TURN = 4  # the rollout's default per-turn call cap
_PLACEHOLDER = re.compile(r"#(\d+)")


def reward(answer: str, reference: str) -> float:
    return token_f1(answer, reference)


def success(answer: str, reference: str) -> bool:
    return exact_match(answer, reference) == 1.0


# ---------------------------------------------------------------- loading
# (title, sentences) -> one page; a record of any file -> (task id, question, answer, paragraphs, support, hops)
Paragraph = tuple[str, Sequence[str]]
Hops = tuple[tuple[str, int], ...]
_Parsed = tuple[str, str, str, Sequence[Paragraph], Iterable[str], Hops]
_WithPages = tuple[Task, Sequence[Paragraph]]


def _from_hf(row: dict) -> _Parsed:
    """RPT's HotpotQA rows (Hugging Face layout: parallel lists under context and supporting_facts)."""
    paragraphs = list(zip(row["context"]["title"], row["context"]["sentences"], strict=True))
    support = row["supporting_facts"]["title"]
    return f"hotpotqa-{row['id']}", row["question"], row["answer"], paragraphs, support, ()


def _from_hipporag_hotpot(row: dict) -> _Parsed:
    """HippoRAG's HotpotQA rows (original layout: context [[title, sentences]], supporting_facts [[title, i]])."""
    support = (title for title, _ in row["supporting_facts"])
    return f"hotpotqa-{row['_id']}", row["question"], row["answer"], row["context"], support, ()


def _from_musique(row: dict) -> _Parsed:
    """MuSiQue rows: paragraphs with one text each, an is_supporting flag, and the question's decomposition.
    Answer aliases are not kept."""
    paragraphs = [(p["title"], [p["paragraph_text"]]) for p in row["paragraphs"]]
    support = (p["title"] for p in row["paragraphs"] if p["is_supporting"])
    hops = tuple((str(h["question"]), int(h["paragraph_support_idx"])) for h in row["question_decomposition"])
    return f"musique-{row['id']}", row["question"], row["answer"], paragraphs, support, hops


_FILES: dict[str, tuple[tuple[str, Callable[[dict], _Parsed]], ...]] = {
    "train": (
        ("hotpotqa_train.jsonl", _from_hf),
        ("hipporag_hotpotqa_train.json", _from_hipporag_hotpot),
        ("hipporag_musique_train.json", _from_musique),
    ),
    "dev": (("hotpotqa_dev.jsonl", _from_hf),),
    "test": (("hotpotqa_test.jsonl", _from_hf),),
}


def _parse(parse: Callable[[dict], _Parsed], row: dict, split: str) -> _WithPages | None:
    """The task and paragraphs of a record; None if it does not map (bad fields, no paragraphs or answer)."""
    try:
        task_id, question, answer, paragraphs, support, hops = parse(row)
        titles, support = tuple(str(t) for t, _ in paragraphs), tuple(dict.fromkeys(support))
        "".join(s for _, sentences in paragraphs for s in sentences)  # TypeError unless all are strings
    except (KeyError, TypeError, ValueError):
        return None
    if not titles or not isinstance(answer, str) or not answer.strip():
        return None
    if any(not 0 <= page < len(titles) for _, page in hops):
        return None
    paths = tuple(f"{task_id}/{n}.html" for n in range(len(titles)))
    meta = TaskMeta(support, titles, paths, hops=hops, split=split)
    return Task(task_id, NAME, question, TOOLS, answer, "", meta), paragraphs


def _records(data_dir: Path, split: str) -> Iterator[_WithPages]:
    """A split's records as tasks with paragraphs, in file order; unmappable ones are skipped with a warning."""
    for name, parse in _FILES[split]:
        text = (data_dir / "multihop" / name).read_text(encoding="utf-8")
        rows = [json.loads(x) for x in text.splitlines()] if name.endswith(".jsonl") else json.loads(text)
        parsed = [_parse(parse, row, split) for row in rows]
        if None in parsed:
            logger.warning("%s: skipped %d records that do not map to a task", name, parsed.count(None))
        yield from (p for p in parsed if p is not None)


def load(data_dir: Path, split: str, *, limit: int | None = None) -> list[Task]:
    """Multihop questions of a split (pages are described in meta, written by `write_pages`)."""
    return [task for task, _ in _records(data_dir, split)][:limit]


# ---------------------------------------------------------------- preparation: pages over loopback


def page_html(paragraph: Paragraph) -> str:
    """One paragraph as a small HTML page: the title in <title> and <h1>, the text in one <p>."""
    title = html.escape(paragraph[0])
    text = html.escape(" ".join(s.strip() for s in paragraph[1] if s.strip()))
    head = f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8"><title>{title}</title></head>'
    return f"{head}\n<body><article><h1>{title}</h1>\n<p>{text}</p></article></body></html>\n"


def write_pages(tasks: Sequence[Task], pages_root: Path, *, data_dir: Path | None = None) -> int:
    """Write the pages of the multihop tasks (re-read from the data) under `pages_root`; return how many."""
    wanted = {t.task_id: t for t in tasks if t.family == NAME}
    splits = sorted({t.meta.split for t in wanted.values()})
    root = data_root(data_dir)
    found = {t.task_id: ps for s in splits for t, ps in _records(root, s) if t.task_id in wanted}
    if missing := wanted.keys() - found.keys():
        raise ValueError(f"{len(missing)} tasks are not in the data, e.g. {sorted(missing)[:3]}")
    for task_id, paragraphs in found.items():
        for rel, paragraph in zip(wanted[task_id].meta.page_paths, paragraphs, strict=True):
            (pages_root / rel).parent.mkdir(parents=True, exist_ok=True)
            (pages_root / rel).write_text(page_html(paragraph), encoding="utf-8")
    return sum(len(wanted[task_id].meta.page_paths) for task_id in found)


def with_base_url(task: Task, base_url: str) -> Task:
    """The task with its pages attached (served under `base_url`) and listed as "Page: d_3fa9c1 <title>"."""
    pages = zip(task.meta.page_titles, task.meta.page_paths, strict=True)
    attached = tuple(
        Attachment("page", f"{base_url.rstrip('/')}/{path}", f"pages/{path}", title) for title, path in pages
    )
    context = "\n".join(a.line for a in attached)
    return dataclasses.replace(task, context=context, attachments=attached)


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # the base class's signature
        logger.debug("page server: " + format, *args)


class PageServer(ThreadingHTTPServer):
    """Serves a folder on 127.0.0.1 (a free port) from a daemon thread; a context manager, or call `close()`."""

    daemon_threads = True

    def __init__(self, root: Path) -> None:
        if not root.is_dir():
            raise FileNotFoundError(f"pages folder not found: {root}")
        super().__init__(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(root)))
        self._thread = threading.Thread(target=self.serve_forever, name="page-server", daemon=True)
        self._thread.start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def close(self) -> None:
        self.shutdown()
        self.server_close()
        self._thread.join()

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def prepared(tasks: Sequence[Task], work_dir: Path, *, data_dir: Path | None = None) -> Iterator[list[Task]]:
    """The tasks with their pages written under `work_dir/pages` and served on loopback while this is open."""
    pages = work_dir / "pages"
    write_pages(tasks, pages, data_dir=data_dir)
    with PageServer(pages) as server:
        yield [with_base_url(t, server.base_url) for t in tasks]


# ---------------------------------------------------------------- the expert


def oracle_reply(task: Task, turns: list[Turn], *, trust_reference: bool) -> str:
    """The next reply: the hops (or supporting pages) still to ask, else the answer."""
    urls = [line.split(" ", 1)[0] for line in context_lines(task, "Page")]  # the pages' handles
    if len(urls) != len(task.meta.page_titles):
        raise ValueError(f"task {task.task_id} lists no pages: prepare it with tasks.prepared first")
    asked = [(r, c.arguments) for t in turns for c, r in zip(t.calls, t.results, strict=True)]
    if task.meta.hops:
        pending = _next_hops(task.meta.hops, urls, asked)
    elif not turns:
        pending = _supporting_pages(task, urls)
    else:
        pending = []
    if pending:
        return "\n".join(call_text("page_qa", url=url, question=q) for url, q in pending[:MAX_PAGES_PER_TURN])
    answers = [str(payload_field(r, "answer") or "") for r in results(turns) if r.ok]
    useful = [a for a in answers if a and "not in the page" not in a.lower()]
    return answer_text(_grounded(task, turns, useful[-1] if useful else NO_ANSWER, trust_reference))


def _supporting_pages(task: Task, urls: list[str]) -> list[tuple[str, str]]:
    """HotpotQA: every supporting page (the first two pages when none is marked) asked the whole question."""
    titles = task.meta.page_titles
    pages = [i for i, title in enumerate(titles) if title in task.meta.supporting_titles] or [0, 1]
    return [(urls[i], task.question) for i in pages if i < len(urls)]


def _next_hops(hops: Sequence[tuple[str, int]], urls: list[str], asked: list) -> list[tuple[str, str]]:
    """The hops not asked yet whose `#k` placeholders all have an observed answer, as (url, question)."""
    answers: dict[int, str] = {}
    done = 0
    for result, arguments in asked:  # the expert asks hops in order, one call per hop
        while done < len(hops) and urls[hops[done][1]] != arguments.get("url"):
            done += 1
        if done < len(hops):
            answers[done + 1] = str(payload_field(result, "answer") or NO_ANSWER)
            done += 1
    pending = []
    for question, page in hops[done:]:
        needed = {int(n) for n in _PLACEHOLDER.findall(question)}
        if not needed <= answers.keys():
            break  # a later hop needs this one's answer first
        pending.append((urls[page], hop_question(question, answers)))
    return pending


def hop_question(template: str, answers: dict[int, str]) -> str:
    """A sub-question as a page reader reads it: `#k` filled with hop k's answer; MuSiQue's Wikidata form
    "Subject >> relation" written as "What is the relation of Subject?"."""
    filled = _PLACEHOLDER.sub(lambda m: answers.get(int(m.group(1)), m.group(0)), template).strip()
    if ">>" in filled:
        subject, _, relation = filled.partition(">>")
        return f"What is the {relation.strip()} of {subject.strip()}?"
    return filled


def _grounded(task: Task, turns: list[Turn], guess: str, trust_reference: bool) -> str:
    """The reference when an observation showed it (or when trusted), else the expert's own reading."""
    seen = "\n".join(r.observation for r in results(turns) if r.ok)
    return task.reference if trust_reference or contains_evidence(seen, task.reference) else guess


FAMILY = Family(
    name=NAME, tools=TOOLS, load=load, reward=reward, success=success, prepared=prepared,
    oracle_reply=oracle_reply,
)  # fmt: skip
