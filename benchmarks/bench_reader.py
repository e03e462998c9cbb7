"""page_qa alone as a reader: single-hop questions with the page that holds the answer, and pages that do not.

    python benchmarks/bench_reader.py --n 150                  # every answer mode -> results/bench_reader.json
    python benchmarks/bench_reader.py --n 30 --modes extract align
    python benchmarks/bench_reader.py --n 150 --recorded       # the table of what is recorded, running nothing
    python benchmarks/bench_reader.py --n 60 --modes extract --models smollm2-135m-instruct gemma3-270m

The questions (positives), in a fixed shuffled order so that any first n mix the sources:
  musique          each hop of MuSiQue's `question_decomposition` (hipporag_musique_train.json) as its own
                   question, `#k` filled with hop k's gold answer, "X >> relation" read as "What is the relation
                   of X?" (as the corpus_qa expert asks it); the page is the hop's supporting paragraph
  research_corpus  the 36 held-out questions about examples/corpus; the page is the question's source page
A question is kept only when its gold answer occurs in its page (normalised): the reader is given the answer.
Negatives, for the first half of the n questions: a page of the same question that does not hold the answer,
the one sharing most words with the question (another paragraph of the MuSiQue question; another corpus page).

Every call goes through the real page_qa code (`page_qa.run`) with a real model (`--models`: built-in names or
checkpoint directories, one after another; SmolLM2-135M-Instruct by default) and the real fetcher, the pages
served over loopback as small HTML files (multihop.page_html; the corpus as it is).
Per answer mode (`page_qa.Config.answer_mode`) it reports, on positives: EM and F1 against the gold answer,
has-gold (the answer contains the gold answer), in-page (the answer occurs on the page), supported (page_qa's own
flag) and "not found" (wrongly); on negatives: the rates of "not in the page" and of supported (wrongly); on
all: p50 latency and mean tokens read and returned.

Every mode is set explicitly (`Config(answer_mode=...)`), whatever page_qa's default. Written: the table and the
settings in results/bench_reader.json (small, committed; a row per model and mode); one JSON line per (model,
mode, question) in <work>/records/<mode>.jsonl (runs/bench_reader/records/ by default: ~750 KB a model for
--n 150, not committed), with a fingerprint of the settings, the model and READER_VERSION (bumped when the reader's code changes); lines under
another fingerprint are ignored, so a run resumes where it stopped and a changed reader is measured anew. Questions run in order,
every mode on one question before the next, so a run cut short leaves a comparable table over its first
questions. "free" and "align" share one generation per question (the model is greedy, so the reply is the same):
the second reuses it, and its latency counts the reused generation's time, as if it had generated it. "extract"
records every candidate's log-prob (`scored`), so other selection rules can be studied without the model.
Limits: latency is one request at a time on this machine's cores, beside whatever else runs on them.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from conductor.models import DEFAULT_MODEL  # noqa: E402
from subagents import page_qa, spans  # noqa: E402
from subagents.backends import build_llm  # noqa: E402
from subagents.common import Runtime  # noqa: E402
from subagents.fetch import FetchConfig, Fetcher  # noqa: E402
from subagents.llm import LLM, BackendConfig, Generation, Message  # noqa: E402
from training.rewards import exact_match, normalize_answer, token_f1  # noqa: E402
from training.tasks import multihop, research_corpus  # noqa: E402
from training.tasks.task import data_root  # noqa: E402

MODES = ("free", "align", "extract")
RESULTS = ROOT / "benchmarks" / "results"
SEED = 25  # the shuffle of the questions
# Bumped with every change to how page_qa answers (page_qa.py, spans.py) that its Config does not show, so that
# records of the old code are measured anew rather than mixed in. free 2: the model's words as page_qa gave them
# before answer modes (no "not in the page" for refusals, `supported` not judged), the observation the shipped
# policy was trained on. extract 5: the prompt's logits at its last position alone (rounding may differ).
READER_VERSION = {"free": 2, "align": 1, "extract": 5}


@dataclass(frozen=True)
class Item:
    """One question on one page; `holds_answer` False for the negatives."""

    item_id: str
    source: str
    question: str
    answer: str
    page: str  # path under the pages folder
    holds_answer: bool


def _overlap(question: str, text: str) -> int:
    return len(set(spans.normal_words(question)) & set(spans.normal_words(text)))


def _holds(text: str, answer: str) -> bool:
    return f" {normalize_answer(answer)} " in f" {normalize_answer(text)} "


def musique(data: Path, pages: Path) -> list[tuple[Item, Item | None]]:
    """Each hop as a question on its supporting paragraph, with its negative (None when every paragraph holds
    the answer); writes the paragraphs it uses as pages."""
    rows = json.loads((data / "multihop" / "hipporag_musique_train.json").read_text(encoding="utf-8"))
    pairs = []
    for row in rows:
        paragraphs = row["paragraphs"]
        answers = {k: str(h["answer"]) for k, h in enumerate(row["question_decomposition"], start=1)}
        for k, hop in enumerate(row["question_decomposition"], start=1):
            question, answer = multihop.hop_question(hop["question"], answers), answers[k]
            gold = paragraphs[hop["paragraph_support_idx"]]
            if not _holds(gold["paragraph_text"], answer):
                continue
            others = [p for p in paragraphs if p is not gold and not _holds(p["paragraph_text"], answer)]
            negative = max(others, key=lambda p: _overlap(question, p["paragraph_text"]), default=None)
            item_id = f"musique-{row['id']}-{k}"
            pos = Item(item_id, "musique", question, answer, _page(pages, row["id"], gold), True)
            neg = None
            if negative is not None:
                neg = dataclasses.replace(
                    pos, item_id=f"{item_id}-neg", page=_page(pages, row["id"], negative), holds_answer=False
                )
            pairs.append((pos, neg))
    return pairs


def _page(pages: Path, row_id: str, paragraph: dict) -> str:
    rel = f"musique/{row_id}-{paragraph['idx']}.html"
    (pages / rel).parent.mkdir(parents=True, exist_ok=True)
    (pages / rel).write_text(
        multihop.page_html((paragraph["title"], [paragraph["paragraph_text"]])), encoding="utf-8"
    )
    return rel


def corpus(pages: Path) -> list[tuple[Item, Item | None]]:
    """research_corpus questions on their source page, with the other page sharing most words as negative."""
    texts = {}
    for path in sorted(research_corpus.CORPUS.glob("*.html")):
        (pages / "corpus").mkdir(parents=True, exist_ok=True)
        (pages / "corpus" / path.name).write_bytes(path.read_bytes())
        texts[path.name] = page_qa.extract_page(path.read_bytes(), "text/html").text
    pairs = []
    for task in research_corpus.load(Path(), "dev"):
        source = task.meta.page_paths[0]
        if not _holds(texts[source], task.reference):
            continue
        pos = Item(task.task_id, "research_corpus", task.question, task.reference, f"corpus/{source}", True)
        others = [n for n, t in texts.items() if n != source and not _holds(t, task.reference)]
        negative = max(others, key=lambda n: _overlap(task.question, texts[n]), default=None)
        neg = None
        if negative is not None:
            neg = dataclasses.replace(
                pos, item_id=f"{pos.item_id}-neg", page=f"corpus/{negative}", holds_answer=False
            )
        pairs.append((pos, neg))
    return pairs


def items(data: Path, pages: Path, n: int) -> list[Item]:
    """The first `n` questions in the fixed shuffled order, each but the second half followed by its negative."""
    pairs = musique(data, pages) + corpus(pages)
    random.Random(SEED).shuffle(pairs)
    chosen = pairs[:n]
    out: list[Item] = []
    for i, (pos, neg) in enumerate(chosen):
        out.append(pos)
        if neg is not None and i < (n + 1) // 2:
            out.append(neg)
    return out


class SharedGenerations:
    """The model, with one generation per prompt kept for the next mode that asks the same (see the docstring)."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.model_id, self.multimodal, self.scores = llm.model_id, llm.multimodal, llm.scores
        self.kept: dict[tuple, tuple[Generation, float]] = {}
        self.reused_s = 0.0  # generation time reused since the last reset
        self.scored: list[tuple[str, float]] = []  # the last call's replies and scores ("extract")

    async def generate(self, messages: list[Message], *, max_new_tokens: int) -> Generation:
        key = (tuple((m.role, m.content) for m in messages), max_new_tokens)
        if key in self.kept:
            generation, seconds = self.kept[key]
            self.reused_s += seconds
            return generation
        start = time.perf_counter()
        generation = await self.llm.generate(messages, max_new_tokens=max_new_tokens)
        self.kept = {key: (generation, time.perf_counter() - start)}  # only the last question's is kept
        return generation

    async def score(self, messages: list[Message], replies: list[str]) -> list[float]:
        scores = await self.llm.score(messages, replies)
        self.scored = list(zip(replies, scores, strict=True))
        return scores

    def count_tokens(self, text: str) -> int:
        return self.llm.count_tokens(text)

    async def aclose(self) -> None:
        await self.llm.aclose()


