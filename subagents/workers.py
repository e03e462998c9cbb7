"""Blocking work in threads of its own kind, bounded, so that work nobody waits for any more cannot pile up.

`asyncio.to_thread` shares one executor (min(32, cores + 4) threads: 6 on 2 cores) with everything in the process,
and a deadline cancels the await, not the thread. Six calls on a text-heavy PDF timed out at 40 s and then held
every one of those threads for ~110 s more, while another client's 320x120 PNG waited 114 s for one (0.06 s alone).

So each kind of blocking work that a page or an image can make long runs in a small pool of its own (`POOLS`),
and a call that would wait behind more than `queue` others of its kind is refused at once (`overloaded`, which a
caller may retry) instead of queueing behind them. A thread counts as busy until its work returns, even when the
call that started it has timed out: that is what bounds the pile. The work itself is bounded too where it can
be cut (a PDF's pages and time, subagents/documents.py; an image's pixels, subagents/pixels.py), so a busy thread
frees within that bound.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal, TypeVar

from subagents.errors import ToolFailure

T = TypeVar("T")

Kind = Literal["documents", "images"]


@dataclass(frozen=True)
class Pool:
    threads: int
    """Threads of this kind at once: a core each on the 2-core machines this runs on, so one kind's flood leaves
    the other kinds, the event loop and the model their share."""
    queue: int
    """Calls that may wait for a thread beyond those running; more are refused (`overloaded`), because a call
    that waits behind many others of its kind would mostly time out while waiting."""


POOLS: dict[Kind, Pool] = {
    # Extracting a page's text (HTML, PDF): up to a few seconds for a large page, bounded by documents.py. Room for
    # every page_qa call the server admits at once (its max_concurrency, 8) and two more: with a queue of 4, an
    # evaluation of 8 episodes reading two hits a turn had page_qa calls refused `overloaded` under normal load.
    "documents": Pool(threads=2, queue=8),
    # Decoding, transforming, finding and reading text in images: tens to hundreds of ms each, bounded by the pixel
    # caps; a plate episode makes several a turn, so more may wait.
    "images": Pool(threads=2, queue=8),
}

_lock = threading.Lock()
_executors: dict[str, ThreadPoolExecutor] = {}
_busy: dict[str, int] = {}


def busy(kind: Kind) -> int:
    """Calls of `kind` running or waiting for a thread, those whose caller gave up included."""
    with _lock:
        return _busy.get(kind, 0)


async def run(kind: Kind, fn: Callable[..., T], *args: object) -> T:
    """`fn(*args)` in a thread of `kind`'s pool; ToolFailure("overloaded") at once when that pool is full."""
    pool = POOLS[kind]
    with _lock:
        if _busy.get(kind, 0) >= pool.threads + pool.queue:
            raise ToolFailure(
                "overloaded", f"the server is busy with other {kind} work; retry in a few seconds"
            )
        _busy[kind] = _busy.get(kind, 0) + 1
        executor = _executors.get(kind)
        if executor is None:
            executor = ThreadPoolExecutor(pool.threads, thread_name_prefix=f"conductor-{kind}")
            _executors[kind] = executor
    try:
        future = executor.submit(functools.partial(fn, *args))
    except BaseException:
        _release(kind)
        raise
    # Released when the thread is done, not when the await is cancelled: a timed-out call keeps its place.
    future.add_done_callback(lambda _: _release(kind))
    return await asyncio.wrap_future(future)


def _release(kind: str) -> None:
    with _lock:
        _busy[kind] -= 1
