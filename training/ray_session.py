"""The run on a Ray cluster (`conductor train CONFIG --ray [ADDRESS]`, settings in `[ray]`): what differs from the
run in this process is who collects and who learns, not the loop (training/loop.py).

    with cluster(cfg.ray):
        async with ray_session(cfg, resume=None, force=False) as (run, collector, learner): ...

The run opens as in this process (training.run.open_run); what this module adds is the learner (trainer workers,
`trainer_workers`), the collector (rollout workers holding the trainer's weights) and where the tools run.

- collect: the step's groups are played by rollout workers (training/ray_rollout.py), actors that each hold a
  sampler and a tool client; a group stays on one worker. Worker r seeds from (seed, step, r), so one worker
  samples exactly what the run in this process samples.
- update: data-parallel trainer workers (training/ray_trainer.py) split the step's micro-batches and all-reduce
  the gradients once (gloo on CPU, NCCL on GPUs); rank 0 writes the checkpoints, which resume on any number of
  workers.
- sync: rank 0's weights go through Ray's object store to every rollout worker, or, with `[ray] weight_push`
  "nccl" or "ipc", stream over the GPU into the workers' vLLM engines (training/weight_sync.py; linked at the
  start; a worker restarted by Ray gets the weights through the object store once, then is linked again). A
  worker takes new weights only between collections, so no episode changes version.
- tools: unless `[tools] url` names a running server, the tool server is deployed on Ray Serve
  (tool_server/ray_serve.py) with `[ray] tool_replicas` replicas, prepared for the tasks exactly like the
  in-process one (training.play.tool_session); its replicas share the result cache through `run_dir/tool_cache/`.

Not on Ray yet: branch credit (its continuations replay episodes on the driver's sampler); `[expert_mix]` (the
scripted expert plays on the collector of the run in this process); `[near_miss]` (its continuations replay
near misses on the collector of the run in this process); `sampling.backend = "server"` (every rollout
worker is its own sampler). All are refused with a ConfigError (`check_supported`, the one place Ray's refusals
are made: `conductor train --ray` asks it before starting a cluster).

Exactness: with 1 rollout worker and 1 trainer worker the run equals the run in this process for the same seed
(tests/test_ray_train.py: losses, sampled tasks). More rollout workers draw other (seeded) samples; more trainer
workers sum gradients in another order (allclose, not equal).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from conductor.settings import ConfigError
from main_agent.backends import chosen_backend
from main_agent.tokens import TrainSequence
from main_agent.types import Episode
from training import play
from training.checkpoint import TrainState
from training.config import TrainConfig, config_json
from training.expert_mix import ExpertMix
from training.near_miss import NearMiss
from training.ray_rollout import RolloutGroup
from training.ray_trainer import TrainerGroup
from training.run import Run, StepHook, open_run
from training.tasks import Task
from training.update import UpdateStats

logger = logging.getLogger(__name__)


def check_supported(cfg: TrainConfig) -> None:
    """ConfigError for what the Ray run does not do (module docstring)."""
    if cfg.credit.mode == "branch":
        raise ConfigError("credit.mode = 'branch' does not run on Ray yet: train it without --ray")
    if cfg.expert_mix.per_group > 0:
        raise ConfigError(
            "[expert_mix] per_group > 0 does not run on Ray yet (the expert plays on the collector of the run in "
            "this process): train it without --ray"
        )
    if cfg.near_miss.per_group > 0:
        raise ConfigError(
            "[near_miss] per_group > 0 does not run on Ray yet (its continuations replay near misses on the "
            "collector of the run in this process): train it without --ray"
        )
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


@dataclass
class RayCollector:
    """Plays a step's groups on the rollout workers."""

    rollouts: RolloutGroup

    @property
    def version(self) -> int:
        """The policy version the rollout workers hold."""
        return self.rollouts.version

    async def collect(self, tasks: Sequence[Task], step: int) -> tuple[list[list[Episode]], None, None]:
        """The step's groups, one per task in order (no branch credit on Ray)."""
        return await self.rollouts.collect(tasks, step), None, None

    async def demonstrate(self, tasks: Sequence[Task], step: int) -> ExpertMix:
        """Never called: `check_supported` refuses `[expert_mix]` on Ray."""
        raise ConfigError("[expert_mix] does not run on Ray yet")

    async def resample(self, tasks: Sequence[Task], groups: Sequence[list[Episode]], step: int) -> NearMiss:
        """Never called: `check_supported` refuses `[near_miss]` on Ray."""
        raise ConfigError("[near_miss] does not run on Ray yet")


