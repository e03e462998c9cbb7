"""The research benchmark's maths over per-question records (records.py): one policy's table, two policies'
paired F1 difference, and the questions a paired comparison needs. Pure; no files.

    summarise(records) -> dict          answer rate, EM, F1, calls, both pages read, second searches, tool
                                        errors, categories
    paired(a, b) -> dict                mean F1 difference b - a over the shared questions, its standard error
    questions_needed(d, sd_diff) -> int n = ((z_0.975 + z_0.8) * sd_diff / d)^2, rounded up
    power(record_sets) -> dict          that n for d = 0.05, sd_diff from what was recorded (or assumed)

Power: a paired comparison of two policies on the same n questions detects a mean F1 difference d at alpha 0.05
two-sided with power 0.8 when n >= ((1.960 + 0.842) * sd_diff / d)^2, sd_diff the standard deviation of the
per-question differences (a normal approximation; with F1 bunched at 0 and 1 it is rough below ~30 pairs).
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Sequence

from benchmarks.studies.research.records import CATEGORIES

Z_ALPHA = 1.959964  # z_{0.975}: alpha 0.05, two-sided
Z_POWER = 0.841621  # z_{0.8}: power 0.8
ASSUMED_SD_DIFF = 0.4
"""sd of per-question F1 differences assumed when no pairs are recorded: two policies that each get ~a third of
the questions right and disagree on a third of them (each disagreement a difference of ~1) give sqrt(1/3) ~ 0.58;
0.4 assumes they agree more often than not. The recorded pairs replace it."""


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def summarise(records: Sequence[dict]) -> dict:
    """One policy's measures over its records; scores over the episodes the tools did not fail. `second_search`
    is the share of questions with one; `second_from_read` and `second_copied` shares of those (records.py);
    `out_of_turns` the share that reached the turn limit without an answer."""
    scored = [r for r in records if r["category"] != "infra_failed"]
    two_hop = [r for r in scored if r["two_hop"]]
    seconds = [r["second_search"] for r in scored if r["second_search"] is not None]
    return {
        "n": len(records),
        "n_infra_failed": len(records) - len(scored),
        "answer_rate": _mean([float(r["answer"] is not None) for r in scored]),
        "em": _mean([r["em"] for r in scored]),
        "f1": _mean([r["f1"] for r in scored]),
        "f1_se": _se([r["f1"] for r in scored]),
        "calls_per_question": _mean([float(r["calls"]) for r in scored]),
        "searches_per_question": _mean([float(r["searches"]) for r in scored]),
        "reads_per_question": _mean([float(r["reads"]) for r in scored]),
        "invalid_calls_per_question": _mean([float(r["invalid_calls"]) for r in scored]),
        "repeated_calls_per_question": _mean([float(r["repeated_calls"]) for r in scored]),
        "out_of_turns": _mean([float(r["stop_reason"] == "max_turns") for r in scored]),
        "hop1_read": _mean([float(r["hop1_read"]) for r in two_hop]),
        "hop2_read": _mean([float(r["hop2_read"]) for r in two_hop]),
        "both_read": _mean([float(r["hop1_read"] and r["hop2_read"]) for r in two_hop]),
        "second_search": _mean([float(r["second_search"] is not None) for r in scored]),
        "second_from_read": _share(seconds, "from_read"),
        "second_copied": _share(seconds, "copied"),
        "tool_error_rate": _ratio(
            sum(r["tool_errors"] for r in scored), sum(r["tool_results"] for r in scored)
        ),
        "categories": {name: Counter(r["category"] for r in records)[name] for name in CATEGORIES},
    }


def _share(kinds: Sequence[str], kind: str) -> float:
    return _mean([float(k == kind) for k in kinds])


def _se(values: Sequence[float]) -> float:
    return statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else math.nan


def _ratio(part: int, whole: int) -> float:
    return part / whole if whole else math.nan


def paired(a: Sequence[dict], b: Sequence[dict]) -> dict:
    """The F1 of `b` minus that of `a` over the questions both scored (infra failures left out): mean, standard
    error, the sd of the differences, and the questions that sd asks for to detect 0.05."""
    f1_a = {r["task_id"]: r["f1"] for r in a if r["category"] != "infra_failed"}
    shared = [
        (f1_a[r["task_id"]], r["f1"]) for r in b if r["task_id"] in f1_a and r["category"] != "infra_failed"
    ]
    diffs = [y - x for x, y in shared]
    sd = statistics.stdev(diffs) if len(diffs) > 1 else math.nan
    return {
        "n_shared": len(diffs),
        "f1_diff": _mean(diffs),
        "f1_diff_se": sd / math.sqrt(len(diffs)) if len(diffs) > 1 else math.nan,
        "sd_diff": sd,
        "questions_for_0.05": questions_needed(0.05, sd) if sd > 0 else None,
    }


def questions_needed(d: float, sd_diff: float) -> int:
    """Questions a paired comparison needs to detect a mean difference `d` at alpha 0.05 two-sided with power 0.8,
    when the per-question differences have standard deviation `sd_diff` (see the module docstring)."""
    assert d > 0 and sd_diff > 0, f"need d > 0 and sd_diff > 0, got d={d}, sd_diff={sd_diff}"
    return math.ceil(((Z_ALPHA + Z_POWER) * sd_diff / d) ** 2)


def detectable(n: int, sd_diff: float) -> float:
    """The smallest mean difference n paired questions detect at alpha 0.05 two-sided with power 0.8."""
    return (Z_ALPHA + Z_POWER) * sd_diff / math.sqrt(n)


def power(record_sets: Sequence[Sequence[dict]], *, d: float = 0.05, available: int | None = None) -> dict:
    """The questions needed to detect `d`, with the sd of the differences from the recorded pairs when two
    policies were recorded; from one policy, sqrt(2) x the sd of its F1 (two policies with that spread and
    uncorrelated scores; scores on the same questions correlate, which makes the need smaller); else
    ASSUMED_SD_DIFF. `sd_from` says which; with `available` (the split's questions), what those detect."""
    sds = [paired(a, b)["sd_diff"] for a, b in zip(record_sets, record_sets[1:], strict=False)]
    spreads = [statistics.stdev([r["f1"] for r in rs]) for rs in record_sets if len(rs) > 1]
    if any(sd > 0 for sd in sds):
        sd, source = max(sd for sd in sds if sd > 0), "recorded pairs (the largest sd)"
    elif any(spread > 0 for spread in spreads):
        sd, source = (
            math.sqrt(2) * max(spreads),
            "one policy's F1 sd x sqrt(2) (scores taken as uncorrelated)",
        )
    else:
        sd, source = ASSUMED_SD_DIFF, "assumed (no spread recorded)"
    found = {
        "d": d,
        "alpha": 0.05,
        "power": 0.8,
        "sd_diff": sd,
        "sd_from": source,
        "n": questions_needed(d, sd),
    }
    if available is not None:
        found |= {"available": available, "detectable_with_available": detectable(available, sd)}
    return found


def format_table(policies: Sequence[str], summaries: Sequence[dict]) -> str:
    """A Markdown table: one row per measure, one column per policy."""
    rows = [
        ("questions (infra failed)", [f"{s['n']} ({s['n_infra_failed']})" for s in summaries]),
        *[(key.replace("_", " "), [f"{s[key]:.3f}" for s in summaries]) for key in _SHOWN],
        *[(f"category {c}", [str(s["categories"][c]) for s in summaries]) for c in CATEGORIES],
    ]
    lines = ["| measure | " + " | ".join(policies) + " |", "|---|" + "---|" * len(policies)]
    return "\n".join([*lines, *(f"| {name} | " + " | ".join(cells) + " |" for name, cells in rows)])


_SHOWN = (
    "answer_rate",
    "em",
    "f1",
    "f1_se",
    "calls_per_question",
    "searches_per_question",
    "reads_per_question",
    "invalid_calls_per_question",
    "repeated_calls_per_question",
    "out_of_turns",
    "hop1_read",
    "hop2_read",
    "both_read",
    "second_search",
    "second_from_read",
    "second_copied",
    "tool_error_rate",
)