def fingerprint(cfg: page_qa.Config, model_id: str) -> str:
    """What a record must have been made with to be reused: settings, model and the mode's READER_VERSION."""
    version = READER_VERSION[cfg.answer_mode]
    return hashlib.sha256(f"{cfg!r}|{model_id}|{version}".encode()).hexdigest()[:16]


def load_records(path: Path, print_: str) -> dict[str, dict]:
    if not path.is_file():
        return {}
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return {r["item"]: r for r in rows if r["fingerprint"] == print_}


async def ask(item: Item, cfg: page_qa.Config, rt: Runtime, base_url: str, page_text: str) -> dict:
    """One page_qa call and what it scored."""
    rt.llm.reused_s, rt.llm.scored = 0.0, []  # type: ignore[attr-defined]
    start = time.perf_counter()
    request = page_qa.Request(url=f"{base_url}/{item.page}", question=item.question)
    response = await page_qa.run(request, cfg, rt)
    latency = time.perf_counter() - start + rt.llm.reused_s  # type: ignore[attr-defined]
    assert response.ok, f"{item.item_id}: {response.observation()}"
    return {
        "item": item.item_id,
        "model": rt.llm.model_id,
        "holds_answer": item.holds_answer,
        "source": item.source,
        "question": item.question,
        "gold": item.answer,
        "answer": response.answer,
        "quote": response.quote,
        "supported": response.supported,
        "not_found": response.answer == page_qa.NOT_FOUND,
        "em": exact_match(response.answer, item.answer),
        "f1": token_f1(response.answer, item.answer),
        "in_page": response.answer != page_qa.NOT_FOUND and _holds(page_text, response.answer),
        "latency_s": latency,
        "tokens_read": response.tokens_read,
        "tokens_returned": response.tokens_returned,
        "scored": rt.llm.scored,  # type: ignore[attr-defined]  # "extract": every candidate's log-prob
    }


