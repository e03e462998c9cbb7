"""Text generation for the frozen sub-agents, behind one small interface.

    LLM.generate(messages, max_new_tokens=...) -> Generation

Three backends, picked by `BackendConfig.backend`:
- "transformers": in-process, CPU or GPU; concurrent requests are micro-batched into one `generate` call.
- "openai": any OpenAI-compatible endpoint (vLLM serve, llama.cpp server, Ollama, a remote API).
- "vllm": an in-process vLLM engine (optional extra, GPU; vllm_backend.py).

Frozen means deterministic: greedy decoding, fixed seed. Failures of the model (refused connection, 5xx,
context too long, empty choices) raise `BackendError`, which sub-agents turn into `backend_error` results.

`build_llm(cfg)` picks the backend with a plain if/elif. Heavy imports (torch, transformers, vllm) happen
inside the constructors, never at import time.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

from conductor.batching import GenerationError
from conductor.models import DEFAULT_MODEL, ModelNotFound
from conductor.settings import check_range
from subagents.common import approx_tokens

if TYPE_CHECKING:  # imported where used: `import openai` alone takes ~0.6 s of every `conductor ask` start
    import openai

logger = logging.getLogger(__name__)


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
    """OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000/v1 (openai backend only)."""
    api_key_env: str | None = None
    """Environment variable holding the API key; None sends a placeholder key (local servers ignore it)."""
    multimodal: bool = False
    """The endpoint accepts images in messages (a VLM); video frames go to it as images instead of OCR text."""
    max_new_tokens: int = 96
    """Upper bound on answer length; sub-agent answers are short by design."""
    max_batch: int = 8
    """Most requests the transformers micro-batcher packs into one generate call (memory-bound on CPU)."""
    batch_wait_ms: float = 25.0
    """How long the micro-batcher waits for more requests after the first: short next to a ~10 s generation."""
    request_timeout_s: float = 120.0
    """Per-request budget for the openai backend: a 135M model on 2 CPU cores needs tens of seconds."""
    seed: int = 0
    """Seed for any sampling; decoding is greedy by default, so this only matters for temperature > 0."""
    max_retries: int = 2
    """Retries the openai client makes on transient failures (refused connection, timeout, 408/409/429/5xx)."""

    def __post_init__(self) -> None:
        """Bounded, finite numbers (BACKEND_BOUNDS), checked alike in the TOML file and in a hot swap, so no
        setting can leave a tool worse than before it (a NaN wait failed every later call)."""
        for name, (low, high) in BACKEND_BOUNDS.items():
            check_range(name, getattr(self, name), low, high)
        if not self.model:
            raise ValueError("model must name a model")


# What BackendConfig accepts. Past these a value is a mistake, never a setting that works:
BACKEND_BOUNDS: dict[str, tuple[float, float]] = {
    "max_new_tokens": (1, 8192),  # SmolLM2's whole context; a sub-agent answer is tens of tokens
    "max_batch": (1, 256),  # prompts in one generate; 256 is far past what fits a CPU's memory already
    "batch_wait_ms": (0, 1000),  # a wait for company; a second is a tenth of a generation, more only stalls
    "request_timeout_s": (0.1, 3600),  # one generation at the endpoint; the tool's call deadline is 150 s
    "seed": (0, 2**63 - 1),  # torch.manual_seed's and the OpenAI API's range
    "max_retries": (0, 10),  # the openai client's retries with backoff; ten already spend minutes
}


class LLM(Protocol):
    """A frozen text model. `model_id` names it in cache keys; `multimodal` says whether images are accepted."""

    model_id: str
    multimodal: bool

    async def generate(self, messages: list[Message], *, max_new_tokens: int) -> Generation: ...

    def count_tokens(self, text: str) -> int: ...

    async def aclose(self) -> None: ...


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
        from subagents.vllm_backend import VLLMLLM  # the optional extra: imported only when asked for

        return VLLMLLM(cfg)
    raise ValueError(f"unknown backend {cfg.backend!r}; expected transformers, openai or vllm")


def _context_error(prompt_tokens: int, *, max_new_tokens: int, context: int) -> BackendError:
    return BackendError(
        f"context length exceeded: prompt of {prompt_tokens} tokens + {max_new_tokens} new tokens "
        f"> the model's context of {context}",
        retryable=False,
    )


def _text_only_error(model_id: str) -> BackendError:
    return BackendError(f"{model_id} is text-only; images need a multimodal backend", retryable=False)


def _chat_dicts(messages: list[Message]) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.content} for m in messages]


def _cut_at_eos(ids: list[int], eos_ids: frozenset[int]) -> list[int]:
    """Generated ids up to and including the first end-of-sequence token (padding after it dropped)."""
    for i, token in enumerate(ids):
        if token in eos_ids:
            return ids[: i + 1]
    return ids


class TransformersLLM:
    """An HF causal LM in this process; concurrent `generate` calls are micro-batched (see batching.py).

    Prompts are rendered with the tokenizer's chat template and left-padded into one greedy `generate`
    call; `generate` derives position ids from the attention mask, so a padded row decodes like the
    unpadded prompt. Tested equal for SmolLM2 on CPU; batched matmuls round differently, so a near-tie
    argmax could in principle flip one token between a batched and an unbatched run.
    `completion_tokens` counts generated tokens up to and including EOS.
    """

    def __init__(self, cfg: BackendConfig) -> None:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        from conductor import models
        from conductor.batching import MicroBatcher

        if cfg.multimodal:
            raise BackendError("the transformers backend is text-only; use openai or vllm", retryable=False)
        path = models.resolve_model(cfg.model)
        torch.manual_seed(cfg.seed)
        self.model_id = f"transformers:{cfg.model}"
        self.multimodal = False
        self.device = models.default_device()
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
        self.model.to(self.device).eval()  # type: ignore[arg-type]  # transformers mistypes the wrapped `to`
        self.context = AutoConfig.from_pretrained(path, local_files_only=True).max_position_embeddings
        eos = self.model.generation_config.eos_token_id
        eos_list = eos if isinstance(eos, list) else [eos]
        self.eos_ids = frozenset(e for e in [*eos_list, self.tokenizer.eos_token_id] if e is not None)
        pad = self.tokenizer.pad_token_id
        self.pad_id: int = pad if pad is not None else min(self.eos_ids)
        self.batcher = MicroBatcher(self.generate_batch, max_batch=cfg.max_batch, wait_ms=cfg.batch_wait_ms)
        logger.info("loaded %s from %s on %s", cfg.model, path, self.device)

    @property
    def queue_depth(self) -> int:
        """Requests waiting for a batch, for /metrics."""
        return self.batcher.queue_depth

    def render(self, messages: list[Message]) -> list[int]:
        """Prompt token ids: the chat template with the assistant turn opened."""
        ids = self.tokenizer.apply_chat_template(
            _chat_dicts(messages), add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return list(ids)

    async def generate(self, messages: list[Message], *, max_new_tokens: int) -> Generation:
        if any(m.images for m in messages):
            raise _text_only_error(self.model_id)
        prompt = self.render(messages)
        if len(prompt) > self.context - max_new_tokens:  # checked here so it never reaches a batch
            raise _context_error(len(prompt), max_new_tokens=max_new_tokens, context=self.context)
        try:
            ids = (await self.batcher.submit(prompt, max_new_tokens))[:max_new_tokens]
        except GenerationError as exc:
            raise BackendError(str(exc), retryable=exc.retryable) from exc
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        assert isinstance(text, str), f"decode of one sequence returned {type(text)}"
        return Generation(text=text.strip(), prompt_tokens=len(prompt), completion_tokens=len(ids))

    def generate_batch(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Blocking: left-pad `prompts` into one greedy generate; each row's new ids cut after EOS."""
        import torch
        from transformers import GenerationConfig

        from conductor.batching import left_pad

        input_ids, attention_mask = left_pad(prompts, pad_id=self.pad_id)  # [batch, width]
        width = input_ids.shape[1]
        # An explicit config: the checkpoint's own generation_config may ask for sampling.
        config = GenerationConfig(
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=self.pad_id,
            eos_token_id=sorted(self.eos_ids),
        )
        with torch.inference_mode():  # thread-local, so entered here in the worker thread
            out = self.model.generate(
                input_ids=input_ids.to(self.device),
                attention_mask=attention_mask.to(self.device),
                generation_config=config,
            )  # [batch, width + generated]
        return [_cut_at_eos(row, self.eos_ids) for row in out[:, width:].tolist()]

    async def score(self, messages: list[Message], replies: list[str]) -> list[float]:
        """Log-probability of each reply as the model's whole answer to `messages` (its tokens, then EOS).

        Only this backend offers it (page_qa's "extract" mode): an endpoint does not return prompt log-probs
        everywhere. One forward of the prompt, then one batched forward of the replies over its KV cache.
        """
        prompt = self.render(messages)
        eos = self.tokenizer.eos_token_id
        assert eos is not None, "scoring needs the tokenizer's end-of-turn token"
        ids = [self.tokenizer.encode(r, add_special_tokens=False) + [eos] for r in replies]
        if len(prompt) + max(map(len, ids), default=0) > self.context:
            raise _context_error(len(prompt), max_new_tokens=max(map(len, ids)), context=self.context)
        return await asyncio.to_thread(self.score_batch, prompt, ids) if ids else []

    def score_batch(self, prompt: list[int], replies: list[list[int]]) -> list[float]:
        """Blocking: summed log-probs of each (non-empty) reply after `prompt`."""
        import torch

        batch, width = len(replies), max(map(len, replies))
        rows = torch.tensor([r + [self.pad_id] * (width - len(r)) for r in replies])  # [batch, width]
        mask = torch.tensor([[1.0] * len(r) + [0.0] * (width - len(r)) for r in replies])  # [batch, width]
        with torch.inference_mode():
            out = self.model(
                input_ids=torch.tensor([prompt], device=self.device), use_cache=True
            )  # [1, P, vocab]
            first = torch.log_softmax(out.logits[0, -1].float(), -1)  # [vocab]: each reply's first token
            cache = out.cache
            cache.batch_repeat_interleave(batch)
            # Right padding: a reply's tokens never attend to the padding after them (causal), so no mask.
            positions = torch.arange(len(prompt), len(prompt) + width).expand(batch, -1)
            logits = self.model(
                input_ids=rows.to(self.device),
                position_ids=positions.to(self.device),
                cache=cache,
            ).logits.float()  # [batch, width, vocab]
            rest = torch.log_softmax(logits[:, :-1], -1).gather(2, rows[:, 1:, None].to(self.device))
            total = first[rows[:, 0]].cpu() + (rest[..., 0].cpu() * mask[:, 1:]).sum(1)  # [batch]
        return total.tolist()

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    async def aclose(self) -> None:
        await self.batcher.aclose()


