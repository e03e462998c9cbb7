"""The sub-agents' OpenAI-compatible backend (`backend = "openai"`: vLLM serve, llama.cpp, Ollama, an API): see
llm.py.

The endpoint is configured, not discovered, but what it sends is untrusted input, as a page is: a proxy's login
page, a crashed server's half reply, a broken or hostile endpoint. So the client is written here on httpx rather
than the openai SDK (which follows redirects, reads a whole body into memory and lets a malformed reply escape as
a TypeError or AttributeError), and every exchange keeps these rules:
- No redirect is followed: a 3xx is a BackendError. The prompt, page text included, goes only to `base_url`; a
  redirect could hand it to any port of this machine, ports the fetch guard (fetch.py) keeps closed to the tools.
- The reply is read as a stream and decoded here (gzip, deflate: `fetch.CappedDecoder`) with a cap on decoded
  bytes (MAX_REPLY_BYTES), so a huge body or a gzip bomb stops at the cap; a longer Content-Length is refused unread.
- Each attempt has one deadline for the whole exchange (`request_timeout_s`): httpx's timeouts are per read, and a
  reader sending a byte every few seconds would restart them until the tool's call deadline.
- Whatever comes back that is not a chat completion (not JSON, not UTF-8, wrong types, a list ...) is a
  BackendError saying what came, in a few hundred characters, never another exception: page_qa reports it as
  `backend_error` and the policy reads it.
- Retries: at most `max_retries`, on transient failures only (a refused or broken connection, a timeout,
  408/409/429/5xx), after a jittered exponential backoff or the reply's Retry-After (at most MAX_BACKOFF_S).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import random
import re
import zlib

import httpx
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from conductor.http import header_number, retry_after
from subagents.common import ToolFailure, approx_tokens
from subagents.fetch import ACCEPT_ENCODING, CappedDecoder
from subagents.llm import (
    BackendConfig,
    BackendError,
    Generation,
    Message,
    cannot_score_error,
    text_only_error,
)

logger = logging.getLogger(__name__)


# A server that accepts the connection but cannot answer within the request budget is as good as down; a
# refused or unreachable host should fail in seconds, not after the whole budget.
CONNECT_TIMEOUT_S = 5.0
# Decoded bytes of a reply: the longest answer a BackendConfig allows (8,192 tokens, ~32 KB of text; ~200 KB even
# if every character came \u-escaped) fits five times over. Eight page_qa calls at once hold at most 8 MiB.
MAX_REPLY_BYTES = 1 << 20
# Of an error reply, this much is read (an error message is a line; an HTML error page is cut) and this much quoted.
MAX_ERROR_BYTES = 64 << 10
MAX_QUOTED_CHARS = 200
# Backoff before retry n: a uniform wait in [0, BACKOFF_S * 2**n], at most MAX_BACKOFF_S, which also caps a
# Retry-After: the openai SDK's values, kept when this client replaced it.
BACKOFF_S = 0.5
MAX_BACKOFF_S = 8.0
RETRIED_STATUS = frozenset({408, 409, 429})  # and every 5xx: the statuses whose cause may pass
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


class _Transient(BackendError):
    """A failure the same request may not meet again (module docstring); `wait_s`: the Retry-After it came with."""

    def __init__(self, message: str, *, wait_s: float | None = None) -> None:
        super().__init__(message, retryable=True)
        self.wait_s = wait_s


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
            self._http = httpx.AsyncClient(
                base_url=cfg.base_url,
                headers={"Authorization": f"Bearer {api_key}", "Accept-Encoding": ACCEPT_ENCODING},
                # Per phase; `_attempt` puts one deadline of the same budget on the whole exchange.
                timeout=httpx.Timeout(cfg.request_timeout_s, connect=CONNECT_TIMEOUT_S),
                follow_redirects=False,  # a redirect is an error (module docstring)
            )
        except httpx.InvalidURL as exc:  # past BackendConfig's check: a host that is no IDNA name
            raise BackendError(f"base_url is not usable: {_quoted(str(exc))}", retryable=False) from None

    async def generate(self, messages: list[Message], *, max_new_tokens: int) -> Generation:
        if not self.multimodal and any(m.images for m in messages):
            raise text_only_error(self.model_id)
        body = {
            "model": self.cfg.model,
            "messages": [_openai_message(m) for m in messages],
            "max_tokens": max_new_tokens,  # not max_completion_tokens: older local servers only know this
            "temperature": 0,
            "seed": self.cfg.seed,
        }
        try:
            completion = _completion(*await self._post(body))
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
        await self._http.aclose()

    async def _post(self, body: dict[str, object]) -> tuple[int, str, bytes]:
        """A 2xx reply to `body`: status, Content-Type and decoded body; transient failures retried (docstring)."""
        attempt = 0
        while True:
            try:
                return await self._attempt(body)
            except _Transient as error:
                if attempt >= self.cfg.max_retries:
                    raise
                attempt += 1
                backoff = random.uniform(0, BACKOFF_S * 2**attempt)
                wait = min(MAX_BACKOFF_S, backoff if error.wait_s is None else error.wait_s)
                logger.info("%s: %s; retry %d in %.2f s", self.model_id, error, attempt, wait)
                await asyncio.sleep(wait)

    async def _attempt(self, body: dict[str, object]) -> tuple[int, str, bytes]:
        """One exchange, the whole of it within `request_timeout_s`."""
        budget = self.cfg.request_timeout_s
        try:
            async with (
                asyncio.timeout(budget),
                self._http.stream("POST", "chat/completions", json=body) as response,
            ):
                return await _read(response)
        except (TimeoutError, httpx.TimeoutException):
            raise _Transient(f"endpoint timed out after {budget:g} s") from None
        except httpx.ConnectError as exc:
            raise _Transient(f"cannot reach endpoint: {_quoted(str(exc))}") from None
        except httpx.TransportError as exc:  # a read or protocol error: a reply cut short, a connection reset
            raise _Transient(
                f"the endpoint's reply broke off: {type(exc).__name__}: {_quoted(str(exc))}"
            ) from None


async def _read(response: httpx.Response) -> tuple[int, str, bytes]:
    """A 2xx reply's status, Content-Type and body (at most MAX_REPLY_BYTES decoded); BackendError otherwise."""
    status, content_type = response.status_code, response.headers.get("content-type", "")
    if 300 <= status < 400:
        raise BackendError(
            f"endpoint answered {status}, a redirect, which is not followed: set base_url to the endpoint itself",
            retryable=False,
        )
    if status < 300:
        return status, content_type, await _body(response, MAX_REPLY_BYTES)
    said = _said(content_type, await _head_of_body(response, MAX_ERROR_BYTES))
    if status == 400 and _CONTEXT_WORDING.search(said):
        raise BackendError(f"context length exceeded: {said[:MAX_QUOTED_CHARS]}", retryable=False)
    message = f"endpoint answered {status}: {said[:MAX_QUOTED_CHARS]}"
    if status >= 500 or status in RETRIED_STATUS:
        raise _Transient(message, wait_s=retry_after(response.headers))
    raise BackendError(message, retryable=False)


