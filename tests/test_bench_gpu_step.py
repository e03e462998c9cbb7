"""benchmarks/perf/gpu_step.py in its tiny form, run as a user runs it (a subprocess, on this machine's device):
the real loop trains, and the table and the JSON carry every measure, each a positive number."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

from benchmarks import ROOT
from benchmarks.perf.gpu_step import COLUMNS, TINY, Parameters, sheet_name
from training.config import device_sizes

MEASURES = ("sampling_s", "update_s", "weight_sync_s", "step_s", "sampled_tokens_per_s", "update_mfu")


def test_the_tiny_step_measures_every_configuration(smollm2_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "step.json"
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    command = [sys.executable, "-m", "benchmarks.perf.gpu_step", "--tiny", "--out", str(out)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["command"] == f"python -m benchmarks.perf.gpu_step --tiny --out {out}"  # the stamp
    assert len(result["commit"].removesuffix("-dirty")) == 40 or result["commit"] == "unknown"
    rows = result["rows"]
    assert [(r["episodes"], r["micro_batch_tokens_set"]) for r in rows] == [(4, False), (4, True)]
    default, small = rows
    device = result["device"]
    assert (
        default["micro_batch_tokens"] == device_sizes(device["type"], device["memory_gib"]).micro_batch_tokens
    )
    assert small["micro_batch_tokens"] == 64  # an explicit size wins over the device's
    for row in rows:
        assert row["update_skipped"] == 0, row  # every step updated: the update time is an update's
        assert row["sampled_tokens"] == 4 * 2 * TINY.max_new_tokens, row  # 4 episodes x 2 whole turns
        for key in (*MEASURES, "update_flops", "update_unique_tokens"):
            assert math.isfinite(row[key]) and row[key] > 0, (key, row[key])
        assert row["step_s"] >= row["sampling_s"] + row["update_s"]
        assert (row["peak_memory_gib"] is None) == (device["type"] == "cpu")
    assert device["peak_flops"] > 0 and result["parameters"]["total"] > result["parameters"]["head"]
    assert all(header in done.stdout for header, _, _ in COLUMNS)
    assert f"{default['micro_batch_tokens']:,} (default)" in done.stdout


def test_a_listed_gpu_takes_its_sheet_peak_and_flops_count_the_head_where_trained() -> None:
    """The longest listed name inside the device's wins ("H100 PCIe" over "H100"); an unlisted one is measured.
    The update's FLOPs: the body on every unique token, the (tied) head on the trained ones only."""
    assert sheet_name("NVIDIA H100 PCIe") == "H100 PCIe"
    assert sheet_name("NVIDIA H100 80GB HBM3") == "H100"
    assert sheet_name("NVIDIA H200") == "H200"
    assert sheet_name("NVIDIA A100-SXM4-80GB") == "A100"
    assert sheet_name("Tesla T4") is None
    assert Parameters(total=100, head=30, tied=True).update_flops(10, 2) == 6 * (70 * 10 + 30 * 2)
    assert Parameters(total=130, head=30, tied=False).update_flops(10, 2) == 6 * (70 * 10 + 30 * 2)