def summarise(model: str, mode: str, records: list[dict]) -> dict:
    pos = [r for r in records if r["holds_answer"]]
    neg = [r for r in records if not r["holds_answer"]]

    def mean(
        rows: list[dict], key: str
    ) -> float:  # nan for none, or for a value not judged ("free": supported)
        known = [r[key] for r in rows]
        return statistics.mean(map(float, known)) if rows and None not in known else float("nan")

    return {
        "model": model,
        "mode": mode,
        "questions": len(pos),
        "negatives": len(neg),
        "em": mean(pos, "em"),
        "holds_gold": statistics.mean(_holds(r["answer"], r["gold"]) for r in pos) if pos else float("nan"),
        "f1": mean(pos, "f1"),
        "in_page": mean(pos, "in_page"),
        "supported": mean(pos, "supported"),
        "supported_on_negatives": mean(neg, "supported"),
        "not_found_on_gold_page": mean(pos, "not_found"),
        "not_found_on_negatives": mean(neg, "not_found"),
        "latency_p50_s": statistics.median(r["latency_s"] for r in records) if records else float("nan"),
        "tokens_read": mean(records, "tokens_read"),
        "tokens_returned": mean(records, "tokens_returned"),
    }


def table(rows: list[dict]) -> str:
    head = (
        f"{'model':<28} | {'mode':<8} | {'n':>4} | {'neg':>4} | {'EM':>5} | {'F1':>5} | has gold | in page | supported: gold page / negatives | "
        f"not found: gold page / negatives | p50 s | tokens read / returned"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['model']:<28} | {r['mode']:<8} | {r['questions']:4d} | {r['negatives']:4d} | {r['em']:5.3f} | {r['f1']:5.3f} | "
            f"{r['holds_gold']:8.3f} | {r['in_page']:7.3f} | {r['supported']:16.3f} / "
            f"{r['supported_on_negatives']:9.3f} | {r['not_found_on_gold_page']:16.3f} / "
            f"{r['not_found_on_negatives']:9.3f} | {r['latency_p50_s']:5.1f} | "
            f"{r['tokens_read']:6.0f} / {r['tokens_returned']:4.0f}"
        )
    return "\n".join(lines)


