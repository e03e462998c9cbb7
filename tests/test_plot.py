"""PNG curves from a synthetic metrics.jsonl."""

from __future__ import annotations

import logging
import math

from training.metrics import MetricsLog
from training.plot import PANELS, panel_keys, plot_run, series

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_run(run_dir, *, with_clip: bool) -> None:
    with MetricsLog(run_dir / "metrics.jsonl") as log:
        for step in range(1, 6):
            row = {
                "step": step,
                "reward/final": 0.1 * step,
                "reward/turn": math.nan if step == 3 else 0.01 * step,
                "success": 0.2 * step,
                "tools/page_qa/calls": step,
                "tools/image_ops/calls": 2,
                "tools/page_qa/error_rate": 0.0,
                "context/main_tokens": 800 + step,
                "loss/pg": -0.01 * step,
            }
            log.write({**row, "clip_frac": 0.05} if with_clip else row)


def test_plot_run_writes_one_png_per_panel(tmp_path):
    """Every panel with data becomes a real PNG file under <run_dir>/plots/."""
    write_run(tmp_path, with_clip=True)
    paths = plot_run(tmp_path)
    assert sorted(p.name for p in paths) == sorted(f"{panel.name}.png" for panel in PANELS)
    for path in paths:
        assert path.parent == tmp_path / "plots" and path.read_bytes().startswith(PNG_MAGIC)


def test_missing_keys_skip_their_panel_with_a_log_line(tmp_path, caplog):
    """A run without clip_frac gets no clip plot, says so in the log, and still plots the rest."""
    write_run(tmp_path, with_clip=False)
    with caplog.at_level(logging.INFO, logger="training.plot"):
        paths = plot_run(tmp_path)
    assert "clip_frac.png" not in {p.name for p in paths} and len(paths) == len(PANELS) - 1
    assert "plot clip_frac skipped" in caplog.text


def test_tool_panel_picks_every_tools_calls_key_and_nothing_else():
    """The tool-call panel draws tools/<name>/calls for each tool, not their error rates."""
    keys = ["tools/page_qa/calls", "tools/image_ops/calls", "tools/page_qa/error_rate", "success"]
    tool_panel = next(p for p in PANELS if p.name == "tool_calls")
    assert panel_keys(tool_panel, keys) == ["tools/image_ops/calls", "tools/page_qa/calls"]


def test_series_keeps_nan_as_a_gap_and_skips_rows_without_the_key():
    """NaN stays NaN (a gap, not a zero); a row lacking the key is left out."""
    rows = [{"step": 1, "x": 1.0}, {"step": 2}, {"step": 3, "x": math.nan}]
    steps, values = series(rows, "x")
    assert steps == [1.0, 3.0] and values[0] == 1.0 and math.isnan(values[1])
