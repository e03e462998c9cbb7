"""The run in this process: the collector samples with its own copy of the policy (or a vLLM engine or server,
training/sampler.py) against a tool server here or at `[tools] url`; the learner steps the trained model beside it.

    async with local_session(cfg, resume=None, force=False) as (run, collector, learner):
        await train_loop(run, collector, learner)                    # training/loop.py

Exact resume: model, optimizer, scheduler, cursor and step come back from the checkpoint, and torch is reseeded
from (seed, step) before each step's sampling, so a resumed run samples and learns exactly what an uninterrupted
one would have (given the same episode concurrency; batched generation pads differently when batches differ).
The update runs in a worker thread, so the event loop keeps serving an overlapped collection meanwhile; the
sampler owns a separate copy of the weights, so the two threads share no tensors.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from main_agent.policy import Policy
from main_agent.tokens import TrainSequence
from main_agent.types import Episode
from tool_server.client import ToolClient
from training import checkpoint as ckpt
from training import play
from training.advantages import BranchValues
from training.branching import BranchStats, branch_values
from training.config import TrainConfig
from training.run import (
    Run,
    StepHook,
    Trainable,
    config_json,
    first_state,
    load_learner,
    load_tasks,
    open_log,
    resume_learner,
    resume_point,
    seed_step,
)
from training.sampler import start_sampler, sync_weights
from training.step import rewarded
from training.tasks import Task
from training.update import UpdateStats, update


@dataclass
class LocalCollector:
    """Plays a step's groups in this process with the run's sampler."""

    cfg: TrainConfig
    policy: Policy
    tokenizer: object
    tools: ToolClient

    @property
    def version(self) -> int:
        """The policy version the sampler holds."""
        return self.policy.version

    async def collect(
        self, tasks: Sequence[Task], step: int
    ) -> tuple[list[list[Episode]], list[list[list[BranchValues]]] | None, BranchStats | None]:
        """G episodes of each task, all in flight together (at most `max_concurrent_episodes`: the sampler
        batches their turns), seeded by (seed, step); then branch credit's continuations, if that is the mode."""
        cfg = self.cfg
        seed_step(cfg, step)
        groups = await play.play(
            tasks, lambda _: self.policy, tools=self.tools, tokenizer=self.tokenizer, cfg=cfg.rollout,
            group_size=cfg.group_size, max_concurrent=cfg.max_concurrent_episodes,
        )  # fmt: skip
        if cfg.credit.mode != "branch":
            return groups, None, None
        branches, branching = await branch_values(
            groups, tasks, policy=self.policy, tools=self.tools, tokenizer=self.tokenizer, cfg=cfg, step=step,
            reward_of=rewarded(cfg.turn_rewards, cfg.reward_kind),
        )  # fmt: skip
        return groups, branches, branching


@dataclass
class LocalLearner:
    """Steps the trained model in this process and pushes its weights to the collector's sampler."""

    trainable: Trainable
    sampler: Policy

    async def update(self, sequences: Sequence[TrainSequence]) -> tuple[UpdateStats, float]:
        """One optimizer step (training/update.py) in a worker thread, the schedule moved after a step that was
        not skipped; the stats and the learning rate the step used."""
        t = self.trainable
        lr = t.optimizer.param_groups[0]["lr"]
        stats = await asyncio.to_thread(update, t.model, t.optimizer, sequences, t.cfg, ref_model=t.ref_model)
        if stats.skipped is None:
            t.scheduler.step()
        return stats, lr

    async def sync(self) -> float:
        """The trained weights into the sampler, its version one up; the seconds it took."""
        return await sync_weights(self.trainable.model, self.sampler, self.trainable.cfg)

    def save(self, step: int, run: Run) -> None:
        """Checkpoint `step_N` (training/checkpoint.py): weights, optimizer, schedule, the run's state."""
        t, cfg = self.trainable, self.trainable.cfg
        ckpt.save_checkpoint(
            cfg.run_dir, step, model=t.model, optimizer=t.optimizer, scheduler=t.scheduler, state=run.state,
            config_json=config_json(cfg), keep_last=cfg.keep_last, tokenizer=t.tokenizer,
        )  # fmt: skip


@contextlib.asynccontextmanager
async def local_session(
    cfg: TrainConfig,
    *,
    resume: Path | None,
    force: bool,
    on_step: StepHook | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> AsyncIterator[tuple[Run, LocalCollector, LocalLearner]]:
    """Load the policy (and its checkpoint when resuming) on its device, the optimizer, the sampler, the tasks
    and the tool client (training.play.tool_session: `transport` replaces the server in tests; else `[tools]`,
    a server at its url or one in this process); the sampler and the log are released whatever happens."""
    cfg, latest = resume_point(cfg, resume=resume, force=force)
    trainable = load_learner(cfg)
    cfg = trainable.cfg
    tasks = load_tasks(cfg)
    state = resume_learner(trainable, latest) if latest is not None else first_state(cfg, tasks)
    policy = await start_sampler(cfg, trainable.model, trainable.tokenizer, version=state.policy_version)
    try:
        log = open_log(cfg, state)
        with log:
            session = play.tool_session(
                tasks, work_dir=cfg.run_dir, access=cfg.tools, data_dir=cfg.run.data_dir, transport=transport
            )
            async with session as (tools, ready):
                run = Run(cfg, ready, state, log, on_step)
                yield (
                    run,
                    LocalCollector(cfg, policy, trainable.tokenizer, tools),
                    LocalLearner(trainable, policy),
                )
    finally:
        await policy.aclose()
