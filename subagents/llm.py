"""The frozen sub-agents' text models: the contract every backend keeps, and the helpers they share.

    LLM.generate(messages, max_new_tokens=...) -> Generation
    LLM.score(prompts, replies) -> list[list[float]]  only where `LLM.scores` (the transformers backend)

A backend is picked by `BackendConfig.backend` (`[<subagent>.model]` in the server's TOML) and built by
`subagents.backends.build_llm`; each lives in its own file: transformers_llm.py (in-process, micro-batched),
openai_llm.py (any OpenAI-compatible endpoint), vllm_llm.py (an in-process vLLM engine, the `vllm` extra).

Frozen means deterministic: greedy decoding, fixed seed. Failures of the model (refused connection, 5xx,
context too long, empty choices) raise `BackendError`, which sub-agents turn into `backend_error` results.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol
from urllib.parse import urlsplit

from conductor.models import DEFAULT_MODEL
from conductor.settings import check_range


@dataclass(frozen=True)
class Message:
    """One chat message. `images` are encoded image bytes (PNG/JPEG) for multimodal backends only."""

    role: Literal["system", "user", "assistant"]
    content: str
    images: tuple[bytes, ...] = ()


@dataclass(frozen=True)
class Generation:
    text: str
    prompt_tokens: int
    completion_tokens: int


class BackendError(Exception):
    """The model behind a sub-agent failed. `retryable` says whether the same call may succeed later."""

    def __init__(self, message: str, *, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable


@dataclass(frozen=True)
class BackendConfig:
    """Which model answers for a sub-agent. Read from `[<subagent>.model]` in the server's TOML."""

    backend: Literal["transformers", "openai", "vllm"] = "transformers"
    """Where generation runs."""
    model: str = DEFAULT_MODEL
    """Built-in name, local HF checkpoint dir (transformers/vllm), or the served model name (openai)."""
    base_url: str | None = None
    """OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000/v1 (openai backend only): http or https, with a
    host, no whitespace or control characters (`check_base_url`)."""
    api_key_env: str | None = None
    """Environment variable holding the API key; None sends a placeholder key (local servers ignore it). The
    tool server accepts only the names its `[server] allowed_api_key_envs` lists."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Weights and activations of an in-process model (transformers). "auto": the dtype its checkpoint was written
    in (float32 for SmolLM2, the policy's model; bfloat16 for the 0.5B reader, conductor/models.py), except
    float32 where the device has no native bfloat16 (a GPU without it, a CPU without AVX512-BF16 or AMX, where
    torch emulates it). In bfloat16 a matmul runs 2.5-3.5x float32's speed on these cores and the weights take
    half the memory, but a micro-batched generation can differ from the same prompt's alone (rounding follows
    the batch's shape); scoring (page_qa's "extract") is one unbatched pass a call and answers alike."""
    multimodal: bool = False
    """The endpoint accepts images in messages (a VLM); video frames go to it as images instead of OCR text."""
    max_new_tokens: int = 96
    """Upper bound on answer length; sub-agent answers are short by design."""
    max_batch: int | None = None
    """Most requests the transformers micro-batcher packs into one generate call; None: by the device the model
    loads on (`batch_for`: 8 on a CPU, as before, where it is memory-bound; 64 on a GPU). A set value wins."""
    batch_wait_ms: float = 25.0
    """How long the micro-batcher waits for more requests after the first: short next to a ~10 s generation."""
    request_timeout_s: float = 120.0
    """Budget of one request of the openai backend, the whole exchange (connect, send, every byte of the reply):
    a 135M model on 2 CPU cores needs tens of seconds."""
    seed: int = 0
    """Seed for any sampling; decoding is greedy by default, so this only matters for temperature > 0."""
    max_retries: int = 2
    """Retries the openai backend makes on transient failures (refused connection, timeout, 408/409/429/5xx)."""

    def __post_init__(self) -> None:
        """Bounded, finite numbers (BACKEND_BOUNDS), checked alike in the TOML file and in a hot swap, so no
        setting can leave a tool worse than before it (a NaN wait failed every later call)."""
        for name, (low, high) in BACKEND_BOUNDS.items():
            if getattr(self, name) is not None:  # max_batch None: chosen for the device (`batch_for`)
                check_range(name, getattr(self, name), low, high)
        if not self.model:
            raise ValueError("model must name a model")
        if self.base_url is not None:
            check_base_url(self.base_url)


