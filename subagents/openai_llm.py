"""The sub-agents' OpenAI-compatible backend (`backend = "openai"`: vLLM serve, llama.cpp, Ollama, an API): see
llm.py."""

from __future__ import annotations

import base64
import logging
import os
import re
from typing import TYPE_CHECKING

import httpx

from subagents.common import approx_tokens
from subagents.llm import (
    BackendConfig,
    BackendError,
    Generation,
    Message,
    cannot_score_error,
    text_only_error,
)

if TYPE_CHECKING:  # imported where used: `import openai` alone takes ~0.6 s of every `conductor ask` start
    import openai

logger = logging.getLogger(__name__)


# A server that accepts the connection but cannot answer within the request budget is as good as down; a
# refused or unreachable host should fail in seconds, not after the whole budget.
CONNECT_TIMEOUT_S = 5.0

# How endpoints word "prompt too long": vLLM ("maximum context length is"), OpenAI
# ("context_length_exceeded"), llama.cpp ("exceeds the available context size"), others ("prompt is too long").
_CONTEXT_WORDING = re.compile(
    r"context[ _-]?(length|size|window)|maximum context|prompt is too long|too many tokens", re.IGNORECASE
)


def served_model(base_url: str, model: str | None = None, *, timeout_s: float = 10.0) -> str:
    """The model to ask at `base_url`: `model` when given, else the first one its `GET /models` lists (vLLM
    serve, llama.cpp, Ollama list theirs). Either way the endpoint must answer that now: a wrong URL is a
    BackendError at start-up, naming what answered, not a `backend_error` in the first call."""
    url = f"{base_url.rstrip('/')}/models"
    try:
        response = httpx.get(url, timeout=httpx.Timeout(timeout_s, connect=CONNECT_TIMEOUT_S))
        response.raise_for_status()
        listed = [str(entry["id"]) for entry in response.json()["data"]]
    except httpx.HTTPError as exc:
        raise BackendError(f"no OpenAI-compatible endpoint answers at {url}: {exc}", retryable=True) from exc
    except (ValueError, KeyError, TypeError) as exc:  # not JSON, or not a model list
        raise BackendError(
            f"{url} answered, but not with a list of models: {exc!r}", retryable=False
        ) from exc
    if model is not None:
        return model
    if not listed:
        raise BackendError(f"{url} lists no model", retryable=False)
    return listed[0]


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
        self.scores = False
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
            raise text_only_error(self.model_id)
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

    async def score(self, messages: list[Message], replies: list[str]) -> list[float]:
        raise cannot_score_error(self.model_id)

    def count_tokens(self, text: str) -> int:
        return approx_tokens(text)

    async def aclose(self) -> None:
        await self.client.close()
