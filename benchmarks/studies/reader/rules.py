"""How page_qa's "extract" picks its answer: every rule chosen on bench_reader's tune split, each ablated on both.

    python -m benchmarks.studies.reader.rules score    # stage 1: each question's candidates and their scores
    python -m benchmarks.studies.reader.rules choose   # stage 2: the grid on tune
                                                       # -> results/reader/rules/summary.json

Stage 1 (the model; resumable, one JSON line a question in runs/reader_rules/<model>/<split>.jsonl, not
committed, ~1.5 MB): for every question of both splits (reader_items), the page as page_qa reads it (the file
bench_reader serves, read with documents.extract_page by its suffix's media type), its top chunks and sentences,
up to SUPERSET candidates (spans.candidates, with kind and sentence rank) plus "not in the page", each scored by
the model's log-probability as the whole reply under three prompts: the question's (page_qa.build_prompt), the
page's without the question (page_qa.prior_prompt) and the system prompt alone (no page, no question). A line is
reused while its fingerprint (model, SUPERSET, the chunking settings, the prompts, FEATURES_VERSION) holds.

Stage 2 (no model): each rule of spans.choose's family (spans.Choice) picks an answer from the recorded scores,
exactly as page_qa does at run time: the first `max_candidates` candidates, the PMI weight on the prior, the
answer-type and sentence-rank terms, the margin "not in the page" must lose by. The grid runs on tune only; the
chosen rule maximises `objective` (EM on gold pages plus half the "not in the page" rate on negatives, with
"not in the page" on at most MAX_NOT_FOUND of tune's gold pages). Then the ablation table: the chosen rule
with each of its terms set back to the rule before's (one at a time), and the rule before, on tune and report.
Report figures here come from recorded scores; bench_reader measures the chosen Config through page_qa.run.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import itertools
import json
import statistics
from pathlib import Path

import numpy as np

from benchmarks import ROOT
from benchmarks.common.records import summary_path, write_summary
from benchmarks.studies.reader import items as reader_items
from benchmarks.studies.reader.bench import HOTPOTQA_N, page_text
from conductor.models import DEFAULT_MODEL
from subagents import page_qa, spans
from subagents.backends import build_llm
from subagents.llm import BackendConfig
from training.rewards import exact_match, token_f1
from training.tasks.task import data_root

SUPERSET = 96  # candidates scored per question; a rule may use the first fewer (their order is fixed)
FEATURES_VERSION = 1  # bumped when candidates or prompts change in a way the fingerprint does not see
PROMPTS = ("question", "page", "none")
MAX_NOT_FOUND = 0.10  # the most "not in the page" on tune's gold pages a chosen rule may say


def fingerprint(model: str, dtype: str = "float32") -> str:
    """What a features line must have been made with to be reused."""
    cfg = page_qa.Config()
    prompts = [page_qa.build_prompt(["P"], "Q"), page_qa.prior_prompt(["P"]), page_qa.bare_prompt()]
    key = [model, SUPERSET, cfg.chunk_chars, cfg.top_k, cfg.max_page_chars, repr(prompts), FEATURES_VERSION]
    key += [] if dtype == "float32" else [dtype]  # float32's lines were recorded before the setting existed
    return hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]


async def features(item: reader_items.Item, pages: Path, llm) -> dict:
    """One question's candidates and their scores under each prompt (the module docstring)."""
    path = pages / item.page
    cfg = page_qa.Config()
    prep = page_qa.prepare(path.read_bytes(), _media(path), question=item.question, cfg=cfg)
    chunks = ["\n".join(chunk) for chunk in prep.top]
    found = spans.candidates(page_qa.page_sentences(prep.top), item.question, limit=SUPERSET)
    replies = [c.span.text for c in found] + [page_qa.NOT_FOUND]
    prompts = {
        "question": page_qa.build_prompt(chunks, item.question),
        "page": page_qa.prior_prompt(chunks),
        "none": page_qa.bare_prompt(),
    }
    # the two prompts that show the page share it (one pass over it), the bare prompt is scored alone
    paged = await llm.score([prompts["question"], prompts["page"]], replies)
    bare = await llm.score([prompts["none"]], replies)
    scores = {
        name: [round(s, 4) for s in values] for name, values in zip(prompts, [*paged, *bare], strict=True)
    }
    return dataclasses.asdict(item) | {
        "candidates": [[c.span.text, c.kind, c.rank] for c in found],
        "scores": scores,
        "in_page": reader_items.holds(page_text(path), item.answer),
    }


