"""The one RL loop of the main policy, top to bottom (`conductor train CONFIG [--async] [--ray [ADDRESS]]`).

Per step s = 1 .. steps:
    1. collect: the next B tasks of a seeded shuffle (the cursor is part of the checkpoint), G episodes of each,
       all concurrent, seeded from (seed, s) (branch credit then continues exact replays of chosen turns' states;
       under `[near_miss]` the policy continues near misses' truncated prefixes: training/near_miss.py; under
       `[expert_mix]` the scripted expert then plays each task once: training/expert_mix.py)
    2. drop stale: groups sampled by weights more than `max_staleness` versions older than the trained ones
    3. score: filter groups with infrastructure failures, final and turn rewards (with `turn_rewards.info_gain`,
       each turn's information gain under the trained model: training/info_gain.py), advantages onto the tokens
       (training/step.py)
    4. update: one optimizer step of the clipped token-level loss over micro-batches (training/update.py)
    5. sync weights: the trained weights to the sampler, its policy version one up
    6. record: a metrics row and a printed line, the rollouts, the curriculum; a checkpoint every `save_every`
       steps and at the end

Who collects and who learns is the variation, not the loop: in this process (training/local_session.py) or on
a Ray cluster's rollout and trainer workers (`on_ray`, training/ray_session.py).

Overlap (`overlap`, `--async`) is the one other setting: step s+1's collection starts before step s trains, so
it samples with the weights of step s-1; the weight push waits for it to finish, so every turn of an episode
has one version, and the loss's importance ratio corrects the one-step lag (groups older than `max_staleness`
versions are dropped). Without overlap the next collection starts after the step is recorded.

Exactness: torch is reseeded from (seed, step) before each collection, and the cursor, the weights, the
optimizer and the schedule are checkpointed, so without overlap a resumed run samples and learns exactly what an
uninterrupted one would have. With overlap it does not: the first collection after a resume samples with the
checkpoint's weights, where the uninterrupted run's was one version behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import httpx

from main_agent.tokens import TrainSequence
from main_agent.types import Episode
from training.advantages import BranchValues
from training.branching import BranchStats
from training.checkpoint import TrainState
from training.config import TrainConfig
from training.data_order import cursor_for, next_tasks
from training.expert_mix import ExpertMix
from training.near_miss import NearMiss
from training.run import Run, StepHook, record_step, steps_left
from training.step import Collected, branches_of, drop_stale, score_groups, step_row
from training.tasks import Task
from training.update import UpdateStats


class Collector(Protocol):
    """Plays a step's tasks with the sampler's current weights (LocalCollector, RayCollector)."""

    @property
    def version(self) -> int: ...

    async def collect(
        self, tasks: Sequence[Task], step: int
    ) -> tuple[list[list[Episode]], list[list[list[BranchValues]]] | None, BranchStats | None]: ...

    async def demonstrate(self, tasks: Sequence[Task], step: int) -> ExpertMix: ...

    async def resample(
        self, tasks: Sequence[Task], groups: Sequence[list[Episode]], step: int
    ) -> NearMiss: ...


class Learner(Protocol):
    """Steps the trained policy, pushes its weights to the collector, checkpoints (LocalLearner, RayLearner)."""

    async def update(self, sequences: Sequence[TrainSequence]) -> tuple[UpdateStats, float]: ...

    async def info_gains(
        self, groups: Sequence[list[Episode]], tasks: Sequence[Task]
    ) -> list[list[list[float]]]: ...

    async def sync(self) -> float: ...

    def save(self, step: int, run: Run) -> None: ...


async def train_loop(run: Run, collector: Collector, learner: Learner, *, overlap: bool = False) -> None:
    """Steps state.step+1 .. steps: collect, drop stale, score, update, sync weights, record."""
    cfg = run.cfg
    if run.state.step >= cfg.steps:
        return
    pending = start_collection(run, collector, run.state, run.state.step + 1)
    try:
        for step in steps_left(run):
            batch = await pending
            if overlap and step < cfg.steps:  # step s+1 samples (weights of s-1) while step s trains
                pending = start_collection(run, collector, batch.state, step + 1)
            t1 = time.monotonic()
            fresh, stale = drop_stale(
                batch.groups, version=collector.version, max_staleness=cfg.max_staleness
            )
            # the turns' information gains, by the trained model before it steps (training/info_gain.py)
            gains = await learner.info_gains(fresh, batch.tasks) if cfg.turn_rewards.info_gain else None
            branches = branches_of(batch.groups, batch.branches, fresh)
            scored = score_groups(
                fresh, batch.tasks, cfg, branches, gains, experts=batch.experts, near_miss=batch.near_miss
            )
            stats, lr = await learner.update(scored.sequences)
            train_s = time.monotonic() - t1
            await asyncio.wait({pending})  # weights never change under a running episode
            sync_s = await learner.sync() if stats.skipped is None else 0.0
            row = step_row(
                collector.version, batch, scored, stats, seconds=(train_s, sync_s), stale_dropped=stale
            )
            record_step(run, {**row, "optim/lr": lr}, batch=batch, successes=scored.successes)
            if step % cfg.save_every == 0 or step == cfg.steps:
                learner.save(step, run)
            if not overlap and step < cfg.steps:
                pending = start_collection(run, collector, batch.state, step + 1)
    finally:
        pending.cancel()
        await asyncio.gather(pending, return_exceptions=True)


def start_collection(
    run: Run, collector: Collector, previous: TrainState, step: int
) -> asyncio.Task[Collected]:
    """Step `step`'s tasks from where `previous` left the cursor (a raised horizon starts its own tasks), played
    by `collector` in a task of its own."""
    tasks, state = next_tasks(run.tasks, cursor_for(run.state, previous), run.cfg)
    mix = run.cfg.expert_mix.per_group > 0
    near = run.cfg.near_miss.per_group > 0
    return asyncio.ensure_future(collect(collector, step, tasks, state, experts=mix, near_miss=near))


async def collect(
    collector: Collector,
    step: int,
    tasks: list[Task],
    state: TrainState,
    *,
    experts: bool = False,
    near_miss: bool = False,
) -> Collected:
    """`tasks` played by `collector` as step `step`; then, with `near_miss`, continuations of the groups' near-miss
    prefixes; then, with `experts`, the scripted expert (after the policy, so it changes nothing the policy
    samples); timed together; `state` is the cursor after them."""
    start = time.monotonic()
    groups, branches, branching = await collector.collect(tasks, step)
    resampled = await collector.resample(tasks, groups, step) if near_miss else None
    mix = await collector.demonstrate(tasks, step) if experts else None
    return Collected(
        step, tasks, state, groups, time.monotonic() - start, branches, branching, experts=mix,
        near_miss=resampled,
    )  # fmt: skip


def train(
    cfg: TrainConfig,
    *,
    overlap: bool = False,
    on_ray: bool = False,
    resume: Path | None = None,
    force: bool = False,
    on_step: StepHook | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> Path:
    """Train (or resume the run in `resume`) up to `cfg.steps`; returns the run directory. `overlap`: step s+1's
    rollouts run while step s trains; `on_ray`: on the Ray cluster at `cfg.ray.address` (a local one by
    default). `on_step` gets every step's metrics row; `transport` replaces the tool server (tests pass an
    `httpx.MockTransport`; in this process only)."""
    if not on_ray:
        from training.local_session import local_session

        session = local_session(cfg, resume=resume, force=force, on_step=on_step, transport=transport)
        return asyncio.run(drive(session, overlap=overlap))
    from conductor.cluster import cluster
    from training.ray_session import ray_session

    assert transport is None, "rollout workers reach the tools over the network: no transport on Ray"
    with cluster(cfg.ray):
        return asyncio.run(
            drive(ray_session(cfg, resume=resume, force=force, on_step=on_step), overlap=overlap)
        )


async def drive(session: contextlib.AbstractAsyncContextManager, *, overlap: bool) -> Path:
    """Run the loop over a started session (released whatever happens); the run directory."""
    async with session as (run, collector, learner):
        await train_loop(run, collector, learner, overlap=overlap)
    return run.cfg.run_dir
