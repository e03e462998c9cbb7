"""benchmarks/studies/reader/video_text.py's scoring and tables, on made-up answers (no models, no server)."""

from __future__ import annotations

from benchmarks.studies.reader.video_text import score_row, summarise, table


def _row(model: str, split: str, answer: str, seconds: float) -> dict:
    gold = "bin blue at f two now"
    row = score_row(
        task_id="grid", split=split, reference=gold, answer=answer, observation=answer, seconds=seconds
    )
    return {"model": model, **row}


def test_only_the_first_line_is_scored_and_groups_split_tune_from_report() -> None:
    """The answer's first line is what is scored (as the expert answers it), while the gold anywhere in the
    observation counts as evidence; tune holds train only, report dev and test, and the ratio line compares
    each model's median seconds with the first model's."""
    rows = [
        _row("small", "train", "Bin blue at F two now.\nMore text.", 2.0),
        _row("small", "dev", "Someone speaks.\nbin blue at f two now", 4.0),
        _row("big", "train", "", 4.0),
        _row("big", "test", "bin blue at f two now", 8.0),
    ]
    assert (rows[0]["first_line"], rows[0]["em"], rows[0]["f1"]) == ("Bin blue at F two now.", 1.0, 1.0)
    assert (rows[1]["em"], rows[1]["f1"], rows[1]["evidence"]) == (0.0, 0.0, True)
    assert (rows[2]["first_line"], rows[2]["evidence"]) == ("unknown", False)
    summary = summarise(rows)
    expected = {"n": 1, "f1": 1.0, "em": 1.0, "evidence": 1.0, "p50_s": 2.0, "mean_s": 2.0}
    assert summary["small"]["tune"] == expected
    assert (summary["small"]["report"]["em"], summary["big"]["report"]["em"]) == (0.0, 1.0)
    assert summary["big"]["all"]["n"] == 2 and summary["big"]["all"]["p50_s"] == 6.0
    text = table(summary)
    assert "| small | tune | 1 | 1.000 | 1.000 | 1.000 | 2.0 | 2.0 |" in text
    assert text.endswith("small 1.00x, big 2.00x")
