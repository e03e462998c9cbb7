"""A training run's start and bookkeeping, whoever collects and learns.

    async with open_run(cfg, resume=None, force=False, start_learner=...) as (run, learner, tools):
        ...                                                   # a collector and a learner on top (the sessions)
    record_step(run, row, batch=collected, successes=...)     # state moved, row logged, rollouts saved

`open_run` is the one start of a run: the checkpoint to resume from (`resume_point`), the learner built on it,
the tasks, the state of a new run (`first_state`), the log and the tools. training/loop.py runs the steps;
training/local_session.py and training/ray_session.py add a collector and a learner. The order of the data is
training/data_order.py's, the trained policy training/learner.py's.

Run directory: `metrics.jsonl`, `rollouts/step_N.jsonl`, `step_N/` checkpoints (training/checkpoint.py),
`pages/` (multihop pages served over loopback), `videos/` (subtitled GRID clips), `sampler/` (the weights a vLLM
sampler loads) and, on Ray, `tool_cache/` (the tool replicas' shared result cache).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import httpx

from tool_server.client import ToolClient
from training import checkpoint as ckpt
from training.checkpoint import CheckpointError, TrainState
from training.config import RESUME_KEYS, TrainConfig, config_to_dict
from training.data_order import load_tasks, next_horizon
from training.metrics import MetricsLog, save_rollouts, trim_metrics
from training.play import tool_session
from training.step import Collected, check_evidence
from training.tasks import Task

logger = logging.getLogger(__name__)

L = TypeVar("L")

StepHook = Callable[[Mapping[str, float]], None]

LearnerStart = Callable[
    [TrainConfig, Path | None], AbstractAsyncContextManager[tuple[L, TrainConfig, TrainState | None]]
]
"""Builds a run's learner from its settings and the checkpoint to resume (None for a new run): the learner, the
settings as it resolved them for its hardware (precision), and the checkpoint's state (None for a new run)."""


@dataclass
class Run:
    """A run's data and bookkeeping, whoever collects and learns (training/loop.py). Mutable: `state` advances
    every step."""

    cfg: TrainConfig
    tasks: list[Task]
    """The tasks, prepared to play (pages and clips under run_dir)."""
    state: TrainState
    log: MetricsLog
    on_step: StepHook | None = None
    """Called with every finished step's metrics row (the CLI prints it and moves its progress bar)."""


@contextlib.asynccontextmanager
async def open_run(
    cfg: TrainConfig,
    *,
    resume: Path | None,
    force: bool,
    start_learner: LearnerStart[L],
    on_step: StepHook | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
    on_ray: bool = False,
) -> AsyncIterator[tuple[Run, L, ToolClient]]:
    """Open a run, new or resumed (`resume_point`): its learner (`start_learner`), its tasks, its state (the
    checkpoint's, or `first_state`), its log and a client of its tools (`training.play.tool_session`: `[tools]`,
    else a server in this process, `transport` in tests, or on Ray Serve when `on_ray`). All of it is released
    whatever happens."""
    cfg, latest = resume_point(cfg, resume=resume, force=force)
    async with start_learner(cfg, latest) as (learner, cfg, state):
        tasks = load_tasks(cfg)
        check_evidence(tasks, cfg.evidence_weight)  # a setting that cannot apply fails before any rollout
        state = state if state is not None else first_state(cfg, tasks)
        with open_log(cfg, state) as log:
            session = tool_session(
                tasks, work_dir=cfg.run_dir, access=cfg.tools, data_dir=cfg.run.data_dir, transport=transport,
                replicas=cfg.ray if on_ray else None,
            )  # fmt: skip
            async with session as (tools, ready):
                yield Run(cfg, ready, state, log, on_step), learner, tools


def resume_point(cfg: TrainConfig, *, resume: Path | None, force: bool) -> tuple[TrainConfig, Path | None]:
    """The run's settings (its directory is `resume` when resuming) and the checkpoint to resume from: None for
    a new run, whose directory must hold none. CheckpointError when there is nothing to resume or the saved
    run's data order and batch shape differ (`RESUME_KEYS`) and not `force`."""
    if resume is not None:
        cfg = dataclasses.replace(cfg, run_dir=resume)
    latest = ckpt.find_latest(cfg.run_dir)
    if resume is None and latest is not None:
        raise CheckpointError(f"{cfg.run_dir} already holds checkpoints: resume it or choose another run_dir")
    if resume is not None and latest is None:
        raise CheckpointError(f"no checkpoint to resume in {resume}")
    if latest is not None:
        saved = ckpt.saved_config(latest)
        ckpt.check_resume_compatible(saved, config_to_dict(cfg), force=force, keys=RESUME_KEYS)
    return cfg, latest


def first_state(cfg: TrainConfig, tasks: Sequence[Task]) -> TrainState:
    """A new run's state: step 0, the data cursor at the start, item tasks at the configured horizon."""
    return TrainState(seed=cfg.run.seed, items=cfg.horizon.items if tasks[0].items else 0)


def open_log(cfg: TrainConfig, state: TrainState) -> MetricsLog:
    """The run's metrics.jsonl, rows past `state.step` dropped (steps redone after a kill)."""
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    trim_metrics(cfg.run_dir / "metrics.jsonl", after_step=state.step)
    return MetricsLog(cfg.run_dir / "metrics.jsonl")


def record_step(run: Run, row: Mapping[str, float], *, batch: Collected, successes: Sequence[bool]) -> None:
    """Move `run.state` past the step `batch` collected; the row logged, the rollouts saved, the row reported.

    `batch.state` carries the data cursor after this step's tasks; `successes` of the step's episodes, played at
    the horizon of `batch.tasks`, move the curriculum when that is still the current one (an overlapped batch
    may predate a raise); `row["policy_version"]` is the sampler's policy version after the step.
    """
    cfg, now, step = run.cfg, run.state, batch.step
    episodes = [e for g in batch.groups for e in g]
    row = {**row, "horizon/items": now.items}
    # Only the cursor comes from `batch.state`: a collection that ran ahead (overlap) copied the counters before
    # the steps in between added to them.
    cursor = dataclasses.replace(now, epoch=batch.state.epoch, position=batch.state.position)
    after = next_horizon(now, cursor, successes if len(batch.tasks[0].items) == now.items else (), cfg)
    run.state = dataclasses.replace(
        after,
        step=step,
        policy_version=int(row["policy_version"]),
        episodes=after.episodes + len(episodes),
        invalid_episodes=after.invalid_episodes + sum(e.stop_reason == "infra_failed" for e in episodes),
        elapsed_s=after.elapsed_s + row["time/rollout"] + row["time/train"] + row["time/weight_sync"],
    )
    save_rollouts(cfg.run_dir / "rollouts" / f"step_{step}.jsonl", episodes)
    run.log.write(row)
    logger.info("step %d done: reward %.3f", step, row.get("reward/final", float("nan")))
    if run.on_step is not None:
        run.on_step(row)


def steps_left(run: Run) -> range:
    """The steps still to run (a resumed run starts after its checkpoint's)."""
    return range(run.state.step + 1, run.cfg.steps + 1)