# A server that accepts the connection but cannot answer within the request budget is as good as down; a
# refused or unreachable host should fail in seconds, not after the whole budget.
CONNECT_TIMEOUT_S = 5.0

# How endpoints word "prompt too long": vLLM ("maximum context length is"), OpenAI
# ("context_length_exceeded"), llama.cpp ("exceeds the available context size"), others ("prompt is too long").
_CONTEXT_WORDING = re.compile(
    r"context[ _-]?(length|size|window)|maximum context|prompt is too long|too many tokens", re.IGNORECASE
)


def _data_url(image: bytes) -> str:
    mime = "image/png" if image.startswith(b"\x89PNG") else "image/jpeg"
    return f"data:{mime};base64,{base64.b64encode(image).decode('ascii')}"


def _openai_message(message: Message) -> dict[str, object]:
    """One chat message on the wire; images become `image_url` content parts after the text."""
    if not message.images:
        return {"role": message.role, "content": message.content}
    parts: list[dict[str, object]] = [{"type": "text", "text": message.content}]
    parts += [{"type": "image_url", "image_url": {"url": _data_url(image)}} for image in message.images]
    return {"role": message.role, "content": parts}


def _map_openai_error(exc: openai.APIError, timeout_s: float) -> BackendError:
    """What a failed call means for the caller, after the client's own retries were spent."""
    import openai

    if isinstance(exc, openai.APITimeoutError):
        return BackendError(f"endpoint timed out after {timeout_s:.0f} s", retryable=True)
    if isinstance(exc, openai.APIConnectionError):
        return BackendError(f"cannot reach endpoint: {exc}", retryable=True)
    if isinstance(exc, openai.APIStatusError):
        status = exc.status_code
        if status == 400 and _CONTEXT_WORDING.search(f"{exc.message} {exc.body}"):
            return BackendError(f"context length exceeded: {exc.message}", retryable=False)
        transient = status >= 500 or status in (408, 409, 429)
        return BackendError(f"endpoint answered {status}: {exc.message}", retryable=transient)
    return BackendError(f"endpoint error: {exc}", retryable=False)  # e.g. a malformed response body


