"""page_qa alone as a reader, on a tune split (rules are chosen there) and a report split (they are measured there).

    python -m benchmarks.studies.reader.bench             # extract, both splits -> results/reader/main/summary.json
    python -m benchmarks.studies.reader.bench --modes free align extract --n 60
    python -m benchmarks.studies.reader.bench --recorded  # the table of what is recorded, running nothing
    python -m benchmarks.studies.reader.bench --set extract.null_margin=2 --label margin  # Config fields
    python -m benchmarks.studies.reader.bench --models smollm2-135m-instruct qwen2.5-coder-0.5b-instruct
    python -m benchmarks.studies.reader.bench --reader-url http://127.0.0.1:8000/v1 --models NAME \\
        --modes free align

The questions (items.py): tune is MuSiQue hops of half the questions (by id) and HotpotQA train, as HTML
pages; report is the other half's hops and HotpotQA dev as Markdown and plain text pages, and research_corpus.
Every question's page holds its gold answer; every other question also has a page that does not (a negative).
Every threshold, prompt and scoring rule of the reader is chosen on tune (rules.py); report is only
measured.

Every call goes through the real page_qa code (`page_qa.run`) with a real model (`--models`: built-in names or
checkpoint directories, one after another; SmolLM2-135M-Instruct by default; with `--reader-url`, the models an
OpenAI-compatible endpoint serves, as `conductor ask --reader-url` reads them) and the real fetcher, the pages
served over loopback. Per split and answer mode (`page_qa.Config.answer_mode`) it reports, on gold pages: EM and
F1 against the gold answer, has-gold (the answer contains it), in-page (the answer occurs on the page), supported
(page_qa's own flag) and "not in the page" (wrongly); on negatives: "not in the page" (rightly) and supported
(wrongly); on all: p50 latency and mean tokens read and returned; and EM, F1 and "not in the page" by question
type (who / when / where / how many / what) and by source.

Every mode is set explicitly (`Config(answer_mode=...)`), whatever page_qa's default; `--set` changes other
Config fields. Written: the rows in results/reader/main/summary.json (small, committed), where a row is replaced by a
run of the same model, mode, settings and READER_VERSION and others are kept, so the table holds earlier readers
beside today's; one JSON line per call in <work>/records/<model>/<mode>.jsonl (runs/bench_reader/ by default,
not committed), with a fingerprint of the settings, the model and READER_VERSION (bumped when the reader's code
changes): lines under another fingerprint are ignored, so a run resumes where it stopped and a changed reader is
measured anew. Questions run in order, every mode on one question before the next. "free" and "align" share one
generation per question (the model is greedy, so the reply is the same): the second reuses it, and its latency
counts the reused generation's time. "extract" records every candidate's log-prob under each prompt it scores
(`scored`), so rules.py can study selection rules without the model.
Limits: latency is one request at a time on this machine's cores, beside whatever else runs on them.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import json
import re
import statistics
import time
from pathlib import Path

from benchmarks import ROOT
from benchmarks.common.records import summary_path, write_summary
from benchmarks.studies.reader import items as reader_items
from benchmarks.studies.reader.items import Item
from conductor.models import DEFAULT_MODEL
from subagents import documents, page_qa, spans
from subagents.backends import build_llm
from subagents.common import Runtime
from subagents.fetch import FetchConfig, Fetcher
from subagents.llm import LLM, BackendConfig, Generation, Message
from training.rewards import exact_match, token_f1
from training.tasks.task import data_root

MODES = ("free", "align", "extract")
HOTPOTQA_N = 150  # HotpotQA questions per split: with ~115 MuSiQue hops, ~265 tune and ~300 report questions
CONTENT_TYPES = {"html": "text/html", "md": "text/markdown", "txt": "text/plain"}
# Bumped with every change to how page_qa answers (page_qa.py, spans.py) that its Config does not show, so that
# records of the old code are measured anew rather than mixed in. free 2: the model's words as page_qa gave them
# before answer modes (no "not in the page" for refusals, `supported` not judged), the observation the shipped
# policy was trained on. extract 5: the prompt's logits at its last position alone (rounding may differ).
# extract 6: candidates with the names inside names, number words, "X, Y" and initials; spans.choose's rule;
# replies scored packed; sentences not split after initials; Markdown read without its marks.
READER_VERSION = {"free": 2, "align": 1, "extract": 6}


def items(data: Path, pages: Path, splits: list[str], *, n: int) -> list[Item]:
    """The first `n` questions of each split (reader_items), tune's first."""
    return [i for s in splits for i in reader_items.split_items(data, pages, s, n=n, hotpotqa_n=HOTPOTQA_N)]