async def run(
    todo: list[Item], modes: list[str], work: Path, *, model: str, recorded: bool
) -> dict[str, list[dict]]:
    """Every mode's records of `model` for `todo`: read where recorded under the same fingerprint, else
    measured now."""
    configs = {m: page_qa.Config(answer_mode=m) for m in modes}  # type: ignore[arg-type]
    model_id = f"transformers:{model}"
    paths = {m: work / "records" / f"{m}.jsonl" for m in modes}
    prints = {m: fingerprint(configs[m], model_id) for m in modes}
    done = {m: load_records(paths[m], prints[m]) for m in modes}
    missing = [i for i in todo if any(i.item_id not in done[m] for m in modes)]
    if missing and not recorded:
        await measure(missing, configs, work, paths, prints, done, model=model)
    return {m: [done[m][i.item_id] for i in todo if i.item_id in done[m]] for m in modes}


async def measure(
    todo: list[Item], configs: dict, work: Path, paths: dict, prints: dict, done: dict, *, model: str
) -> None:
    llm = SharedGenerations(build_llm(BackendConfig(model=model)))
    fetcher = Fetcher(FetchConfig(allow_private_cidrs=("127.0.0.0/8",)))
    rt = Runtime(llm=llm, fetcher=fetcher, state=None, count_tokens=llm.count_tokens)  # type: ignore[arg-type]
    paths[next(iter(paths))].parent.mkdir(parents=True, exist_ok=True)
    try:
        with multihop.PageServer(work / "pages") as server:
            for k, item in enumerate(todo, start=1):
                text = page_qa.extract_page((work / "pages" / item.page).read_bytes(), "text/html").text
                for mode, cfg in configs.items():
                    if item.item_id in done[mode]:
                        continue
                    record = await ask(item, cfg, rt, server.base_url, text) | {"fingerprint": prints[mode]}
                    done[mode][item.item_id] = record
                    with paths[mode].open("a", encoding="utf-8") as f:
                        f.write(json.dumps(record) + "\n")
                    print(
                        f"[{k}/{len(todo)}] {model} {mode:<7} {record['latency_s']:5.1f} s  {item.item_id}: "
                        f"{record['answer']!r} (gold {item.answer!r})",
                        flush=True,
                    )
    finally:
        await fetcher.aclose()
        await llm.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--n", type=int, default=150, help="questions (the first n; negatives for half of them)"
    )
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument(
        "--models", nargs="+", default=[DEFAULT_MODEL], help="built-in names or checkpoint dirs, in turn"
    )
    parser.add_argument(
        "--work", type=Path, default=ROOT / "runs" / "bench_reader", help="pages and per-question records"
    )
    parser.add_argument("--recorded", action="store_true", help="run nothing: tabulate the records")
    parser.add_argument("--out", type=Path, default=RESULTS / "bench_reader.json")
    args = parser.parse_args()
    todo = items(data_root(None), args.work / "pages", args.n)
    rows = []
    for model in args.models:
        records = asyncio.run(run(todo, args.modes, args.work, model=model, recorded=args.recorded))
        rows += [summarise(model, m, records[m]) for m in args.modes]
    print("\n" + table(rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    configs = {m: page_qa.Config(answer_mode=m) for m in args.modes}  # type: ignore[arg-type]
    settings = {
        "n": args.n,
        "modes": args.modes,
        "seed": SEED,
        "models": [f"transformers:{m}" for m in args.models],
        "reader_version": {m: READER_VERSION[m] for m in args.modes},
        "page_qa": {m: dataclasses.asdict(cfg) for m, cfg in configs.items()},
    }
    report = {"settings": settings, "rows": rows}
    args.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