class OpenAILLM:
    """Any OpenAI-compatible chat-completions endpoint (vLLM serve, llama.cpp server, Ollama, an API).

    One retry layer: the openai client's own `max_retries` (exponential backoff with jitter, honouring
    Retry-After) covers exactly the transient failures (connection errors, timeouts, 408/409/429/5xx)
    and never retries other 4xx. A second layer (tenacity) would multiply attempts, so there is none.
    `count_tokens` is an estimate (`approx_tokens`): the endpoint's tokenizer is not known here. Token
    counts in `Generation` come from the response's `usage` and fall back to the same estimate.
    """

    def __init__(self, cfg: BackendConfig) -> None:
        import openai

        if cfg.base_url is None:
            raise BackendError(
                "the openai backend needs base_url (e.g. http://127.0.0.1:8000/v1)", retryable=False
            )
        api_key = "EMPTY"  # local servers ignore the key, but the client insists on one
        if cfg.api_key_env is not None:
            if cfg.api_key_env not in os.environ:
                raise BackendError(f"environment variable {cfg.api_key_env} is not set", retryable=False)
            api_key = os.environ[cfg.api_key_env]
        self.cfg = cfg
        self.model_id = f"openai:{cfg.model}"
        self.multimodal = cfg.multimodal
        self.client = openai.AsyncOpenAI(
            base_url=cfg.base_url,
            api_key=api_key,
            # Read/write/pool share the per-request budget; connect is short (see CONNECT_TIMEOUT_S).
            # openai.Timeout is the Timeout class of the HTTP library the installed client uses (httpx or
            # httpx2 since openai 3); httpx.Timeout works at run time too but mistypes under openai 3.
            timeout=openai.Timeout(cfg.request_timeout_s, connect=CONNECT_TIMEOUT_S),
            max_retries=cfg.max_retries,
        )

    async def generate(self, messages: list[Message], *, max_new_tokens: int) -> Generation:
        import openai  # loaded by __init__ already

        if not self.multimodal and any(m.images for m in messages):
            raise _text_only_error(self.model_id)
        try:
            response = await self.client.chat.completions.create(
                model=self.cfg.model,
                messages=[_openai_message(m) for m in messages],  # type: ignore[misc]
                max_tokens=max_new_tokens,  # not max_completion_tokens: older local servers only know this
                temperature=0,
                seed=self.cfg.seed,
            )
        except openai.APIError as exc:
            error = _map_openai_error(exc, self.cfg.request_timeout_s)
            logger.warning("%s: %s", self.model_id, error)
            raise error from exc
        if not response.choices or response.choices[0].message.content is None:
            raise BackendError(
                f"{self.model_id} returned no answer (empty choices or content)", retryable=True
            )
        text = response.choices[0].message.content.strip()
        if response.usage is None:
            prompt_tokens = sum(approx_tokens(m.content) for m in messages)
            return Generation(text=text, prompt_tokens=prompt_tokens, completion_tokens=approx_tokens(text))
        usage = response.usage
        return Generation(
            text=text, prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens
        )

    def count_tokens(self, text: str) -> int:
        return approx_tokens(text)

    async def aclose(self) -> None:
        await self.client.close()
