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
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from main_agent.tokens import TrainSequence
from main_agent.types import Episode
from tool_server.client import ToolClient
from training import checkpoint as ckpt
from training import expert_mix, near_miss, play
from training.advantages import BranchValues
from training.branching import BranchStats, branch_values
from training.checkpoint import TrainState
from training.config import TrainConfig, config_json
from training.data_order import seed_step
from training.expert_mix import ExpertMix
from training.info_gain import group_gains
from training.learner import Learner, load_learner, resume_learner
from training.near_miss import NearMiss
from training.run import Run, StepHook, open_run
from training.sampler import Sampler, sampler_settings
from training.step import rewarded
from training.tasks import Task
from training.update import UpdateStats, update


@dataclass
class LocalCollector:
    """Plays a step's groups in this process with the run's sampler."""

    cfg: TrainConfig
    sampler: Sampler
    tools: ToolClient

    @property
    def version(self) -> int:
        """The policy version the sampler holds."""
        return self.sampler.version

    async def collect(
        self, tasks: Sequence[Task], step: int
    ) -> tuple[list[list[Episode]], list[list[list[BranchValues]]] | None, BranchStats | None]:
        """G episodes of each task, all in flight together (at most `max_concurrent_episodes`: the sampler
        batches their turns), seeded by (seed, step); then branch credit's continuations, if that is the mode."""
        cfg, policy, tokenizer = self.cfg, self.sampler.policy, self.sampler.tokenizer
        seed_step(cfg, step)
        groups = await play.play(
            tasks, lambda _: policy, tools=self.tools, tokenizer=tokenizer, cfg=cfg.rollout,
            group_size=cfg.group_size, max_concurrent=cfg.max_concurrent_episodes,
        )  # fmt: skip
        if cfg.credit.mode != "branch":
            return groups, None, None
        branches, branching = await branch_values(
            groups, tasks, policy=policy, tools=self.tools, tokenizer=tokenizer, cfg=cfg, step=step,
            reward_of=rewarded(cfg),
        )  # fmt: skip
        return groups, branches, branching

    async def demonstrate(self, tasks: Sequence[Task], step: int) -> ExpertMix:
        """The scripted expert's episodes of the step's tasks through this collector's tools, in the policy's
        token format (`[expert_mix]`, training/expert_mix.py): none once its weight is 0."""
        cfg = self.cfg
        return await expert_mix.demonstrate(
            tasks, mix=cfg.expert_mix, step=step, tools=self.tools, tokenizer=self.sampler.tokenizer,
            rollout=cfg.rollout, max_concurrent=cfg.max_concurrent_episodes,
        )  # fmt: skip

    async def resample(self, tasks: Sequence[Task], groups: Sequence[list[Episode]], step: int) -> NearMiss:
        """Continuations of the groups' near-miss prefixes, sampled by this collector's policy through its tools
        (`[near_miss]`, training/near_miss.py): none at a step the setting is off."""
        cfg = self.cfg
        return await near_miss.resample(
            groups, tasks, cfg=cfg.near_miss, step=step, policy=self.sampler.policy, tools=self.tools,
            tokenizer=self.sampler.tokenizer, rollout=cfg.rollout, reward_kind=cfg.reward_kind,
            max_concurrent=cfg.max_concurrent_episodes,
        )  # fmt: skip


@dataclass
class LocalLearner:
    """Steps the trained model in this process and loads its weights into the collector's sampler."""

    learner: Learner
    sampler: Sampler

    async def update(self, sequences: Sequence[TrainSequence]) -> tuple[UpdateStats, float]:
        """One optimizer step (training/update.py) in a worker thread, the schedule moved after a step that was
        not skipped; the stats and the learning rate the step used."""
        t = self.learner
        lr = t.optimizer.param_groups[0]["lr"]
        stats = await asyncio.to_thread(update, t.model, t.optimizer, sequences, t.cfg, ref_model=t.ref_model)
        if stats.skipped is None:
            t.scheduler.step()
        return stats, lr

    async def info_gains(
        self, groups: Sequence[list[Episode]], tasks: Sequence[Task]
    ) -> list[list[list[float]]]:
        """Each turn's information gain under the trained model (training/info_gain.py), in a worker thread."""
        t = self.learner
        return await asyncio.to_thread(group_gains, t.model, t.tokenizer, groups, tasks, t.cfg)

    async def sync(self) -> float:
        """The trained weights into the sampler, its version one up; the seconds it took."""
        start = time.monotonic()
        await self.sampler.load(self.learner.model, self.sampler.version + 1)
        return time.monotonic() - start

    def save(self, step: int, run: Run) -> None:
        """Checkpoint `step_N` (training/checkpoint.py): weights, optimizer, schedule, the run's state."""
        t, cfg = self.learner, self.learner.cfg
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
    """The run opened (training.run.open_run: the learner in this process, `start_learner`; the tool client
    from `[tools]`, or `transport` in tests), and the sampler holding the run's current weights; all released
    whatever happens."""
    opened = open_run(
        cfg, resume=resume, force=force, start_learner=start_learner, on_step=on_step, transport=transport
    )
    async with opened as (run, learner, tools):
        sampler = Sampler(sampler_settings(run.cfg), learner.tokenizer)
        try:
            await sampler.load(learner.model, run.state.policy_version)
            yield run, LocalCollector(run.cfg, sampler, tools), LocalLearner(learner, sampler)
        finally:
            await sampler.aclose()


@contextlib.asynccontextmanager
async def start_learner(
    cfg: TrainConfig, checkpoint: Path | None
) -> AsyncIterator[tuple[Learner, TrainConfig, TrainState | None]]:
    """The policy on its device, its optimizer and schedule (training/learner.py), loaded from `checkpoint` when
    resuming; the settings as it resolved them, and the checkpoint's state."""
    learner = load_learner(cfg)
    state = resume_learner(learner, checkpoint) if checkpoint is not None else None
    yield learner, learner.cfg, state
