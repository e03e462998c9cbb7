"""The project's HTTP rules, written once: what a reply's headers say, the caps on a reply, the one hardened client
the OpenAI-compatible endpoints are reached through, and when a failed request is worth another attempt.

Two clients talk to OpenAI-compatible endpoints: the reader behind `--reader-url` (subagents/openai_llm.py) and
the policy behind `--policy-url` (main_agent/openai_policy.py). Both use the `openai` package for the protocol,
over `openai_client`'s httpx client, whose transport holds these rules for every exchange:
- No redirect is followed: a 3xx is `ReplyRefused`. The prompt, a page's text included, goes only to the
  configured URL; a redirect could hand it to any port of this machine (ports the fetch guard keeps closed to
  the tools). No proxy is read from the environment either.
- A reply is decoded here as it streams (identity, gzip, deflate: `CappedDecoder`), never by httpx: a 2xx past
  `max_bytes` decoded (a huge body, a gzip bomb) or declared longer by its Content-Length is `ReplyRefused`, as
  are an encoding that cannot be decoded under a cap (br, zstd) and a corrupt one. Of an error reply only the
  first MAX_ERROR_BYTES are read, quietly: its first line says what went wrong.
- The request's `read` timeout bounds the whole exchange (connect, send, every byte of the reply), not only each
  read: a server sending a byte every few seconds would restart a per-read timeout until the caller's deadline.
The SDK's own retries are off (`max_retries=0`); its callers retry through `retried`, the one retry layer:
transient failures only (`transient`), after a jittered exponential backoff or the reply's Retry-After, at most
MAX_WAIT_S. The tool client (tool_server/client.py) keeps its own rule on tenacity (its server's 500s are bugs,
its read timeouts calls still running) and shares `retry_after`.

Headers are untrusted input: a value that is no plain number counts as absent, never as an error: `str.isdigit()`
accepts "²" and other Unicode digits that `float()` refuses, and a `Retry-After: ²` from a reader was an HTTP 500
of the tool server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from typing import TypeVar

import httpx
import openai
import tenacity

logger = logging.getLogger(__name__)
T = TypeVar("T")

# Decoded bytes of a 2xx reply: the longest answer a reader may give (8,192 tokens, ~32 KB of text; ~200 KB even if
# every character came \u-escaped) fits five times over, and a policy's sample with its ids and log-probs too.
MAX_REPLY_BYTES = 1 << 20
# Of an error reply, this much is read: an error message is a line; an HTML error page is cut.
MAX_ERROR_BYTES = 64 << 10
# A refused or unreachable host should fail in seconds, not after the whole budget of a reply.
CONNECT_TIMEOUT_S = 5.0
# Sending a request: a prompt, a page's text or a few images, megabytes at most, to a server that is listening.
WRITE_TIMEOUT_S = 30.0
# Waiting for one of the pool's connections: the pool holds 100, more than any caller's concurrent requests.
POOL_TIMEOUT_S = 30.0
# Backoff before retry n: a uniform wait in [0, BACKOFF_S * 2**(n-1)], at most MAX_WAIT_S, which also caps a
# Retry-After (the openai SDK's own values).
BACKOFF_S = 0.5
MAX_WAIT_S = 8.0
RETRIED_STATUS = frozenset({408, 409, 429})  # and every 5xx: the statuses whose cause may pass

# zlib window bits per Content-Encoding decodable with a hard cap on its output; clients advertise exactly these.
_DECODERS = {"gzip": zlib.MAX_WBITS | 16, "deflate": zlib.MAX_WBITS}
ACCEPT_ENCODING = ", ".join(_DECODERS)
"""The Accept-Encoding of a client whose replies `CappedDecoder` decodes (the fetcher's, the endpoints')."""
# Headers of a reply the transport decoded itself (and raw: a header's bytes need not be ASCII).
_DROPPED_HEADERS = (b"content-encoding", b"content-length")
# A number in a header (Retry-After, retry-after-ms, Content-Length): ASCII digits, an optional ASCII fraction.
_ASCII_NUMBER = re.compile(r"[0-9]+(?:\.[0-9]+)?")


def header_number(value: str) -> float | None:
    """A header's non-negative decimal number, or None for anything else (treated as absent)."""
    if _ASCII_NUMBER.fullmatch(value.strip()) is None:
        return None
    return float(value)  # past 1e308: inf, which every caller's own cap bounds


