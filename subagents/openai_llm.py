"""The sub-agents' OpenAI-compatible backend (`backend = "openai"`: vLLM serve, llama.cpp, Ollama, an API): see
llm.py.

The endpoint is configured, not discovered, but what it sends is untrusted input, as a page is: a proxy's login
page, a crashed server's half reply, a broken or hostile endpoint. The `openai` package speaks the protocol over
the project's hardened client (conductor/http.py: no redirect followed, replies decoded under a cap, the whole
exchange within `request_timeout_s`, retries on transient failures only, at most `max_retries`). Here:
- The reply's body is read by this module's strict models, not the SDK's (which build their objects without
  validating them): whatever comes back that is not a chat completion (not JSON, not UTF-8, wrong types, a list,
  a token count past MAX_USAGE_TOKENS ...) is a BackendError saying what came, in a few hundred characters.
- Every failure is a BackendError, never another exception: page_qa reports it as `backend_error` and the policy
  reads it. `retryable` says whether the same call may yet succeed (conductor/http.py's `transient`).
"""

from __future__ import annotations

import base64
import logging
import os
import re

import httpx
import openai
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from conductor.http import (
    CONNECT_TIMEOUT_S,
    MAX_ERROR_BYTES,
    ReplyRefused,
    openai_client,
    reason,
    retried,
    transient,
)
from subagents.common import approx_tokens
from subagents.llm import (
    BackendConfig,
    BackendError,
    Generation,
    Message,
    cannot_score_error,
    text_only_error,
)

logger = logging.getLogger(__name__)

# Of an error reply's text, this much is quoted in a BackendError.
MAX_QUOTED_CHARS = 200
# Most tokens a reply's `usage` may report for one request: ten times the longest context window served today
# (10M tokens). Past it the count is no count (a reader said 10**30) and would swamp tokens_read in metrics.
MAX_USAGE_TOKENS = 100_000_000


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


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True)  # no coercion: 123 is no answer, "5" no token count


class _ReplyMessage(_Strict):
    content: str | None


class _Choice(_Strict):
    message: _ReplyMessage


class _Usage(_Strict):
    """Token counts as the endpoint reports them: a count past MAX_USAGE_TOKENS is a lie, a BackendError."""

    prompt_tokens: int = Field(ge=0, le=MAX_USAGE_TOKENS)
    completion_tokens: int = Field(ge=0, le=MAX_USAGE_TOKENS)


class _Completion(_Strict):
    """The fields of a chat completion this client reads; the others (id, model, finish_reason ...) are ignored."""

    choices: list[_Choice]
    usage: _Usage | None = None


class OpenAILLM:
    """Any OpenAI-compatible chat-completions endpoint, under the rules of the module docstring.

    `count_tokens` is an estimate (`approx_tokens`): the endpoint's tokenizer is not known here. Token counts in
    `Generation` come from the reply's `usage` and fall back to the same estimate.
    """

    def __init__(self, cfg: BackendConfig) -> None:
        if cfg.base_url is None:
            raise BackendError(
                "the openai backend needs base_url (e.g. http://127.0.0.1:8000/v1)", retryable=False
            )
        api_key = "EMPTY"  # local servers ignore the key, but some insist on one
        if cfg.api_key_env is not None:
            if cfg.api_key_env not in os.environ:
                raise BackendError(f"environment variable {cfg.api_key_env} is not set", retryable=False)
            api_key = os.environ[cfg.api_key_env]
        self.cfg = cfg
        self.model_id = f"openai:{cfg.model}"
        self.multimodal = cfg.multimodal
        self.scores = False
        try:
            self._openai = openai_client(cfg.base_url, api_key=api_key, reply_timeout_s=cfg.request_timeout_s)
        except httpx.InvalidURL as exc:  # past BackendConfig's check: a host that is no IDNA name
            raise BackendError(f"base_url is not usable: {_quoted(str(exc))}", retryable=False) from None

    async def generate(self, messages: list[Message], *, max_new_tokens: int) -> Generation:
        if not self.multimodal and any(m.images for m in messages):
            raise text_only_error(self.model_id)
        try:
            completion = _completion(await self._post(messages, max_new_tokens))
        except BackendError as error:
            logger.warning("%s: %s", self.model_id, error)
            raise
        content = completion.choices[0].message.content if completion.choices else None
        if content is None:
            raise BackendError(
                f"{self.model_id} returned no answer (empty choices or content)", retryable=True
            )
        text = content.strip()
        if completion.usage is None:
            prompt_tokens = sum(approx_tokens(m.content) for m in messages)
            return Generation(text=text, prompt_tokens=prompt_tokens, completion_tokens=approx_tokens(text))
        usage = completion.usage
        return Generation(
            text=text, prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens
        )

    async def score(self, prompts: list[list[Message]], replies: list[str]) -> list[list[float]]:
        raise cannot_score_error(self.model_id)

    def count_tokens(self, text: str) -> int:
        return approx_tokens(text)

    async def aclose(self) -> None:
        await self._openai.close()

    async def _post(self, messages: list[Message], max_new_tokens: int) -> httpx.Response:
        """The 2xx reply, its body read; transient failures retried (conductor/http.py), others a BackendError."""
        wire = [_openai_message(m) for m in messages]
        try:
            reply = await retried(
                lambda: self._openai.chat.completions.with_raw_response.create(
                    model=self.cfg.model,
                    messages=wire,  # type: ignore[arg-type]  # the wire shape, not the SDK's TypedDicts
                    max_tokens=max_new_tokens,  # not max_completion_tokens: older local servers only know this
                    temperature=0,
                    seed=self.cfg.seed,
                ),
                max_retries=self.cfg.max_retries,
            )
        except openai.APIError as exc:
            raise _backend_error(exc, budget_s=self.cfg.request_timeout_s) from None
        return reply.http_response