def page_text(path: Path) -> str:
    """The page's text as page_qa reads it."""
    return documents.extract_page(path.read_bytes(), CONTENT_TYPES[path.suffix.lstrip(".")]).text


class SharedGenerations:
    """The model, with one generation per prompt kept for the next mode that asks the same (see the docstring)."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.model_id, self.multimodal, self.scores = llm.model_id, llm.multimodal, llm.scores
        self.kept: dict[tuple, tuple[Generation, float]] = {}
        self.reused_s = 0.0  # generation time reused since the last reset
        self.scored: list[dict] = []  # the last call's replies and scores, per prompt scored ("extract")

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

    async def score(self, prompts: list[list[Message]], replies: list[str]) -> list[list[float]]:
        scores = await self.llm.score(prompts, replies)
        self.scored += [{"replies": replies, "scores": [round(s, 4) for s in row]} for row in scores]
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


async def ask(item: Item, cfg: page_qa.Config, rt: Runtime, base_url: str, text: str) -> dict:
    """One page_qa call and what it scored."""
    rt.llm.reused_s, rt.llm.scored = 0.0, []  # type: ignore[attr-defined]
    start = time.perf_counter()
    request = page_qa.Request(url=f"{base_url}/{item.page}", question=item.question)
    response = await page_qa.run(request, cfg, rt)
    latency = time.perf_counter() - start + rt.llm.reused_s  # type: ignore[attr-defined]
    assert response.ok, f"{item.item_id}: {response.observation()}"
    found = response.answer != page_qa.NOT_FOUND
    return {
        "item": item.item_id,
        "split": item.split,
        "source": item.source,
        "question_type": item.question_type,
        "model": rt.llm.model_id,
        "holds_answer": item.holds_answer,
        "question": item.question,
        "gold": item.answer,
        "answer": response.answer,
        "quote": response.quote,
        "supported": response.supported,
        "not_found": not found,
        "em": exact_match(response.answer, item.answer),
        "f1": token_f1(response.answer, item.answer),
        "in_page": found and reader_items.holds(text, response.answer),
        "latency_s": round(latency, 3),
        "tokens_read": response.tokens_read,
        "tokens_returned": response.tokens_returned,
        "scored": rt.llm.scored,  # type: ignore[attr-defined]  # "extract": every candidate's log-prob
    }


def _mean(rows: list[dict], key: str) -> float:
    """The mean of `key` over `rows`; nan for none, or for a value not judged ("free": supported)."""
    known = [r[key] for r in rows]
    return statistics.mean(map(float, known)) if rows and None not in known else float("nan")


def summarise(records: list[dict]) -> dict:
    """The measures of one split's records (module docstring)."""
    pos = [r for r in records if r["holds_answer"]]
    neg = [r for r in records if not r["holds_answer"]]
    return {
        "questions": len(pos),
        "negatives": len(neg),
        "em": _mean(pos, "em"),
        "f1": _mean(pos, "f1"),
        "holds_gold": _mean([{"x": reader_items.holds(r["answer"], r["gold"])} for r in pos], "x"),
        "in_page": _mean(pos, "in_page"),
        "supported": _mean(pos, "supported"),
        "supported_on_negatives": _mean(neg, "supported"),
        "not_found_on_gold_page": _mean(pos, "not_found"),
        "not_found_on_negatives": _mean(neg, "not_found"),
        "latency_p50_s": statistics.median(r["latency_s"] for r in records) if records else float("nan"),
        "tokens_read": _mean(records, "tokens_read"),
        "tokens_returned": _mean(records, "tokens_returned"),
    }


