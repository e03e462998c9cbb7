"""Tool-server replicas on Ray Serve (tool_server/ray_serve.py): one local Ray cluster for the module, two
replicas of the real app with fake sub-agents (`pid_subagents`: answers name the replica's pid) and fake
models, real HTTP through Serve's proxy on loopback. Later tests redeploy the app, so the order matters."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from conductor.cluster import RayConfig, cluster
from tests.tool_server_fakes import FakeFactory, make_config, pid_subagents
from tool_server.client import CallResult, ToolClient
from tool_server.config import CacheConfig, ServerConfig
from tool_server.ray_serve import DEFAULT_NAME, DEPLOYMENT, ReplicaCounts, deploy

serve = pytest.importorskip("ray.serve", reason="Ray Serve is the optional extra `distributed`")

pytestmark = pytest.mark.slow  # a Ray cluster and a Serve deploy take ~10 s; the module ~30 s

RAY_CFG = RayConfig(tool_replicas=2)
DEADLINE_S = 60.0  # per call; a burst here takes 1-3 s, a restart of a replica about 5 s
TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def tool_url() -> Iterator[str]:
    with cluster(RAY_CFG):
        yield deploy(make_config(), RAY_CFG, subagents=pid_subagents(Counter()), llm_factory=FakeFactory())


async def burst(
    url: str,
    n: int,
    *,
    delay_s: float,
    tool: str = "image_ops",
    token: str | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> list[CallResult]:
    """`n` concurrent calls of `tool` (image_ops: never cached), each taking `delay_s` in the fake."""
    client = ToolClient(url, token=token, max_concurrency=n, deadline_s=DEADLINE_S, transport=transport)
    async with client as tools:
        calls = [tools.call(tool, {"text": f"call {i}", "delay_s": delay_s}) for i in range(n)]
        return await asyncio.gather(*calls)


def pids(results: list[CallResult]) -> set[int]:
    """The processes that computed the answers (pid_subagents' echo is "<text>@<pid>")."""
    return {int(str(result.payload["echo"]).rsplit("@", 1)[1]) for result in results}


def replica_states() -> dict[str, int]:
    """Serve's count of the tool server's replicas by state."""
    states: dict[str, int] = serve.status().applications[DEFAULT_NAME].deployments[DEPLOYMENT].replica_states
    return states


async def test_a_burst_spreads_over_both_replicas(tool_url: str) -> None:
    """16 concurrent calls of 0.3 s are answered by both replicas, 8 each (Serve's per-replica cap is one
    micro-batch), and every answer names its replica in X-Conductor-Replica."""
    counts = ReplicaCounts()
    results = await burst(tool_url, 16, delay_s=0.3, transport=counts)
    assert all(result.ok for result in results)
    assert len(pids(results)) == 2, pids(results)
    assert sorted(counts.seen.values()) == [8, 8], counts.seen


async def test_a_replica_killed_mid_burst_loses_no_call(tool_url: str) -> None:
    """SIGKILL of one replica while 16 calls of 1 s are in flight (8 on each): every call returns ok, the
    killed replica's calls answered by the other after the client's retry, and Serve restarts the replica."""
    victim, survivor = sorted(pids(await burst(tool_url, 16, delay_s=0.05)))
    counts = ReplicaCounts()
    calls = asyncio.create_task(burst(tool_url, 16, delay_s=1.0, transport=counts))
    await asyncio.sleep(0.4)  # all 16 are on the replicas by now (a call reaches one in ~10 ms); none is done
    os.kill(victim, signal.SIGKILL)
    results = await calls
    assert all(result.ok for result in results), [r.error for r in results if not r.ok]
    assert survivor in pids(results) and victim not in pids(results)
    # Answers no replica gave ("?": the proxy's 500s for calls in flight on the victim, then retried) show only
    # when the kill lands while Serve has routed calls there; when it lands first, every call goes to the
    # survivor. Either way none is lost (test_client.py covers the retry of the 500 itself).
    assert await replacement_answers(tool_url, gone=victim)
    assert replica_states() == {"RUNNING": 2}


async def replacement_answers(url: str, *, gone: int, timeout_s: float = 30.0) -> bool:
    """Whether bursts reach two replicas, neither of them `gone`, within `timeout_s` (Serve's status is no
    proof: it lists a killed replica as RUNNING until a health check fails; the replacement answered ~2.5 s
    after the burst)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        seen = pids(await burst(url, 16, delay_s=0.3))
        if len(seen) == 2 and gone not in seen:
            return True
    return False


async def test_replicas_share_the_disk_cache_and_check_the_token(
    tool_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The driver's config reaches every replica: with `[cache] directory` a repeat is a hit whichever
    replica takes it (16 of 16), and a token in the driver's $token_env is required. Replaces the app."""
    cfg: ServerConfig = make_config(cache=CacheConfig(directory=tmp_path))
    monkeypatch.setenv(cfg.token_env, TOKEN)
    port = int(tool_url.rsplit(":", 1)[1])
    url = deploy(cfg, RAY_CFG, subagents=pid_subagents(Counter()), llm_factory=FakeFactory(), port=port)
    first = await burst(url, 16, delay_s=0.3, tool="search", token=TOKEN)
    again = await burst(url, 16, delay_s=0.3, tool="search", token=TOKEN)
    assert len(pids(first)) == 2 and not any(r.cached for r in first)
    assert all(r.cached for r in again), [r.cached for r in again]
    async with httpx.AsyncClient(base_url=url) as client:
        answers = await asyncio.gather(*(client.get("/metrics") for _ in range(16)))
    assert {answer.status_code for answer in answers} == {401}
