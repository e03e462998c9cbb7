"""Training against the real tool server over loopback HTTP, frozen sub-agents, and kill -9 + resume.

The policy is tests/test_train.py's tiny random Llama with the real SmolLM2 tokenizer. A random policy never
writes a valid call or answer, so every real reward is 0; the runs that must see weights move swap the scorer
for test_train's `parity_score` stub. The tool server is the real app (real sub-agent modules, routes, limits)
behind uvicorn on 127.0.0.1, with a fake model behind the sub-agents unless the test is about the real one.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import torch

from subagents.common import Files
from subagents.fetch import FetchConfig
from tests.test_train import (
    TINY_ROLLOUT,
    check_run_trained,
    final_weights,
    parity_score,
    sampled_task_ids,
    tiny_config,
)
from tests.tool_server_fakes import FakeFactory, make_config, page_server, serving
from tool_server.app import create_app, host_of
from tool_server.config import CacheConfig, ServerConfig
from tool_server.embedded import ToolAccess
from training import step as step_module
from training import tasks as task_data
from training.checkpoint import find_latest
from training.config import TrainConfig, load_train_config
from training.loop import train
from training.metrics import read_metrics
from training.tasks import Task

REPO = Path(__file__).resolve().parent.parent
ROW_KEYS = {
    "step", "policy_version", "reward/final", "reward/turn", "success", "loss/pg", "loss/kl", "grad_norm",
    "clip_frac", "update/tokens", "update/skipped", "episodes/collected", "episodes/infra_failed",
    "episodes/stale_dropped", "context/main_tokens", "time/rollout", "time/train", "time/weight_sync", "perf/tokens_per_s",
}  # fmt: skip


def plates_root(shared_data: Path) -> Path:
    return shared_data / "images" / "plates" / "endtoend"


@contextmanager
def plate_tool_server(shared_data: Path) -> Iterator[str]:
    """The real tool server (fake model behind the sub-agents) that may read the plate photos; yields its URL."""
    files = Files(roots=(str(plates_root(shared_data)),))
    with serving(create_app(make_config(port=0, files=files), llm_factory=FakeFactory())) as url:
        yield url


def plate_config(run_dir: Path, policy: Path, tools_url: str, shared_data: Path) -> TrainConfig:
    cfg = tiny_config(run_dir, policy, task="plate_reading", tools=ToolAccess(url=tools_url))
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, limit=4, data_dir=shared_data))


def check_metrics_and_rollouts(run_dir: Path, policy: Path) -> None:
    """2 finite, trained steps with every namespaced key, no infra failures, 4 plate episodes saved per step."""
    rows = check_run_trained(run_dir, policy, 2)
    for row in rows:
        assert ROW_KEYS <= row.keys(), ROW_KEYS - row.keys()
        assert row["episodes/infra_failed"] == 0 and row["episodes/stale_dropped"] == 0
        assert math.isfinite(row["grad_norm"]) and row["grad_norm"] > 0
    for step in (1, 2):
        ids = sampled_task_ids(run_dir, step)
        assert len(ids) == 4 and all(i.startswith("plate-") for i in ids), ids


@pytest.mark.slow
def test_two_sync_and_two_async_steps_against_the_real_tool_server(
    tiny_policy: Path, tmp_path: Path, shared_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sync and async loops each train 2 steps on real plate tasks with `tools_url` at the real tool server over
    loopback HTTP: weights move, losses finite, metrics and rollouts written, and the server saw no errors."""
    monkeypatch.setattr(step_module, "score", parity_score)
    photo = task_data.load_family("plate_reading", "train", data_dir=shared_data, limit=1)[0].meta.image_path
    with plate_tool_server(shared_data) as url:
        # The server these runs use can serve the tasks' tool (the random policy itself never calls it).
        loaded = httpx.post(
            f"{url}/v1/tools/image_ops", json={"op": "load", "image": photo}, timeout=60
        ).json()
        assert loaded["ok"], loaded
        for overlap, name in ((False, "sync"), (True, "async")):
            run_dir = train(plate_config(tmp_path / name, tiny_policy, url, shared_data), overlap=overlap)
            check_metrics_and_rollouts(run_dir, tiny_policy)
        server = httpx.get(f"{url}/metrics", timeout=10).json()["tools"]
    assert server["image_ops"]["calls"] >= 1
    assert all(t["errors"] == 0 for t in server.values()), server


def page_qa_fields(url: str, page: str) -> dict[str, object]:
    body = {"url": f"{page}/ada", "question": "Where was Ada Lovelace born?"}
    answer = httpx.post(f"{url}/v1/tools/page_qa", json=body, timeout=180).json()
    assert answer["ok"] and not answer["cached"], answer
    keys = ("answer", "quote", "title", "url", "chunks", "tokens_read", "tokens_returned")
    return {k: answer[k] for k in keys}