def groups(records: list[dict]) -> dict[str, dict]:
    """EM, F1 and "not in the page" (gold pages; negatives) per question type and per source."""
    out = {}
    kinds = {"question_type": lambda r: spans.question_type(r["question"]), "source": lambda r: r["source"]}
    for of in kinds.values():  # the type by today's rule, whenever the record was made
        for value in sorted({of(r) for r in records}):
            mine = [r for r in records if of(r) == value]
            pos = [r for r in mine if r["holds_answer"]]
            neg = [r for r in mine if not r["holds_answer"]]
            out[value] = {
                "questions": len(pos), "negatives": len(neg), "em": _mean(pos, "em"), "f1": _mean(pos, "f1"),
                "not_found_on_gold_page": _mean(pos, "not_found"), "not_found_on_negatives": _mean(neg, "not_found"),
            }  # fmt: skip
    return out


def row(model: str, cfg: page_qa.Config, label: str, records: list[dict]) -> dict:
    """One reader's row: its settings and, per split, its measures and their groups."""
    splits = sorted({r["split"] for r in records}, key=reader_items.SPLITS.index)
    return {
        "model": model,
        "mode": cfg.answer_mode,
        "label": label,
        "reader_version": READER_VERSION[cfg.answer_mode],
        "page_qa": dataclasses.asdict(cfg),
        "splits": {
            s: summarise(mine) | {"groups": groups(mine)}
            for s in splits
            if (mine := [r for r in records if r["split"] == s])
        },
    }


def table(rows: list[dict]) -> str:
    """One line per reader: tune and report EM, F1 and "not in the page" on gold pages / negatives."""
    head = f"{'reader':<44} | split  | {'n':>4} | {'neg':>4} | {'EM':>5} | {'F1':>5} | not found: gold / neg | in page | p50 s"
    lines = [head, "-" * len(head)]
    for r in rows:
        name = f"{r['model']} {r['mode']} v{r['reader_version']} {r['label']}".strip()
        for split, s in r["splits"].items():
            lines.append(
                f"{name:<44} | {split:<6} | {s['questions']:4d} | {s['negatives']:4d} | {s['em']:5.3f} | "
                f"{s['f1']:5.3f} | {s['not_found_on_gold_page']:10.3f} / {s['not_found_on_negatives']:5.3f} | "
                f"{s['in_page']:7.3f} | {s['latency_p50_s']:5.1f}"
            )
    return "\n".join(lines)


def group_table(rows: list[dict], split: str) -> str:
    """Per reader, EM / F1 / not found (gold; negatives) by question type and source on `split`."""
    lines = []
    for r in rows:
        if split not in r["splits"]:
            continue
        lines.append(f"{r['model']} {r['mode']} v{r['reader_version']} {r['label']} ({split})")
        for name, g in r["splits"][split]["groups"].items():
            lines.append(
                f"  {name:<16} n {g['questions']:3d} neg {g['negatives']:3d} | EM {g['em']:.3f} F1 {g['f1']:.3f} | "
                f"not found: gold {g['not_found_on_gold_page']:.3f} / neg {g['not_found_on_negatives']:.3f}"
            )
    return "\n".join(lines)


def reader_name(reader: BackendConfig) -> str:
    """The reader as rows and record folders name it: the model, "at <url>" behind an endpoint."""
    name = Path(reader.model).name
    return name if reader.base_url is None else f"{name} at {reader.base_url}"


async def run(
    todo: list[Item], configs: dict[str, page_qa.Config], work: Path, *, reader: BackendConfig, recorded: bool
) -> dict[str, list[dict]]:
    """Every mode's records of `reader` for `todo`: read where recorded under the same fingerprint, else
    measured now."""
    model_id = f"{reader.backend}:{reader.model}" + (f"@{reader.base_url}" if reader.base_url else "")
    folder = work / "records" / re.sub(r"[^\w.-]+", "_", reader_name(reader))
    paths = {m: folder / f"{m}.jsonl" for m in configs}
    prints = {m: fingerprint(configs[m], model_id) for m in configs}
    done = {m: load_records(paths[m], prints[m]) for m in configs}
    missing = [i for i in todo if any(i.item_id not in done[m] for m in configs)]
    if missing and not recorded:
        await measure(missing, configs, work, paths, prints, done, reader=reader)
    return {m: [done[m][i.item_id] for i in todo if i.item_id in done[m]] for m in configs}


