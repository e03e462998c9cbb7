"""Training on Ray (training/loop.py with `on_ray`, training/ray_session.py, training/ray_rollout.py) on a local cluster: the same run as in one
process, rollout workers that die mid-step, and the `--ray` command line.

The loop tests train the tiny random Llama of tests/test_train.py against the fake sub-agents served over real
loopback HTTP (every worker is its own process, so the tools cannot be an in-process mock), with its stub
reward (`parity_score`), which the driver computes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from app.cli import optional_value
from conductor.cluster import RayConfig, cluster
from main_agent.rollout import RolloutConfig
from tests.test_train import final_weights, parity_score, sampled_task_ids, tiny_config
from tests.tool_server_fakes import FakeFactory, fake_subagents, make_config, serving
from tool_server.app import create_app
from tool_server.embedded import ToolAccess
from training import step as step_module
from training.loop import train
from training.metrics import read_metrics
from training.ray_rollout import split
from training.step import InfraFailure, score_groups
from training.tasks import Task

ray = pytest.importorskip("ray", reason="Ray is the optional extra `distributed`")


@pytest.fixture(scope="module")
def fake_tools() -> Iterator[tuple[str, Counter[str]]]:
    """The fake sub-agents behind real uvicorn on loopback; the counter counts the calls that ran."""
    calls: Counter[str] = Counter()
    app = create_app(make_config(), subagents=fake_subagents(calls), llm_factory=FakeFactory())
    with serving(app) as url:
        yield url, calls


def test_a_steps_tasks_split_into_contiguous_shares() -> None:
    """Every task goes to exactly one worker, in order, shares differing by at most one task."""
    tasks = [Task(f"t{i}", "video_qa", "q", ("search",), "a") for i in range(5)]
    shares = split(tasks, 3)
    assert [[t.task_id for t in s] for s in shares] == [["t0", "t1"], ["t2", "t3"], ["t4"]]
    assert split(tasks[:1], 2) == [tasks[:1], []]


def test_ray_alone_takes_the_settings_address_on_the_command_line() -> None:
    """`--ray` at the end or before another option gets an empty value (the [ray] address applies); a value
    after it stays."""
    assert optional_value(["train", "c.toml", "--ray"], "--ray", "") == ["train", "c.toml", "--ray", ""]
    assert optional_value(["train", "--ray", "--async"], "--ray", "") == ["train", "--ray", "", "--async"]
    assert optional_value(["train", "--ray", "auto"], "--ray", "") == ["train", "--ray", "auto"]


@pytest.mark.slow
def test_one_worker_each_equals_the_single_process_run(
    tiny_policy: Path, tmp_path: Path, stub_tasks, monkeypatch: pytest.MonkeyPatch, fake_tools
) -> None:
    """1 rollout worker + 1 trainer worker on Ray == `train` in one process, same seed: the same tasks
    sampled, the same losses and rewards, the same final weights, for 2 steps."""
    monkeypatch.setattr(step_module, "score", parity_score)
    threads = torch.get_num_threads()  # the same thread count: CPU matmuls sum in the same order
    on_ray = RayConfig(cpus_per_rollout_worker=threads, cpus_per_trainer_worker=threads, tool_replicas=1)
    cfg = tiny_config(tmp_path / "local", tiny_policy, tools=ToolAccess(url=fake_tools[0]), ray=on_ray)
    local = train(cfg)
    remote = train(dataclasses.replace(cfg, run_dir=tmp_path / "ray"), on_ray=True)
    a, b = read_metrics(local / "metrics.jsonl"), read_metrics(remote / "metrics.jsonl")
    assert [r["step"] for r in b] == [1, 2] and [r["policy_version"] for r in b] == [1, 2]
    for key in ("loss/pg", "reward/final", "grad_norm", "update/tokens", "optim/lr"):
        assert [r[key] for r in a] == [r[key] for r in b], key
    assert all(sampled_task_ids(local, s) == sampled_task_ids(remote, s) for s in (1, 2))
    wa, wb = final_weights(local), final_weights(remote)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


WAIT_CALL = '<tool_call>{"name": "image_ops", "arguments": {"text": "wait", "delay_s": 3}}</tool_call>'
SLOW_TASKS = [Task(f"slow-{i}", "video_qa", f"What is {i}?", ("image_ops",), str(i)) for i in range(2)]


@pytest.mark.slow
async def test_a_rollout_worker_killed_mid_step_loses_its_share_and_comes_back(
    tiny_policy: Path, tmp_path: Path, fake_tools
) -> None:
    """SIGKILL of one of 2 rollout workers while its episodes wait on a tool: its group comes back
    infra-failed with the reason, the other worker's group is whole; the step fails by the infra-failure rule
    at 25 % and trains at 50 %; the next collection runs on the restarted worker (a new process)."""
    from training.ray_rollout import RolloutGroup, load_structure

    url, calls = fake_tools
    rollout = RolloutConfig(max_turns=2, max_new_tokens=8, first_turn_prefix=WAIT_CALL)  # a 3 s call first
    on_ray = RayConfig(rollout_workers=2, max_restarts=1)
    cfg = tiny_config(tmp_path / "run", tiny_policy, rollout=rollout, ray=on_ray, max_concurrent_episodes=2)
    with cluster(on_ray):
        model, _ = load_structure(cfg)
        group = await RolloutGroup.start(cfg, tools_url=url, weights=ray.put(model.state_dict()), version=0)
        pids = await asyncio.gather(*(w.pid.remote() for w in group.workers))
        before = calls["image_ops"]
        step = asyncio.ensure_future(group.collect(SLOW_TASKS, 1))
        deadline = time.monotonic() + 60  # both workers load nothing more: their calls start within seconds
        while calls["image_ops"] < before + 4 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        os.kill(pids[1], signal.SIGKILL)
        groups = await step
        assert [e.stop_reason == "infra_failed" for e in groups[0]] == [False, False]
        assert all(e.infra_error.startswith("rollout worker 1 died: Actor") for e in groups[1]), groups[1]
        with pytest.raises(InfraFailure, match="2 of 4 episodes cannot be trained on"):
            score_groups(groups, SLOW_TASKS, cfg)
        lenient = dataclasses.replace(cfg, max_infra_failure_frac=0.5)
        assert len(score_groups(groups, SLOW_TASKS, lenient).sequences) == 2
        again = await group.collect(SLOW_TASKS, 2)
        assert not any(e.stop_reason == "infra_failed" for g in again for e in g)
        assert await group.workers[1].pid.remote() != pids[1]
        await group.close()


class Remote:
    """An actor method's stand-in: `.remote(...)` runs `fn` (a coroutine function) as Ray would hand it back."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def remote(self, *args):
        return self.fn(*args)


