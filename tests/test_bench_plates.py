"""The plates benchmark's records and table on hand-built episodes."""

from __future__ import annotations

from benchmarks.studies.plates.records import format_table, groups, record, summarise
from main_agent.types import Episode, ToolCall, ToolResult, Turn
from training.tasks import Task, TaskMeta, plates


def photo(country: str, reference: str = "7ABC123") -> Task:
    meta = TaskMeta(plate_box=(0, 0, 10, 5), split="dev")
    return Task(f"plate-{country}-x", "plate_reading", plates.QUESTION, ("image_ops",), reference, "", meta)


def call(op: str, payload: dict | None) -> Turn:
    result = ToolResult("image_ops", payload is not None, "", None, 1.0, 0, 0, False, payload)
    return Turn([], [], [], "", "", [ToolCall("image_ops", {"op": op}, "")], [result], [], 0, 0.0, 0.0)


def episode(answer: str | None, *turns: Turn, stop: str = "answer") -> Episode:
    return Episode("plate-x", "q", [1], list(turns), answer, stop, 0, 1.0, 1.0, 0.0)  # type: ignore[arg-type]


def test_a_record_says_what_the_reads_showed_and_how_the_answer_was_shaped():
    """Retried is a second zoomed read; shown is the label inside a read; rule_right is plate_shaped's pick;
    refused calls count as tool errors; the plain give-up is neither plate-shaped nor a line of the read."""
    turns = [
        call("zoom", {"op": "zoom"}),
        call("read", {"op": "read", "text": "TEXAS"}),
        call("zoom", None),
        call("zoom", {"op": "zoom"}),
        call("read", {"op": "read", "text": "TEXAS 7ABC-123"}),
    ]
    row = record(photo("us"), episode("7ABC123", *turns))
    assert (row["country"], row["success"], row["plate_shaped"], row["retried"]) == ("us", True, True, True)
    assert (row["calls"], row["refused"], row["shown"], row["rule_right"]) == (5, 1, True, True)
    whole = record(photo("eu"), episode("TEXAS", call("read", {"op": "read", "text": "TEXAS"})))
    assert (whole["success"], whole["plate_shaped"], whole["shown"]) == (False, False, False)
    assert not whole["gave_up"] and not row["gave_up"]
    honest = record(photo("us"), episode(plates.GAVE_UP, call("read", {"op": "read", "text": "TEXAS"})))
    assert (honest["success"], honest["plate_shaped"], honest["gave_up"]) == (False, False, True)


def test_summary_leaves_infra_failures_out_and_groups_by_country_and_split():
    """An infra-failed episode counts in n, not in the shares; each country gets a row, then both together."""
    read = call("read", {"op": "read", "text": "7ABC123"})
    rows = [
        record(photo("us"), episode("7ABC123", read)),
        record(photo("eu"), episode(None, stop="infra_failed")),
    ]
    assert summarise(rows)["n"] == 2 and summarise(rows)["success"] == 1.0
    table = groups("expert", rows)
    assert [(r["country"], r["split"]) for r in table] == [("eu", "dev"), ("us", "dev"), ("all", "dev")]
    assert "| expert | all | dev | 2 | 1.00 |" in format_table(table)
