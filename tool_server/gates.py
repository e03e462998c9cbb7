"""The per-tool gates: how many calls of a tool run at once, and how many may wait for a slot and how long.

Overload rules (ToolGate, QueueBounds), the `[<tool>.limits]` and `[server]` settings:
- Each tool runs at most `max_concurrency` calls at once. A call finding them all taken waits at most
  `queue_timeout_s` for a slot, FIFO.
- It may wait only while fewer than `max_queued_calls` calls wait at the gates in all (every tool together) and
  fewer than `max_queued_calls_per_peer` from its peer (IP address); else it is refused at once.
- A refusal is `Overloaded`: HTTP 429 + Retry-After (a full queue turns over within one queue deadline), the
  envelope `{"ok": false, "error": {"kind": "overloaded", "retryable": true}}`; in a batch or over MCP an
  `overloaded` result. tool_server/client.py retries a 429 after its Retry-After (at most 10 s, twice), then
  raises ToolServerError: the rollout marks the episode `infra_failed`, never a reward.
Nothing waits unboundedly, in time or in number. Bounded in time only, a flood of whole calls to a tool whose
calls never end (a reader that stays silent) held 280 connections waiting 20 s each, and with them the whole
connection share of their address (one address on loopback: every client's), starving every other client.

While every call of a request only waits (for a slot, or for an equal call's result from the cache) its `Caller`
says so, and the request's connection may then be reclaimed to make room for another: answered 429 or 503 and
closed, nothing of its work lost (connections.py). In-process calls (no connection) count against the bounds
under their scope's client address, MCP calls under none (one bucket for all of them); neither is reclaimed.
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager

from starlette.types import Scope

from tool_server.config import ToolLimits


class Overloaded(Exception):
    """A tool call refused for want of a slot: the queue bounds were reached, or no slot freed within the
    tool's queue deadline."""

    def __init__(self, tool: str, why: str, *, retry_after_s: int) -> None:
        super().__init__(f"{tool} is at capacity: {why}; retry after {retry_after_s} s")
        self.retry_after_s = retry_after_s


# The key under which a connection puts its request's Caller in the ASGI scope's "extensions" (connections.py).
CALLER_EXTENSION = "conductor.caller"


class Caller:
    """The request a tool call came in, as the gates see it: `peer`, the IP address it came from (for the
    per-peer queue bound), and whether its calls all wait (for a slot, or for an equal call's result) with none
    holding a slot: `on_waiting` hears each change, so its connection knows when it may be reclaimed (answered
    and closed to make room, connections.py) without losing work. Event-loop confined."""

    def __init__(self, peer: str, *, on_waiting: Callable[[bool], None] | None = None) -> None:
        self.peer = peer
        self._on_waiting = on_waiting
        self._waits = 0
        self._holds = 0

    @property
    def only_waiting(self) -> bool:
        return self._waits > 0 and self._holds == 0

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """One of its calls is after a result (holding a slot inside this or not: `holding`)."""
        self._count(waits=1)
        try:
            yield
        finally:
            self._count(waits=-1)

    @contextmanager
    def holding(self) -> Iterator[None]:
        """One of its calls holds a tool's slot."""
        self._count(holds=1)
        try:
            yield
        finally:
            self._count(holds=-1)

    def _count(self, *, waits: int = 0, holds: int = 0) -> None:
        before = self.only_waiting
        self._waits, self._holds = self._waits + waits, self._holds + holds
        if self._on_waiting is not None and self.only_waiting != before:
            self._on_waiting(self.only_waiting)


def caller_of(scope: Scope) -> Caller:
    """The Caller its connection put in `scope`, else one for the scope's client address (in-process, Ray)."""
    caller = (scope.get("extensions") or {}).get(CALLER_EXTENSION)
    if isinstance(caller, Caller):
        return caller
    client = scope.get("client")
    return Caller(client[0] if client else "")


class QueueBounds:
    """How many calls may wait at the gates for a slot, all tools together: `total`, and `per_peer` from one
    peer. Event-loop confined."""

    def __init__(self, *, total: int, per_peer: int) -> None:
        self.total = total
        self.per_peer = per_peer
        self.waiting = 0
        self._peers: Counter[str] = Counter()

    def full_for(self, peer: str) -> str | None:
        """Why a call from `peer` may not wait now, or None when it may."""
        if self.waiting >= self.total:
            return f"{self.waiting} calls already wait for a slot (at most {self.total})"
        if self._peers[peer] >= self.per_peer:
            return f"{self._peers[peer]} calls from {peer or 'this client'} already wait (at most {self.per_peer})"
        return None

    @contextmanager
    def place(self, peer: str) -> Iterator[None]:
        """Count one waiting call of `peer` while inside."""
        self.waiting += 1
        self._peers[peer] += 1
        try:
            yield
        finally:
            self.waiting -= 1
            self._peers[peer] -= 1
            if not self._peers[peer]:
                del self._peers[peer]


class ToolGate:
    """At most `max_concurrency` calls of one tool at once; a call that finds them taken waits for a slot at
    most `queue_timeout_s`, and only within the `queue` bounds it shares with the other tools' gates."""

    def __init__(self, tool: str, limits: ToolLimits, *, queue: QueueBounds) -> None:
        self.tool = tool
        self.limits = limits
        self.queue = queue
        self._slots = asyncio.Semaphore(limits.max_concurrency)
        self.waiting = 0
        self.running = 0

    @property
    def retry_after_s(self) -> int:
        """What 429 answers suggest: one queue deadline, by when a full queue has turned over once."""
        return max(1, math.ceil(self.limits.queue_timeout_s))

    @asynccontextmanager
    async def slot(self, caller: Caller) -> AsyncIterator[None]:
        """Hold one of the tool's slots for `caller`: a free one at once, else after a bounded wait; raises
        Overloaded when the queue is full or no slot frees up within the queue deadline."""
        if self._slots.locked():  # taken, or others wait first (FIFO)
            await self._wait_for_slot(caller)
        else:
            await self._slots.acquire()  # never suspends while a slot is free
        self.running += 1
        try:
            with caller.holding():
                yield
        finally:
            self.running -= 1
            self._slots.release()

    async def _wait_for_slot(self, caller: Caller) -> None:
        full = self.queue.full_for(caller.peer)
        if full is not None:
            raise Overloaded(self.tool, f"its queue is full: {full}", retry_after_s=self.retry_after_s)
        self.waiting += 1
        try:
            with self.queue.place(caller.peer):
                async with asyncio.timeout(self.limits.queue_timeout_s):
                    await self._slots.acquire()
        except TimeoutError:
            waited = f"no slot within {self.limits.queue_timeout_s:g} s"
            raise Overloaded(self.tool, waited, retry_after_s=self.retry_after_s) from None
        finally:
            self.waiting -= 1