class FakeWorker:
    """A rollout worker handle that records the object-store loads it gets."""

    def __init__(self) -> None:
        self.loaded: list[tuple[object, int]] = []
        self.load_weights = Remote(self._load)

    async def _load(self, weights: object, version: int) -> float:
        self.loaded.append((weights, version))
        return 0.0


@dataclasses.dataclass
class FakeTrainers:
    """Trainer rank 0 as the GPU push sees it: links opened, sends made, the ranks a send loses."""

    links: list[list[int]] = dataclasses.field(default_factory=list)
    sends: list[tuple[list[int], int]] = dataclasses.field(default_factory=list)
    lose: list[int] = dataclasses.field(default_factory=list)

    def link(self, workers: dict, transport: str) -> None:
        assert transport == "ipc"
        self.links.append(sorted(workers))

    def send(self, ranks: list[int], version: int) -> list[int]:
        self.sends.append((ranks, version))
        lost, self.lose = self.lose, []
        return lost

    def sampler_weights(self) -> str:
        return f"weights@{len(self.sends)}"


async def test_a_gpu_push_streams_to_linked_workers_and_relinks_one_that_came_back() -> None:
    """Under `[ray] weight_push` the driver links every worker at the start and then streams only to live
    linked ones; a worker lost during a push, or restarted after dying in a collection, gets the new weights
    once through the object store (at the new version) and a new link in the same sync; until then a
    restarted worker's share is lost, not sampled from outdated weights."""
    from types import SimpleNamespace

    from training.ray_rollout import RolloutGroup
    from training.ray_session import RayLearner

    workers = [FakeWorker(), FakeWorker()]
    rollouts = RolloutGroup(workers, 2, "weights@start", 0, stale=set(), unlinked={0, 1})
    trainers = FakeTrainers()
    learner = RayLearner(SimpleNamespace(ray=RayConfig(weight_push="ipc")), trainers, rollouts)
    await learner.link_workers()
    assert trainers.links == [[0, 1]] and rollouts.unlinked == set()
    await learner.sync()  # version 1
    assert trainers.sends == [([0, 1], 1)] and workers[0].loaded == workers[1].loaded == []
    assert rollouts.version == 1 and rollouts.weights is None

    trainers.lose = [1]  # worker 1 dies while the weights stream to it
    await learner.sync()  # version 2
    assert trainers.sends[-1] == ([0, 1], 2) and workers[1].loaded == [("weights@2", 2)]
    assert trainers.links[-1] == [1] and not rollouts.stale and not rollouts.unlinked

    rollouts.stale.add(0), rollouts.unlinked.add(0)  # worker 0 died in a collection; Ray restarts it
    lost = await rollouts._collect(0, [Task("t", "video_qa", "q?", ("image_ops",), "a")], step=3)
    assert [e.infra_error for e in lost[0]] == ["rollout worker 0 has not come back"] * 2
    assert workers[0].loaded == []  # no outdated weights: it waits for the push
    await learner.sync()  # version 3
    assert trainers.sends[-1] == ([1], 3) and workers[0].loaded == [("weights@3", 3)]
    assert trainers.links[-1] == [0] and not rollouts.stale and not rollouts.unlinked


