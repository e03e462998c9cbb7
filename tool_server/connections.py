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
- Request heads: one that could be read two ways is answered 400 and its connection closed before h11 reads it:
  both Content-Length and Transfer-Encoding (h11 followed the chunked framing and kept the connection, so bytes
  past the chunked body ran as a second request: smuggling past a proxy that reads Content-Length), or a folded
  header line (obs-fold, a line starting with a space or tab; RFC 9112 lets a server refuse it, and h11 joined it
  into the line above). (Two Authorization headers: limits.AuthMiddleware.)
- States: a connection is unread (it has sent nothing yet), idle (running no request: between requests, or still
  receiving one, its headers or its body; the app starts on the headers but only waits for the body), running
  (a whole request arrived and is not answered), or waiting: running a request whose calls all only wait, for a
  tool's slot or an equal call's result (gates.Caller), holding no slot, for two turns of the event loop or
  more (a call about to take a free slot is not waiting).
- Admission (`max_connections` in all, `max_connections_per_peer` from one IP address): a request runs while its
  peer and the server run at most that many requests (waiting ones not counted: the gates bound them,
  gates.QueueBounds); past a cap it is answered 503 with Retry-After and Connection: close, except the open
  paths (/health), always admitted.
- Making room: a new connection that takes its peer or the server past those caps of open connections first
  closes the longest-idle connection (that peer's past its share, anyone's past the total), in the order they
  went idle, so a trickling sender is closed before a client that has just finished a request. An idle socket
  holds no work: closing it costs its owner a reconnect (clients retry a closed kept-alive connection), never
  the server a slot; nginx treats keep-alive connections the same way when it runs out. With none idle it
  reclaims the connection that began waiting last: its request is answered 429 (past the peer's share) or 503
  (past the total), Retry-After, Connection: close, never dropped silently, and nothing is lost (the call held
  no slot; an equal call's result still lands in the cache). With none waiting either, the new connection
  stays, past the share.
- Unread connections are never closed to make room while the file-descriptor budget (`max_connections` +
  registry.HEALTH_RESERVE open sockets) has room: what one carries (a health probe, a call) is read first.
  Closing the longest-idle of them let every new connection of a flood close the one before it unread: /health
  answered 3 of 38 probes under 280 connections holding whole calls. Past that budget the longest-idle
  connection goes, unread or not, else the last to begin waiting; with none, the new socket is closed at once.

On loopback every client is one peer, the policy's own tool client included: there the per-peer caps are the ones
met, eviction and reclaims keep room, and the gates (gates.ToolGate, gates.QueueBounds) bound the work itself and
how many calls may wait for it, so calls that only wait never fill a share.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import re
from typing import Any

import h11
from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from tool_server.gates import CALLER_EXTENSION, Caller
from tool_server.registry import ConnectionRegistry

logger = logging.getLogger(__name__)

# Before a request body's rate is judged: its first bytes may wait out one lost packet's retransmission (Linux's
# initial retransmission timeout is 1 s), and a body of a few packets is whole long before.
BODY_GRACE_S = 2.0
# The blank line that ends a request head (h11 accepts a bare \n as a line end).
HEAD_END = re.compile(rb"\n\r?\n")
# What a refused request is told to wait: a tool call's queue turns over within its queue deadline (20 s), but
# a connection frees as soon as any request ends, usually well within a second.
RETRY_AFTER_S = 1


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
        self._head_due = False  # a request head may be whole: `handle_events` checks it before h11 reads it
        self._tail = b""  # the last 2 bytes received: a head's blank line may span two reads
        self._task: asyncio.Task[Any] | None = None  # the task running this connection's request
        self._caller: Caller | None = None  # that request's, as the gates see it
        self._reclaimed_with: int | None = None  # the status its request is answered with once reclaimed
        self._app, self.app = self.app, self._admit  # every request passes `_admit` first

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._request_timer = self.loop.call_later(self.request_timeout_s, self._close, "no whole request")
        if not self.registry.opened(self, self.client[0] if self.client else ""):
            self._close(f"over {len(self.registry)} connections")

    def data_received(self, data: bytes) -> None:
        if HEAD_END.search(data) or HEAD_END.search(self._tail + data[:2]):
            self._head_due = True
        self._tail = data[-2:] if len(data) >= 2 else (self._tail + data)[-2:]
        super().data_received(data)
        if self.conn.their_state in (h11.IDLE, h11.SEND_BODY):  # a request has begun and is not whole yet
            if self._request_timer is None:
                self._request_timer = self.loop.call_later(self.request_timeout_s, self._close, "no request")
        else:
            self._request_timer = _cancelled(self._request_timer)
        self._watch_body(len(data))
        self._track()

    def handle_events(self) -> None:
        """h11 reads what came; a request head that could be read two ways is refused before it does."""
        if self._head_due and self.conn.their_state is h11.IDLE:
            self._head_due = False
            problem = head_problem(self.conn.trailing_data[0])
            if problem is not None:
                self._refuse_head(problem)
                return
        super().handle_events()

    def on_response_complete(self) -> None:
        self._head_due = True  # a pipelined request's head may wait whole in h11's buffer
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

    def reclaim(self, status: int) -> None:
        """Answer this connection's request `status` and close it, to make room for another: its calls only
        wait (called by the registry). Its task is cancelled; `_admit` answers."""
        count = self.registry.reclaims.occurred(now=self.loop.time())
        if count is not None:
            message = "reclaimed %d requests that only waited, to make room (this: %d; since last said)"
            logger.info(message, count, status)
        if self._task is None:  # its request ended meanwhile
            self._close("reclaimed to make room")
            return
        self._reclaimed_with = status
        self._task.cancel()

    def _caller_waits(self, caller: Caller, only_waiting: bool, *, turns: int = 2) -> None:
        """Tell the registry whether this connection's request only waits: at once when it stops, after `turns`
        turns of the event loop when it starts (if it still does then), so that a call about to take a free slot
        (its cache flight's task starts on the next turn) is never reclaimed as waiting."""
        if caller is not self._caller:  # a request of this connection that ended (a cache flight outlives it)
            return
        if not only_waiting or not caller.only_waiting:
            self.registry.waiting(self, False)
        elif turns:
            self.loop.call_soon(functools.partial(self._caller_waits, caller, True, turns=turns - 1))
        else:
            self.registry.waiting(self, True)

    def _refuse_head(self, problem: str) -> None:
        """Answer 400 and close: h11 would read the head one way, a proxy in front perhaps another."""
        logger.debug("refusing a request head from %s: %s", self.client, problem)
        body = json.dumps({"error": {"kind": "bad_request", "message": f"{problem}: refused"}}).encode()
        head = b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\nconnection: close\r\n"
        self.transport.write(head + b"content-length: %d\r\n\r\n" % len(body) + body)
        self.transport.close()

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
        if not self.registry.admits(self, scope["path"]):
            count = self.registry.refusals.occurred(now=self.loop.time())
            if count is not None:
                message = "503 to %s: running-request caps reached (%d refused since last said)"
                logger.warning(message, self.client, count)
            await _refuse(send, 503, "the server has no free connection; retry")
            return
        peer = self.client[0] if self.client else ""
        caller = Caller(peer, on_waiting=lambda waits: self._caller_waits(caller, waits))
        scope["extensions"] = {**(scope.get("extensions") or {}), CALLER_EXTENSION: caller}
        task = asyncio.current_task()
        self._task, self._caller = task, caller
        try:
            await self._app(scope, receive, send)
        except asyncio.CancelledError:
            if self._reclaimed_with is None or task is None or task.uncancel():
                raise  # not (only) a reclaim: the client went away, the server stops
            await self._answer_reclaimed(send, self._reclaimed_with)
        finally:
            self._task = self._caller = None

    async def _answer_reclaimed(self, send: Send, status: int) -> None:
        if self.cycle.response_started:  # not while its calls only wait; closed all the same
            self._close("reclaimed mid-response")
        else:
            await _refuse(send, status, "your call was waiting, and its connection was needed for another")


async def _refuse(send: Send, status: int, message: str) -> None:
    """Answer `status` (429 or 503) with an `overloaded` error, Retry-After and Connection: close."""
    body = json.dumps({"error": {"kind": "overloaded", "message": f"{message}; retry", "retryable": True}})
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(b"retry-after", str(RETRY_AFTER_S).encode()), (b"connection", b"close")]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body.encode()})


def head_problem(buffer: bytes) -> str | None:
    """Why the server refuses the request head at the start of `buffer` (whole or not yet), or None: a folded
    header line, or both Content-Length and Transfer-Encoding (module docstring)."""
    end = HEAD_END.search(buffer)
    lines = buffer[: end.start() if end else len(buffer)].split(b"\n")[1:]  # after the request line
    if any(line[:1] in (b" ", b"\t") for line in lines):
        return "a folded header line (obs-fold)"
    names = {line.split(b":", 1)[0].strip().lower() for line in lines}
    if {b"content-length", b"transfer-encoding"} <= names:
        return "both Content-Length and Transfer-Encoding"
    return None


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