def retry_after(headers: Mapping[str, str]) -> float | None:
    """The wait a reply asks for, in seconds: `retry-after-ms` (OpenAI's) or `Retry-After` in seconds. An HTTP
    date, or anything that is no plain number, is None: the caller's backoff then."""
    for name, scale in (("retry-after-ms", 0.001), ("retry-after", 1.0)):
        value = header_number(headers.get(name, ""))
        if value is not None:
            return value * scale
    return None


class ReplyRefused(Exception):
    """A reply a client will not read: a redirect, past a cap (`too_large`), or an encoding it cannot decode under
    one. Never transient: the same request gets the same reply."""

    def __init__(self, message: str, *, too_large: bool = False) -> None:
        super().__init__(message)
        self.too_large = too_large


class CappedDecoder:
    """Decodes a Content-Encoding chunk by chunk, never producing more than `cap` bytes in all; ReplyRefused past
    the cap, for an encoding it cannot bound, or a corrupt stream."""

    def __init__(self, encoding: str, cap: int) -> None:
        self._encoding = encoding.strip().lower()
        if self._encoding not in ("", "identity", *_DECODERS):
            raise ReplyRefused(f"unsupported Content-Encoding {self._encoding[:20]!r}")
        self._zlib = zlib.decompressobj(_DECODERS[self._encoding]) if self._encoding in _DECODERS else None
        self._cap = cap
        self._total = 0

    def feed(self, chunk: bytes) -> bytes:
        # max_length = room + 1: reaching it proves the cap is exceeded without inflating further.
        with self._corrupt():
            out = self._zlib.decompress(chunk, self._cap - self._total + 1) if self._zlib else chunk
        return self._count(out)

    def flush(self) -> bytes:
        with self._corrupt():
            return self._count(self._zlib.flush()) if self._zlib else b""

    def _count(self, out: bytes) -> bytes:
        self._total += len(out)
        if self._total > self._cap:
            raise ReplyRefused(f"too large: over {self._cap} bytes once decoded", too_large=True)
        return out

    @contextlib.contextmanager
    def _corrupt(self) -> Iterator[None]:
        try:
            yield
        except zlib.error as exc:
            raise ReplyRefused(f"corrupt {self._encoding} encoding: {exc}") from None


def openai_client(
    base_url: str, *, api_key: str, reply_timeout_s: float, max_bytes: int = MAX_REPLY_BYTES
) -> openai.AsyncOpenAI:
    """The `openai` SDK at `base_url` over the hardened httpx client (module docstring), its own retries off.
    `reply_timeout_s` bounds each whole exchange; a call may pass its own (`timeout=` of the SDK's methods)."""
    timeout = httpx.Timeout(
        connect=CONNECT_TIMEOUT_S, read=reply_timeout_s, write=WRITE_TIMEOUT_S, pool=POOL_TIMEOUT_S
    )
    http = httpx.AsyncClient(
        transport=_Guard(max_bytes),
        timeout=timeout,
        follow_redirects=False,  # and the transport refuses a 3xx whatever a call asks
        headers={"Accept-Encoding": ACCEPT_ENCODING},
    )
    return openai.AsyncOpenAI(
        base_url=base_url, api_key=api_key, http_client=http, max_retries=0, timeout=timeout
    )


def transient(error: BaseException) -> bool:
    """Whether the same request may yet succeed: no connection, a timeout, a reply broken off, 408/409/429/5xx;
    never a reply refused (`ReplyRefused`) nor another status: the same request would fail the same way."""
    if isinstance(error, openai.APIStatusError):
        return error.status_code >= 500 or error.status_code in RETRIED_STATUS
    return isinstance(error, openai.APIConnectionError) and not isinstance(error.__cause__, ReplyRefused)


def reason(error: openai.APIError) -> str:
    """Why no reply came, in a line: the status, or the transport's error under the SDK's 'Connection error.'"""
    if isinstance(error, openai.APIStatusError):
        return f"HTTP {error.status_code}"
    cause = error.__cause__
    return str(error) if cause is None else f"{type(cause).__name__}: {cause}"[:300]


async def retried(call: Callable[[], Awaitable[T]], *, max_retries: int) -> T:
    """`await call()`, the retry layer of the OpenAI-compatible clients: at most `max_retries` more attempts, on
    `transient` failures only; the last failure is raised as it is."""
    retrying = tenacity.AsyncRetrying(
        retry=tenacity.retry_if_exception(transient),
        stop=tenacity.stop_after_attempt(max_retries + 1),
        wait=_wait,
        before_sleep=_log_retry,
        reraise=True,
    )

    async def attempt() -> T:  # tenacity awaits a coroutine function; a lambda's coroutine it would return
        return await call()

    return await retrying(attempt)


