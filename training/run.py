"""A training run's plumbing, shared by the sync and async loops: start or resume, tools, data order, bookkeeping.

    run = await start_run(cfg, resume=None, force=False)  # model, sampler (training/sampler.py), optimizer, tasks
    async with tool_session(run) as (tools, tasks):
        batch, state = next_tasks(tasks, run.state, cfg)   # seeded shuffle per epoch; the cursor is in `state`
        groups = await collect(run, tools, batch)           # training/play.py
        ...                                                # score, update, sync (train.py)
        finish_step(run, step, row, state=state, episodes=..., stepped=...)   # log, rollouts, checkpoint

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
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import torch
from torch import nn

from conductor.models import native_bf16
from main_agent.backends import load_policy
from main_agent.policy import Policy, SamplingConfig
from main_agent.transformers_policy import TransformersPolicy
from main_agent.types import Episode
from tool_server.client import ToolClient
from training import checkpoint as ckpt
from training import play
from training import tasks as task_data
from training.checkpoint import CheckpointError, TrainState
from training.config import RESUME_KEYS, TrainConfig, config_to_dict
from training.curriculum import Horizon, advance, horizons
from training.metrics import MetricsLog, save_rollouts, trim_metrics
from training.sampler import start_sampler
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
        random.Random(cfg.seed * 1_000_003 + epoch).shuffle(order)
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
    torch.manual_seed(cfg.seed * 1_000_003 + step + rank * 1_000_000_007)


@dataclass
class Run:
    """Everything a training loop holds. Mutable: `state` advances every step."""

    cfg: TrainConfig
    model: Model
    tokenizer: object
    policy: Policy
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    ref_model: nn.Module | None
    tasks: list[Task]
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


async def start_run(
    cfg: TrainConfig, *, resume: Path | None, force: bool, on_step: StepHook | None = None
) -> Run:
    """Load the policy (and its checkpoint when resuming) on its device, the optimizer, the sampler, the tasks."""
    cfg, latest = resume_point(cfg, resume=resume, force=force)
    learner = load_learner(cfg)
    cfg = learner.cfg
    tasks = load_tasks(cfg)
    state = TrainState(seed=cfg.seed, items=cfg.horizon.items if tasks[0].items else 0)
    if latest is not None:
        state = resume_learner(learner, latest)
    model, tokenizer = learner.model, learner.tokenizer
    policy = await start_sampler(cfg, model, tokenizer, version=state.policy_version)
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    trim_metrics(cfg.run_dir / "metrics.jsonl", after_step=state.step)  # steps redone after a kill
    log = MetricsLog(cfg.run_dir / "metrics.jsonl")
    optimizer, scheduler, ref_model = learner.optimizer, learner.scheduler, learner.ref_model
    return Run(cfg, model, tokenizer, policy, optimizer, scheduler, ref_model, tasks, state, log, on_step)


@dataclass
class Learner:
    """The trained policy and what steps it, built alike wherever a run trains: in the single-process loops
    (`start_run`) and in every data-parallel trainer worker on Ray (training/ray_trainer.py)."""

    cfg: TrainConfig
    """The run's settings with precision made concrete for the model's device (`with_precision`)."""
    model: Model
    tokenizer: object
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    ref_model: nn.Module | None
    """The frozen starting policy the KL is measured against (kl_coef > 0), else None."""


def load_learner(cfg: TrainConfig) -> Learner:
    """The policy on its device (LoRA adapters drawn from `cfg.seed`, so every process draws the same ones),
    its frozen reference when kl_coef > 0, AdamW and the linear warm-up schedule."""
    torch.manual_seed(cfg.seed)  # LoRA initialisation draws from it
    in_process = SamplingConfig(backend="transformers")  # the trained weights live here; cfg.sampling samples
    learner, tokenizer = load_policy(cfg.policy, in_process, lora_rank=cfg.lora_rank, device=cfg.device)
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
    return Learner(cfg, model, tokenizer, optimizer, scheduler, ref_model)


def resume_learner(learner: Learner, checkpoint: Path) -> TrainState:
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
    if not hasattr(task_data.FAMILIES.get(cfg.task), "item_reward"):
        tasks = task_data.load_family(cfg.task, cfg.split, data_dir=cfg.data_dir, limit=cfg.limit)
    else:
        load = functools.partial(
            task_data.load_family, cfg.task, cfg.split, data_dir=cfg.data_dir, limit=cfg.limit
        )
        tasks = [t for n in horizons(cfg.horizon) for t in load(items=n)]
    if not tasks:
        raise ValueError(f"no tasks in {cfg.task}/{cfg.split}")
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


def tool_session(run: Run, *, transport: httpx.AsyncBaseTransport | None = None):
    """The run's tool client and tasks ready to play (training.play.tool_session), pages and clips under run_dir.

    `transport` (tests) replaces the server; else `[tools]`: a server at its url, or one in this process."""
    cfg = run.cfg
    return play.tool_session(
        run.tasks, work_dir=cfg.run_dir, access=cfg.tools, data_dir=cfg.data_dir, transport=transport
    )


def collect(run: Run, tools: ToolClient, tasks: Sequence[Task]) -> Awaitable[list[list[Episode]]]:
    """G episodes of each task, all in flight together (at most `max_concurrent_episodes`): one group per task."""
    cfg = run.cfg
    return play.play(
        tasks,
        lambda _: run.policy,
        tools=tools,
        tokenizer=run.tokenizer,
        cfg=cfg.rollout,
        group_size=cfg.group_size,
        max_concurrent=cfg.max_concurrent_episodes,
    )


def finish_step(
    run: Run,
    step: int,
    row: Mapping[str, float],
    *,
    state: TrainState,
    episodes: Sequence[Episode],
    stepped: bool,
    successes: Sequence[bool] = (),
    items: int = 0,
) -> None:
    """Step the learning-rate schedule when the optimizer `stepped` (it counts optimizer steps), record the
    step (`record_step`), checkpoint when due."""
    cfg = run.cfg
    row = {**row, "optim/lr": run.optimizer.param_groups[0]["lr"]}
    if stepped:
        run.scheduler.step()
    run.state = record_step(
        cfg, run.state, step, row, state=state, episodes=episodes, successes=successes, items=items,
        version=run.policy.version, log=run.log, on_step=run.on_step,
    )  # fmt: skip
    if step % cfg.save_every == 0 or step == cfg.steps:
        ckpt.save_checkpoint(
            cfg.run_dir,
            step,
            model=run.model,
            optimizer=run.optimizer,
            scheduler=run.scheduler,
            state=run.state,
            config_json=config_json(cfg),
            keep_last=cfg.keep_last,
            tokenizer=run.tokenizer,
        )


def record_step(
    cfg: TrainConfig,
    now: TrainState,
    step: int,
    row: Mapping[str, float],
    *,
    state: TrainState,
    episodes: Sequence[Episode],
    successes: Sequence[bool],
    items: int,
    version: int,
    log: MetricsLog,
    on_step: StepHook | None,
) -> TrainState:
    """The state after `step` (from `now`); the row logged, the rollouts saved, the row reported (`on_step`).

    `state` carries the data cursor after this step's tasks; `successes` of the step's episodes, played at
    horizon `items`, move the curriculum when that is still the current one (an async batch may predate a
    raise); `version` is the sampler's policy version after the step. Shared by the in-process loops
    (`finish_step`) and the Ray loop (training/train_ray.py).
    """
    row = {**row, "horizon/items": now.items}
    # Only the cursor comes from `state`: a collection that ran ahead (async) copied the counters before the
    # steps in between added to them.
    cursor = dataclasses.replace(now, epoch=state.epoch, position=state.position)
    after = next_horizon(now, cursor, successes if items == now.items else (), cfg)
    after = dataclasses.replace(
        after,
        step=step,
        policy_version=version,
        episodes=after.episodes + len(episodes),
        invalid_episodes=after.invalid_episodes + sum(e.stop_reason == "infra_failed" for e in episodes),
        elapsed_s=after.elapsed_s + row["time/rollout"] + row["time/train"] + row["time/weight_sync"],
    )
    save_rollouts(cfg.run_dir / "rollouts" / f"step_{step}.jsonl", episodes)
    log.write(row)
    logger.info("step %d done: reward %.3f", step, row.get("reward/final", float("nan")))
    if on_step is not None:
        on_step(row)
    return after


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