# What BackendConfig accepts. Past these a value is a mistake, never a setting that works:
BACKEND_BOUNDS: dict[str, tuple[float, float]] = {
    "max_new_tokens": (1, 8192),  # SmolLM2's whole context; a sub-agent answer is tens of tokens
    "max_batch": (1, 256),  # prompts in one generate; 256 is far past what fits a CPU's memory already
    "batch_wait_ms": (0, 1000),  # a wait for company; a second is a tenth of a generation, more only stalls
    "request_timeout_s": (0.1, 3600),  # one generation at the endpoint; the tool's call deadline is 150 s
    "seed": (0, 2**63 - 1),  # torch.manual_seed's and the OpenAI API's range
    "max_retries": (0, 10),  # the openai backend's retries with backoff; ten already spend minutes
}

# Longest base_url accepted: RFC 9110's least URL length every HTTP party should support (8,000 octets) is for
# whole request targets; an endpoint's base is a host and a short path, so 2,048 is already far past a real one.
MAX_BASE_URL_CHARS = 2048


def check_base_url(url: str) -> None:
    """ValueError unless `url` is an http:// or https:// URL with a host, a valid port and no whitespace or control
    characters (a `\\r` in it failed the model's build as an HTTP 500; `ftp://` was accepted and failed later)."""
    if len(url) > MAX_BASE_URL_CHARS:
        raise ValueError(f"base_url must be at most {MAX_BASE_URL_CHARS} characters, got {len(url)}")
    odd = next((c for c in url if c.isspace() or not c.isprintable()), None)
    if odd is not None:
        raise ValueError(f"base_url must not contain whitespace or control characters, found {odd!r}")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018  (ValueError for a port that is not a number from 0 to 65535)
    except ValueError as exc:  # that, or a malformed IPv6 host
        raise ValueError(f"base_url is not a URL: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"base_url must be an http:// or https:// URL, got scheme {parts.scheme[:20]!r}")
    if not parts.hostname:
        raise ValueError("base_url must name a host, e.g. http://127.0.0.1:8000/v1")


CPU_BATCH = 8  # memory-bound on a CPU; the value before the batch was sized by device
# A 135M model's KV cache for a ~1.5k-token page_qa prompt is tens of MB a row: 64 rows are a few GB of a GPU's.
GPU_BATCH = 64


def batch_for(device: str, configured: int | None) -> int:
    """The transformers micro-batch on `device` ("cpu", "cuda", "cuda:N"): `configured` where set, else
    `GPU_BATCH` on a GPU and `CPU_BATCH` on anything else."""
    if configured is not None:
        return configured
    return GPU_BATCH if device.startswith("cuda") else CPU_BATCH


class LLM(Protocol):
    """A frozen text model. `model_id` names it in cache keys; `multimodal` says whether images are accepted;
    `scores` whether `score` works (the transformers backend: an OpenAI-compatible endpoint does not return
    the log-probs of a reply it is given everywhere, and the vLLM backend does not ask its engine for them).
    Where it does not, `score` raises `cannot_score_error`; sub-agents that need it say so at start-up
    (page_qa's `check_model`)."""

    model_id: str
    multimodal: bool
    scores: bool

    async def generate(self, messages: list[Message], *, max_new_tokens: int) -> Generation: ...

    async def score(self, prompts: list[list[Message]], replies: list[str]) -> list[list[float]]:
        """Log-probability of each reply as the model's whole answer (its tokens, then EOS) to each prompt's
        messages, [prompt][reply]; prompts that share their first tokens (a page) may share their work."""
        ...

    def count_tokens(self, text: str) -> int: ...

    async def aclose(self) -> None: ...


def context_error(prompt_tokens: int, *, max_new_tokens: int, context: int) -> BackendError:
    return BackendError(
        f"context length exceeded: prompt of {prompt_tokens} tokens + {max_new_tokens} new tokens "
        f"> the model's context of {context}",
        retryable=False,
    )


def text_only_error(model_id: str) -> BackendError:
    return BackendError(f"{model_id} is text-only; images need a multimodal backend", retryable=False)


def cannot_score_error(model_id: str) -> BackendError:
    return BackendError(
        f"{model_id} cannot score replies; only the transformers backend can", retryable=False
    )


def chat_dicts(messages: list[Message]) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.content} for m in messages]


def cut_at_eos(ids: list[int], eos_ids: frozenset[int]) -> list[int]:
    """Generated ids up to and including the first end-of-sequence token (padding after it dropped)."""
    for i, token in enumerate(ids):
        if token in eos_ids:
            return ids[: i + 1]
    return ids
