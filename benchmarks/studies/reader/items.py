"""bench_reader's questions: a tune split to choose the reader's rules on, and a report split to measure them on.

A question is kept only when its gold answer occurs in its page (normalised): the reader is given the answer.
Each split mixes sources, in a fixed shuffled order, so that any first n of a split mix them too; every other
question (the 1st, 3rd, ...) is followed by a negative: a page that does not hold the answer.

tune (every threshold, prompt and scoring rule is chosen here; pages written as HTML)
  musique   each hop of MuSiQue's `question_decomposition` (hipporag_musique_train.json) for the questions whose
            id falls in the tune half (`_half`), `#k` filled with hop k's gold answer, "X >> relation" read as
            "What is the relation of X?" (as the corpus_qa expert asks it); the page is the hop's supporting
            paragraph; the negative the question's other paragraph sharing most words with the hop's question
  hotpotqa  HotpotQA train (hotpotqa_train.jsonl): the question as asked, on the supporting paragraph that holds
            its answer (where a research policy asks it on the second page it reads); the negative is the other
            supporting paragraph (the first hop's page, where a reader should say "not in the page"), else the
            distractor sharing most words with the question
report (nothing is chosen here; other sources and page formats)
  musique          the hops of the other half of MuSiQue's questions (held out by question id), as Markdown
                   and plain text pages (alternately)
  hotpotqa         HotpotQA dev (hotpotqa_dev.jsonl), as tune's hotpotqa, as Markdown and plain text pages
  research_corpus  the 36 held-out questions about examples/corpus on their source page (HTML as shipped);
                   the negative the other page sharing most words with the question

Limits: the report's MuSiQue hops come from the same file as tune's (other questions, other paragraphs), and
the earlier bench_reader (one split) chose "extract" and its defaults on MuSiQue train hops and research_corpus,
so those two report sources were seen by that older choice; HotpotQA dev was not. Yes/no answers (comparison
questions) never occur in a page and are left out.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from subagents import documents, spans
from training.rewards import normalize_answer
from training.tasks import multihop, research_corpus

SPLITS = ("tune", "report")
SEED = 25  # the shuffle of each split's questions
FORMATS = {"tune": ("html",), "report": ("md", "txt")}  # page formats, given in turn to a split's pages


@dataclass(frozen=True)
class Item:
    """One question on one page; `holds_answer` False for the negatives."""

    item_id: str
    split: str
    source: str
    question: str
    answer: str
    page: str  # path under the pages folder
    holds_answer: bool
    question_type: str


Pair = tuple[Item, Item | None]  # a question on its gold page, and on a page without the answer (None: none)


def holds(text: str, answer: str) -> bool:
    return f" {normalize_answer(answer)} " in f" {normalize_answer(text)} "


def overlap(question: str, text: str) -> int:
    return len(set(spans.normal_words(question)) & set(spans.normal_words(text)))


def _half(key: str) -> str:
    """The split a MuSiQue question belongs to, by a hash of its id (stable, about half each)."""
    return SPLITS[int(hashlib.sha256(key.encode()).hexdigest(), 16) % 2]


def write_page(pages: Path, stem: str, title: str, text: str, fmt: str) -> str:
    """One paragraph as a page file in `fmt` (html, md, txt) under `pages`; its path relative to `pages`."""
    rel = f"{stem}.{fmt}"
    body = {
        "html": lambda: multihop.page_html((title, [text])),
        "md": lambda: f"# {title}\n\n{text}\n",
        "txt": lambda: f"{title}\n\n{text}\n",
    }[fmt]()
    (pages / rel).parent.mkdir(parents=True, exist_ok=True)
    (pages / rel).write_text(body, encoding="utf-8")
    return rel


def _pair(item: Item, negative: tuple[str, str] | None, write: Callable[[str, str], str]) -> Pair:
    """`item` and its negative on the page `negative` (title, text), each page written by `write`."""
    if negative is None:
        return item, None
    neg = dataclasses.replace(
        item, item_id=f"{item.item_id}-neg", page=write(f"{item.item_id}-neg", *negative), holds_answer=False
    )
    return item, neg


def musique(data: Path, pages: Path, split: str) -> Iterator[Pair]:
    """The hops of the split's MuSiQue questions on their supporting paragraph (see the module docstring)."""
    rows = json.loads((data / "multihop" / "hipporag_musique_train.json").read_text(encoding="utf-8"))
    formats = FORMATS[split]
    n = 0
    for row in rows:
        if _half(str(row["id"])) != split:
            continue
        paragraphs = row["paragraphs"]
        answers = {k: str(h["answer"]) for k, h in enumerate(row["question_decomposition"], start=1)}
        for k, hop in enumerate(row["question_decomposition"], start=1):
            question, answer = multihop.hop_question(hop["question"], answers), answers[k]
            gold = paragraphs[hop["paragraph_support_idx"]]
            if not holds(gold["paragraph_text"], answer):
                continue
            fmt, n = formats[n % len(formats)], n + 1

            def write(stem: str, title: str, text: str, fmt: str = fmt) -> str:
                return write_page(pages, f"musique/{stem}", title, text, fmt)

            item_id = f"musique-{row['id']}-{k}"
            page = write(item_id, gold["title"], gold["paragraph_text"])
            item = Item(
                item_id, split, "musique", question, answer, page, True, spans.question_type(question)
            )
            others = [p for p in paragraphs if p is not gold and not holds(p["paragraph_text"], answer)]
            negative = max(others, key=lambda p: overlap(question, p["paragraph_text"]), default=None)
            yield _pair(
                item, None if negative is None else (negative["title"], negative["paragraph_text"]), write
            )


