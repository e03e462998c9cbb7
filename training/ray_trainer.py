"""Data-parallel trainer workers: Ray actors that each hold a replica of the policy and step it together.

    trainers, state = TrainerGroup.start(cfg, cfg.ray, checkpoint=latest)  # state: the checkpoint's, or None
    stats, lr = trainers.update(scored.sequences)    # one optimizer step on every replica (training.update.update)
    weights = trainers.sampler_weights()             # ObjectRef: rank 0's weights, for the rollout workers
    trainers.link({0: worker}, "nccl"); trainers.send([0], version)   # or over the GPU (training/weight_sync.py)
    trainers.save(step, state, config_json, keep_last)    # rank 0 writes run_dir/step_N (training/checkpoint.py)
    trainers.shutdown()

Every worker loads the policy as the single-process run does (`training.learner.load_learner`: same seed, so the same
LoRA adapters) and receives the whole step. Worker r runs micro-batches r, r + W, ... of the step's
`micro_batches`, each normalised by the step's total token count; then ONE all-reduce sums the gradients (one
flat bucket) and one more the logged sums and a non-finite flag, so every worker skips a bad step together or
clips and steps the same AdamW on the same gradients. The replicas stay identical, as under DDP, so rank 0 alone
serves weights and writes checkpoints, and those hold full states: a checkpoint written by N workers resumes on
M. One worker joins no process group: its step is the single-process `update`, with no collective at all.

Why plain actors, torch.distributed (gloo on CPU, NCCL on GPUs) and a hand-made bucket:
- Ray Train's TorchTrainer owns the loop: it runs a training function in its workers and streams reports back.
  Here the driver owns it: it calls each step between rollouts that run on other actors, then pushes weights.
- DDP averages gradients over ranks. Our loss is already divided by the step's global token count (ranks hold
  unequal token counts), so the right reduction is a SUM; DDP would need a rescale by W, no_sync around all
  but the last micro-batch, and a wrapper that renames every state_dict key (`module.`) checkpoints and
  samplers see. Summing once after the whole backward takes twenty lines.
- FSDP2 shards parameters, gradients and optimizer states for models that do not fit one device; a policy of
  at most 1B parameters with AdamW (about 16 GB in float32) fits one GPU, so replicas stay whole and a
  checkpoint needs no gathering.

Limits: the all-reduce waits for the whole backward (DDP overlaps buckets with it); the bucket is a second
copy of the gradients; NCCL needs a whole GPU per worker (`gpus_per_trainer_worker = 1`); rank 0 writes to
`run_dir` on its own node (shared storage when the driver is elsewhere); the rendezvous port is found free on
rank 0 and bound moments later (a narrow race). A dead worker is not restarted: a fresh replica would have
missed the steps since the start, so the run fails and resumes from its last checkpoint.
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from conductor.cluster import RayConfig, actor_threads, free_port, require_ray
from main_agent.tokens import TrainSequence
from main_agent.types import Episode
from training import checkpoint as ckpt
from training.checkpoint import TrainState
from training.config import TrainConfig
from training.info_gain import group_gains
from training.learner import load_learner, resume_learner
from training.sampler import sampler_state
from training.tasks import Task
from training.update import DataParallel, UpdateStats, accumulate_gradients, update

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=30)
"""How long a worker waits in a collective for the others (the rendezvous included) before it fails: longer
than the slowest rank's share of a step on a CPU."""
CLOSE_TIMEOUT_S = 30.0
"""How long `shutdown` lets the workers leave the process group before it kills them anyway."""


