"""The power of the horizon study: what difference in per-item accuracy it can detect, at the size it ran and at
the sizes it would need, and what those cost on the machine the records were made on.

    python -m benchmarks.studies.horizon.power   # from results/horizon/main/ and results/learning/plates/
    python -m benchmarks.studies.horizon.power --target 0.1 --rho 0 0.3 --steps 20 --episodes 8

Two credit modes are compared by their mean over S seeds of the final dev per-item accuracy. One seed's estimate
varies by the seed's training (sigma_seed, between seeds) and by the evaluation (K audits of N photos, per-item
accuracy p): var = sigma_seed^2 + p (1 - p) (1 + (N - 1) rho) / (K N), where rho is the correlation of two photos'
outcomes within one audit (0: photos independent; 1: an audit is right or wrong as a whole). The difference of two
modes' means has variance 2 var / S, and the minimum detectable difference at a two-sided alpha of 0.05 with
power 0.8 is MDE = (1.96 + 0.84) sqrt(2 var / S) (the usual normal approximation; with few seeds a t quantile
would widen it).

Where the numbers come from (nothing here trains or samples):
  p at each N: the records' mean per-item accuracy over modes and seeds (results/horizon/main/records/*.json);
  sigma_seed: the sample standard deviation over seeds of final dev success of a credit mode in
    results/learning/plates/records/*.json when some mode has two or more seeds, else that of bench_horizon's repeated
    seeds, else 0 (then the MDE is a lower bound: evaluation noise alone);
  cost: seconds per training episode and per evaluated audit at each N, from the same records.
The dev split caps K: its 49 photos make 49 // N disjoint audits (plate_audit bundles never share a photo), so
beyond that only seeds shrink the MDE. The size to reach the target: at each N, every dev audit and the fewest
seeds S with MDE <= target, and the cost of the whole study on this machine (every N, mode and seed: `--steps`
steps of `--episodes` episodes, then the evaluation). The model counts the evaluation's noise as if each seed
drew its own photos; both modes read the same dev photos, which pairs part of that noise away, so with sigma_seed
measured on the same photos the sizes are conservative by at most that term.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common.records import RESULTS, summary_path, write_summary

HORIZON = Path("horizon", "main", "records")
LEARNING = Path("learning", "plates", "records")
"""The stage records the power is read from, under benchmarks/results/."""

Z = 1.96 + 0.84
"""z_(1 - alpha/2) + z_power at alpha 0.05 (two-sided) and power 0.8."""
DEV_PHOTOS = 49
"""plate_reading's dev split (hashed file names of the shared US and EU sets); plate_audit bundles it by N."""
SAMPLED = "sampled-"
"""bench_learning's sampled dev evaluations (several episodes per photo at the training temperature): not the
greedy final success whose spread over seeds this needs."""
MODES = 3
"""Credit modes of the study (outcome, turn, branch)."""


@dataclass(frozen=True)
class Cell:
    """What the records say about one N: per-item accuracy and the seconds a training episode and an evaluated
    audit took."""

    n: int
    p: float
    episode_s: float
    audit_s: float
    stages: int
    audits: int


def seed_variance(p: float, n: int, audits: int, sigma_seed: float, rho: float) -> float:
    """The variance of one seed's final per-item accuracy: its training's spread plus its evaluation's noise."""
    return sigma_seed**2 + p * (1 - p) * (1 + (n - 1) * rho) / (audits * n)


def mde(p: float, n: int, audits: int, seeds: int, sigma_seed: float, rho: float) -> float:
    """The minimum detectable difference between two modes' seed means (see the module docstring)."""
    return Z * math.sqrt(2 * seed_variance(p, n, audits, sigma_seed, rho) / seeds)


def seeds_needed(p: float, n: int, audits: int, sigma_seed: float, rho: float, target: float) -> int:
    """The fewest seeds per mode with an MDE <= target, at `audits` audits per evaluation."""
    var = seed_variance(p, n, audits, sigma_seed, rho)
    return max(math.ceil(2 * var * (Z / target) ** 2), 2)  # a spread needs two seeds


def sizing_p(p: float) -> float:
    """p for sizing: at least 0.1 from 0 and 1 (an accuracy recorded as 0 on 3 audits is not known to be 0, and
    p (1 - p) = 0 would say one audit suffices)."""
    return min(max(p, 0.1), 0.9)


def horizon_cells(records: Path) -> tuple[list[Cell], dict]:
    """Per N, from bench_horizon's stage records; and the size they ran at (steps, audits, seeds)."""
    by_n: dict[int, list[dict]] = defaultdict(list)
    for _, record in _records(records, "n*-*-s*.json"):
        by_n[record["stage"]["n"]].append(record)
    cells, ran = [], {}
    for n, rows in sorted(by_n.items()):
        evals = [r["eval"] for r in rows]
        steps = [r["training"]["steps"] for r in rows]
        episodes = [r["training"]["steps"] * r["settings"]["batch_tasks"] * 4 for r in rows]  # G = 4 a task
        audits = sum(e["n"] for e in evals)
        cells.append(
            Cell(
                n=n,
                p=statistics.mean(e["items_right"] for e in evals),
                episode_s=sum(r["training"]["wall_s"] for r in rows) / sum(episodes),
                audit_s=sum(e["wall_s"] for e in evals) / audits,
                stages=len(rows),
                audits=audits,
            )
        )
        ran[n] = {"steps": max(steps), "audits": evals[0]["n"], "seeds": _seeds(rows)}
    return cells, ran


