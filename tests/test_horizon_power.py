"""benchmarks/studies/horizon/power.py: the detectable difference and the seeds that reach a target, on fake records."""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

import pytest

from benchmarks.studies.horizon import power as hp


def test_mde_is_the_normal_approximation_for_two_seed_means() -> None:
    """Evaluation noise alone: 2.8 sqrt(2 p (1 - p) / (K N S)); the seed spread and within-audit correlation add."""
    assert hp.mde(0.5, 1, 100, 1, 0.0, 0.0) == pytest.approx(2.8 * math.sqrt(2 * 0.25 / 100))
    assert hp.mde(0.5, 8, 6, 3, 0.0, 0.3) > hp.mde(0.5, 8, 6, 3, 0.0, 0.0)
    assert hp.mde(0.5, 8, 6, 3, 0.05, 0.0) > hp.mde(0.5, 8, 6, 3, 0.0, 0.0)


@pytest.mark.parametrize(
    ("p", "n", "audits", "sigma", "rho"), [(0.3, 1, 49, 0.02, 0.0), (0.2, 8, 6, 0.05, 0.3)]
)
def test_seeds_needed_is_the_fewest_that_reach_the_target(p, n, audits, sigma, rho) -> None:
    """With the seeds it names the MDE is within the target; with one fewer (above the floor of two) it is not."""
    seeds = hp.seeds_needed(p, n, audits, sigma, rho, 0.1)
    assert hp.mde(p, n, audits, seeds, sigma, rho) <= 0.1
    assert seeds == 2 or hp.mde(p, n, audits, seeds - 1, sigma, rho) > 0.1


def _record(folder: Path, n: int, credit: str, seed: int, right: float) -> None:
    record = {
        "stage": {"n": n, "credit": credit, "seed": seed},
        "settings": {"steps": 2, "batch_tasks": 1, "eval_n": 3, "sampler": "vllm"},
        "eval": {"n": 3, "items_right": right, "wall_s": 30.0 * n},
        "training": {"steps": 2, "wall_s": 80.0 * n},
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"n{n}-{credit}-s{seed}.json").write_text(json.dumps(record), encoding="utf-8")


def test_report_reads_accuracy_cost_and_seed_spread_from_the_records(tmp_path: Path) -> None:
    """p per N is the records' mean, the seconds per episode and audit their ratio, sigma_seed the pooled spread
    of repeated seeds; the size needed uses every dev audit at each N."""
    horizon = tmp_path / hp.HORIZON
    for credit, rights in {"outcome": (0.2, 0.4), "turn": (0.3, 0.3)}.items():
        for seed, right in enumerate(rights):
            _record(horizon, 4, credit, seed, right)
    args = argparse.Namespace(target=0.1, rho=[0.0], steps=20, episodes=8)
    rep = hp.report(args, tmp_path)
    (cell,) = rep["cells"]
    assert (
        cell["p"] == pytest.approx(0.3)
        and cell["episode_s"] == pytest.approx(320 / 8)
        and cell["audit_s"] == pytest.approx(120 / 3)
    )
    assert rep["sigma_seed"] == pytest.approx(
        math.sqrt((0.02 + 0.0) / 2)
    )  # outcome's variance 0.02, turn's 0
    assert rep["achieved"][0]["seeds"] == 2
    (needed,) = rep["needed"]
    assert needed["audits"] == [hp.DEV_PHOTOS // 4]
    assert needed["seeds"] == [hp.seeds_needed(0.3, 4, 12, rep["sigma_seed"], 0.0, 0.1)]


def test_bench_learning_seeds_are_pooled_per_mode_and_temperature(tmp_path: Path) -> None:
    """bench_learning's "outcome-s0" (temperature 1) and "outcome-s1-t1.15" are different studies: their seeds'
    spread is taken apart, never across temperatures (which would add the temperature's effect to the seeds').
    The sampled evaluations ("sampled-outcome-s0-t1.15") measure another thing than the greedy success and are
    left out."""
    learning = tmp_path / hp.LEARNING
    learning.mkdir(parents=True)
    dev = {"outcome-s0": 0.9, "outcome-s0-t1.15": 0.1, "outcome-s1-t1.15": 0.3, "explore-t1.15": None}
    dev |= {"sampled-outcome-s0-t1.15": 0.2, "sampled-outcome-s1-t1.15": 0.9, "sampled-turn-s1-t1.15": 0.0}
    for stage, success in dev.items():
        record = {"eval": {"success_rate": success} if success is not None else None}
        (learning / f"{stage}.json").write_text(json.dumps(record), encoding="utf-8")
    sigma, source = hp.seed_spread(learning, tmp_path / hp.HORIZON)
    assert sigma == pytest.approx(statistics.stdev([0.1, 0.3])) and source.startswith("bench_learning")
