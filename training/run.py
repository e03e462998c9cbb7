"""A training run's plumbing, whoever collects and learns: start or resume, data order, bookkeeping.

    cfg, latest = resume_point(cfg, resume=None, force=False)  # the checkpoint to resume from, if any
    learner = load_learner(cfg)                               # the trained policy, optimizer, schedule
    state = resume_learner(learner, latest) if latest else first_state(cfg, tasks)
    run = Run(cfg, tasks, state, open_log(cfg, state))
    batch, state = next_tasks(tasks, cursor_for(run, previous), cfg)   # seeded shuffle per epoch; the cursor
    record_step(run, row, batch=collected, successes=...)     # state moved, row logged, rollouts saved

training/loop.py runs the steps; training/local_session.py and training/ray_session.py start a run with these.
Run directory: `metrics.jsonl`, `rollouts/step_N.jsonl`, `step_N/` checkpoints (training/checkpoint.py),
`pages/` (multihop pages served over loopback) and `videos/` (subtitled GRID clips).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import logging
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from conductor.models import native_bf16
from main_agent.backends import load_policy
from main_agent.policy import SamplingConfig
from main_agent.transformers_policy import TransformersPolicy
from training import checkpoint as ckpt
from training import tasks as task_data
from training.checkpoint import CheckpointError, TrainState
from training.config import RESUME_KEYS, TrainConfig, config_to_dict
from training.curriculum import Horizon, advance, horizons
from training.metrics import MetricsLog, save_rollouts, trim_metrics
from training.step import Collected
from training.tasks import Task

if TYPE_CHECKING:
    from training.checkpoint import Model

logger = logging.getLogger(__name__)


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


def seed_step(cfg: TrainConfig, step: int, *, rank: int = 0) -> None:
    """Sampling draws from torch's global RNG; reseeding per step makes each step's draws a function of
    (seed, step) alone, so a resumed run repeats them without saving RNG state. Rollout worker `rank` of a run
    on Ray (training/ray_rollout.py) adds its rank, worker 0 drawing what this process would."""
    torch.manual_seed(cfg.run.seed * 1_000_003 + step + rank * 1_000_000_007)


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


StepHook = Callable[[Mapping[str, float]], None]


def with_precision(cfg: TrainConfig, device: str) -> TrainConfig:
    """`cfg` with precision "auto" made concrete for `device` (bf16 where the hardware has it), said in the log."""
    if cfg.precision != "auto":
        return cfg
    precision = "bf16" if native_bf16(device) else "fp32"
    logger.info("precision auto: %s on %s", precision, device)
    return dataclasses.replace(cfg, precision=precision)


@dataclass
class Trainable:
    """The trained policy and what steps it, built alike wherever a run trains: in this process
    (training/local_session.py) and in every data-parallel trainer worker on Ray (training/ray_trainer.py)."""

    cfg: TrainConfig
    """The run's settings with precision made concrete for the model's device (`with_precision`)."""
    model: Model
    tokenizer: object
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    ref_model: nn.Module | None
    """The frozen starting policy the KL is measured against (kl_coef > 0), else None."""


def load_learner(cfg: TrainConfig) -> Trainable:
    """The policy on its device (LoRA adapters drawn from `cfg.run.seed`, so every process draws the same ones),
    its frozen reference when kl_coef > 0, AdamW and the linear warm-up schedule."""
    torch.manual_seed(cfg.run.seed)  # LoRA initialisation draws from it
    in_process = SamplingConfig(backend="transformers")  # the trained weights live here; cfg.sampling samples
    learner, tokenizer = load_policy(cfg.run.policy, in_process, lora_rank=cfg.lora_rank, device=cfg.device)
    assert isinstance(learner, TransformersPolicy), learner
    model = learner.model
    cfg = with_precision(cfg, next(model.parameters()).device.type)
    ref_model = copy.deepcopy(model).eval().requires_grad_(False) if cfg.kl_coef > 0 else None
    params = [p for p in model.parameters() if p.requires_grad]
    # No weight decay: with all advantages 0 a step must leave the weights where they are.
    optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / (cfg.warmup_steps + 1))
    )
    return Trainable(cfg, model, tokenizer, optimizer, scheduler, ref_model)


def resume_learner(learner: Trainable, checkpoint: Path) -> TrainState:
    """Load `checkpoint` into `learner` (weights, optimizer, schedule, RNG) at the configured learning rate;
    returns its TrainState."""
    state = ckpt.load_checkpoint(
        checkpoint, model=learner.model, optimizer=learner.optimizer, scheduler=learner.scheduler
    )
    set_learning_rate(learner.optimizer, learner.scheduler, learner.cfg.learning_rate)
    logger.info("resuming %s at step %d", checkpoint, state.step)
    return state


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


def load_tasks(cfg: TrainConfig) -> list[Task]:
    """The split's tasks; for an item family, its tasks at every horizon the curriculum can reach (prepared
    together, drawn by the current one)."""
    if cfg.task not in task_data.ITEM_FAMILIES:
        tasks = task_data.load_family(cfg.task, cfg.run.split, data_dir=cfg.run.data_dir, limit=cfg.run.limit)
    else:
        load = functools.partial(
            task_data.load_family, cfg.task, cfg.run.split, data_dir=cfg.run.data_dir, limit=cfg.run.limit
        )
        tasks = [t for n in horizons(cfg.horizon) for t in load(items=n)]
    if not tasks:
        raise ValueError(f"no tasks in {cfg.task}/{cfg.run.split}")
    return tasks


def set_learning_rate(
    optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR, lr: float
) -> None:
    """Make a resumed run use the configured learning rate, not the one its checkpoint saved (the optimizer and
    scheduler states both carry it). With lr unchanged this recomputes the same value, so resume stays exact."""
    if scheduler.base_lrs[0] != lr:
        logger.warning("learning rate changed on resume: %g -> %g", scheduler.base_lrs[0], lr)
    scheduler.base_lrs = [lr] * len(optimizer.param_groups)
    for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas, strict=True):
        group["initial_lr"] = lr
        group["lr"] = lr * factor(scheduler.last_epoch)


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


def cursor_for(run: Run, previous: TrainState) -> TrainState:
    """The data cursor the next collection starts from: where `previous` left it, or the start of the new
    horizon's tasks when the curriculum raised it meanwhile."""
    if run.state.items != previous.items:
        return dataclasses.replace(previous, items=run.state.items, recent=(), epoch=0, position=0)
    return previous


def config_json(cfg: TrainConfig) -> str:
    """The resolved settings a checkpoint stores (and `resume_point` compares)."""
    return json.dumps(config_to_dict(cfg), sort_keys=True)


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


def steps_left(run: Run) -> range:
    """The steps still to run (a resumed run starts after its checkpoint's)."""
    return range(run.state.step + 1, run.cfg.steps + 1)