def _seeds(rows: list[dict]) -> int:
    """The fewest seeds any credit mode has at one N (the comparison is as strong as its weaker side)."""
    per_mode: dict[str, int] = defaultdict(int)
    for row in rows:
        per_mode[row["stage"]["credit"]] += 1
    return min(per_mode.values())


def _records(folder: Path, pattern: str) -> list[tuple[str, dict]]:
    """(stage name without its seed, record) of every record file matching `pattern`, in name order; what follows
    the seed stays (bench_learning's "outcome-s1-t1.15" is "outcome-t1.15": another temperature, not a seed)."""
    paths = sorted(folder.glob(pattern))
    return [(re.sub(r"-s\d+(?=-|$)", "", p.stem), json.loads(p.read_text(encoding="utf-8"))) for p in paths]


def seed_spread(learning: Path, horizon: Path) -> tuple[float, str]:
    """sigma_seed and where it came from (see the module docstring)."""
    sources = (
        (learning, "*-s*.json", "success_rate", "bench_learning (final dev success, plate_reading)"),
        (
            horizon,
            "n*-*-s*.json",
            "items_right",
            "bench_horizon (final dev per-item accuracy, repeated seeds)",
        ),
    )
    for folder, pattern, key, source in sources:
        by_mode: dict[str, list[float]] = defaultdict(list)
        for mode, record in _records(folder, pattern):
            if record.get("eval") and not mode.startswith(SAMPLED):
                by_mode[mode].append(record["eval"][key])
        spreads = [statistics.stdev(v) for v in by_mode.values() if len(v) >= 2]
        if spreads:
            return math.sqrt(statistics.mean(x * x for x in spreads)), source  # pooled over modes
    return 0.0, "none recorded: 0 (evaluation noise alone; the MDE is a lower bound)"


def study_hours(cells: list[Cell], audits: list[int], seeds: list[int], steps: int, episodes: int) -> float:
    """Hours for every N x mode x seed: `steps` steps of `episodes` episodes, then the N's audits."""
    per_n = [steps * episodes * c.episode_s + k * c.audit_s for c, k in zip(cells, audits, strict=True)]
    return sum(h * s for h, s in zip(per_n, seeds, strict=True)) * MODES / 3600


def report(args: argparse.Namespace, results: Path) -> dict:
    """The power as run and the size that reaches `args.target`, from the records under `results`."""
    cells, ran = horizon_cells(results / HORIZON)
    if not cells:
        sys.exit(f"no horizon records in {results / HORIZON}: run python -m benchmarks.studies.horizon.bench")
    sigma, source = seed_spread(results / LEARNING, results / HORIZON)
    achieved = [
        {
            "n": c.n,
            "p": c.p,
            **ran[c.n],
            "mde": mde(sizing_p(c.p), c.n, ran[c.n]["audits"], ran[c.n]["seeds"], sigma, 0),
        }
        for c in cells
    ]
    needed = []
    for rho in args.rho:
        audits = [DEV_PHOTOS // c.n for c in cells]
        seeds = [
            seeds_needed(sizing_p(c.p), c.n, k, sigma, rho, args.target)
            for c, k in zip(cells, audits, strict=True)
        ]
        hours = study_hours(cells, audits, seeds, args.steps, args.episodes)
        needed.append({"rho": rho, "audits": audits, "seeds": seeds, "hours": hours})
    return {
        "target": args.target,
        "sigma_seed": sigma,
        "sigma_source": source,
        "cells": [vars(c) for c in cells],
        "achieved": achieved,
        "needed": needed,
        "plan": {"steps": args.steps, "episodes_per_step": args.episodes, "modes": MODES},
    }


def table(rep: dict) -> str:
    lines = [
        f"sigma_seed = {rep['sigma_seed']:.3f} ({rep['sigma_source']}); target difference {rep['target']}",
        "",
        "| N (as run) | per-item accuracy | steps | audits | seeds | MDE (rho 0) |",
        "|---|---|---|---|---|---|",
    ]
    for a in rep["achieved"]:
        lines.append(
            f"| {a['n']} | {a['p']:.3f} | {a['steps']} | {a['audits']} | {a['seeds']} | {a['mde']:.2f} |"
        )
    ns = ", ".join(str(a["n"]) for a in rep["achieved"])
    lines += [
        "",
        f"| to detect the target: rho | audits (all of dev) at N = {ns} | seeds per mode | hours here |",
    ]
    lines.append("|---|---|---|---|")
    for row in rep["needed"]:
        audits, seeds = (", ".join(map(str, row[k])) for k in ("audits", "seeds"))
        lines.append(f"| {row['rho']} | {audits} | {seeds} | {row['hours']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=float, default=0.1, help="difference in per-item accuracy to detect")
    parser.add_argument("--rho", type=float, nargs="+", default=[0.0, 0.3], help="within-audit correlation")
    parser.add_argument("--steps", type=int, default=20, help="RL steps per run of the sized study")
    parser.add_argument("--episodes", type=int, default=8, help="episodes per step of the sized study")
    args = parser.parse_args()
    rep = report(args, RESULTS)
    print(table(rep))
    out = write_summary(summary_path("horizon", "power"), rep)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