def _media(path: Path) -> str:
    return {".html": "text/html", ".md": "text/markdown", ".txt": "text/plain"}[path.suffix]


async def score(todo: list[reader_items.Item], pages: Path, out: Path, *, model: str, dtype: str) -> None:
    """Stage 1: the features of every question not yet recorded under this fingerprint."""
    print_ = fingerprint(model, dtype)
    done = {r["item_id"] for r in load(out, print_)}
    missing = [i for i in todo if i.item_id not in done]
    if not missing:
        return
    llm = build_llm(BackendConfig(model=model, dtype=dtype))  # type: ignore[arg-type]  # argparse's choices
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        for k, item in enumerate(missing, 1):
            record = await features(item, pages, llm) | {"fingerprint": print_}
            with out.open("a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
            print(f"[{k}/{len(missing)}] {item.item_id}: {len(record['candidates'])} candidates", flush=True)
    finally:
        await llm.aclose()


def load(path: Path, print_: str) -> list[dict]:
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [r for r in rows if r["fingerprint"] == print_]


# ---------------------------------------------------------------- stage 2: rules on the recorded scores


def answer(record: dict, rule: spans.Choice) -> str:
    """The answer `rule` gives from a record's scores, as page_qa would."""
    found = [
        spans.Candidate(spans.Span(text, 0, len(text)), kind, rank)
        for text, kind, rank in record["candidates"][: rule.max_candidates]
    ]
    n = len(found)
    scores = record["scores"]["question"][:n] + record["scores"]["question"][-1:]
    prior = record["scores"][rule.prior][:n] + record["scores"][rule.prior][-1:] if rule.pmi_weight else None
    best = spans.choose(found, scores, prior, record["question"], rule)
    return page_qa.NOT_FOUND if best is None else found[best].span.text


def measure(records: list[dict], rule: spans.Choice) -> dict:
    """EM, F1 and "not in the page" on gold pages, and "not in the page" on negatives, under `rule`."""
    pos = [r for r in records if r["holds_answer"]]
    neg = [r for r in records if not r["holds_answer"]]
    said = {r["item_id"]: answer(r, rule) for r in records}
    nf = page_qa.NOT_FOUND
    return {
        "questions": len(pos),
        "negatives": len(neg),
        "em": statistics.mean(exact_match(said[r["item_id"]], r["answer"]) for r in pos),
        "f1": statistics.mean(token_f1(said[r["item_id"]], r["answer"]) for r in pos),
        "not_found_on_gold_page": statistics.mean(said[r["item_id"]] == nf for r in pos),
        "not_found_on_negatives": statistics.mean(said[r["item_id"]] == nf for r in neg),
    }


def objective(m: dict, max_not_found: float = MAX_NOT_FOUND) -> float:
    """What the grid maximises on tune: EM, plus half the rate of "not in the page" on negatives (a wrong
    answer there misleads the policy, but a reader's job is answering); -1 past `max_not_found` on gold pages."""
    if m["not_found_on_gold_page"] > max_not_found:
        return -1.0
    return m["em"] + 0.5 * m["not_found_on_negatives"]


GRID = {
    "max_candidates": (32, 48, 64, 96),
    "pmi_weight": (0.0, 0.25, 0.5, 0.75, 1.0),
    "prior": ("page", "none"),
    "kind_weight": (0.0, 1.0, 2.0, 4.0),
    "rank_weight": (0.0, 0.5, 1.0, 2.0),
    "length_weight": (0.0, 0.5, 1.0, 1.5, 2.0),
    "null_margin": (-4.0, -2.0, -1.0, 0.0, 1.0, 2.0, 4.0, 8.0),
}


def grid() -> list[spans.Choice]:
    """Every rule of GRID in its order (the smaller values first), but the prior's prompt where it weighs nothing."""
    rules = []
    for values in itertools.product(*GRID.values()):
        rule = spans.Choice(**dict(zip(GRID, values, strict=True)))
        if rule.pmi_weight or rule.prior == "page":
            rules.append(rule)
    return rules


@dataclasses.dataclass(frozen=True)
class Table:
    """The records of one split as arrays, for the grid: candidate columns padded to SUPERSET (`count` says
    how many of a row's are candidates)."""

    scores: dict[str, np.ndarray]  # prompt -> [R, SUPERSET] log-probs
    not_found: dict[str, np.ndarray]  # prompt -> [R] log-prob of "not in the page"
    wanted: np.ndarray  # [R, SUPERSET] the candidate is of the kind its question wants
    rank: np.ndarray  # [R, SUPERSET]
    words: np.ndarray  # [R, SUPERSET]
    em: np.ndarray  # [R, SUPERSET] the candidate is the gold answer (normalised)
    holds: np.ndarray  # [R] a gold page
    count: np.ndarray  # [R] candidates recorded


def table(records: list[dict]) -> Table:
    shape = (len(records), SUPERSET)
    scores = {p: np.zeros(shape) for p in PROMPTS}
    wanted, rank, words, em = np.zeros(shape, bool), np.zeros(shape), np.zeros(shape), np.zeros(shape)
    count = np.array([len(r["candidates"]) for r in records])
    for i, r in enumerate(records):
        n = len(r["candidates"])
        for p in PROMPTS:
            scores[p][i, :n] = r["scores"][p][:n]
        kind = spans.EXPECTED_KIND.get(spans.question_type(r["question"]))
        kinds = {kind, "part"} if kind == "name" else {kind}
        for j, (text, k, place) in enumerate(r["candidates"]):
            wanted[i, j], rank[i, j], words[i, j] = k in kinds, place, len(text.split())
            em[i, j] = exact_match(text, r["answer"])
    not_found = {p: np.array([r["scores"][p][-1] for r in records]) for p in PROMPTS}
    holds = np.array([r["holds_answer"] for r in records])
    return Table(scores, not_found, wanted, rank, words, em, holds, count)


def fast_measure(t: Table, rule: spans.Choice) -> dict:
    """`measure`'s EM and "not in the page" rates, computed on arrays (spans.choose's arithmetic; `choose`
    checks the chosen rule against `measure`)."""
    prior = t.scores[rule.prior] if rule.pmi_weight else 0.0
    value = t.scores["question"] - rule.pmi_weight * prior
    total = value + rule.kind_weight * t.wanted - rule.rank_weight * t.rank + rule.length_weight * t.words
    total[np.arange(SUPERSET)[None, :] >= np.minimum(t.count, rule.max_candidates)[:, None]] = -np.inf
    best = total.argmax(1)  # the first of equals
    top = total[np.arange(len(best)), best]
    null = t.not_found["question"] - rule.pmi_weight * (t.not_found[rule.prior] if rule.pmi_weight else 0.0)
    answered = np.isfinite(top) & (top >= null + rule.null_margin)
    right = answered & (t.em[np.arange(len(best)), best] > 0)
    return {
        "em": right[t.holds].mean(),
        "not_found_on_gold_page": (~answered)[t.holds].mean(),
        "not_found_on_negatives": (~answered)[~t.holds].mean(),
    }


def choose(tune: list[dict], max_not_found: float = MAX_NOT_FOUND) -> tuple[spans.Choice, dict]:
    """The rule of the grid with the best objective on tune (ties: the earlier in grid order), and its measures."""
    arrays = table(tune)
    best = max(grid(), key=lambda rule: objective(fast_measure(arrays, rule), max_not_found))
    measured, fast = measure(tune, best), fast_measure(arrays, best)
    assert all(abs(measured[k] - fast[k]) < 1e-9 for k in fast), (measured, fast)
    return best, measured


# The rule before this study: the log-prob alone over 48 candidates, "not in the page" when it scores best.
BEFORE = spans.Choice(max_candidates=48, pmi_weight=0.0, kind_weight=0.0, rank_weight=0.0, length_weight=0.0)


def ablations(chosen: spans.Choice) -> dict[str, spans.Choice]:
    """The chosen rule, each of its terms set back to the rule before's, and the rule before."""
    rows = {"chosen": chosen}
    for field in dataclasses.fields(spans.Choice):
        if getattr(chosen, field.name) != getattr(BEFORE, field.name) and field.name != "prior":
            rows[f"without {field.name}"] = dataclasses.replace(
                chosen, **{field.name: getattr(BEFORE, field.name)}
            )
    rows["the log-prob alone (the rule before)"] = BEFORE
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", choices=("score", "choose"))
    parser.add_argument("--n", type=int, default=1000, help="questions per split (the first n; default all)")
    parser.add_argument("--splits", nargs="+", default=list(reader_items.SPLITS), choices=reader_items.SPLITS)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument(
        "--max-not-found",
        type=float,
        default=MAX_NOT_FOUND,
        help='the most "not in the page" on tune\'s gold pages a chosen rule may say',
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16", "auto"),
        help="the reader's (BackendConfig)",
    )
    parser.add_argument("--work", type=Path, default=ROOT / "runs", help="bench_reader's pages live here")
    parser.add_argument("--out", type=Path, default=summary_path("reader", "rules"))
    args = parser.parse_args()
    pages = args.work / "bench_reader" / "pages"
    folder = args.work / "reader_rules" / Path(args.model).name
    todo = [
        i
        for s in args.splits
        for i in reader_items.split_items(data_root(None), pages, s, n=args.n, hotpotqa_n=HOTPOTQA_N)
    ]
    if args.stage == "score":
        for split in args.splits:  # a file a split: two processes may score the two at once
            mine = [i for i in todo if i.split == split]
            asyncio.run(score(mine, pages, folder / f"{split}.jsonl", model=args.model, dtype=args.dtype))
        return
    by_split = {}
    for split in args.splits:
        records = {
            r["item_id"]: r for r in load(folder / f"{split}.jsonl", fingerprint(args.model, args.dtype))
        }
        by_split[split] = [records[i.item_id] for i in todo if i.split == split and i.item_id in records]
    chosen, tuned = choose(by_split["tune"], args.max_not_found)
    print(f"chosen on tune ({len(by_split['tune'])} lines): {chosen}\n  {tuned}")
    rows = []
    for name, rule in ablations(chosen).items():
        rows.append(
            {"rule": name, "settings": dataclasses.asdict(rule)}
            | {s: measure(r, rule) for s, r in by_split.items() if r}
        )
    for row in rows:
        cells = " | ".join(
            f"{s}: EM {m['em']:.3f} F1 {m['f1']:.3f} nf {m['not_found_on_gold_page']:.3f}/{m['not_found_on_negatives']:.3f}"
            for s, m in row.items()
            if s in reader_items.SPLITS
        )
        print(f"{row['rule']:<34} {cells}")
    report = {
        "grid": {k: list(v) for k, v in GRID.items()},
        "max_not_found": args.max_not_found,
        "model": args.model,
        "dtype": args.dtype,
        "chosen": dataclasses.asdict(chosen),
        "rows": rows,
    }
    write_summary(args.out, report)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
