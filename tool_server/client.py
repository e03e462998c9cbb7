"""Async client for the tool server, used by the main agent's rollout.

Two kinds of outcome, kept apart on purpose:
- `CallResult`: the tool ran (or refused the arguments). Errors here (`ok=False`) are the policy's business:
  they become observations it reads.
- `ToolServerError`: the infrastructure failed (server unreachable, 5xx after retries, the whole-call
  deadline ran out, a response that is not the protocol). The rollout marks the episode `infra_failed`;
  it is never turned into reward.

Budgets: httpx timeouts are per phase (connect, read, write, pool); a total deadline per call bounds the
sum, including retries. One retry layer, on transient failures only: connection errors and 502/503/504,
and 429 after the server's Retry-After (bounded).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Mapping
from dataclasses import dataclass

import httpx

logger = logging.getLogger(__name__)

# Phase timeouts. Connect is on loopback or a LAN: 5 s is generous. Read covers one sub-agent call: a
# page-QA answer from a 135M model on 2 CPU cores takes 10-20 s, longer when queued behind others.
DEFAULT_TIMEOUT = httpx.Timeout(connect=5.0, read=180.0, write=30.0, pool=30.0)
# Whole-call budget including retries: a rollout turn must not hang on one call.
DEFAULT_DEADLINE_S = 240.0
# Transient failures are retried this many times (so at most 3 attempts), with jittered backoff.
MAX_RETRIES = 2
BACKOFF_S = 0.5
MAX_RETRY_AFTER_S = 10.0  # never sleep longer than this on a server's Retry-After
TRANSIENT_STATUS = frozenset({502, 503, 504})


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
    def from_json(cls, name: str, data: Mapping[str, object]) -> CallResult:
        err = data.get("error")
        error = (
            CallError(str(err["kind"]), str(err["message"]), bool(err.get("retryable")))
            if isinstance(err, dict)
            else None
        )
        try:
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
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        # Pool limits follow the concurrency cap so queued calls wait on the semaphore, not inside httpx.
        limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
        self._http = httpx.AsyncClient(
            base_url=base_url.rstrip("/"),
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
        return response.json()

    async def health(self) -> dict[str, object]:
        return (await self._request("GET", "/health", session=None, body=None)).json()

    async def call(
        self, name: str, arguments: Mapping[str, object], *, session: str = "default"
    ) -> CallResult:
        """Run one tool. Tool-level errors come back as `CallResult(ok=False)`; infra failures raise."""
        async with self._slots:
            response = await self._request("POST", f"/v1/tools/{name}", session=session, body=dict(arguments))
        if response.status_code == 404:
            return _unknown_tool(name)
        return CallResult.from_json(name, response.json())

    async def call_many(
        self, calls: list[tuple[str, Mapping[str, object]]], *, session: str = "default"
    ) -> list[CallResult]:
        """Run several calls concurrently (bounded by the client's concurrency cap), results in order."""
        return list(await asyncio.gather(*(self.call(n, a, session=session) for n, a in calls)))

    async def _request(self, method: str, path: str, *, session: str | None, body: object) -> httpx.Response:
        headers = {"X-Conductor-Session": session} if session else {}
        try:
            async with asyncio.timeout(self.deadline_s):
                return await self._with_retries(method, path, headers=headers, body=body)
        except TimeoutError as exc:
            raise ToolServerError(
                f"{method} {path}: no answer within the {self.deadline_s:.0f} s deadline"
            ) from exc

    async def _with_retries(
        self, method: str, path: str, *, headers: dict[str, str], body: object
    ) -> httpx.Response:
        for attempt in range(MAX_RETRIES + 1):
            last = attempt == MAX_RETRIES
            try:
                response = await self._http.request(method, path, headers=headers, json=body)
            except (
                httpx.ConnectError,
                httpx.RemoteProtocolError,
                httpx.ConnectTimeout,
                httpx.PoolTimeout,
            ) as exc:
                if last:
                    raise ToolServerError(f"{method} {path}: tool server unreachable: {exc!r}") from exc
                await asyncio.sleep(_backoff(attempt))
                continue
            except (
                httpx.TimeoutException
            ) as exc:  # a read/write timeout: the call may have run; do not repeat it
                raise ToolServerError(f"{method} {path}: timed out: {exc!r}") from exc
            if response.status_code < 400 or response.status_code == 404:
                return response
            if last or response.status_code not in TRANSIENT_STATUS | {429}:
                raise ToolServerError(f"{method} {path}: HTTP {response.status_code}: {response.text[:300]}")
            await asyncio.sleep(_retry_delay(response, attempt))
        raise AssertionError("unreachable")


def _backoff(attempt: int) -> float:
    return BACKOFF_S * (2**attempt) * (0.5 + random.random())


def _retry_delay(response: httpx.Response, attempt: int) -> float:
    header = response.headers.get("Retry-After", "")
    if header.replace(".", "", 1).isdigit():
        return min(float(header), MAX_RETRY_AFTER_S)
    return _backoff(attempt)


def _unknown_tool(name: str) -> CallResult:
    error = CallError("invalid_args", f"unknown tool {name!r}", False)
    return CallResult(
        name, False, f"error (invalid_args): unknown tool {name!r}", error, 0.0, 0, 0, False, {}
    )
