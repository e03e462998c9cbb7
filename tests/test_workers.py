"""subagents/workers.py: bounded pools per kind of blocking work; a thread stays counted until its work returns.

Each test gives the documents pool one thread and one queued place (a fresh executor: not one an earlier test
made with the shipped size) and releases its blocked work before it ends.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest

from subagents import workers
from subagents.errors import ToolFailure


@pytest.fixture
def small_pool(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """The documents pool at 1 thread + 1 queued call; yields an event that blocked work waits on (set at the
    end, so no test leaves a thread behind)."""
    monkeypatch.setitem(workers.POOLS, "documents", workers.Pool(threads=1, queue=1))
    monkeypatch.setattr(workers, "_executors", {})
    monkeypatch.setattr(workers, "_busy", {})
    release = threading.Event()
    yield release
    release.set()
    for executor in workers._executors.values():
        executor.shutdown(wait=True)


async def until_busy(kind: workers.Kind, count: int) -> None:
    """Wait (at most 5 s) until `count` calls of `kind` are running or queued."""
    async with asyncio.timeout(5):
        while workers.busy(kind) != count:
            await asyncio.sleep(0.005)


async def test_results_and_failures_come_back_and_free_the_pool(small_pool: threading.Event) -> None:
    """A call returns its function's value or raises its exception (a ToolFailure stays one); each frees its
    place when done."""
    assert await workers.run("documents", sum, [1, 2, 3]) == 6

    def fails() -> None:
        raise ToolFailure("unsupported_media", "not a page")

    with pytest.raises(ToolFailure, match="not a page"):
        await workers.run("documents", fails)
    assert workers.busy("documents") == 0


async def test_a_call_past_the_pool_and_its_queue_is_refused_at_once(small_pool: threading.Event) -> None:
    """With the thread busy and the queue full, the next call is refused at once as overloaded (retryable), not
    queued behind them; another kind's pool still runs; once the work returns, calls run again."""
    running = asyncio.ensure_future(workers.run("documents", small_pool.wait))
    queued = asyncio.ensure_future(workers.run("documents", small_pool.wait))
    await until_busy("documents", 2)
    with pytest.raises(ToolFailure) as refused:
        await workers.run("documents", sum, [1])
    assert (refused.value.error.kind, refused.value.error.retryable) == ("overloaded", True)
    assert await workers.run("images", sum, [2]) == 2
    small_pool.set()
    assert await running and await queued
    assert await workers.run("documents", sum, [3]) == 3


async def test_a_timed_out_calls_thread_counts_as_busy_until_its_work_returns(
    small_pool: threading.Event,
) -> None:
    """The attack this bounds: calls that time out cancel their await, not their thread, and more such calls
    piled up on the shared executor. Here a call that timed out still holds its place until its work really
    returns, so further calls are refused rather than queued behind it; then its place frees."""
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(workers.run("documents", small_pool.wait), timeout=0.05)
    assert workers.busy("documents") == 1
    queued = asyncio.ensure_future(workers.run("documents", small_pool.wait))
    await until_busy("documents", 2)
    with pytest.raises(ToolFailure, match="overloaded"):
        await workers.run("documents", sum, [1])
    small_pool.set()
    assert await queued
    await until_busy("documents", 0)


async def test_a_call_cancelled_while_queued_never_runs(small_pool: threading.Event) -> None:
    """A call whose caller gives up while it waits for a thread is dropped from the queue: its work never runs
    and its place frees at once."""
    ran: list[str] = []
    running = asyncio.ensure_future(workers.run("documents", small_pool.wait))
    queued = asyncio.ensure_future(workers.run("documents", ran.append, "ran"))
    await until_busy("documents", 2)
    queued.cancel()
    await until_busy("documents", 1)
    small_pool.set()
    assert await running
    assert ran == [] and queued.cancelled()


def test_the_documents_pool_holds_every_page_qa_call_the_server_admits():
    """Normal load is never refused: the page_qa calls the server admits at once (its default max_concurrency)
    fit the documents pool's threads and queue, so `overloaded` means more than the server itself lets in."""
    from subagents.workers import POOLS
    from tool_server.config import default_tools

    pool = POOLS["documents"]
    assert default_tools()["page_qa"].limits.max_concurrency <= pool.threads + pool.queue
