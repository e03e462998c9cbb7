"""PNG curves of a training run from its `metrics.jsonl` (keys as in `training.metrics`).

    conductor plot RUN_DIR                 writes RUN_DIR/plots/{reward,success,tool_calls,...}.png

One figure per panel, one line per metric key against `step` (the row number when a row has no step). A panel
none of whose keys appear in the run is skipped with a log line; NaN values (a step with nothing to average)
leave gaps instead of dropping to 0.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from training.metrics import read_metrics

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Panel:
    """One PNG: the metric keys matching any of `patterns` (full-match regular expressions)."""

    name: str
    """File name without `.png`."""
    title: str
    patterns: tuple[str, ...]


PANELS = (
    Panel("reward", "Reward", (r"reward/final", r"reward/turn")),
    Panel("success", "Success rate", (r"success",)),
    Panel("tool_calls", "Tool calls per step", (r"tools/[^/]+/calls", r"tools/calls_per_episode")),
    Panel("context_tokens", "Main context tokens per episode", (r"context/main_tokens",)),
    Panel("loss", "Loss", (r"loss/pg", r"loss/kl")),
    Panel("clip_frac", "Clip fraction", (r"clip_frac",)),
)


def panel_keys(panel: Panel, keys: Sequence[str]) -> list[str]:
    """The run's keys this panel draws, in pattern order then alphabetically."""
    found: list[str] = []
    for pattern in panel.patterns:
        found += sorted(k for k in keys if re.fullmatch(pattern, k) and k not in found)
    return found


def series(rows: Sequence[dict[str, float]], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of `key`; rows without it are left out, NaN values kept (they draw as gaps)."""
    points = [(float(row.get("step", i + 1)), row[key]) for i, row in enumerate(rows) if key in row]
    return [s for s, _ in points], [math.nan if v is None else float(v) for _, v in points]


def plot_run(run_dir: Path) -> list[Path]:
    """Write one PNG per panel with data into `<run_dir>/plots/`; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a training machine
    from matplotlib import pyplot as plt

    rows = read_metrics(run_dir / "metrics.jsonl")
    keys = sorted({k for row in rows for k in row})
    out = run_dir / "plots"
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for panel in PANELS:
        chosen = panel_keys(panel, keys)
        if not chosen:
            logger.info(
                "plot %s skipped: no key matching %s in %s", panel.name, ", ".join(panel.patterns), run_dir
            )
            continue
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        for key in chosen:
            ax.plot(*series(rows, key), marker="." if len(rows) < 50 else None, label=key)
        ax.set(title=panel.title, xlabel="step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
        written.append(save_figure(fig, out / f"{panel.name}.png"))
    return written


def save_figure(fig, path: Path) -> Path:
    """Lay `fig` out, write it to `path` as a 100-dpi PNG (its folder made) and free it: every plot's last step."""
    from matplotlib import pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
