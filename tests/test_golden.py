"""Golden records of whole training runs: the loop's behaviour pinned down while its code changes shape.

Five 2-step runs of the tiny random Llama of tests/test_train.py (its stub reward `parity_score`, the stub tasks,
seed 0, float32, the transformers sampler): sync, async (`overlap`), sync with branch credit, and on a local Ray
cluster (1 rollout worker, 1 trainer worker) sync and async. Each run's episodes (every id, log-prob, text,
observation, reward) and metrics rows are compared with the JSON records in tests/golden/, minus what measures
time (`*_s`, `*_ms`, `time/*`, `perf/*`): the same episodes and metrics before and after a change to the loop.

Floats compare within 1e-6 relative or 1e-7 absolute (a record is exact on the machine that wrote it; another CPU
may round a log-prob differently in the last bits, and a loss that sums to about 0 is all rounding); ids, texts
and counts compare exactly.

    CONDUCTOR_GOLDEN=write pytest tests/test_golden.py   # write the records anew (after a deliberate change)
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from main_agent.policy import SamplingConfig
from tests.fakes import fake_tool_server
from tests.test_train import parity_score, tiny_config
from training import step as step_module
from training.advantages import CreditConfig
from training.loop import train
from training.metrics import read_metrics

GOLDEN = Path(__file__).resolve().parent / "golden"
WRITE = os.environ.get("CONDUCTOR_GOLDEN") == "write"
TIMING_PREFIXES = ("time/", "perf/")
TIMING_SUFFIXES = ("_s", "_ms")


def scrub(value: Any) -> Any:
    """`value` without what measures time: keys ending in _s or _ms, metric keys under time/ or perf/."""
    if isinstance(value, dict):
        return {
            k: scrub(v)
            for k, v in value.items()
            if not (k.endswith(TIMING_SUFFIXES) or k.startswith(TIMING_PREFIXES))
        }
    if isinstance(value, list):
        return [scrub(v) for v in value]
    return value


def record(run_dir: Path) -> dict[str, Any]:
    """A finished run's episodes per step (as saved under rollouts/) and metrics rows, timings removed."""
    metrics = read_metrics(run_dir / "metrics.jsonl")
    episodes = {}
    for row in metrics:
        step = int(row["step"])
        lines = (run_dir / "rollouts" / f"step_{step}.jsonl").read_text(encoding="utf-8").splitlines()
        episodes[str(step)] = [json.loads(line) for line in lines]
    return scrub({"episodes": episodes, "metrics": metrics})


def same(a: Any, b: Any, where: str = "") -> None:
    """Assert `a` equals `b` (the record): floats within 1e-6 relative or 1e-7 absolute, NaN equal to NaN, the rest exactly."""
    if isinstance(b, dict):
        assert isinstance(a, dict) and sorted(a) == sorted(b), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for key in b:
            same(a[key], b[key], f"{where}/{key}")
    elif isinstance(b, list):
        assert isinstance(a, list) and len(a) == len(b), f"{where}: {len(a)} items, recorded {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{where}[{i}]")
    elif isinstance(b, float) and not isinstance(a, bool):
        assert isinstance(a, int | float), f"{where}: {a!r} != recorded {b!r}"
        assert (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-6, abs=1e-7), (
            f"{where}: {a!r} != recorded {b!r}"
        )
    else:
        assert a == b, f"{where}: {a!r} != recorded {b!r}"


def check(name: str, run_dir: Path) -> None:
    """Compare the run in `run_dir` with the record `name` (or write the record, CONDUCTOR_GOLDEN=write)."""
    path = GOLDEN / f"{name}.json"
    got = record(run_dir)
    if WRITE:
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        return
    assert path.is_file(), f"no record {path}: write it with CONDUCTOR_GOLDEN=write"
    same(got, json.loads(path.read_text(encoding="utf-8")), name)


def golden_config(run_dir: Path, policy: Path, **changes: Any):
    """tests/test_train.py's tiny run, pinned to what does not depend on the machine: fp32, transformers."""
    sampling = SamplingConfig(backend="transformers")
    return tiny_config(run_dir, policy, precision="fp32", sampling=sampling, **changes)


BRANCH = CreditConfig(mode="branch", branch_k=2, branch_turns=1)
LOCAL_RUNS = {"sync": (False, {}), "async": (True, {}), "sync_branch": (False, {"credit": BRANCH})}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LOCAL_RUNS))
def test_a_local_run_gives_the_recorded_episodes_and_metrics(
    name: str, tiny_policy: Path, tmp_path: Path, stub_tasks, monkeypatch: pytest.MonkeyPatch
) -> None:
    """2 steps in this process, tools from the fake server (tests/fakes.py), against the record `name`."""
    monkeypatch.setattr(step_module, "score", parity_score)
    overlap, changes = LOCAL_RUNS[name]
    cfg = golden_config(tmp_path / name, tiny_policy, **changes)
    check(name, train(cfg, overlap=overlap, transport=fake_tool_server()))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ray_sync", "ray_async"])
def test_a_ray_run_gives_the_recorded_episodes_and_metrics(
    name: str, tiny_policy: Path, tmp_path: Path, stub_tasks, monkeypatch: pytest.MonkeyPatch
) -> None:
    """2 steps on a local Ray cluster (1 rollout worker, 1 trainer worker), the fake sub-agents served over
    loopback (fresh for the run, so its cache starts empty), against the record `name`."""
    pytest.importorskip("ray", reason="Ray is the optional extra `distributed`")
    from conductor.cluster import RayConfig
    from tests.tool_server_fakes import FakeFactory, fake_subagents, make_config, serving
    from tool_server.app import create_app
    from tool_server.embedded import ToolAccess

    monkeypatch.setattr(step_module, "score", parity_score)
    threads = torch.get_num_threads()
    on_ray = RayConfig(cpus_per_rollout_worker=threads, cpus_per_trainer_worker=threads, tool_replicas=1)
    app = create_app(make_config(), subagents=fake_subagents(Counter()), llm_factory=FakeFactory())
    with serving(app) as url:
        cfg = golden_config(tmp_path / name, tiny_policy, tools=ToolAccess(url=url), ray=on_ray)
        check(name, train(cfg, on_ray=True, overlap=name == "ray_async"))