def hotpotqa(data: Path, pages: Path, split: str, *, limit: int) -> Iterator[Pair]:
    """HotpotQA questions on the supporting paragraph holding the answer (see the module docstring)."""
    name = {"tune": "hotpotqa_train.jsonl", "report": "hotpotqa_dev.jsonl"}[split]
    lines = (data / "multihop" / name).read_text(encoding="utf-8").splitlines()
    formats = FORMATS[split]
    n = 0
    for line in lines:
        if n >= limit:
            return
        row = json.loads(line)
        context = zip(row["context"]["title"], row["context"]["sentences"], strict=True)
        paragraphs = {title: " ".join(s.strip() for s in sentences) for title, sentences in context}
        support = list(dict.fromkeys(row["supporting_facts"]["title"]))
        answer, question = row["answer"], row["question"]
        gold = next((t for t in support if holds(paragraphs[t], answer)), None)
        if gold is None:  # yes/no, or an answer the paragraphs word otherwise
            continue
        fmt, n = formats[n % len(formats)], n + 1

        def write(stem: str, title: str, text: str, fmt: str = fmt) -> str:
            return write_page(pages, f"hotpotqa/{stem}", title, text, fmt)

        item_id = f"hotpotqa-{row['id']}"
        page = write(item_id, gold, paragraphs[gold])
        item = Item(item_id, split, "hotpotqa", question, answer, page, True, spans.question_type(question))
        others = [t for t in paragraphs if t != gold and not holds(paragraphs[t], answer)]
        first_hop = [t for t in support if t in others]
        nearest = max(others, key=lambda t: overlap(question, paragraphs[t]), default=None)
        negative = first_hop[0] if first_hop else nearest
        yield _pair(item, None if negative is None else (negative, paragraphs[negative]), write)


def corpus(pages: Path) -> Iterator[Pair]:
    """research_corpus questions on their source page, with the other page sharing most words as negative."""
    texts = {}
    for path in sorted(research_corpus.CORPUS.glob("*.html")):
        (pages / "corpus").mkdir(parents=True, exist_ok=True)
        (pages / "corpus" / path.name).write_bytes(path.read_bytes())
        texts[path.name] = documents.extract_page(path.read_bytes(), "text/html").text
    for task in research_corpus.load(Path(), "dev"):
        source = task.meta.page_paths[0]
        if not holds(texts[source], task.reference):
            continue
        question, answer, kind = task.question, task.reference, spans.question_type(task.question)
        item = Item(
            task.task_id, "report", "research_corpus", question, answer, f"corpus/{source}", True, kind
        )
        others = [n for n, t in texts.items() if n != source and not holds(t, task.reference)]
        negative = max(others, key=lambda n: overlap(task.question, texts[n]), default=None)
        neg = None
        if negative is not None:
            neg = dataclasses.replace(
                item, item_id=f"{item.item_id}-neg", page=f"corpus/{negative}", holds_answer=False
            )
        yield item, neg


def split_items(data: Path, pages: Path, split: str, *, n: int, hotpotqa_n: int) -> list[Item]:
    """The first `n` questions of `split` in its fixed shuffled order, every other one followed by its negative."""
    pairs = [*musique(data, pages, split), *hotpotqa(data, pages, split, limit=hotpotqa_n)]
    if split == "report":
        pairs += corpus(pages)
    random.Random(SEED).shuffle(pairs)
    out: list[Item] = []
    for i, (pos, neg) in enumerate(pairs[:n]):
        out.append(pos)
        if neg is not None and i % 2 == 0:
            out.append(neg)
    return out