class FakeEngine:
    """The calls a rollout worker forwards to its vLLM engine during a GPU push, recorded; `fail_start` makes
    the first one fail."""

    def __init__(self, fail_start: bool = False) -> None:
        self.calls: list[str] = []
        self.fail_start = fail_start

    async def start_weight_update(self) -> None:
        if self.fail_start:
            raise RuntimeError("engine refused")
        self.calls.append("start")

    async def finish_weight_update(self) -> None:
        self.calls.append("finish")

    async def reset_prefix_cache(self) -> None:
        self.calls.append("reset_prefix_cache")


class FakeSampler:
    """A sampler whose engine is `engine` and whose policy samples its version."""

    def __init__(self, engine: FakeEngine) -> None:
        self.version, self.policy, self._engine = 0, self, engine

    def engine(self) -> FakeEngine:
        return self._engine

    def streamed(self, version: int) -> None:
        self.version = version

    async def sample(self, prompt_ids: list[int], *, max_new_tokens: int) -> int:
        return self.version


async def test_a_worker_samples_nothing_between_the_start_and_finish_of_a_gpu_push() -> None:
    """The worker's swap lock is taken by start_weight_update and let go by finish_weight_update: a sample
    asked for in between waits and comes out at the new version; finish drops the prefix cache; an engine that
    fails to start the update leaves the lock free."""
    from training.ray_rollout import RolloutWorker

    worker = object.__new__(RolloutWorker)  # the actor's state without loading a model
    engine = FakeEngine()
    worker.sampler, worker.swap = FakeSampler(engine), asyncio.Lock()
    await worker.start_weight_update()
    waiting = asyncio.ensure_future(worker.sample([1, 2], 4))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    await worker.finish_weight_update(3)
    assert await waiting == 3 and worker.sampler.version == 3
    assert engine.calls == ["start", "finish", "reset_prefix_cache"]
    worker.sampler = FakeSampler(FakeEngine(fail_start=True))
    with pytest.raises(RuntimeError, match="engine refused"):
        await worker.start_weight_update()
    assert not worker.swap.locked()


