"""The plates benchmark's maths: one plate_reading episode -> its record, records -> a table per policy, country
and split. Pure; no files.

    record(task, episode) -> dict     answer, success, plate-shaped answer, the plain give-up, calls, refused
                                      calls, retried, reads
    summarise(records) -> dict        the measures of one group of records
    format_table(rows) -> str         one line per (policy, country, split)

A photo's country is its folder in the shared data (us, eu: the task id `plate-<country>-<name>`). "retried":
more than one zoomed read (a second region or an autocontrast). "shown": some read holds the label (letters and
digits, anywhere in it): the reader's ceiling. "rule right": `conductor.plates.plate_shaped` of the reads (the
first read that has some) is the label, over the photos where a read showed it: the rule alone, whoever played.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from conductor.plates import is_plate_shaped, normalize_plate, plate_shaped
from main_agent.types import Episode
from training import tasks as task_data
from training.tasks import Task

COLUMNS = ("n", "success", "answered", "plate_shaped", "gave_up", "retried", "kept_retried", "calls",
           "tool_errors", "shown", "rule_right")  # fmt: skip


def country(task: Task) -> str:
    """us or eu: the folder of the photo (task ids are `plate-<folder>-<name>`)."""
    return task.task_id.split("-")[1]


def record(task: Task, episode: Episode) -> dict:
    """One episode's record (see the module docstring)."""
    pairs = [(c, r) for turn in episode.turns for c, r in zip(turn.calls, turn.results, strict=True)]
    ops = [str(c.arguments.get("op")) for c, _ in pairs]
    reads = [
        str((r.payload or {}).get("text") or "") for c, r in pairs if r.ok and c.arguments.get("op") == "read"
    ]
    label = normalize_plate(task.reference)
    ruled = next((p for text in reads if (p := plate_shaped(text))), None)
    answer = episode.answer
    return {
        "task_id": task.task_id,
        "country": country(task),
        "split": task.meta.split,
        "answer": answer,
        "success": episode.stop_reason != "infra_failed" and task_data.success(task, answer),
        "infra_failed": episode.stop_reason == "infra_failed",
        "plate_shaped": answer is not None and is_plate_shaped(answer),
        "gave_up": task_data.gave_up(task, answer),
        "calls": len(pairs),
        "refused": sum(not r.ok for _, r in pairs),
        "retried": ops.count("zoom") + ops.count("autocontrast") > 1,
        "reads": reads,
        "shown": any(label in normalize_plate(text) for text in reads),
        "rule_right": ruled == label,
    }


def _share(records: Sequence[dict], key: str) -> float:
    return sum(bool(r[key]) for r in records) / len(records) if records else math.nan


def summarise(records: Sequence[dict]) -> dict:
    """A group's measures: shares of its photos, except kept_retried (of its successes), calls (a mean),
    tool_errors (refused calls over calls) and rule_right (over the photos a read showed the label in)."""
    scored = [r for r in records if not r["infra_failed"]]
    right = [r for r in scored if r["success"]]
    calls = sum(r["calls"] for r in scored)
    return {
        "n": len(records),
        "success": _share(scored, "success"),
        "answered": sum(r["answer"] is not None for r in scored) / len(scored) if scored else math.nan,
        "plate_shaped": _share(scored, "plate_shaped"),
        "gave_up": _share(scored, "gave_up"),
        "retried": _share(scored, "retried"),
        "kept_retried": _share(right, "retried"),
        "calls": calls / len(scored) if scored else math.nan,
        "tool_errors": sum(r["refused"] for r in scored) / calls if calls else math.nan,
        "shown": _share(scored, "shown"),
        "rule_right": _share([r for r in scored if r["shown"]], "rule_right"),
    }


def groups(policy: str, records: Sequence[dict]) -> list[dict]:
    """One summary per (country, split) of `records`, then one per split over both countries."""
    keys = sorted({(r["country"], r["split"]) for r in records}) + sorted(
        {("all", r["split"]) for r in records}
    )
    return [
        {"policy": policy, "country": c, "split": s}
        | summarise([r for r in records if r["split"] == s and c in ("all", r["country"])])
        for c, s in keys
    ]


def format_table(rows: Sequence[dict]) -> str:
    """A Markdown table, one line per row of `groups`."""
    head = ["policy", "country", "split", *COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [row["policy"], row["country"], row["split"]] + [_cell(row[c]) for c in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(value: float | int) -> str:
    if isinstance(value, int):
        return str(value)
    return "-" if math.isnan(value) else f"{value:.2f}"
