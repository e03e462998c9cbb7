"""train.py's loop on a Ray cluster (`conductor train CONFIG --ray [ADDRESS]`, settings in `[ray]`).

The same steps from the same functions; what differs, and only this:

- collect: the step's groups are played by rollout workers (training/ray_rollout.py), actors that each hold a
  sampler and a tool client; a group stays on one worker. Worker r seeds from (seed, step, r), so one worker
  samples exactly what the single-process loop samples.
- update: data-parallel trainer workers (training/ray_trainer.py) split the step's micro-batches and all-reduce
  the gradients once (gloo on CPU, NCCL on GPUs); rank 0 writes the checkpoints, which resume on any number of
  workers.
- sync: rank 0's weights go through Ray's object store to every rollout worker, or, with `[ray] weight_push`
  "nccl" or "ipc", stream over the GPU into the workers' vLLM engines (training/weight_sync.py; linked at the
  start; a worker restarted by Ray gets the weights through the object store once, then is linked again).
- tools: unless `[tools] url` names a running server, the tool server is deployed on Ray Serve
  (tool_server/ray_serve.py) with `[ray] tool_replicas` replicas, prepared for the tasks exactly like the
  in-process one; its replicas share the result cache through `run_dir/tool_cache/`.
- `--async` (`overlap`): step s+1's collection is launched before step s trains, from the weights of step
  s-1, as in train_async.py; a worker takes the new weights once that collection is done, so no episode
  changes version. Groups older than `max_staleness` versions are dropped.

Not on Ray yet: branch credit (its continuations replay episodes on the driver's sampler); `sampling.backend =
"server"` (every rollout worker is its own sampler). Both are refused with a ConfigError.

Exactness: with 1 rollout worker and 1 trainer worker the run equals the single-process run for the same seed
(tests/test_ray_train.py: losses, sampled tasks). More rollout workers draw other (seeded) samples; more trainer
workers sum gradients in another order (allclose, not equal).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from conductor.cluster import cluster
from conductor.settings import ConfigError
from main_agent.backends import chosen_backend
from main_agent.types import Episode
from tool_server.client import ToolClient
from tool_server.config import ServerConfig, load_config
from training import play
from training import tasks as task_data
from training.checkpoint import TrainState
from training.config import TrainConfig
from training.metrics import MetricsLog, trim_metrics
from training.ray_rollout import RolloutGroup
from training.ray_trainer import TrainerGroup
from training.run import StepHook, config_json, load_tasks, next_tasks, record_step, resume_point
from training.tasks import Task
from training.train import score_groups, step_row
from training.train_async import drop_stale

logger = logging.getLogger(__name__)


@dataclass
class RayRun:
    """What the Ray loop holds (training.run.Run's counterpart: the model lives in the trainer workers)."""

    cfg: TrainConfig
    trainers: TrainerGroup
    tasks: list[Task]
    state: TrainState
    log: MetricsLog
    on_step: StepHook | None = None


@dataclass(frozen=True)
class Collected:
    """One step's rollouts as a collection hands them over."""

    step: int
    tasks: list[Task]
    state: TrainState  # the data cursor after these tasks
    groups: list[list[Episode]]
    rollout_s: float


def check_supported(cfg: TrainConfig) -> None:
    """ConfigError for what the Ray loop does not run (module docstring)."""
    if cfg.credit.mode == "branch":
        raise ConfigError("credit.mode = 'branch' does not run on Ray yet: train it without --ray")
    if chosen_backend(cfg.sampling) == "server":
        raise ConfigError(
            "sampling.backend = 'server' does not run on Ray: every rollout worker samples itself"
        )
    rc = cfg.ray
    if rc.weight_push != "object_store" and not (
        chosen_backend(cfg.sampling) == "vllm"
        and rc.gpus_per_trainer_worker > 0
        and rc.gpus_per_rollout_worker > 0
    ):
        raise ConfigError(
            f"[ray] weight_push = '{rc.weight_push}' streams weights between GPUs into vLLM engines: it needs "
            "sampling.backend = 'vllm' and gpus_per_trainer_worker and gpus_per_rollout_worker > 0 "
            "(or weight_push = 'object_store')"
        )


def start_ray_run(cfg: TrainConfig, *, resume: Path | None, force: bool, on_step: StepHook | None) -> RayRun:
    """Start the trainer workers (loading the checkpoint when resuming), the tasks and the metrics log."""
    check_supported(cfg)
    cfg, latest = resume_point(cfg, resume=resume, force=force)
    trainers, state = TrainerGroup.start(cfg, cfg.ray, checkpoint=latest)
    cfg = trainers.cfg  # precision "auto" made concrete by the workers, for their hardware
    if latest is not None:
        logger.info(
            "resuming %s at step %d on %d trainer workers", latest, state.step, cfg.ray.trainer_workers
        )
    tasks = load_tasks(cfg)
    if state is None:
        state = TrainState(seed=cfg.seed, items=cfg.horizon.items if tasks[0].items else 0)
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    trim_metrics(cfg.run_dir / "metrics.jsonl", after_step=state.step)  # steps redone after a kill
    return RayRun(cfg, trainers, tasks, state, MetricsLog(cfg.run_dir / "metrics.jsonl"), on_step)


@contextlib.asynccontextmanager
async def tool_session(cfg: TrainConfig, tasks: Sequence[Task]) -> AsyncIterator[tuple[str, list[Task]]]:
    """The tool server's URL and the tasks ready to play (prepared under run_dir): `[tools] url`, or the tool
    server on Ray Serve with what the tasks need (folders, loopback pages, corpus: training.play.server_needs)."""
    with task_data.prepared(tasks, cfg.run_dir, data_dir=cfg.data_dir) as ready:
        if cfg.tools.url is not None:
            async with ToolClient(cfg.tools.url) as probe:
                await probe.health()  # fail here, with the URL, rather than in every worker's first episode
            yield cfg.tools.url, ready
            return
        from tool_server import ray_serve
        from tool_server.embedded import embedded_config

        roots, loopback, corpus = play.server_needs(ready)
        server = embedded_config(load_config(cfg.tools.config), roots=roots, loopback=loopback, corpus=corpus)
        server = shared_cache(server, cfg.run_dir / "tool_cache")
        url = await asyncio.to_thread(ray_serve.deploy, server, cfg.ray)
        try:
            yield url, ready
        finally:
            ray_serve.shutdown()


def shared_cache(server: ServerConfig, folder: Path) -> ServerConfig:
    """`server` with its result cache on disk in `folder` unless it names one: each replica keeps its own memory
    cache, the folder is what they share (a result computed by one replica is a hit on every other; measured in
    tool_server/ray_serve.py)."""
    if not server.cache.enabled or server.cache.directory is not None:
        return server
    return dataclasses.replace(server, cache=dataclasses.replace(server.cache, directory=folder))


async def collect(
    rollouts: RolloutGroup, tasks: Sequence[Task], cursor: TrainState, cfg: TrainConfig, step: int
) -> Collected:
    """Step `step`'s tasks from `cursor` and their groups, played by the rollout workers."""
    batch, state = next_tasks(tasks, cursor, cfg)
    start = time.monotonic()
    groups = await rollouts.collect(batch, step)
    return Collected(step, batch, state, groups, time.monotonic() - start)


def cursor_for(run: RayRun, previous: TrainState) -> TrainState:
    """The data cursor the next collection starts from: where `previous` left it, or the start of the new
    horizon's tasks when the curriculum raised it meanwhile."""
    if run.state.items != previous.items:
        return dataclasses.replace(previous, items=run.state.items, recent=(), epoch=0, position=0)
    return previous


async def train_loop(run: RayRun, *, overlap: bool = False) -> None:
    """Steps state.step+1 .. steps: collect on the rollout workers, update on the trainer workers, push."""
    cfg = run.cfg
    async with tool_session(cfg, run.tasks) as (url, tasks):
        weights = run.trainers.sampler_weights()
        rollouts = await RolloutGroup.start(
            cfg, tools_url=url, weights=weights, version=run.state.policy_version
        )
        try:
            if cfg.ray.weight_push != "object_store":
                await link_workers(run, rollouts)
            first = run.state.step + 1
            pending = asyncio.ensure_future(collect(rollouts, tasks, run.state, cfg, first))
            for step in range(first, cfg.steps + 1):
                batch = await pending
                if overlap and step < cfg.steps:  # step s+1 samples (weights of s-1) while step s trains
                    pending = asyncio.ensure_future(collect(rollouts, tasks, batch.state, cfg, step + 1))
                t1 = time.monotonic()
                fresh, stale = drop_stale(
                    batch.groups, version=rollouts.version, max_staleness=cfg.max_staleness
                )
                scored = score_groups(fresh, batch.tasks, cfg)
                stats, lr = await asyncio.to_thread(run.trainers.update, scored.sequences)
                t2 = time.monotonic()
                stepped = stats.skipped is None
                version = rollouts.version + stepped
                sync_s = await sync_weights(run, rollouts, version) if stepped else 0.0
                seconds = (batch.rollout_s, t2 - t1, sync_s)
                row = step_row(
                    step, version, batch.groups, scored, stats, seconds=seconds, stale_dropped=stale
                )
                finish_step(run, step, {**row, "optim/lr": lr}, batch=batch, successes=scored.successes)
                if not overlap and step < cfg.steps:
                    cursor = cursor_for(run, batch.state)
                    pending = asyncio.ensure_future(collect(rollouts, tasks, cursor, cfg, step + 1))
        finally:
            await rollouts.close()


async def sync_weights(run: RayRun, rollouts: RolloutGroup, version: int) -> float:
    """Every rollout worker takes the trainer's new weights as `version`; the seconds it took. Through the object
    store, or (`[ray] weight_push`) over the GPU to each worker linked to the trainer, after which a worker that
    is new or restarted gets the weights once through the object store and is linked for the next push."""
    if run.cfg.ray.weight_push == "object_store":
        return await rollouts.push(run.trainers.sampler_weights(), version)
    start = time.monotonic()
    linked = sorted(set(range(len(rollouts.workers))) - rollouts.unlinked - rollouts.stale)
    lost = await asyncio.to_thread(run.trainers.send, linked, version)
    rollouts.stale.update(lost)
    rollouts.unlinked.update(lost)
    if rollouts.unlinked:
        await rollouts.push(run.trainers.sampler_weights(), version, ranks=sorted(rollouts.unlinked))
        await link_workers(run, rollouts)
    rollouts.advanced(version)
    return time.monotonic() - start


async def link_workers(run: RayRun, rollouts: RolloutGroup) -> None:
    """Trainer rank 0 opens a GPU weight link to every live rollout worker that has none."""
    ready = {r: rollouts.workers[r] for r in sorted(rollouts.unlinked - rollouts.stale)}
    if ready:
        await asyncio.to_thread(run.trainers.link, ready, run.cfg.ray.weight_push)
        rollouts.unlinked -= set(ready)


def finish_step(
    run: RayRun, step: int, row: dict[str, float], *, batch: Collected, successes: Sequence[bool]
) -> None:
    """training.run.finish_step for the Ray loop: the trainer workers stepped their scheduler already, and
    rank 0 writes the checkpoint."""
    cfg = run.cfg
    episodes = [e for g in batch.groups for e in g]
    version = int(row["policy_version"])
    run.state = record_step(
        cfg, run.state, step, row, state=batch.state, episodes=episodes, successes=successes,
        items=len(batch.tasks[0].items), version=version, log=run.log, on_step=run.on_step,
    )  # fmt: skip
    if step % cfg.save_every == 0 or step == cfg.steps:
        run.trainers.save(step, run.state, config_json(cfg), cfg.keep_last)


def train_ray(
    cfg: TrainConfig,
    *,
    resume: Path | None = None,
    force: bool = False,
    on_step: StepHook | None = None,
    overlap: bool = False,
) -> Path:
    """Train (or resume the run in `resume`) on the Ray cluster at `cfg.ray.address` (a local one by
    default); returns the run directory. `overlap`: step s+1's rollouts run while step s trains (`--async`)."""
    with cluster(cfg.ray):
        run = start_ray_run(cfg, resume=resume, force=force, on_step=on_step)
        try:
            asyncio.run(train_loop(run, overlap=overlap))
        finally:
            run.log.close()
            run.trainers.shutdown()
    return run.cfg.run_dir
