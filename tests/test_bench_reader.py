"""benchmarks/bench_reader.py: the question set it measures page_qa on (real shared data; no model)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from subagents import page_qa
from tests.conftest import REPO


def bench() -> ModuleType:
    path = REPO / "benchmarks" / "bench_reader.py"
    spec = importlib.util.spec_from_file_location("bench_reader", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_reader"] = module
    spec.loader.exec_module(module)
    return module


def test_questions_hold_their_answer_and_negatives_do_not(shared_data: Path, tmp_path: Path) -> None:
    """Every question's page holds its gold answer as page_qa extracts it, every negative page does not, hop
    placeholders are filled, both sources appear among the first questions, and the order is fixed."""
    reader = bench()
    items = reader.items(shared_data, tmp_path, 40)
    again = reader.items(shared_data, tmp_path / "again", 40)
    assert [i.item_id for i in items] == [i.item_id for i in again]
    assert len({i.item_id for i in items}) == len(items)
    positives = [i for i in items if i.holds_answer]
    assert len(positives) == 40 and {i.source for i in positives} == {"musique", "research_corpus"}
    assert len(items) - len(positives) >= 15  # negatives for the first half, where one exists
    for item in items:
        text = page_qa.extract_page((tmp_path / item.page).read_bytes(), "text/html").text
        assert reader._holds(text, item.answer) == item.holds_answer, item
        assert "#" not in item.question, item
