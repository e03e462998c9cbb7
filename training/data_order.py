"""A run's data order: which tasks it has, which of them each step plays, and the seeds its draws come from.

    tasks = load_tasks(cfg)                                  # the split's tasks (item tasks at every horizon),
                                                             # or the `task_ids` of it
    batch, state = next_tasks(tasks, cursor_for(now, previous), cfg)   # seeded shuffle per epoch; cursor moved
    seed_step(cfg, step)                                     # before a step's collection: draws of (seed, step)
    state = next_horizon(now, state, successes, cfg)         # the curriculum moved by a step's successes

The cursor (epoch, position) and the curriculum's place are part of TrainState, so a resumed run draws the tasks
an uninterrupted one would have (training/checkpoint.py).
"""

from __future__ import annotations

import dataclasses
import functools
import random
from collections.abc import Sequence

import torch

from training import tasks as task_data
from training.checkpoint import TrainState
from training.config import TrainConfig
from training.curriculum import Horizon, advance, horizons
from training.tasks import Task


def load_tasks(cfg: TrainConfig) -> list[Task]:
    """The split's tasks; for an item family, its tasks at every horizon the curriculum can reach (prepared
    together, drawn by the current one)."""
    if not task_data.family_named(cfg.task).has_items:
        tasks = task_data.load_family(cfg.task, cfg.run.split, data_dir=cfg.run.data_dir, limit=cfg.run.limit)
    else:
        load = functools.partial(
            task_data.load_family, cfg.task, cfg.run.split, data_dir=cfg.run.data_dir, limit=cfg.run.limit
        )
        tasks = [t for n in horizons(cfg.horizon) for t in load(items=n)]
    if cfg.task_ids:
        tasks = only(tasks, cfg.task_ids, f"{cfg.task}/{cfg.run.split}")
    if not tasks:
        raise ValueError(f"no tasks in {cfg.task}/{cfg.run.split}")
    return tasks


def only(tasks: Sequence[Task], ids: Sequence[str], where: str) -> list[Task]:
    """The tasks of `ids`, in the loader's order; ValueError naming the ids `tasks` lacks."""
    if missing := set(ids) - {t.task_id for t in tasks}:
        shown = ", ".join(sorted(missing)[:5]) + (" ..." if len(missing) > 5 else "")
        raise ValueError(f"task_ids: {len(missing)} not in {where}: {shown}")
    return [t for t in tasks if t.task_id in set(ids)]


def next_tasks(tasks: Sequence[Task], state: TrainState, cfg: TrainConfig) -> tuple[list[Task], TrainState]:
    """The next `batch_tasks` tasks of a seeded per-epoch shuffle, and the state with the cursor moved past them.
    Item tasks are drawn from those of the current horizon (`state.items`) only."""
    if state.items:
        tasks = [t for t in tasks if len(t.items) == state.items]
    picked: list[Task] = []
    epoch, position = state.epoch, state.position
    while len(picked) < cfg.batch_tasks:
        order = list(range(len(tasks)))
        random.Random(cfg.run.seed * 1_000_003 + epoch).shuffle(order)
        take = order[position : position + cfg.batch_tasks - len(picked)]
        picked += [tasks[i] for i in take]
        position += len(take)
        if position == len(tasks):
            epoch, position = epoch + 1, 0
    return picked, dataclasses.replace(state, epoch=epoch, position=position)


def cursor_for(now: TrainState, previous: TrainState) -> TrainState:
    """The data cursor the next collection starts from: where `previous` left it, or the start of the new
    horizon's tasks when the curriculum raised it since (`now` is the run's state)."""
    if now.items != previous.items:
        return dataclasses.replace(previous, items=now.items, recent=(), epoch=0, position=0)
    return previous


def next_horizon(
    now: TrainState, after: TrainState, successes: Sequence[bool], cfg: TrainConfig
) -> TrainState:
    """`after` (the data cursor past this step) with the curriculum moved by `successes`; a raise restarts the
    cursor, now over the tasks of the new horizon."""
    if not now.items:
        return after
    horizon = advance(Horizon(now.items, now.recent), successes, cfg.horizon)
    if horizon.items != now.items:
        return dataclasses.replace(after, items=horizon.items, recent=(), epoch=0, position=0)
    return dataclasses.replace(after, items=now.items, recent=horizon.recent)


def seed_step(cfg: TrainConfig, step: int, *, rank: int = 0) -> None:
    """Sampling draws from torch's global RNG; reseeding per step makes each step's draws a function of
    (seed, step) alone, so a resumed run repeats them without saving RNG state. Rollout worker `rank` of a run
    on Ray (training/ray_rollout.py) adds its rank, worker 0 drawing what this process would."""
    torch.manual_seed(cfg.run.seed * 1_000_003 + step + rank * 1_000_000_007)