@dataclass
class RayLearner:
    """Steps the trainer workers and pushes rank 0's weights to the rollout workers."""

    cfg: TrainConfig
    trainers: TrainerGroup
    rollouts: RolloutGroup

    async def update(self, sequences: Sequence[TrainSequence]) -> tuple[UpdateStats, float]:
        """One optimizer step on every trainer worker (they move their schedules); the stats and the learning
        rate the step used."""
        return await asyncio.to_thread(self.trainers.update, sequences)

    async def info_gains(
        self, groups: Sequence[list[Episode]], tasks: Sequence[Task]
    ) -> list[list[list[float]]]:
        """Each turn's information gain under the trained model, scored by trainer rank 0."""
        return await asyncio.to_thread(self.trainers.info_gains, groups, tasks)

    async def sync(self) -> float:
        """Every rollout worker takes the trainer's new weights, one version up; the seconds it took. Through the
        object store, or (`[ray] weight_push`) over the GPU to each worker linked to the trainer, after which a
        worker that is new or restarted gets the weights once through the object store and is linked for the
        next push."""
        rollouts, version = self.rollouts, self.rollouts.version + 1
        if self.cfg.ray.weight_push == "object_store":
            return await rollouts.push(self.trainers.sampler_weights(), version)
        start = time.monotonic()
        linked = sorted(set(range(len(rollouts.workers))) - rollouts.unlinked - rollouts.stale)
        lost = await asyncio.to_thread(self.trainers.send, linked, version)
        rollouts.stale.update(lost)
        rollouts.unlinked.update(lost)
        if rollouts.unlinked:
            await rollouts.push(self.trainers.sampler_weights(), version, ranks=sorted(rollouts.unlinked))
            await self.link_workers()
        rollouts.advanced(version)
        return time.monotonic() - start

    async def link_workers(self) -> None:
        """Trainer rank 0 opens a GPU weight link to every live rollout worker that has none."""
        rollouts = self.rollouts
        ready = {r: rollouts.workers[r] for r in sorted(rollouts.unlinked - rollouts.stale)}
        if ready:
            await asyncio.to_thread(self.trainers.link, ready, self.cfg.ray.weight_push)
            rollouts.unlinked -= set(ready)

    def save(self, step: int, run: Run) -> None:
        """Rank 0 writes checkpoint `step_N` (the replicas are identical)."""
        self.trainers.save(step, run.state, config_json(self.cfg), self.cfg.keep_last)


@contextlib.asynccontextmanager
async def ray_session(
    cfg: TrainConfig, *, resume: Path | None, force: bool, on_step: StepHook | None = None
) -> AsyncIterator[tuple[Run, RayCollector, RayLearner]]:
    """The run opened (training.run.open_run: the trainer workers, `trainer_workers`; the tools on Ray Serve
    unless `[tools] url` names a server) and the rollout workers holding the trainer's weights, on the cluster
    `cluster(cfg.ray)` joined; all of them shut down whatever happens."""
    check_supported(cfg)
    opened = open_run(
        cfg, resume=resume, force=force, start_learner=trainer_workers, on_step=on_step, on_ray=True
    )
    async with opened as (run, trainers, tools):
        weights = trainers.sampler_weights()
        rollouts = await RolloutGroup.start(
            run.cfg, tools_url=tools.url, weights=weights, version=run.state.policy_version
        )
        try:
            learner = RayLearner(run.cfg, trainers, rollouts)
            if run.cfg.ray.weight_push != "object_store":
                await learner.link_workers()
            yield run, RayCollector(rollouts), learner
        finally:
            await rollouts.close()


@contextlib.asynccontextmanager
async def trainer_workers(
    cfg: TrainConfig, checkpoint: Path | None
) -> AsyncIterator[tuple[TrainerGroup, TrainConfig, TrainState | None]]:
    """The trainer workers, loading `checkpoint` when resuming; the settings as they resolved them for their
    hardware (precision), and the checkpoint's state. Shut down on exit."""
    trainers, state = TrainerGroup.start(cfg, cfg.ray, checkpoint=checkpoint)
    try:
        if state is not None:
            logger.info(
                "resuming %s at step %d on %d trainer workers",
                checkpoint,
                state.step,
                cfg.ray.trainer_workers,
            )
        yield trainers, trainers.cfg, state
    finally:
        trainers.shutdown()


@contextlib.asynccontextmanager
async def serve_tools(cfg: TrainConfig, tasks: Sequence[Task]) -> AsyncIterator[tuple[str, list[Task]]]:
    """The tool server's URL for rollout workers outside a run (benchmarks/perf/ray.py) and the tasks ready to
    play: `[tools] url`, or the tool server on Ray Serve (training.play.tool_session, as a run's)."""
    session = play.tool_session(
        tasks, work_dir=cfg.run_dir, access=cfg.tools, data_dir=cfg.run.data_dir, replicas=cfg.ray
    )
    async with session as (tools, ready):
        yield tools.url, ready
