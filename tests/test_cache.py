"""The frozen-result cache: keys, LRU bound, disk persistence, what is stored, single-flight."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from pydantic import BaseModel

from subagents.common import ToolResponse, fail
from tool_server.cache import ResultCache, cache_key
from tool_server.config import CacheConfig


class Question(BaseModel):
    url: str
    question: str
    k: int = 3


class Answer(ToolResponse):
    answer: str = ""

    def summary(self) -> str:
        return self.answer


class Computer:
    """A compute function that counts its runs and can be told to fail, raise, or wait."""

    def __init__(self, answer: str = "42", *, ok: bool = True, delay_s: float = 0.0) -> None:
        self.runs = 0
        self.answer, self.ok, self.delay_s = answer, ok, delay_s

    async def __call__(self) -> Answer:
        self.runs += 1
        await asyncio.sleep(self.delay_s)
        if not self.ok:
            return fail(Answer, "fetch_failed", "down")
        return Answer(answer=self.answer)


def key(question: str = "Who?", *, model: str = "m1", tool: str = "page_qa") -> str:
    return cache_key(tool, model, Question(url="http://a.example/", question=question))


def test_key_is_the_exact_request_whatever_the_field_order() -> None:
    """Key order does not matter, but any other difference does: "ok.mp4\n" or " http://..." may name
    something else (or nothing), so whitespace is never stripped."""
    a = cache_key("page_qa", "m", Question(url="http://a.example/", question="Who?", k=3))
    b = cache_key(
        "page_qa", "m", Question.model_validate({"k": 3, "question": "Who?", "url": "http://a.example/"})
    )
    assert a == b
    assert a != cache_key("page_qa", "m", Question(url="http://a.example/", question="Who?\n", k=3))
    assert a != cache_key("page_qa", "m", Question(url=" http://a.example/", question="Who?", k=3))


def test_key_separates_tool_model_settings_and_request() -> None:
    """A different tool, model, settings fingerprint or question is a different entry."""
    base = key()
    assert len({base, key(model="m2"), key(tool="search"), key("Where?")}) == 4
    request = Question(url="u", question="q")
    assert cache_key("t", "m", request, settings="a") != cache_key("t", "m", request, settings="b")


async def test_hit_returns_stored_response_marked_cached() -> None:
    """The second identical lookup does not compute and says it came from the cache."""
    cache, compute = ResultCache(CacheConfig()), Computer()
    first = await cache.get_or_compute("page_qa", key(), Answer, compute)
    second = await cache.get_or_compute("page_qa", key(), Answer, compute)
    assert (compute.runs, first.cached, second.cached, second.answer) == (1, False, True, "42")
    stats = cache.stats["page_qa"]
    assert (stats.hits, stats.misses, stats.hit_rate) == (1, 1, 0.5)


async def test_lru_evicts_least_recently_used() -> None:
    """Past max_entries the least recently used entry goes; a recently read one stays."""
    cache = ResultCache(CacheConfig(max_entries=2))
    computes = {q: Computer(q) for q in ("a", "b", "c")}
    for q in ("a", "b"):
        await cache.get_or_compute("t", key(q), Answer, computes[q])
    await cache.get_or_compute("t", key("a"), Answer, computes["a"])  # a is now the most recent
    await cache.get_or_compute("t", key("c"), Answer, computes["c"])  # evicts b
    for q in ("a", "c", "b"):  # a and c are still held; b was evicted and runs again
        await cache.get_or_compute("t", key(q), Answer, computes[q])
    assert len(cache) == 2
    assert {q: c.runs for q, c in computes.items()} == {"a": 1, "b": 2, "c": 1}


async def test_failures_are_not_cached() -> None:
    """An error result is recomputed next time: the outside world may behave differently."""
    cache, compute = ResultCache(CacheConfig()), Computer(ok=False)
    for _ in range(2):
        response = await cache.get_or_compute("t", key(), Answer, compute)
        assert not response.ok
    assert compute.runs == 2 and len(cache) == 0


async def test_disk_round_trip_across_instances(tmp_path: Path) -> None:
    """A result written by one cache instance is served by a new one over the same folder."""
    compute = Computer("persisted")
    await ResultCache(CacheConfig(directory=tmp_path)).get_or_compute("t", key(), Answer, compute)
    fresh = ResultCache(CacheConfig(directory=tmp_path))
    response = await fresh.get_or_compute("t", key(), Answer, compute)
    assert (compute.runs, response.answer, response.cached) == (1, "persisted", True)
    assert [p.suffix for p in tmp_path.iterdir()] == [".json"]  # atomic write left no temp file


async def test_damaged_disk_entry_is_a_miss(tmp_path: Path) -> None:
    """A truncated file on disk is recomputed and overwritten, not a crash."""
    await ResultCache(CacheConfig(directory=tmp_path)).get_or_compute("t", key(), Answer, Computer())
    (entry,) = tmp_path.iterdir()
    entry.write_text('{"key": ')
    compute = Computer("again")
    response = await ResultCache(CacheConfig(directory=tmp_path)).get_or_compute("t", key(), Answer, compute)
    assert (compute.runs, response.answer) == (1, "again")


async def test_single_flight_computes_once_for_concurrent_identical_calls() -> None:
    """A group of G identical concurrent calls runs the sub-agent once; the others wait and share it."""
    cache, compute = ResultCache(CacheConfig()), Computer(delay_s=0.05)
    responses = await asyncio.gather(*(cache.get_or_compute("t", key(), Answer, compute) for _ in range(8)))
    assert compute.runs == 1
    assert [r.answer for r in responses] == ["42"] * 8
    assert sum(r.cached for r in responses) == 7
    assert (cache.stats["t"].hits, cache.stats["t"].misses) == (7, 1)


async def test_single_flight_survives_the_first_caller_giving_up() -> None:
    """Cancelling the caller that started the computation does not cancel it for the waiters."""
    cache, compute = ResultCache(CacheConfig()), Computer(delay_s=0.1)
    leader = asyncio.create_task(cache.get_or_compute("t", key(), Answer, compute))
    await asyncio.sleep(0.01)
    follower = asyncio.create_task(cache.get_or_compute("t", key(), Answer, compute))
    await asyncio.sleep(0.01)
    leader.cancel()
    assert (await follower).answer == "42"
    assert compute.runs == 1


async def test_single_flight_shares_exceptions_and_does_not_store_them() -> None:
    """An exception reaches every waiter; the next call computes afresh."""
    cache = ResultCache(CacheConfig())

    async def broken() -> Answer:
        await asyncio.sleep(0.02)
        raise RuntimeError("bug")

    results = await asyncio.gather(
        *(cache.get_or_compute("t", key(), Answer, broken) for _ in range(3)), return_exceptions=True
    )
    assert all(isinstance(r, RuntimeError) for r in results)
    assert (await cache.get_or_compute("t", key(), Answer, Computer())).answer == "42"


@pytest.mark.parametrize("max_entries", [1, 3])
async def test_memory_never_exceeds_bound(max_entries: int) -> None:
    """However many distinct requests arrive, memory holds at most max_entries."""
    cache = ResultCache(CacheConfig(max_entries=max_entries))
    for i in range(10):
        await cache.get_or_compute("t", key(str(i)), Answer, Computer())
    assert len(cache) == max_entries