def _backend_error(error: openai.APIError, *, budget_s: float) -> BackendError:
    """What `error` says, as a BackendError; retryable where the same call may yet succeed."""
    retryable = transient(error)
    if isinstance(error, openai.APITimeoutError):
        return BackendError(f"endpoint timed out after {budget_s:g} s", retryable=retryable)
    if isinstance(error, openai.APIStatusError):
        said = _said(error.response.headers.get("content-type", ""), error.response.content)
        if error.status_code == 400 and _CONTEXT_WORDING.search(said):
            return BackendError(f"context length exceeded: {said[:MAX_QUOTED_CHARS]}", retryable=False)
        return BackendError(
            f"endpoint answered {error.status_code}: {said[:MAX_QUOTED_CHARS]}", retryable=retryable
        )
    cause = error.__cause__
    if isinstance(cause, ReplyRefused):
        return BackendError(f"the endpoint's reply is refused: {_quoted(str(cause))}", retryable=False)
    if isinstance(cause, httpx.ConnectError):
        return BackendError(f"cannot reach endpoint: {_quoted(str(cause))}", retryable=retryable)
    # a read or protocol error: a reply cut short, a connection reset
    return BackendError(f"the endpoint's reply broke off: {_quoted(reason(error))}", retryable=retryable)


def _completion(response: httpx.Response) -> _Completion:
    """The chat completion `response` holds; BackendError naming the first problem (never quoting the body)."""
    try:
        return _Completion.model_validate_json(response.content)
    except ValidationError as exc:
        error = exc.errors(include_url=False, include_input=False)[0]
        problem = f"{'.'.join(map(str, error['loc'])) or 'the body'}: {error['msg']}"
        media = response.headers.get("content-type", "").partition(";")[0].strip() or "no Content-Type"
        raise BackendError(
            f"endpoint answered {response.status_code} with no chat completion ({_quoted(media)}, "
            f"{len(response.content)} bytes): {_quoted(problem)}",
            retryable=False,
        ) from None


def _said(content_type: str, body: bytes) -> str:
    """What an error reply says: its text when JSON or plain text (an API's error message), else its type and size
    (an HTML error page or a binary says nothing a reader of the observation could use)."""
    media = content_type.partition(";")[0].strip().lower()
    if media in ("application/json", "text/plain"):
        return _quoted(body.decode("utf-8", errors="ignore"), limit=MAX_ERROR_BYTES)
    return f"({_quoted(media) or 'no Content-Type'}, {len(body)} bytes)"


def _quoted(text: str, *, limit: int = MAX_QUOTED_CHARS) -> str:
    """`text` on one line of printable characters, at most `limit` of them."""
    return " ".join("".join(c if c.isprintable() else " " for c in text[: limit * 2]).split())[:limit]
