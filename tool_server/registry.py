"""Which connection makes room for another: the open connections of one server per peer and state.

The rules are tool_server/connections.py's (its docstring states them all); this is their bookkeeping, kept apart
so it can be tested with stand-in connections: anything with `evict()` and `reclaim(status)`.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from typing import Protocol

# Open sockets beyond `max_connections` before the longest-idle go even unread (the file-descriptor budget): room
# for a few /health probes at once while every slot runs a request (only the open paths are admitted then), and
# for a flood's unread connections to be read; each costs one file descriptor.
HEALTH_RESERVE = 64
# A line logged on every occurrence of what an attack repeats (a 503, a client gone) is said at most this often,
# counting the occurrences since: under attack a warning per refusal was 1,465 lines a minute, burying the log.
LOG_EVERY_S = 10.0


class Connection(Protocol):
    """What the registry asks of a connection (connections.GuardedH11Protocol)."""

    def evict(self) -> None:
        """Close it: it runs no request."""

    def reclaim(self, status: int) -> None:
        """Answer its request `status` and close it: its calls only wait."""


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
    """The open connections of one server, counted per peer, each in one state (connections.py's docstring): unread (sent
    nothing yet), idle (running no request), waiting (its request's calls only wait: reclaimable) or running.
    Unread, idle and waiting ones are kept in the order they entered it. Event-loop confined: only the protocol
    callbacks touch it."""

    def __init__(self, *, max_connections: int, per_peer: int, open_paths: frozenset[str]) -> None:
        self.max_connections = max_connections
        self.per_peer = per_peer
        self.open_paths = open_paths
        self._peer_of: dict[Connection, str] = {}
        self._peers: Counter[str] = Counter()
        self._state: dict[Connection, str] = {}
        self._queues: dict[str, dict[Connection, None]] = {"unread": {}, "idle": {}, "waiting": {}}
        self._running: Counter[str] = Counter()  # connections running a request, per peer
        self.running_total = 0
        self.evicted = 0
        """Unread or idle connections closed to make room (for tests and logs)."""
        self.reclaims = LogThrottle()
        """Waiting requests answered and closed to make room, and when to say so."""
        self.refusals = LogThrottle()
        """Requests answered 503, and when to say so."""

    def __len__(self) -> int:
        return len(self._peer_of)

    @property
    def busy_count(self) -> int:
        """Connections running a request now, waiting ones included."""
        return self.running_total + len(self._queues["waiting"])

    def opened(self, conn: Connection, peer: str) -> bool:
        """Count a new (unread) connection, making room for it; False when the descriptor budget has no room
        for it: close it."""
        self._peer_of[conn] = peer
        self._peers[peer] += 1
        self._move(conn, "unread")
        if self._peers[peer] > self.per_peer:
            self._make_room(lambda other: other is not conn and self._peer_of[other] == peer, status=429)
        if len(self) > self.max_connections:
            self._make_room(lambda other: other is not conn, status=503)
        if len(self) > self.max_connections + HEALTH_RESERVE:
            self._make_room(lambda other: other is not conn, status=503, unread_too=True)
        return len(self) <= self.max_connections + HEALTH_RESERVE

    def closed(self, conn: Connection) -> None:
        """Forget `conn` (idempotent: an evicted connection was forgotten when it was closed)."""
        if conn not in self._peer_of:
            return
        self._move(conn, None)
        peer = self._peer_of.pop(conn)
        self._peers[peer] -= 1
        if not self._peers[peer]:
            del self._peers[peer]

    def busy(self, conn: Connection) -> None:
        """A whole request arrived on `conn`: it runs (a waiting one stays waiting)."""
        if self._state.get(conn) in ("unread", "idle"):
            self._move(conn, "running")

    def idle(self, conn: Connection) -> None:
        """`conn` runs no request; one that just finished, or sent its first bytes, goes to the end (the most
        recently idle), one that was idle already keeps its place, whatever bytes it sends meanwhile."""
        if self._state.get(conn) not in (None, "idle"):
            self._move(conn, "idle")

    def waiting(self, conn: Connection, only_waiting: bool) -> None:
        """The calls of the request `conn` runs now all only wait (gates.Caller), or no longer do."""
        state = self._state.get(conn)
        if only_waiting and state == "running":
            self._move(conn, "waiting")
        elif not only_waiting and state == "waiting":
            self._move(conn, "running")

    def admits(self, conn: Connection, path: str) -> bool:
        """Whether a request on `conn` may run: always on the open paths, else while its peer and the server
        run at most their caps of requests (this one counted)."""
        if path in self.open_paths:
            return True
        this = self._state.get(conn) != "running"
        mine = self._running[self._peer_of.get(conn, "")]
        return mine + this <= self.per_peer and self.running_total + this <= self.max_connections

    def _move(self, conn: Connection, state: str | None) -> None:
        """Put `conn` in `state` (at the end of its order; None: out of every state)."""
        old = self._state.pop(conn, None)
        peer = self._peer_of[conn]
        if old == "running":
            self._running[peer] -= 1
            self.running_total -= 1
        elif old is not None:
            del self._queues[old][conn]
        if state == "running":
            self._running[peer] += 1
            self.running_total += 1
        elif state is not None:
            self._queues[state][conn] = None
        if state is not None:
            self._state[conn] = state

    def _make_room(
        self, eligible: Callable[[Connection], bool], *, status: int, unread_too: bool = False
    ) -> None:
        """Close the longest-idle connection `eligible` accepts (unread ones too, the longest open first, with
        `unread_too`), else reclaim the one that began waiting last, answering it `status`; else nothing."""
        for state in ("idle", "unread") if unread_too else ("idle",):
            victim = next((other for other in self._queues[state] if eligible(other)), None)
            if victim is not None:
                self.closed(victim)
                self.evicted += 1
                victim.evict()
                return
        victim = next((other for other in reversed(self._queues["waiting"]) if eligible(other)), None)
        if victim is not None:
            self.closed(victim)
            victim.reclaim(status)
