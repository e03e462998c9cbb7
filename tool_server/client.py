"""Async client for the tool server, used by the main agent's rollout.

Two kinds of outcome, kept apart on purpose:
- `CallResult`: the tool ran (or refused the arguments). Errors here (`ok=False`) are the policy's business:
  they become observations it reads.
- `ToolServerError`: the infrastructure failed (server unreachable, any httpx transport error, 5xx after
  retries, the whole-call deadline ran out, a response that is not the protocol). The rollout marks the
  episode `infra_failed`; it is never turned into reward. No httpx exception leaves this module.

Budgets: httpx timeouts are per phase (connect, read, write, pool); a total deadline per call bounds the
sum, including retries and the waits between them.

Retries: one layer (tenacity), at most MAX_RETRIES more attempts, on transient failures only:
- connection failures (ConnectError, ConnectTimeout, PoolTimeout): nothing reached the server;
- a connection that broke without an answer (ReadError, WriteError, CloseError, RemoteProtocolError):
  mostly a kept-alive connection the server had already closed (uvicorn closes it after a 500, and idle
  ones after its keep-alive timeout) handed out again by the pool. If it broke mid-call the call may have
  run; repeating it is still safe, as sub-agents are frozen and deterministic and the only state a call
  leaves is one more image in its session's bounded image store;
- HTTP 502/503/504 (a proxy, or a server restarting), and 429 after its Retry-After (at most
  MAX_RETRY_AFTER_S);
- HTTP 500 that the tool server did not write (`_proxy_failure`): its own 500s are JSON (a bug, not
  retried), so a 500 of another kind came from a proxy in front of it. Ray Serve's proxy answers a call whose
  replica died mid-call with 500 "Internal Server Error" (text/plain) and does not retry it itself
  (tool_server/ray_serve.py); the repeat goes to a live replica. Repeating is safe as above.
A read or write timeout is not retried: the server may still be running the call, so a repeat would
double the load on a server already too slow for the budget and could not finish within the deadline.
Other statuses are not retried either: the same request would fail the same way.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import tenacity

from conductor.http import retry_after
from subagents.handles import Attachment

logger = logging.getLogger(__name__)

# Phase timeouts. Connect is on loopback or a LAN: 5 s is generous. Read covers one sub-agent call: a
# page-QA answer from a 135M model on 2 CPU cores takes 10-20 s, longer when queued behind others.
DEFAULT_TIMEOUT = httpx.Timeout(connect=5.0, read=180.0, write=30.0, pool=30.0)
# Whole-call budget including retries: a rollout turn must not hang on one call.
DEFAULT_DEADLINE_S = 240.0
# Transient failures are retried this many times (so at most 3 attempts): a restarting server or a stale
# pooled connection recovers within one retry; more would only spend the deadline.
MAX_RETRIES = 2
# Jittered exponential backoff: a uniform wait in [0, BACKOFF_S * 2**(n-1)] before retry n, so clients
# that failed together do not come back together.
BACKOFF_S = 0.5
MAX_RETRY_AFTER_S = 10.0  # never sleep longer than this on a server's Retry-After (or a backoff)
RETRIED_STATUS = frozenset({429, 502, 503, 504})
RETRIED_ERRORS = (httpx.NetworkError, httpx.RemoteProtocolError, httpx.ConnectTimeout, httpx.PoolTimeout)


class ToolServerError(Exception):
    """The tool server could not serve the call: an infrastructure failure, not a policy mistake."""


@dataclass(frozen=True)
class CallError:
    kind: str
    message: str
    retryable: bool


@dataclass(frozen=True)
class CallResult:
    """One tool call's outcome as the server reported it. `payload` is the full response JSON (for traces)."""

    name: str
    ok: bool
    observation: str
    error: CallError | None
    latency_ms: float
    tokens_read: int
    tokens_returned: int
    cached: bool
    payload: Mapping[str, object]

    @classmethod
    def from_json(cls, name: str, data: object) -> CallResult:
        if not isinstance(data, dict):
            raise ToolServerError(f"malformed response for {name}: not a JSON object")
        err = data.get("error")
        try:
            error = (
                CallError(str(err["kind"]), str(err["message"]), bool(err.get("retryable")))
                if isinstance(err, dict)
                else None
            )
            return cls(
                name=name,
                ok=bool(data["ok"]),
                observation=str(data["observation"]),
                error=error,
                latency_ms=float(data.get("latency_ms", 0.0)),  # type: ignore[arg-type]
                tokens_read=int(data.get("tokens_read", 0)),  # type: ignore[call-overload]
                tokens_returned=int(data.get("tokens_returned", 0)),  # type: ignore[call-overload]
                cached=bool(data.get("cached", False)),
                payload=data,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ToolServerError(f"malformed response for {name}: {exc!r}") from exc


class ToolClient:
    """`async with ToolClient(url) as tools: await tools.call("search", {"query": "..."})`."""

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        max_concurrency: int = 16,
        deadline_s: float = DEFAULT_DEADLINE_S,
        timeout: httpx.Timeout = DEFAULT_TIMEOUT,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.url = base_url.rstrip("/")
        """The server's base URL (another process's client reaches the same server there)."""
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        # Pool limits follow the concurrency cap so queued calls wait on the semaphore, not inside httpx.
        limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
        self._http = httpx.AsyncClient(
            base_url=self.url,
            headers=headers,
            timeout=timeout,
            limits=limits,
            transport=transport,
        )
        self._slots = asyncio.Semaphore(max_concurrency)
        self.deadline_s = deadline_s

    async def __aenter__(self) -> ToolClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def tools(self) -> list[dict[str, object]]:
        """The OpenAI function schemas the server publishes (the policy's prompt is built from these)."""
        response = await self._request("GET", "/v1/tools", session=None, body=None)
        tools: list[dict[str, object]] = _json(response)
        return tools

    async def health(self) -> dict[str, object]:
        health: dict[str, object] = _json(await self._request("GET", "/health", session=None, body=None))
        return health

    async def call(
        self, name: str, arguments: Mapping[str, object], *, session: str = "default"
    ) -> CallResult:
        """Run one tool. Tool-level errors come back as `CallResult(ok=False)`; infra failures raise."""
        async with self._slots:
            response = await self._request("POST", f"/v1/tools/{name}", session=session, body=dict(arguments))
        if response.status_code == 404:
            return _unknown_tool(name)
        return CallResult.from_json(name, _json(response))

    async def attach(self, attachments: Sequence[Attachment], *, session: str) -> list[str]:
        """Register what a user or task attached in `session` (before its first turn); their handles, which
        must be the ones the attachments derive (`Attachment.handle`), else ToolServerError. A refusal is an
        infrastructure failure too: attachments come from the program, not the policy."""
        body = {"attachments": [dataclasses.asdict(a) for a in attachments]}
        response = await self._request("POST", "/v1/attach", session=session, body=body)
        if response.status_code == 404:
            raise ToolServerError("POST /v1/attach: this tool server takes no attachments (an older version)")
        handles = _json(response).get("handles")
        if handles != [a.handle for a in attachments]:
            raise ToolServerError(f"POST /v1/attach: handles {handles!r} differ from the attachments' own")
        return list(handles)

    async def _request(self, method: str, path: str, *, session: str | None, body: object) -> httpx.Response:
        """One call under the deadline and the retry policy (module docstring); ToolServerError otherwise."""
        headers = {"X-Conductor-Session": session} if session else {}
        where = f"{method} {path}"
        try:
            async with asyncio.timeout(self.deadline_s):
                return await _retrying()(self._attempt, method, path, headers=headers, body=body)
        except TimeoutError as exc:
            raise ToolServerError(f"{where}: no answer within the {self.deadline_s:.0f} s deadline") from exc
        except _RetriedStatus as exc:
            answer = f"HTTP {exc.response.status_code}: {exc.response.text[:300]}"
            raise ToolServerError(f"{where}: {answer} (after {MAX_RETRIES + 1} attempts)") from exc
        except httpx.TimeoutException as exc:  # a read or write timeout: never retried (module docstring)
            raise ToolServerError(f"{where}: timed out: {exc!r}") from exc
        except httpx.RequestError as exc:  # every other transport error, retried first where transient
            raise ToolServerError(f"{where}: tool server unreachable: {exc!r}") from exc

    async def _attempt(
        self, method: str, path: str, *, headers: dict[str, str], body: object
    ) -> httpx.Response:
        """One exchange: a final response (< 400, or 404), else _RetriedStatus or ToolServerError."""
        response = await self._http.request(method, path, headers=headers, json=body)
        if response.status_code < 400 or response.status_code == 404:
            return response
        if response.status_code in RETRIED_STATUS or _proxy_failure(response):
            raise _RetriedStatus(response)
        raise ToolServerError(f"{method} {path}: HTTP {response.status_code}: {response.text[:300]}")


def _proxy_failure(response: httpx.Response) -> bool:
    """A 500 the tool server did not write: every 500 of its own is JSON (app._internal_error), while a proxy
    in front of it (Ray Serve's, for a replica that died) answers in plain text. Transient: module docstring."""
    content_type = response.headers.get("content-type", "")
    return response.status_code == 500 and not content_type.startswith("application/json")


class _RetriedStatus(Exception):
    """An answer worth another attempt (RETRIED_STATUS); carries it for its Retry-After and the last error."""

    def __init__(self, response: httpx.Response) -> None:
        super().__init__(f"HTTP {response.status_code}")
        self.response = response


_backoff = tenacity.wait_random_exponential(multiplier=BACKOFF_S, max=MAX_RETRY_AFTER_S)


def _wait(state: tenacity.RetryCallState) -> float:
    """The pause before the next attempt: a 429's Retry-After (at most MAX_RETRY_AFTER_S), else backoff."""
    failure = state.outcome.exception() if state.outcome is not None else None
    if isinstance(failure, _RetriedStatus):
        asked = retry_after(failure.response.headers)  # seconds; an HTTP date or a "²" falls back to backoff
        if asked is not None:
            return min(asked, MAX_RETRY_AFTER_S)
    return _backoff(state)


def _retrying() -> tenacity.AsyncRetrying:
    """The retry policy, built per call: a tenacity controller keeps the state of the call it runs."""
    return tenacity.AsyncRetrying(
        retry=tenacity.retry_if_exception_type((*RETRIED_ERRORS, _RetriedStatus)),
        stop=tenacity.stop_after_attempt(MAX_RETRIES + 1),
        wait=_wait,
        before_sleep=tenacity.before_sleep_log(logger, logging.INFO),
        reraise=True,
    )


def _json(response: httpx.Response) -> Any:
    """The body as JSON; a body that is not JSON is a broken server, not a tool result."""
    try:
        return response.json()
    except ValueError as exc:
        where = f"{response.request.method} {response.request.url.path}"
        raise ToolServerError(f"{where}: the answer is not JSON: {response.text[:200]!r}") from exc


def _unknown_tool(name: str) -> CallResult:
    error = CallError("invalid_args", f"unknown tool {name!r}", False)
    return CallResult(
        name, False, f"error (invalid_args): unknown tool {name!r}", error, 0.0, 0, 0, False, {}
    )
