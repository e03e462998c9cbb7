"""Which implementation samples the policy, and the one place that builds it (`[sampling] backend`).

    policy, tokenizer = load_policy(ref, sampling)     # from a model reference: ask, evaluation, SFT
    policy = build_policy(backend, tokenizer, sampling, model=..., folder=..., version=...)   # from weights in hand

`chosen_backend` resolves "auto"; `build_policy` is the one switch over "transformers", "vllm" and "server"
(`build_reloadable` the last two, whose weights reload from a folder), used by `load_policy` and by the
trainer's sampler (training/sampler.py), in this process and in every Ray rollout worker. The contract is
main_agent/policy.py; each implementation has its own file, and the vLLM one (an optional extra) is imported only
when asked for.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Literal

from conductor.models import resolve_model
from main_agent.openai_policy import OpenAIPolicy
from main_agent.policy import Policy, ReloadablePolicy, SamplingConfig
from main_agent.transformers_policy import TransformersPolicy, load_model, merged_checkpoint, tokenizer_dir


def load_policy(
    ref: str,
    sampling: SamplingConfig = SamplingConfig(),
    *,
    lora_rank: int = 0,
    device: str = "auto",
    max_batch: int = 16,
    seed: int = 0,
    max_model_len: int = 4096,
) -> tuple[Policy, object]:
    """The policy `ref` names (built-in name, checkpoint or LoRA adapter folder), sampled by `sampling.backend`,
    and its tokenizer (prompts are rendered here whoever samples). Raises ModelNotFound or PolicyError.

    In process (`transformers`) the weights go to `device` ("auto": cuda when visible); `lora_rank` > 0 adds
    fresh LoRA adapters to a dense model (training); `max_batch` episodes share one generate. A vLLM engine
    (`vllm`) reads the checkpoint folder itself with `max_model_len` (at most the model's context; on CPU its KV
    cache sized for `max_batch` sequences of it at once): dense weights
    only, so an adapter is sampled from its merged copy (`merged_checkpoint`); a server (`server`) serves its
    own copy, so only the tokenizer is loaded here. `seed` seeds the engines' and servers' sampling.
    """
    from transformers import AutoTokenizer

    path = resolve_model(ref)
    backend = chosen_backend(sampling, adapter=(path / "adapter_config.json").is_file())
    model = None
    if backend == "transformers":
        model, tokenizer = load_model(path, lora_rank=lora_rank, device=device)
    else:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir(path), local_files_only=True)
    if backend == "vllm" and (path / "adapter_config.json").is_file():
        path = merged_checkpoint(path)  # an engine reads dense weights only
    if backend == "vllm":
        max_model_len = min(max_model_len, model_context(path))
    policy = build_policy(
        backend, tokenizer, sampling, model=model, folder=path, max_batch=max_batch, seed=seed,
        max_model_len=max_model_len,
    )  # fmt: skip
    return policy, tokenizer


def model_context(path: Path) -> int:
    """The longest sequence the checkpoint's position embeddings cover (a vLLM engine refuses to start with a
    longer `max_model_len`)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path, local_files_only=True).max_position_embeddings


def chosen_backend(sampling: SamplingConfig, *, adapter: bool = False) -> str:
    """The backend that samples: `sampling.backend`, with "auto" resolved (vllm when installed, unless the
    checkpoint is a LoRA adapter, which an engine reads only as a merged dense copy: ~540 MB written and an engine
    started for what transformers samples at once; transformers otherwise)."""
    if sampling.backend != "auto":
        return sampling.backend
    installed = importlib.util.find_spec("vllm") is not None
    return "vllm" if installed and not adapter else "transformers"


def build_policy(
    backend: str,
    tokenizer,
    sampling: SamplingConfig,
    *,
    model=None,
    folder: Path | None = None,
    version: int = 0,
    max_batch: int = 16,
    seed: int = 0,
    max_model_len: int = 4096,
    dtype: Literal["float32", "bfloat16"] = "float32",
    weight_transfer: Literal["nccl", "ipc"] | None = None,
) -> Policy:
    """The policy `backend` samples with, at `version`: "transformers" samples `model` (a module in this
    process, used as it is; `max_batch` episodes share one generate); "vllm" and "server" are `build_reloadable`'s.
    """
    if backend == "transformers":
        assert model is not None, "the transformers backend samples a model in this process"
        return TransformersPolicy(model, tokenizer, cfg=sampling, max_batch=max_batch, version=version)
    return build_reloadable(
        backend, tokenizer, sampling, folder=folder, version=version, seed=seed, max_model_len=max_model_len,
        dtype=dtype, concurrent=max_batch, weight_transfer=weight_transfer,
    )  # fmt: skip


def build_reloadable(
    backend: str,
    tokenizer,
    sampling: SamplingConfig,
    *,
    folder: Path | None,
    version: int = 0,
    seed: int = 0,
    max_model_len: int = 4096,
    dtype: Literal["float32", "bfloat16"] = "float32",
    concurrent: int = 8,
    weight_transfer: Literal["nccl", "ipc"] | None = None,
) -> ReloadablePolicy:
    """The policy `backend` samples with at `version`, whose weights reload from a folder (`reload_weights`):
    "vllm" starts an engine on the dense checkpoint in `folder` (`max_model_len`, `dtype`, `concurrent`: the
    sequences it samples at once, and `weight_transfer` for a GPU weight push); "server" talks to `sampling.url`,
    whose weights the caller loads. `seed` seeds the engines' and servers' sampling."""
    if backend == "server":
        assert sampling.url is not None  # SamplingConfig checks it
        policy = OpenAIPolicy(sampling.url, sampling.model, tokenizer, cfg=sampling, seed=seed)
        policy.version = version
        return policy
    elif backend == "vllm":
        assert folder is not None, "a vLLM engine loads a checkpoint folder"
        from main_agent.vllm_policy import VLLMPolicy  # the optional extra: imported only when asked for

        return VLLMPolicy.start(
            folder, tokenizer, cfg=sampling, seed=seed, max_model_len=max_model_len, version=version,
            dtype=dtype, concurrent=concurrent, weight_transfer=weight_transfer,
        )  # fmt: skip
    raise ValueError(f"unknown sampling backend {backend!r}; expected transformers, vllm or server")