async def _body(response: httpx.Response, cap: int) -> bytes:
    """The decoded body, read as it streams; BackendError past `cap` decoded bytes (a longer Content-Length is
    refused unread), or for an encoding that cannot be decoded under a cap (br, zstd) or a corrupt one."""
    declared = header_number(response.headers.get("content-length", ""))
    if declared is not None and declared > cap:
        raise BackendError(
            f"the reply is too large: Content-Length {declared:.0f} over {cap} bytes", retryable=False
        )
    encoding = response.headers.get("content-encoding", "")
    try:
        decoder = CappedDecoder(encoding, cap)
        chunks = [decoder.feed(chunk) async for chunk in response.aiter_raw()]
        return b"".join(chunks) + decoder.flush()
    except ToolFailure as exc:
        what = "too large" if exc.error.kind == "too_large" else "not readable"
        raise BackendError(
            f"the reply is {what}: {exc.error.message[:MAX_QUOTED_CHARS]}", retryable=False
        ) from None
    except zlib.error as exc:
        raise BackendError(
            f"the reply's {encoding[:20]!r} encoding is corrupt: {exc}", retryable=False
        ) from None


async def _head_of_body(response: httpx.Response, cap: int) -> bytes:
    """At most the first `cap` decoded bytes of an error reply, the rest unread; b"" if none can be decoded."""
    chunks: list[bytes] = []
    try:
        decoder = CappedDecoder(response.headers.get("content-encoding", ""), cap)
        async for chunk in response.aiter_raw():
            chunks.append(decoder.feed(chunk))
    except (
        ToolFailure,
        zlib.error,
    ):  # past the cap, or not decodable: what came so far says enough, or nothing
        pass
    return b"".join(chunks)


def _completion(status: int, content_type: str, body: bytes) -> _Completion:
    """The chat completion `body` holds; BackendError naming the first problem (never quoting the body)."""
    try:
        return _Completion.model_validate_json(body)
    except ValidationError as exc:
        error = exc.errors(include_url=False, include_input=False)[0]
        problem = f"{'.'.join(map(str, error['loc'])) or 'the body'}: {error['msg']}"
        media = content_type.partition(";")[0].strip() or "no Content-Type"
        raise BackendError(
            f"endpoint answered {status} with no chat completion ({_quoted(media)}, {len(body)} bytes): "
            f"{_quoted(problem)}",
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
