"""The horizon curriculum: when N grows, which tasks are drawn, and what a resumed run keeps."""

from __future__ import annotations

import dataclasses

import pytest

from training.checkpoint import TrainState
from training.config import TrainConfig
from training.curriculum import Horizon, HorizonConfig, advance, horizons
from training.data_order import next_horizon, next_tasks
from training.tasks import Task

CFG = HorizonConfig(items=2, max_items=8, raise_at=0.5, window=4, factor=2)


def test_horizons_double_up_to_the_ceiling() -> None:
    """items, x factor, ..., capped at max_items; no curriculum is the start alone."""
    assert horizons(CFG) == [2, 4, 8]
    assert horizons(HorizonConfig(items=3, max_items=10)) == [3, 6, 10]
    assert horizons(HorizonConfig(items=4)) == [4]


def test_the_horizon_rises_only_on_a_full_window_at_the_threshold() -> None:
    """Three of three successes are not a full window of four; four at 3/4 >= 0.5 raise N to 4 and empty the
    window; a rate under the threshold keeps N and slides the window."""
    assert advance(Horizon(2), [True] * 3, CFG) == Horizon(2, (True,) * 3)
    assert advance(Horizon(2, (True,) * 3), [False], CFG) == Horizon(4)
    low = advance(Horizon(4), [False, False, True, False, False], CFG)
    assert low == Horizon(4, (False, True, False, False))


def test_the_horizon_stops_at_its_ceiling() -> None:
    """At max_items every success keeps N where it is."""
    assert advance(Horizon(8), [True] * 8, CFG).items == 8
    assert advance(Horizon(4), [True] * 4, HorizonConfig(items=4)).items == 4


def test_bad_horizon_settings_are_refused() -> None:
    """A factor under 2 would never grow N; a threshold outside (0, 1] could never or always be met."""
    for bad in ({"factor": 1}, {"raise_at": 0.0}, {"items": 0}, {"window": 0}):
        with pytest.raises(ValueError, match="horizon"):
            HorizonConfig(**bad)  # type: ignore[arg-type]


def item_task(task_id: str, n: int) -> Task:
    items = tuple(Task(f"{task_id}-{i}", "plate_reading", "q", ("image_ops",), "AB12") for i in range(n))
    return Task(task_id, "plate_audit", "q", ("image_ops",), "\n".join(["AB12"] * n), items=items)


def test_tasks_are_drawn_from_the_current_horizon_and_a_raise_restarts_the_cursor() -> None:
    """With tasks of N = 2 and 4 prepared together, a step draws only the current N's; a raise moves to N = 4
    with the cursor at its start and an empty window; a step played at an older N moves nothing."""
    tasks = [item_task(f"a{i}", 2) for i in range(3)] + [item_task(f"b{i}", 4) for i in range(3)]
    cfg = TrainConfig(task="plate_audit", batch_tasks=2, horizon=CFG)
    state = TrainState(items=2, recent=(True, True, True))
    batch, after = next_tasks(tasks, state, cfg)
    assert all(len(t.items) == 2 for t in batch) and after.position == 2
    raised = next_horizon(state, after, [True, False], cfg)
    assert (raised.items, raised.recent, raised.epoch, raised.position) == (4, (), 0, 0)
    batch, _ = next_tasks(tasks, raised, cfg)
    assert all(len(t.items) == 4 for t in batch)
    stale = next_horizon(raised, dataclasses.replace(raised, position=2), [], cfg)
    assert (stale.items, stale.recent, stale.position) == (4, (), 2)