class TrainerWorker:
    """One data-parallel rank (a Ray actor: `TrainerGroup.start` wraps it with `ray.remote`)."""

    def __init__(self, cfg: TrainConfig, rank: int, world: int, cpus: float) -> None:
        torch.set_num_threads(actor_threads(cpus))
        self.rank, self.world = rank, world
        self.learner = load_learner(cfg)
        self.dp: DataParallel | None = None
        self.links: dict = {}  # rollout worker rank -> weight_sync.Link (rank 0, under a GPU weight push)

    def settings(self) -> TrainConfig:
        """The run's settings as this worker resolved them (precision concrete for its device)."""
        return self.learner.cfg

    def address(self) -> tuple[str, int]:
        """This node's IP and a port free on it now: rank 0's rendezvous point for the process group."""
        ray = require_ray()
        return ray.util.get_node_ip_address(), free_port()

    def join(self, master: tuple[str, int]) -> None:
        """Join the workers' process group at rank 0's `master` address: NCCL when the model is on a GPU."""
        import torch.distributed as dist

        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = master[0], str(master[1])
        device = next(self.learner.model.parameters()).device.type
        backend = "nccl" if device == "cuda" else "gloo"
        dist.init_process_group(
            backend, rank=self.rank, world_size=self.world, timeout=COLLECTIVE_TIMEOUT
        )  # init_method "env://": MASTER_ADDR and MASTER_PORT
        self.dp = DataParallel(self.rank, self.world)

    def load(self, checkpoint: Path) -> TrainState:
        """Load `checkpoint` (full states, whoever wrote it) into this replica; its TrainState."""
        return resume_learner(self.learner, checkpoint)

    def update(self, sequences: list[TrainSequence]) -> tuple[UpdateStats, float]:
        """One optimizer step on this rank's share of `sequences` (all ranks together), the schedule moved after
        a step that was not skipped; the stats and the learning rate the step used."""
        learner = self.learner
        lr = learner.optimizer.param_groups[0]["lr"]
        stats = update(
            learner.model, learner.optimizer, sequences, learner.cfg, ref_model=learner.ref_model, dp=self.dp
        )
        if stats.skipped is None:
            learner.scheduler.step()
        return stats, lr

    def info_gains(self, groups: list[list[Episode]], tasks: list[Task]) -> list[list[list[float]]]:
        """Each turn's information gain under this replica (training/info_gain.py): no gradient, no collective."""
        learner = self.learner
        return group_gains(learner.model, learner.tokenizer, groups, tasks, learner.cfg)

    def gradients(self, sequences: list[TrainSequence]) -> dict[str, torch.Tensor]:
        """The step's gradient (summed over the ranks) by parameter name, without stepping; then cleared. A test
        seam: ranks and worker counts compared."""
        learner = self.learner
        sums = accumulate_gradients(
            learner.model, sequences, learner.cfg, ref_model=learner.ref_model, dp=self.dp
        )
        assert sums is not None, "a non-finite loss: no gradient to compare"
        named = learner.model.named_parameters()
        grads = {k: p.grad.detach().cpu().clone() for k, p in named if p.grad is not None}
        learner.optimizer.zero_grad(set_to_none=True)
        return grads

    def weights(self) -> dict[str, torch.Tensor]:
        """This replica's weights as a sampler loads them (`sampler_state`)."""
        return sampler_state(self.learner.model)

    def link(self, workers: dict[int, object], transport: str) -> None:
        """Open a GPU weight link (training/weight_sync.py) to each rollout worker in `workers` {rank: handle}.
        Rank 0 only: the replicas are identical. A link it replaces led to a worker since restarted: dropped."""
        from training.weight_sync import Link

        for rank, worker in sorted(workers.items()):
            self.links[rank] = Link.open(self.learner.model, worker, transport)

    def send(self, ranks: list[int], version: int) -> list[int]:
        """Stream this replica's weights over the links to rollout workers `ranks`, as `version`; returns the
        ranks whose worker died meanwhile (their links dropped: the driver treats them as restarted, and they
        are linked again once back)."""
        ray = require_ray()
        lost = []
        for rank in ranks:
            try:
                self.links[rank].send(version)
            except ray.exceptions.RayActorError as exc:
                logger.warning("weight push to rollout worker %d failed: %s", rank, exc)
                del self.links[rank]  # not closed: its peer is gone, and a communicator's teardown would wait
                lost.append(rank)
        return lost

    def save(self, step: int, state: TrainState, config_json: str, keep_last: int) -> Path:
        """Write checkpoint `step_N` of this replica (with the tokenizer) into the run directory."""
        learner = self.learner
        return ckpt.save_checkpoint(
            learner.cfg.run_dir, step, model=learner.model, optimizer=learner.optimizer,
            scheduler=learner.scheduler, state=state, config_json=config_json, keep_last=keep_last,
            tokenizer=learner.tokenizer,
        )  # fmt: skip

    def close(self) -> None:
        """Leave the process group."""
        import torch.distributed as dist

        if self.dp is not None:
            dist.destroy_process_group()
            self.dp = None