_backoff = tenacity.wait_random_exponential(multiplier=BACKOFF_S, max=MAX_WAIT_S)


def _wait(state: tenacity.RetryCallState) -> float:
    """The pause before the next attempt: the reply's Retry-After (at most MAX_WAIT_S), else backoff."""
    failure = state.outcome.exception() if state.outcome is not None else None
    if isinstance(failure, openai.APIStatusError):
        asked = retry_after(failure.response.headers)
        if asked is not None:
            return min(asked, MAX_WAIT_S)
    return _backoff(state)


def _log_retry(state: tenacity.RetryCallState) -> None:
    """One line per retry, without the reply's text (the SDK's message quotes it whole)."""
    failure = state.outcome.exception() if state.outcome is not None else None
    assert isinstance(failure, openai.APIError), f"retried {failure!r}, no APIError"
    wait = state.next_action.sleep if state.next_action is not None else 0.0
    logger.info("%s; retry %d in %.2f s", reason(failure), state.attempt_number, wait)


class _Guard(httpx.AsyncBaseTransport):
    """httpx's transport under the rules of the module docstring: redirects refused, replies decoded under a cap,
    the whole exchange within the request's read timeout."""

    def __init__(self, max_bytes: int) -> None:
        self._inner = httpx.AsyncHTTPTransport()
        self._max_bytes = max_bytes

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        budget = request.extensions.get("timeout", {}).get("read")
        deadline = None if budget is None else asyncio.get_running_loop().time() + budget
        async with _within(deadline, request):
            response = await self._inner.handle_async_request(request)
        assert isinstance(response.stream, httpx.AsyncByteStream), response.stream
        try:
            cap = self._cap(response)
        except ReplyRefused:
            await response.aclose()
            raise
        encoding = response.headers.get("content-encoding", "")
        quiet = response.status_code >= 400  # an error reply: what came before the cap says enough
        stream = _CappedStream(
            response.stream, encoding, cap, quiet=quiet, deadline=deadline, request=request
        )
        # Decoded here: httpx must neither decode it again nor count it against the encoded length.
        headers = [(k, v) for k, v in response.headers.raw if k.lower() not in _DROPPED_HEADERS]
        return httpx.Response(
            response.status_code, headers=headers, stream=stream, extensions=response.extensions
        )

    def _cap(self, response: httpx.Response) -> int:
        """How much of `response` may be read, decoded."""
        status = response.status_code
        if 300 <= status < 400:
            raise ReplyRefused(f"a {status} redirect, not followed: the URL must name the endpoint itself")
        if status >= 400:
            return MAX_ERROR_BYTES
        declared = header_number(response.headers.get("content-length", ""))
        if declared is not None and declared > self._max_bytes:
            raise ReplyRefused(
                f"too large: Content-Length {declared:.0f} over {self._max_bytes}", too_large=True
            )
        return self._max_bytes

    async def aclose(self) -> None:
        await self._inner.aclose()


class _CappedStream(httpx.AsyncByteStream):
    """A reply's body decoded under `cap`, each read within the exchange's deadline; past the cap, or where it
    cannot be decoded, ReplyRefused, or (`quiet`) the body ends there."""

    def __init__(
        self,
        raw: httpx.AsyncByteStream,
        encoding: str,
        cap: int,
        *,
        quiet: bool,
        deadline: float | None,
        request: httpx.Request,
    ) -> None:
        self._raw, self._encoding, self._cap, self._quiet = raw, encoding, cap, quiet
        self._deadline, self._request = deadline, request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        chunks = aiter(self._raw)
        try:
            decoder = CappedDecoder(self._encoding, self._cap)
            while True:
                async with _within(self._deadline, self._request):
                    chunk = await anext(chunks, None)
                if chunk is None:
                    break
                yield decoder.feed(chunk)
            yield decoder.flush()
        except ReplyRefused:
            if not self._quiet:
                raise

    async def aclose(self) -> None:
        await self._raw.aclose()


@contextlib.asynccontextmanager
async def _within(deadline: float | None, request: httpx.Request) -> AsyncIterator[None]:
    """The block within `deadline` (the event loop's clock); past it, httpx's ReadTimeout, as the SDK expects."""
    try:
        async with asyncio.timeout_at(deadline):
            yield
    except TimeoutError:
        raise httpx.ReadTimeout("no whole reply within the read timeout", request=request) from None
