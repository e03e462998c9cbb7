"""Which second search finds a two-hop question's other page: the rule corpus_qa's chained expert follows.

    OMP_NUM_THREADS=1 python -m benchmarks.studies.research.second_search --n 60   # -> results/research/second_search/

On the first n HotpotQA questions of corpus_qa **train** (the rule is chosen here; dev reports it, through the
expert and the policies in bench.py), through the real tools in this process: search with the question, read the
top hit with page_qa (the question asked whole), and where that hit is a supporting page, search again with each
candidate query made of what the policy has seen by then:

    answer            what the first read answered
    question+answer   the question, a space, that answer          (the rule: corpus_qa.oracle_reply)
    quote             the sentence the first read quoted
    question+quote    the question and that sentence
    first hits        no second search: the first search's hits not read yet

For each, whether the other supporting page is the best hit not read yet, and whether it is one of the two best
(the expert's second read takes two pages: corpus_qa.CHAIN_READS). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

from benchmarks.common.records import summary_path, write_summary
from tool_server.client import ToolClient
from tool_server.embedded import ToolAccess
from training import tasks as task_data
from training.play import tool_session
from training.rewards import supporting_pages
from training.tasks import Task

QUERIES = ("answer", "question+answer", "quote", "question+quote")


def _file(url: object) -> str:
    return str(url).rsplit("/", 1)[-1]


async def _hits(tools: ToolClient, query: str, session: str) -> list[tuple[str, str]]:
    """(handle, file) of each hit of `query`; none when the search failed."""
    result = await tools.call("search", {"query": query}, session=session)
    hits = (result.payload or {}).get("hits") if result.ok else None
    return [(str(h["id"]), _file(h["url"])) for h in hits or []]  # type: ignore[union-attr]


async def _question(tools: ToolClient, task: Task) -> dict:
    """One question's first search and read, then every candidate second search (see the module docstring)."""
    support, session = supporting_pages(task), task.task_id
    first = await _hits(tools, task.question, session)
    row: dict = {"task_id": task.task_id, "top_hit_supporting": bool(first) and first[0][1] in support}
    if not row["top_hit_supporting"]:
        return row
    read = await tools.call("page_qa", {"url": first[0][0], "question": task.question}, session=session)
    answer = str((read.payload or {}).get("answer") or "") if read.ok else ""
    answer = "" if "not in the page" in answer.lower() else answer
    quote = str((read.payload or {}).get("quote") or "") if read.ok else ""
    other = [page for page in support if page != first[0][1]]
    texts = {"answer": answer, "question+answer": f"{task.question} {answer}".strip(), "quote": quote,
             "question+quote": f"{task.question} {quote}".strip()}  # fmt: skip
    found = {"first hits": [f for _, f in first[1:]]}
    for name, query in texts.items():
        found[name] = [f for _, f in await _hits(tools, query, session) if f != first[0][1]] if query else []
    row["best"] = {name: bool(files[:1]) and files[0] in other for name, files in found.items()}
    row["two_best"] = {name: any(f in other for f in files[:2]) for name, files in found.items()}
    return row


async def _run(tasks: list[Task]) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="second-search-") as work:
        async with tool_session(tasks, work_dir=Path(work), access=ToolAccess()) as (tools, ready):
            return [await _question(tools, task) for task in ready]


def table(rows: list[dict]) -> tuple[str, dict]:
    """The share of questions (of those whose top hit was a supporting page) per query and measure."""
    chained = [r for r in rows if r["top_hit_supporting"]]
    names = ["first hits", *QUERIES]
    shares = {
        name: {k: sum(r[k][name] for r in chained) / max(len(chained), 1) for k in ("best", "two_best")}
        for name in names
    }
    lines = [
        f"{len(chained)} of {len(rows)} questions: the question's top hit is a supporting page",
        "second search | other page the best unread hit | one of the two best",
        *(f"{name} | {s['best']:.3f} | {s['two_best']:.3f}" for name, s in shares.items()),
    ]
    return "\n".join(lines), shares


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=60, help="the first n HotpotQA questions of corpus_qa train")
    parser.add_argument("--out", type=Path, default=summary_path("research", "second_search"))
    args = parser.parse_args()
    hotpot = [t for t in task_data.load_family("corpus_qa", "train") if not t.meta.hops][: args.n]
    rows = asyncio.run(_run(hotpot))
    text, shares = table(rows)
    print(text)
    write_summary(args.out, {"n": len(rows), "shares": shares, "rows": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