async def measure(
    todo: list[Item],
    configs: dict,
    work: Path,
    paths: dict,
    prints: dict,
    done: dict,
    *,
    reader: BackendConfig,
) -> None:
    base = build_llm(reader)
    for cfg in configs.values():
        page_qa.check_model(cfg, base)  # "extract" behind an endpoint is refused, as the tool server does
    llm = SharedGenerations(base)
    model = reader_name(reader)
    fetcher = Fetcher(FetchConfig(allow_private_cidrs=("127.0.0.0/8",)))
    rt = Runtime(llm=llm, fetcher=fetcher, state=None, count_tokens=llm.count_tokens)  # type: ignore[arg-type]
    paths[next(iter(paths))].parent.mkdir(parents=True, exist_ok=True)
    try:
        with reader_items.multihop.PageServer(work / "pages") as server:
            for k, item in enumerate(todo, start=1):
                text = page_text(work / "pages" / item.page)
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


def config_overrides(pairs: list[str]) -> dict:
    """`--set key=value` pairs as page_qa.Config fields, `extract.key=value` as its rule's (values parsed as
    JSON, else kept as strings)."""
    fields = {f.name for f in dataclasses.fields(page_qa.Config)} - {"answer_mode", "extract"}
    fields |= {f"extract.{f.name}" for f in dataclasses.fields(spans.Choice)}
    out: dict = {}
    rule: dict = {}
    for pair in pairs:
        key, _, text = pair.partition("=")
        if key not in fields:
            raise SystemExit(f"--set {key}: not a page_qa.Config field; one of {sorted(fields)}")
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text
        if key.startswith("extract."):
            rule[key.removeprefix("extract.")] = value
        else:
            out[key] = value
    return out | ({"extract": dataclasses.replace(spans.Choice(), **rule)} if rule else {})


def merged(out: Path, rows: list[dict]) -> list[dict]:
    """The rows already in `out`, with those of the same reader (model, mode, version, settings) replaced."""

    def key(r: dict) -> str:
        return json.dumps([r["model"], r["mode"], r["reader_version"], r["page_qa"]], sort_keys=True)

    old = json.loads(out.read_text(encoding="utf-8"))["rows"] if out.is_file() else []
    new = {key(r): r for r in rows}
    return [r for r in old if "splits" in r and key(r) not in new] + rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1000, help="questions per split (the first n; default all)")
    parser.add_argument("--splits", nargs="+", default=list(reader_items.SPLITS), choices=reader_items.SPLITS)
    parser.add_argument("--modes", nargs="+", default=["extract"], choices=MODES)
    parser.add_argument(
        "--set", dest="overrides", nargs="*", default=[], help="page_qa.Config fields: key=value"
    )
    parser.add_argument("--label", default="", help="a name for the row (e.g. what --set changes)")
    parser.add_argument(
        "--models", nargs="+", default=[DEFAULT_MODEL], help="built-in names or checkpoint dirs, in turn"
    )
    parser.add_argument(
        "--reader-url", help="an OpenAI-compatible endpoint serving --models (free and align; no extract)"
    )
    parser.add_argument(
        "--work", type=Path, default=ROOT / "runs" / "bench_reader", help="pages and per-question records"
    )
    parser.add_argument("--recorded", action="store_true", help="run nothing: tabulate the records")
    parser.add_argument("--out", type=Path, default=summary_path("reader", "main"))
    args = parser.parse_args()
    todo = items(data_root(None), args.work / "pages", args.splits, n=args.n)
    overrides = config_overrides(args.overrides)
    configs = {m: page_qa.Config(answer_mode=m, **overrides) for m in args.modes}  # type: ignore[arg-type]
    rows = []
    for model in args.models:
        backend = "openai" if args.reader_url else "transformers"
        reader = BackendConfig(backend=backend, model=model, base_url=args.reader_url)  # type: ignore[arg-type]
        records = asyncio.run(run(todo, configs, args.work, reader=reader, recorded=args.recorded))
        rows += [row(reader_name(reader), configs[m], args.label, records[m]) for m in args.modes]
    print("\n" + table(rows) + "\n\n" + group_table(rows, "report"))
    settings = {"n": args.n, "hotpotqa_n": HOTPOTQA_N, "seed": reader_items.SEED}
    write_summary(args.out, {"settings": settings, "rows": merged(args.out, rows)})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
