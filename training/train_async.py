"""train.py with step s+1's rollouts running while step s trains (`conductor train --async ...`).

The same steps as train.py, from the same functions; what differs, and only this:

- A producer task collects each step's groups with the sampler's current weights and hands them to the trainer
  through an `asyncio.Queue(maxsize=1)`. It may start step s+1 once step s-1 has finished, so it runs at most one
  step ahead: the batch of step s+1 is sampled by the weights of step s-1 while step s trains.
- The trainer drops groups sampled by weights more than `max_staleness` versions older than the trained ones
  (`episodes/stale_dropped`); the loss's importance ratio (sampler log-probs vs the trained policy's) corrects
  the one-step lag of the rest.
- Branch credit's continuations are sampled by the producer right after its groups, with the same weights.
- `update` runs in a worker thread (`asyncio.to_thread`), so the event loop keeps serving rollouts meanwhile. The
  sampler owns a separate copy of the weights, so the two threads share no tensors.
- The producer holds an `asyncio.Condition` while it collects; the trainer syncs weights and finishes the step
  under it, so weights never change under a running episode (every turn of an episode has one version).

Limit: a resumed async run is not bit-identical to an uninterrupted one (which batch overlapped which update
depends on timing); train.py is the exactly reproducible loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from main_agent.types import Episode
from tool_server.client import ToolClient
from training.advantages import BranchValues
from training.branching import BranchStats
from training.checkpoint import TrainState
from training.config import TrainConfig
from training.run import Run, StepHook, collect, finish_step, next_tasks, seed_step, steps_left, tool_session
from training.sampler import sync_weights
from training.tasks import Task
from training.train import branch, drive, score_groups, step_row, update


@dataclass(frozen=True)
class Batch:
    """One step's rollouts as the producer hands them over."""

    step: int
    tasks: list[Task]
    state: TrainState  # the data cursor after these tasks
    groups: list[list[Episode]]
    rollout_s: float
    branches: (
        list[list[list[BranchValues]]] | None
    )  # branch credit's continuation values, sampled with the groups
    branching: BranchStats | None


async def produce(
    run: Run, tools: ToolClient, tasks: Sequence[Task], queue: asyncio.Queue[Batch], synced: asyncio.Condition
) -> None:
    """Collect steps state.step+1 .. steps, each once the trainer has finished the step two before it."""
    cfg, state = run.cfg, run.state
    for step in range(run.state.step + 1, cfg.steps + 1):
        async with synced:
            await synced.wait_for(finished(run, step - 2))
            if run.state.items != state.items:  # the curriculum raised the horizon: its tasks from the start
                state = dataclasses.replace(state, items=run.state.items, recent=(), epoch=0, position=0)
            batch_tasks, state = next_tasks(tasks, state, cfg)
            seed_step(cfg, step)
            t0 = time.monotonic()
            groups = await collect(run, tools, batch_tasks)
            branches, branching = await branch(run, tools, batch_tasks, groups, step)
        rollout_s = time.monotonic() - t0
        await queue.put(Batch(step, batch_tasks, state, groups, rollout_s, branches, branching))


def finished(run: Run, step: int) -> Callable[[], bool]:
    """A predicate: has the trainer finished `step`?"""
    return lambda: run.state.step >= step


def drop_stale(
    groups: Sequence[list[Episode]], *, version: int, max_staleness: int
) -> tuple[list[list[Episode]], int]:
    """Groups whose every episode was sampled by version >= `version - max_staleness`, and how many episodes the
    dropped groups held. (A group is collected under one version, so this drops exactly the stale episodes.)"""
    fresh = [g for g in groups if all(e.policy_version >= version - max_staleness for e in g)]
    return fresh, sum(map(len, groups)) - sum(map(len, fresh))


def fresh_branches(batch: Batch, fresh: Sequence[list[Episode]]) -> list[list[list[BranchValues]]] | None:
    """The branch values of the groups `drop_stale` kept, in their order."""
    if batch.branches is None:
        return None
    kept = {id(g) for g in fresh}
    return [b for g, b in zip(batch.groups, batch.branches, strict=True) if id(g) in kept]


async def next_batch(queue: asyncio.Queue[Batch], producer: asyncio.Task[None]) -> Batch:
    """The producer's next batch, or the producer's exception if it failed instead of delivering."""
    get = asyncio.ensure_future(queue.get())
    await asyncio.wait({get, producer}, return_when=asyncio.FIRST_COMPLETED)
    if get.done():
        return get.result()
    get.cancel()
    producer.result()  # raises what the producer raised
    raise RuntimeError("the rollout producer stopped before the last step")


async def train_loop(run: Run, *, transport: httpx.AsyncBaseTransport | None = None) -> None:
    """Steps state.step+1 .. steps; the producer collects the next step's groups while this one trains."""
    cfg = run.cfg
    async with tool_session(run, transport=transport) as (tools, tasks):
        queue: asyncio.Queue[Batch] = asyncio.Queue(maxsize=1)
        synced = asyncio.Condition()
        producer = asyncio.create_task(produce(run, tools, tasks, queue, synced), name="rollout-producer")
        try:
            for step in steps_left(run):
                batch = await next_batch(queue, producer)
                assert batch.step == step, f"producer delivered step {batch.step}, trainer is at step {step}"
                t1 = time.monotonic()
                fresh, stale = drop_stale(
                    batch.groups, version=run.policy.version, max_staleness=cfg.max_staleness
                )
                scored = score_groups(fresh, batch.tasks, cfg, fresh_branches(batch, fresh))
                stats = await asyncio.to_thread(
                    update, run.model, run.optimizer, scored.sequences, cfg, ref_model=run.ref_model
                )
                train_s = time.monotonic() - t1
                async with synced:  # waits for the running collection: weights never change mid-episode
                    sync_s = await sync_weights(run.model, run.policy, cfg) if stats.skipped is None else 0.0
                    seconds = (batch.rollout_s, train_s, sync_s)
                    row = step_row(
                        step,
                        run.policy.version,
                        batch.groups,
                        scored,
                        stats,
                        seconds=seconds,
                        stale_dropped=stale,
                        branching=batch.branching,
                    )
                    episodes = [e for g in batch.groups for e in g]
                    finish_step(
                        run, step, row, state=batch.state, episodes=episodes, stepped=stats.skipped is None,
                        successes=scored.successes, items=len(batch.tasks[0].items),
                    )  # fmt: skip
                    synced.notify_all()
        finally:
            producer.cancel()
            await asyncio.gather(producer, return_exceptions=True)


def train_async(
    cfg: TrainConfig,
    *,
    resume: Path | None = None,
    force: bool = False,
    on_step: StepHook | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> Path:
    """Like `train.train`, with rollouts overlapping updates; returns the run directory."""
    run = drive(train_loop, cfg, resume=resume, force=force, on_step=on_step, transport=transport)
    return asyncio.run(run)
