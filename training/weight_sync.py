"""The weight push over the GPU: trainer rank 0 streams the policy into the rollout workers' vLLM engines with
vLLM's weight-transfer engines (`vllm.distributed.weight_transfer`), never through host memory.

    link = Link.open(model, worker, "nccl")   # on trainer rank 0, once per rollout worker (a Ray actor handle)
    link.send(version)                        # after every optimizer step: the worker samples `version` next

`[ray] weight_push` picks the transport (training/ray_session.py decides when each runs):
- "nccl": a broadcast from the trainer's GPU to the engine's. NCCL refuses two ranks on one device, so the
  engine must be on another GPU than the trainer (checked at `open`, with the fix in the error).
- "ipc": CUDA IPC handles of the trainer's tensors, read by an engine on the same GPU (one GPU shared by the
  trainer and the samplers, as on a single-GPU machine).

Each rollout worker gets its own link (for NCCL, its own two-rank communicator) rather than joining one group
of all engines: a worker that dies and is restarted by Ray is linked again alone, while the others keep theirs,
and no broadcast ever waits for a peer that is gone. The cost is one transfer per engine instead of one for
all; over NVLink a 7B model in bf16 moves in well under a second. A link whose worker died is dropped, not
closed: tearing down a communicator whose peer is gone may wait for it. Limit: NCCL has no timeout inside a
broadcast, so a worker that dies in the middle of one (rather than before it) hangs the push.

What streams is `training.sampler.dense_parameters`: a LoRA policy's layers merged one at a time, so no merged
copy of the model is ever materialised. The worker side (the engine calls, under the worker's swap lock so no
episode straddles two versions) is `RolloutWorker.init_weight_transfer_engine` and its neighbours in
training/ray_rollout.py; the version reaches the worker with `finish_weight_update`.

Needs CUDA and the `vllm` extra; the transfer tests are marked `gpu` (tests/test_weight_sync.py).
"""

from __future__ import annotations

import base64
import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo, IPCTrainerWeightTransferEngine
from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo, NCCLTrainerWeightTransferEngine

from conductor.cluster import free_port, require_ray
from training.sampler import dense_parameters

Transport = Literal["nccl", "ipc"]

SYNC_TIMEOUT_S = 1800.0
"""How long one call to a rollout worker may take. `start_weight_update` first waits for the collection the
worker is running (in `--async` runs a whole step's episodes, minutes on a small GPU); past half an hour the
worker is stuck, not slow, and the run fails with Ray's GetTimeoutError rather than wait on."""


class DenseSource(WeightSource):
    """The trainer's model as vLLM's trainer engines read it: `dense_parameters`, fresh on every pass."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._meta = [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in dense_parameters(model)]

    def metadata(self) -> list[ParamMeta]:
        return self._meta  # names, dtypes and shapes never change during a run: computed once

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return dense_parameters(self.model)


class WorkerClient:
    """vLLM's weight-sync client protocol (`VLLMWeightSyncClient`) over one rollout worker, which forwards each
    call to its engine; `version` rides on `finish_weight_update`, so the worker relabels its sampler in the
    same locked section that swaps the weights."""

    def __init__(self, worker) -> None:
        self.worker = worker
        self.version = -1

    def _call(self, method: str, *args) -> None:
        ray = require_ray()
        ray.get(getattr(self.worker, method).remote(*args), timeout=SYNC_TIMEOUT_S)

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._call("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self._call("start_weight_update")

    def update_weights(self, update_info: dict | list[dict]) -> None:
        infos = update_info if isinstance(update_info, list) else [update_info]
        pickled = [pickle_handles(info) for info in infos]
        self._call("update_weights", pickled if isinstance(update_info, list) else pickled[0])

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call("finish_weight_update", self.version)

    def shutdown_weight_transfer_engine(self) -> None:
        self._call("shutdown_weight_transfer_engine")


@dataclass
class Link:
    """Trainer rank 0's transfer channel to one rollout worker's engine."""

    client: WorkerClient
    engine: NCCLTrainerWeightTransferEngine | IPCTrainerWeightTransferEngine

    @classmethod
    def open(cls, model: nn.Module, worker, transport: Transport) -> Link:
        """Connect to `worker`'s engine (which must have been started with the same transport): both sides
        rendezvous now; ValueError when the GPUs do not suit the transport."""
        ray = require_ray()
        here, there = device_uuid(), ray.get(worker.device_uuid.remote(), timeout=SYNC_TIMEOUT_S)
        check_devices(transport, trainer=here, engine=there)
        client, source = WorkerClient(worker), DenseSource(model)
        if transport == "ipc":
            engine = IPCTrainerWeightTransferEngine.trainer_init(
                IPCTrainerInitInfo(rank=0), client=client, source=source
            )
        else:
            host, port = ray.util.get_node_ip_address(), free_port()
            info = NCCLTrainerInitInfo(master_address=host, master_port=port, world_size=2, rank=0)
            engine = NCCLTrainerWeightTransferEngine.trainer_init(info, client=client, source=source)
        return cls(client, engine)

    def send(self, version: int) -> None:
        """Stream the model into the engine; the worker samples as `version` from its next collection."""
        self.client.version = version
        self.engine.send_weights()


def pickle_handles(update_info: dict) -> dict:
    """`update_info` with CUDA IPC handles (tuples of torch objects, which the engine's msgpack channel does not
    carry) as the base64 pickle vLLM's IPC engine accepts (`ipc_handles_pickled`; the worker sets
    VLLM_ALLOW_INSECURE_SERIALIZATION for it, training/ray_rollout.py). NCCL's update info passes unchanged."""
    if update_info.get("ipc_handles") is None:
        return update_info
    rest = {k: v for k, v in update_info.items() if k != "ipc_handles"}
    return {
        **rest,
        "ipc_handles_pickled": base64.b64encode(pickle.dumps(update_info["ipc_handles"])).decode(),
    }


def check_devices(transport: Transport, *, trainer: str, engine: str) -> None:
    """ValueError when `transport` cannot join these two GPUs (their UUIDs): NCCL needs two devices, CUDA IPC
    one."""
    if transport == "nccl" and trainer == engine:
        raise ValueError(
            "weight_push = 'nccl' needs the engine on another GPU than the trainer (NCCL refuses two ranks on "
            "one device); with one GPU shared by both, set [ray] weight_push = 'ipc'"
        )
    if transport == "ipc" and trainer != engine:
        raise ValueError(
            "weight_push = 'ipc' needs the engine on the trainer's GPU (CUDA IPC stays within one device); "
            "with the engines on other GPUs, set [ray] weight_push = 'nccl'"
        )


def device_uuid() -> str:
    """The UUID of the GPU this process computes on (Ray narrows CUDA_VISIBLE_DEVICES to its share)."""
    return str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