def test_a_gpu_push_is_refused_without_vllm_engines_on_gpus(tiny_policy: Path, tmp_path: Path) -> None:
    """`weight_push = "nccl"` or "ipc" with a transformers sampler or without GPUs is a ConfigError that says
    what it needs; an unknown transport is refused when the settings are read."""
    from conductor.settings import ConfigError
    from main_agent.policy import SamplingConfig
    from training.ray_session import check_supported

    cfg = tiny_config(tmp_path, tiny_policy, ray=RayConfig(weight_push="nccl"))
    with pytest.raises(ConfigError, match="needs sampling.backend = 'vllm' and gpus_per_trainer_worker"):
        check_supported(cfg)
    on_gpus = RayConfig(weight_push="ipc", gpus_per_rollout_worker=0.5, gpus_per_trainer_worker=0.5)
    cpu_sampler = dataclasses.replace(cfg, ray=on_gpus, sampling=SamplingConfig(backend="transformers"))
    with pytest.raises(ConfigError, match="weight_push = 'ipc'"):
        check_supported(cpu_sampler)
    check_supported(dataclasses.replace(cfg, ray=on_gpus, sampling=SamplingConfig(backend="vllm")))
    with pytest.raises(ConfigError, match="weight_push one of object_store, nccl, ipc"):
        RayConfig(weight_push="tcp")


@pytest.mark.slow
def test_the_ray_loop_resumes_on_another_worker_count(
    tiny_policy: Path, tmp_path: Path, stub_tasks, monkeypatch: pytest.MonkeyPatch, fake_tools
) -> None:
    """A run checkpointed by 2 trainer and 2 rollout workers (`--async`) resumes on 1 of each: steps 1-3
    logged once each, versions counting on, the checkpoint's weights trained further."""
    monkeypatch.setattr(step_module, "score", parity_score)
    two = RayConfig(rollout_workers=2, trainer_workers=2)
    cfg = tiny_config(tmp_path / "run", tiny_policy, tools=ToolAccess(url=fake_tools[0]), ray=two, steps=2)
    run_dir = train(cfg, on_ray=True, overlap=True)
    first = final_weights(run_dir)
    one = dataclasses.replace(cfg, steps=3, ray=RayConfig())
    train(one, on_ray=True, resume=run_dir)
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["policy_version"] == 3
    assert rows[1]["episodes/stale_dropped"] == 0  # the async batch was one version behind: kept
    state = json.loads((run_dir / "step_3" / "state.json").read_text())
    assert state["step"] == 3 and state["episodes"] == 12
    last = final_weights(run_dir)
    assert any(not torch.equal(first[k], last[k]) for k in first)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("push", ["object_store", "ipc"])
def test_on_a_gpu_the_trainer_and_a_vllm_rollout_worker_share_it(
    push: str, tiny_policy: Path, tmp_path: Path, stub_tasks, monkeypatch: pytest.MonkeyPatch, fake_tools
) -> None:
    """The GPU layout on one GPU: the trainer worker trains on cuda (NCCL backend) and the rollout worker
    samples with a vLLM engine on the same GPU, half each; 2 steps train and the pushed weights reach the
    engine: through the object store the sampler folder holds the last version; over CUDA IPC
    (`weight_push = "ipc"`) only the starting one, every later version streamed into the engine."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("vllm", reason="needs the vllm extra")
    from main_agent.policy import SamplingConfig

    monkeypatch.setattr(step_module, "score", parity_score)
    halves = RayConfig(gpus_per_rollout_worker=0.5, gpus_per_trainer_worker=0.5, weight_push=push)
    vllm = SamplingConfig(backend="vllm", gpu_memory_utilization=0.3)
    cfg = tiny_config(tmp_path / "run", tiny_policy, tools=ToolAccess(url=fake_tools[0]), ray=halves)
    run_dir = train(dataclasses.replace(cfg, sampling=vllm, device="cuda"), on_ray=True)
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["policy_version"] for r in rows] == [1, 2] and all(r["update/skipped"] == 0.0 for r in rows)
    folders = sorted(p.name for p in (run_dir / "sampler" / "worker-0").iterdir())
    assert folders == (["v2"] if push == "object_store" else ["v0"])
