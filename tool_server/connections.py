"""What one client can hold of the server's connections, and for how long (uvicorn's h11 protocol, guarded).

uvicorn counts every open socket, idle or busy, against one cap (`limit_concurrency`) and answers every request
503 once it is reached, /health included; it has no per-client share and no deadline on a request's arrival or on
a response. So sockets that send nothing, kept-alive sockets that poll now and then, or never-ending responses
could fill the cap from one client. `GuardedH11Protocol` (made by `guarded_h11(cfg)`) replaces that cap with these
rules, each a `[server]` setting:

- Request deadline (`request_timeout_s`): a connection must deliver each request whole (headers and body) within
  this of opening, or of the first byte of its next request; else it is closed.
- Body rate (`min_body_rate_bytes_s`): once a request's headers are in, its body must arrive at this average rate,
  judged from BODY_GRACE_S on; else the connection is closed. A client trickling its body a byte a second held a
  slot for the whole request deadline.
- Keep-alive (`keep_alive_s`, uvicorn's `timeout_keep_alive`): an idle connection between requests is closed after it.
- Unread replies (`send_timeout_s`): a reply the client stops reading, more than the transport's high-water mark
  (64 KiB) of it waiting unsent, has its connection aborted after this and the reply dropped; a connection closed
  for any reason with a reply still unsent is aborted, not closed (a close waits for the client to read it all).
- Response lifetime (`response_timeout_s`): a response not finished this long after its request arrived has its
  connection closed, so no stream or stuck handler holds a slot for ever. (The MCP endpoint opens no streams at
  all: a GET for one is 405, app.py.)
- Caps (`max_connections` in all, `max_connections_per_peer` from one IP address): a connection that takes its
  peer or the server past a cap first makes room by closing the longest-idle connection (of that peer, else of
  anyone). Idle means running no request: between requests, or still receiving one (its headers or its body; the
  app starts on the headers but only waits for the body), in the order they opened or finished their last
  response, so a trickling sender is closed before a client that has just connected. An idle socket holds no work:
  closing it costs its owner a reconnect (clients retry a closed kept-alive connection), never the server a slot;
  nginx treats keep-alive connections the same way when it runs out.
- Where no idle connection can make room (every one is running a request), requests past a cap are answered 503
  with Retry-After and Connection: close, except the open paths (/health): the HEALTH_RESERVE connections over
  `max_connections` serve only those. Past that reserve a new socket is closed at once: the file-descriptor budget.

On loopback every client is one peer, the policy's own tool client included: there the total cap with eviction
is what keeps room, and the per-tool gates (limits.ToolGate) bound the work itself.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import Counter
from collections.abc import Callable
from typing import Any

import h11
from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)

# Connections beyond `max_connections` accepted for the open paths only (/health): enough for a few probes at
# once while every slot runs a request; each costs one file descriptor.
HEALTH_RESERVE = 64
# Before a request body's rate is judged: its first bytes may wait out one lost packet's retransmission (Linux's
# initial retransmission timeout is 1 s), and a body of a few packets is whole long before.
BODY_GRACE_S = 2.0
# A line logged on every occurrence of what an attack repeats (a 503, a client gone) is said at most this often,
# counting the occurrences since: under attack a warning per refusal was 1,465 lines a minute, burying the log.
LOG_EVERY_S = 10.0
# What a refused request is told to wait: a tool call's queue turns over within its queue deadline (20 s), but
# a connection frees as soon as any request ends, usually well within a second.
RETRY_AFTER_S = 1


class LogThrottle:
    """When a line logged on every occurrence of something may be said: the first at once, then at most once per
    LOG_EVERY_S, with the occurrences since the last. Event-loop confined."""

    def __init__(self) -> None:
        self.total = 0
        """Every occurrence counted (for tests and metrics)."""
        self._since = 0
        self._said_at = -math.inf

    def occurred(self, *, now: float) -> int | None:
        """Count one occurrence at `now` (a monotonic clock); the occurrences to report if a line is due, else None."""
        self.total += 1
        self._since += 1
        if now - self._said_at < LOG_EVERY_S:
            return None
        count, self._since, self._said_at = self._since, 0, now
        return count


class ConnectionRegistry:
    """The open connections of one server, counted per peer, with the idle ones (running no request: module
    docstring) in the order they went idle (the longest idle first). Event-loop confined: only the protocol
    callbacks touch it."""

    def __init__(self, *, max_connections: int, per_peer: int, open_paths: frozenset[str]) -> None:
        self.max_connections = max_connections
        self.per_peer = per_peer
        self.open_paths = open_paths
        self._peer_of: dict[GuardedH11Protocol, str] = {}
        self._peers: Counter[str] = Counter()
        self._idle: dict[GuardedH11Protocol, None] = {}  # insertion order: the longest idle first
        self.evicted = 0
        """Idle connections closed to make room (for tests and logs)."""
        self.refusals = LogThrottle()
        """Requests answered 503, and when to say so."""

    def __len__(self) -> int:
        return len(self._peer_of)

    @property
    def busy_count(self) -> int:
        """Connections running a request now."""
        return len(self._peer_of) - len(self._idle)

    def opened(self, conn: GuardedH11Protocol, peer: str) -> bool:
        """Count a new (idle) connection, making room for it; False when it is past the reserve: close it."""
        self._peer_of[conn] = peer
        self._peers[peer] += 1
        if self._peers[peer] > self.per_peer:
            self._evict(lambda other: other is not conn and self._peer_of[other] == peer)
        if len(self) > self.max_connections:
            self._evict(lambda other: other is not conn)
        self._idle[conn] = None
        return len(self) <= self.max_connections + HEALTH_RESERVE

    def closed(self, conn: GuardedH11Protocol) -> None:
        """Forget `conn` (idempotent: an evicted connection was forgotten when it was closed)."""
        peer = self._peer_of.pop(conn, None)
        self._idle.pop(conn, None)
        if peer is not None:
            self._peers[peer] -= 1
            if not self._peers[peer]:
                del self._peers[peer]

    def busy(self, conn: GuardedH11Protocol) -> None:
        self._idle.pop(conn, None)

    def idle(self, conn: GuardedH11Protocol) -> None:
        """`conn` runs no request; one that just finished goes to the end (the most recently idle), one that
        was idle already keeps its place, whatever bytes it sends meanwhile."""
        if conn in self._peer_of and conn not in self._idle:
            self._idle[conn] = None

    def admits(self, conn: GuardedH11Protocol, path: str) -> bool:
        """Whether a request on `conn` may run: always for the open paths, else within both caps."""
        peer = self._peer_of.get(conn, "")
        return path in self.open_paths or (
            len(self) <= self.max_connections and self._peers[peer] <= self.per_peer
        )

    def _evict(self, eligible: Callable[[GuardedH11Protocol], bool]) -> None:
        """Close the longest-idle connection `eligible` accepts, if any."""
        victim = next((other for other in self._idle if eligible(other)), None)
        if victim is not None:
            self.closed(victim)
            self.evicted += 1
            victim.evict()


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol under the rules of the module docstring; one `registry` per server."""

    request_timeout_s: float = 10.0
    response_timeout_s: float = 300.0
    min_body_rate: float = 1024.0
    send_timeout_s: float = 30.0
    registry: ConnectionRegistry

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._request_timer: asyncio.TimerHandle | None = None
        self._response_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._send_timer: asyncio.TimerHandle | None = None
        self._body_started: float | None = None  # when the body being received began (its headers were in)
        self._body_bytes = 0
        self._app, self.app = self.app, self._admit  # every request passes `_admit` first

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._request_timer = self.loop.call_later(self.request_timeout_s, self._close, "no whole request")
        if not self.registry.opened(self, self.client[0] if self.client else ""):
            self._close(f"over {len(self.registry)} connections")

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state in (h11.IDLE, h11.SEND_BODY):  # a request has begun and is not whole yet
            if self._request_timer is None:
                self._request_timer = self.loop.call_later(self.request_timeout_s, self._close, "no request")
        else:
            self._request_timer = _cancelled(self._request_timer)
        self._watch_body(len(data))
        self._track()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._track()

    def connection_lost(self, exc: Exception | None) -> None:
        self._request_timer = _cancelled(self._request_timer)
        self._response_timer = _cancelled(self._response_timer)
        self._body_timer = _cancelled(self._body_timer)
        self._send_timer = _cancelled(self._send_timer)
        self.registry.closed(self)
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        """More than the high-water mark waits unsent: the client has `send_timeout_s` to drain it below the
        low-water mark (`resume_writing`), or the connection is aborted."""
        super().pause_writing()
        if self._send_timer is None:
            self._send_timer = self.loop.call_later(self.send_timeout_s, self._close, "its reply unread")

    def resume_writing(self) -> None:
        super().resume_writing()
        self._send_timer = _cancelled(self._send_timer)

    def timeout_keep_alive_handler(self) -> None:
        """Keep-alive ran out: closed as uvicorn closes it, but aborted if its last reply is still unsent."""
        self._close("idle past keep-alive")

    def evict(self) -> None:
        """Close this idle connection to make room for another (called by the registry)."""
        self._close("running no request, evicted to make room")

    def _watch_body(self, received: int) -> None:
        """Time the request body being received, if any, against `min_body_rate` (`_check_body_rate`)."""
        if self.conn.their_state is not h11.SEND_BODY:
            self._body_started, self._body_timer = None, _cancelled(self._body_timer)
        elif self._body_started is None:  # headers just in; the body bytes that came with them go uncounted
            self._body_started, self._body_bytes = self.loop.time(), 0
            self._body_timer = self.loop.call_later(BODY_GRACE_S, self._check_body_rate)
        else:
            self._body_bytes += received

    def _check_body_rate(self) -> None:
        """Close the connection when its body has come slower than `min_body_rate` on average; else look again
        when the bytes so far stop paying for the time."""
        self._body_timer = None
        if self._body_started is None:
            return
        now = self.loop.time()
        if self.flow.read_paused:  # the app has not read what came: the client was kept waiting, not slow
            self._body_started, self._body_bytes = now, 0
            self._body_timer = self.loop.call_later(BODY_GRACE_S, self._check_body_rate)
            return
        paid_until = self._body_started + self._body_bytes / self.min_body_rate
        if paid_until <= now:
            self._close(f"request body slower than {self.min_body_rate:g} bytes/s")
        else:
            self._body_timer = self.loop.call_at(paid_until, self._check_body_rate)

    def _track(self) -> None:
        """Tell the registry whether a request runs here (it arrived whole and is not answered yet), and time
        its response from its headers on."""
        answering = self.cycle is not None and not self.cycle.response_complete
        if answering and self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):
            self.registry.busy(self)
        else:
            self.registry.idle(self)
        if answering:
            if self._response_timer is None:
                timeout = self.response_timeout_s
                self._response_timer = self.loop.call_later(
                    timeout, self._close, "response past its lifetime"
                )
        else:
            self._response_timer = _cancelled(self._response_timer)

    def _close(self, why: str) -> None:
        """Close the connection; abort it if a reply is still unsent (a close would wait for the client to read
        it, which one that never reads never does), even when a close already began."""
        if self.transport.get_write_buffer_size():
            logger.debug(
                "aborting %s: %s, %d bytes unsent", self.client, why, self.transport.get_write_buffer_size()
            )
            self.transport.abort()
        elif not self.transport.is_closing():
            logger.debug("closing %s: %s", self.client, why)
            self.transport.close()

    async def _admit(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.registry.admits(self, scope["path"]):
            await self._app(scope, receive, send)
            return
        count = self.registry.refusals.occurred(now=self.loop.time())
        if count is not None:
            message = (
                "503 to %s: connection caps reached, no idle connection to close (%d refused since last said)"
            )
            logger.warning(message, self.client, count)
        body = b'{"error": {"kind": "overloaded", "message": "the server has no free connection; retry"}}'
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        headers += [(b"retry-after", str(RETRY_AFTER_S).encode()), (b"connection", b"close")]
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _cancelled(timer: asyncio.TimerHandle | None) -> asyncio.TimerHandle | None:
    """Cancel `timer`, if any; None, what the attribute that held it becomes."""
    if timer is not None:
        timer.cancel()
    return None


def guarded_h11(
    *,
    request_timeout_s: float,
    response_timeout_s: float,
    min_body_rate: float,
    send_timeout_s: float,
    max_connections: int,
    per_peer: int,
    open_paths: frozenset[str],
) -> type[GuardedH11Protocol]:
    """A `GuardedH11Protocol` class with these limits and its own registry, for `uvicorn.Config(http=...)`."""
    registry = ConnectionRegistry(max_connections=max_connections, per_peer=per_peer, open_paths=open_paths)
    limits = {
        "request_timeout_s": request_timeout_s,
        "response_timeout_s": response_timeout_s,
        "min_body_rate": min_body_rate,
        "send_timeout_s": send_timeout_s,
    }
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {**limits, "registry": registry})
