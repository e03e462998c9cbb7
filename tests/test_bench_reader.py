"""benchmarks/studies/reader/: bench.py and items.py, the two splits page_qa is measured on (real shared data; no
model), and rules.py's choice on recorded scores."""

from __future__ import annotations

from pathlib import Path

from benchmarks.studies.reader import bench as reader
from benchmarks.studies.reader import items as reader_items
from benchmarks.studies.reader import rules
from subagents import documents


def test_the_splits_hold_their_answers_and_share_no_question(shared_data: Path, tmp_path: Path) -> None:
    """Every question's page holds its gold answer as page_qa reads it and every negative page does not; tune's
    pages are HTML and report's Markdown and plain text (and the corpus's own HTML); no MuSiQue question has
    hops in both splits; every source appears among the first questions; the order is fixed."""
    items = reader.items(shared_data, tmp_path, ["tune", "report"], n=60)
    again = reader.items(shared_data, tmp_path / "again", ["tune", "report"], n=60)
    assert [i.item_id for i in items] == [i.item_id for i in again]
    assert len({i.item_id for i in items}) == len(items)
    positives = [i for i in items if i.holds_answer]
    assert {(i.split, i.source) for i in positives} >= {
        ("tune", "musique"), ("tune", "hotpotqa"), ("report", "musique"), ("report", "hotpotqa"),
        ("report", "research_corpus"),
    }  # fmt: skip
    assert len(items) - len(positives) >= 50  # every other question has a negative, where one exists
    for item in items:
        assert reader_items.holds(reader.page_text(tmp_path / item.page), item.answer) == item.holds_answer
        assert "#" not in item.question, item
        suffix = Path(item.page).suffix
        assert suffix in (
            {".html"} if item.split == "tune" or item.source == "research_corpus" else {".md", ".txt"}
        )
    musique = {split: {i.item_id.rsplit("-", 1)[0] for i in positives if i.split == split and i.source == "musique"}
               for split in ("tune", "report")}  # fmt: skip
    assert musique["tune"] and musique["report"] and not musique["tune"] & musique["report"]


def test_a_markdown_report_page_reads_as_its_html(shared_data: Path, tmp_path: Path) -> None:
    """A report page written as Markdown reads, to page_qa, exactly as the same paragraph written as HTML."""
    item = next(i for i in reader.items(shared_data, tmp_path, ["report"], n=20) if i.page.endswith(".md"))
    html = tmp_path / Path(item.page).with_suffix(".html")
    md = (tmp_path / item.page).read_text(encoding="utf-8")
    title, _, text = md.partition("\n\n")
    html.write_text(reader_items.multihop.page_html((title.removeprefix("# "), [text.strip()])))
    assert reader.page_text(tmp_path / item.page) == reader.page_text(html)
    assert documents.extract_page(html.read_bytes(), "text/html").title == title.removeprefix("# ")


def test_the_rule_chosen_from_records_is_what_page_qa_would_answer() -> None:
    """rules.py's array arithmetic (the grid) gives each rule the EM and "not in the page" rates that
    spans.choose gives record by record (the path page_qa takes), and its choice is the grid's best."""
    from subagents import spans

    def record(i: int, holds: bool) -> dict:
        candidates = [["Paris", "name", 0], ["1889", "number", 0], ["tall tower", "phrase", 1]]
        q = [-2.0 - i % 3, -2.5, -1.5 + (i % 2), -4.0 + i % 5]
        page = [-1.0, -3.0 - i % 2, -1.0, -5.0]
        return {
            "item_id": f"q{i}", "question": "Where is it?" if i % 2 else "When was it built?",
            "answer": "Paris" if i % 2 else "1889", "holds_answer": holds, "candidates": candidates,
            "scores": {"question": q, "page": page, "none": [x - 1 for x in page]},
        }  # fmt: skip

    records = [record(i, holds=i % 4 != 3) for i in range(24)]
    arrays = rules.table(records)
    for rule in rules.grid()[::97]:
        fast, slow = rules.fast_measure(arrays, rule), rules.measure(records, rule)
        assert all(abs(fast[k] - slow[k]) < 1e-9 for k in fast), (rule, fast, slow)
    chosen, measured = rules.choose(records)
    assert rules.objective(measured) == max(
        rules.objective(rules.fast_measure(arrays, r)) for r in rules.grid()
    )
    assert isinstance(chosen, spans.Choice)