@dataclass
class TrainerGroup:
    """The driver's handle on the trainer workers; `workers[0]` is rank 0."""

    workers: list
    cfg: TrainConfig
    """The run's settings as the workers resolved them (precision concrete for their device)."""

    @classmethod
    def start(
        cls, cfg: TrainConfig, ray_cfg: RayConfig, *, checkpoint: Path | None
    ) -> tuple[TrainerGroup, TrainState | None]:
        """`ray_cfg.trainer_workers` workers holding the starting policy, or `checkpoint` (then its TrainState
        comes back too), in one process group when there are several."""
        ray = require_ray()
        actor = ray.remote(TrainerWorker).options(
            num_cpus=ray_cfg.cpus_per_trainer_worker, num_gpus=ray_cfg.gpus_per_trainer_worker
        )
        world = ray_cfg.trainer_workers
        group = cls([actor.remote(cfg, r, world, ray_cfg.cpus_per_trainer_worker) for r in range(world)], cfg)
        try:
            state = group._setup(checkpoint)
        except BaseException:
            group.shutdown()
            raise
        logger.info("%d trainer workers ready (precision %s)", world, group.cfg.precision)
        return group, state

    def _setup(self, checkpoint: Path | None) -> TrainState | None:
        resolved = gather([w.settings.remote() for w in self.workers])
        assert all(s == resolved[0] for s in resolved), "trainer workers resolved different settings"
        self.cfg = resolved[0]
        if len(self.workers) > 1:
            master = gather([self.workers[0].address.remote()])[0]
            gather([w.join.remote(master) for w in self.workers])
        if checkpoint is None:
            return None
        return gather([w.load.remote(checkpoint) for w in self.workers])[0]

    def update(self, sequences: Sequence[TrainSequence]) -> tuple[UpdateStats, float]:
        """One optimizer step on `sequences` on every worker: rank 0's stats and the learning rate it used."""
        ray = require_ray()
        batch = ray.put(list(sequences))  # once into the object store, read by every worker
        return gather([w.update.remote(batch) for w in self.workers])[0]

    def info_gains(self, groups: Sequence[list[Episode]], tasks: Sequence[Task]) -> list[list[list[float]]]:
        """Rank 0 scores each turn's information gain (the replicas are identical)."""
        return gather([self.workers[0].info_gains.remote(list(groups), list(tasks))])[0]

    def sampler_weights(self):
        """An ObjectRef of rank 0's weights for the samplers (training.sampler.sampler_state); a rollout worker
        that gets it as an argument gets the dict."""
        return self.workers[0].weights.remote()

    def link(self, workers: dict[int, object], transport: str) -> None:
        """Rank 0 opens a GPU weight link to each rollout worker in `workers` {rank: actor handle}."""
        gather([self.workers[0].link.remote(workers, transport)])

    def send(self, ranks: list[int], version: int) -> list[int]:
        """Rank 0 streams the weights to the linked rollout workers `ranks` as `version`; the ranks lost."""
        return gather([self.workers[0].send.remote(ranks, version)])[0]

    def save(self, step: int, state: TrainState, config_json: str, keep_last: int) -> Path:
        """Rank 0 writes checkpoint `step_N` into the run directory (once: the replicas are identical)."""
        return gather([self.workers[0].save.remote(step, state, config_json, keep_last)])[0]

    def shutdown(self) -> None:
        """Leave the process group (waiting at most CLOSE_TIMEOUT_S: a worker may be stuck in a collective whose
        peer died) and kill the workers."""
        ray = require_ray()
        closing = [w.close.remote() for w in self.workers]
        ray.wait(closing, num_returns=len(closing), timeout=CLOSE_TIMEOUT_S)
        for worker in self.workers:
            ray.kill(worker)


def gather(refs: list) -> list:
    """ray.get of every ref, raising a worker's failure as soon as it happens: the others may be waiting for it
    in a collective (until COLLECTIVE_TIMEOUT)."""
    ray = require_ray()
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        ray.get(done)
    return ray.get(refs)
