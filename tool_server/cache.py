"""A cache of frozen sub-agent results, keyed by (tool, model id, settings, exact validated request).

Frozen sub-agents decode greedily, so the same request to the same model gives the same answer; RL runs
ask the same thing many times (a group of G episodes for one task often opens with the same search or
page question). Properties:

- Key: tool name, the model id of the backend that answered (a hot-swapped model never sees its
  predecessor's answers), a fingerprint of the tool's settings, and the validated request as
  `model_dump(mode="json")` with sorted keys and nothing else changed: no normalisation, since two requests
  that differ at all may have different answers (`"ok.mp4\n"` names no file; stripping it once served
  `ok.mp4`'s summary for it).
- Only successful responses are stored: an error (a fetch that failed, a timeout) may not recur.
- Memory: an LRU bounded by `max_entries`. Disk (optional): one JSON file per entry, named by the SHA-256
  of the key, written atomically (temp file + os.replace), so concurrent servers and crashes never leave a
  torn file. Chosen over sqlite3 for transparency (`cat` an entry) and no locking; the folder is not
  bounded, delete it to reset. A disk hit is promoted into memory.
- Single-flight: identical requests that arrive while the first is computing wait for it instead of
  computing again; they count as hits. The computation runs as its own task, so a caller that gives up
  (client disconnect) neither cancels it for the others nor leaves them hanging.

Limit: the settings fingerprint is the dataclass repr; a change in code that does not show in the settings
(a new prompt template) needs the disk folder cleared.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
import os
import tempfile
from collections import OrderedDict, defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel

from subagents.common import ToolResponse
from tool_server.config import CacheConfig

logger = logging.getLogger(__name__)

R = TypeVar("R", bound=ToolResponse)


@dataclass
class CacheStats:
    """Lookups of one tool. Coalesced (single-flight) waiters count as hits: they did not compute."""

    hits: int = 0
    misses: int = 0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


def cache_key(tool: str, model_id: str, request: BaseModel, *, settings: str = "") -> str:
    """The cache key: one line each for tool, model, settings fingerprint and the exact request as JSON."""
    body = json.dumps(request.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    fingerprint = hashlib.sha256(settings.encode()).hexdigest()[:16]
    return f"{tool}\n{model_id}\n{fingerprint}\n{body}"


class DiskStore:
    """One JSON file per entry: `<sha256(key)>.json` holding {"key": ..., "response": ...}."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        return self.directory / f"{hashlib.sha256(key.encode()).hexdigest()}.json"

    def read(self, key: str) -> dict[str, Any] | None:
        """The stored response for `key`, or None (missing, unreadable, or a hash collision)."""
        try:
            entry = json.loads(self._path(key).read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:  # a damaged file is a miss, not a crash
            logger.warning("ignoring unreadable cache entry for %s: %s", key.split("\n", 1)[0], exc)
            return None
        if entry.get("key") != key:
            return None
        response: dict[str, Any] = entry["response"]
        return response

    def write(self, key: str, response: dict[str, Any]) -> None:
        """Write atomically: a reader sees the old file, the new file, or none; never a torn one."""
        fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as file:
                json.dump({"key": key, "response": response}, file)
            os.replace(tmp, self._path(key))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


class ResultCache:
    """LRU (+ optional disk) cache with single-flight; see the module docstring."""

    def __init__(self, cfg: CacheConfig) -> None:
        self.cfg = cfg
        self._memory: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._disk = DiskStore(cfg.directory) if cfg.directory is not None else None
        self._flights: dict[str, asyncio.Task[ToolResponse]] = {}
        self.stats: defaultdict[str, CacheStats] = defaultdict(CacheStats)

    def __len__(self) -> int:
        return len(self._memory)

    async def get_or_compute(
        self, tool: str, key: str, response_type: type[R], compute: Callable[[], Awaitable[R]]
    ) -> R:
        """The cached response for `key` (with `cached=True`), else `compute()`'s, stored if it succeeded.

        Exceptions from `compute` (bugs, an overloaded queue) reach every waiter and are not stored.
        """
        stats = self.stats[tool]
        stored = await self._lookup(key)
        if stored is not None:
            stats.hits += 1
            return response_type.model_validate({**stored, "cached": True})
        flight = self._flights.get(key)
        if flight is not None:
            stats.hits += 1
            shared = await asyncio.shield(flight)
            return response_type.model_validate({**shared.model_dump(mode="json"), "cached": True})
        stats.misses += 1
        task: asyncio.Task[ToolResponse] = asyncio.ensure_future(self._compute_and_store(key, compute))
        self._flights[key] = task
        task.add_done_callback(functools.partial(self._landed, key))
        response = await asyncio.shield(task)
        assert isinstance(response, response_type), (type(response), response_type)
        return response

    def _landed(self, key: str, task: asyncio.Task[ToolResponse]) -> None:
        """A flight ended: forget it, and take its exception here, as every waiter may have gone (a caller whose
        connection was closed or reclaimed), which asyncio would log as never retrieved."""
        self._flights.pop(key, None)
        if not task.cancelled():
            task.exception()

    async def _compute_and_store(self, key: str, compute: Callable[[], Awaitable[R]]) -> R:
        response = await compute()
        if response.ok:
            await self._store(key, response.model_dump(mode="json"))
        return response

    async def _lookup(self, key: str) -> dict[str, Any] | None:
        if key in self._memory:
            self._memory.move_to_end(key)
            return self._memory[key]
        if self._disk is None:
            return None
        stored = await asyncio.to_thread(self._disk.read, key)
        if stored is not None:
            self._remember(key, stored)
        return stored

    async def _store(self, key: str, response: dict[str, Any]) -> None:
        self._remember(key, response)
        if self._disk is None:
            return
        try:
            await asyncio.to_thread(self._disk.write, key, response)
        except OSError as exc:  # a full or read-only disk costs a later recomputation, not this answer
            logger.warning("cache write to %s failed: %s", self._disk.directory, exc)

    def _remember(self, key: str, response: dict[str, Any]) -> None:
        self._memory[key] = response
        self._memory.move_to_end(key)
        while len(self._memory) > self.cfg.max_entries:
            self._memory.popitem(last=False)