@pytest.mark.slow
def test_subagents_stay_frozen_across_training(
    tiny_policy: Path, smollm2_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the real SmolLM2 behind page_qa and the cache off, a page_qa call answers identically before and
    after a training step against that server, and the sub-agent's weights are bit-identical and grad-free."""
    monkeypatch.setattr(step_module, "score", parity_score)
    cfg: ServerConfig = make_config(
        port=0,
        cache=CacheConfig(enabled=False),
        fetch=FetchConfig(allow_private_cidrs=("127.0.0.0/8",)),
    )
    app = create_app(cfg)
    with page_server() as page, serving(app) as url:
        tasks = [
            Task(f"ada-{i}", "video_qa", q, ("page_qa",), "London", context=f"Page: Ada Lovelace {page}/ada")
            for i, q in enumerate(["Where was Ada Lovelace born?", "Who was Ada Lovelace's father?"])
        ]
        monkeypatch.setattr(task_data, "load_family", lambda *a, **k: tasks)
        model = host_of(app).slots["page_qa"].backend.llm.model  # type: ignore[attr-defined]
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
        before = page_qa_fields(url, page)
        rollout = dataclasses.replace(TINY_ROLLOUT, max_turns=1)
        cfg = tiny_config(tmp_path / "run", tiny_policy, steps=1, rollout=rollout, tools=ToolAccess(url=url))
        run_dir = train(cfg)
        after = page_qa_fields(url, page)
    assert read_metrics(run_dir / "metrics.jsonl")[0]["update/skipped"] == 0.0  # the policy did train
    assert before["answer"] and before == after
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    assert not model.training and all(p.grad is None for p in model.parameters())


# `conductor train` with the scorer swapped for the stub (a monkeypatch cannot cross into a child process, and
# real rewards of a random policy are all 0, which would leave the weights where they are).
DRIVER = """
import sys
from tests.test_train import parity_score
from training import step
step.score = parity_score
from app.cli import main
sys.argv = ["conductor", "train", *sys.argv[1:]]
main()
"""


def write_toml(path: Path, policy: Path, tools_url: str, shared_data: Path) -> Path:
    path.write_text(
        f'policy = "{policy}"\ntask = "plate_reading"\nlimit = 4\ndata_dir = "{shared_data}"\n'
        "steps = 4\nwarmup_steps = 4\nbatch_tasks = 2\ngroup_size = 2\n"
        "lr = 1e-3\nmax_concurrent_episodes = 1\nsave_every = 1\nkeep_last = 1\n"
        f'[tools]\nurl = "{tools_url}"\n'
        "[rollout]\nmax_turns = 1\nmax_new_tokens = 8\nmax_context_tokens = 1024\nobservation_tokens = 32\n"
    )
    return path


def start_driver(toml: Path, log: Path, *args: str) -> subprocess.Popen[bytes]:
    """The driver in a child process; its output goes to `log` (a pipe nobody reads could fill and block it)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    argv = [sys.executable, "-c", DRIVER, str(toml), *args]
    with log.open("wb") as out:
        return subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)


def tail(log: Path) -> str:
    return log.read_text(errors="replace")[-2000:]


def kill_after_checkpoint(proc: subprocess.Popen[bytes], run_dir: Path, *, step: int, log: Path) -> int:
    """SIGKILL `proc` as soon as a valid checkpoint of `step` or later exists; return the latest step then."""
    deadline = time.monotonic() + 300  # import, model load and 2 steps take ~30 s on a loaded 2-core machine
    while time.monotonic() < deadline and proc.poll() is None:
        pointer = run_dir / "latest"  # cheap to poll; find_latest then hashes the files once
        if pointer.is_file() and int(pointer.read_text().strip().removeprefix("step_")) >= step:
            latest = find_latest(run_dir)
            if latest is not None and int(latest.name.removeprefix("step_")) >= step:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                return int(latest.name.removeprefix("step_"))
        time.sleep(0.02)
    proc.kill()  # past the deadline: never leave the child running (a no-op once it has exited)
    proc.wait()
    raise AssertionError(
        f"no step-{step} checkpoint before the run ended (rc {proc.returncode}): {tail(log)}"
    )


@pytest.mark.slow
def test_kill_nine_mid_run_then_resume_matches_a_straight_run(
    tiny_policy: Path, tmp_path: Path, shared_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 4-step CLI run SIGKILLed after its step-2 checkpoint and resumed in a fresh process samples the same
    tasks, logs each step once with the same losses, and ends with weights equal to an uninterrupted run's."""
    monkeypatch.setattr(step_module, "score", parity_score)
    with plate_tool_server(shared_data) as url:
        toml = write_toml(tmp_path / "train.toml", tiny_policy, url, shared_data)
        killed = tmp_path / "killed"
        first, second = tmp_path / "first.log", tmp_path / "second.log"
        proc = start_driver(toml, first, "--set", f"run_dir={killed}")
        at_kill = kill_after_checkpoint(proc, killed, step=2, log=first)
        assert proc.returncode == -signal.SIGKILL and at_kill < 4, (proc.returncode, at_kill)
        resumed = start_driver(toml, second, "--resume", str(killed))
        try:
            resumed.wait(timeout=300)  # ~20 s on a loaded 2-core machine
        finally:
            resumed.kill()  # a no-op once it has exited
        assert resumed.returncode == 0, tail(second)
        straight = train(load_train_config(toml, [f"run_dir={tmp_path / 'straight'}"]))
    rows, expected = read_metrics(killed / "metrics.jsonl"), read_metrics(straight / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # a step logged before the kill is not logged twice
    for key in ("loss/pg", "reward/final", "grad_norm"):
        assert [r[key] for r in rows] == [r[key] for r in expected], key
    for step in range(1, 5):
        assert sampled_task_ids(killed, step) == sampled_task_ids(straight, step), step
    a, b = final_weights(straight), final_weights(killed)
    assert (killed / "step_4").is_dir() and a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
