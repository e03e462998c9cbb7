"""What protects the tool server: auth, body size, overload refusal, and hot swapping a backend under load."""

from __future__ import annotations

import asyncio
import hmac
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from subagents.backends import BackendConfig, BackendError
from tests.tool_server_fakes import FakeFactory, fake_subagents, make_config, running, with_limits
from tool_server.app import create_app, serve
from tool_server.config import ServerConfig, ToolLimits, ToolsConfig
from tool_server.limits import is_loopback

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def token_cfg(monkeypatch: pytest.MonkeyPatch) -> ServerConfig:
    """A config whose token variable holds TOKEN."""
    cfg = make_config()
    monkeypatch.setenv(cfg.token_env, TOKEN)
    return cfg


def app_for(cfg: ServerConfig, factory: FakeFactory | None = None) -> Any:
    return create_app(cfg, subagents=fake_subagents(Counter()), llm_factory=factory or FakeFactory())


# ---------------------------------------------------------------- auth


@pytest.mark.parametrize(
    "headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"}]
)
async def test_missing_or_wrong_token_is_401_with_challenge(
    token_cfg: ServerConfig, headers: dict[str, str]
) -> None:
    """With a token configured, a request without the right bearer token gets 401 + WWW-Authenticate."""
    async with running(app_for(token_cfg)) as client:
        for method, path in (("GET", "/v1/tools"), ("POST", "/v1/tools/search"), ("POST", "/mcp")):
            reply = await client.request(method, path, json={"text": "x"}, headers=headers)
            assert reply.status_code == 401, path
            assert reply.headers["WWW-Authenticate"] == "Bearer"


async def test_right_token_passes_and_health_is_open(token_cfg: ServerConfig) -> None:
    """The right token is accepted (scheme case-insensitive); /health needs none."""
    async with running(app_for(token_cfg)) as client:
        ok = await client.post(
            "/v1/tools/search", json={"text": "x"}, headers={"Authorization": f"bearer {TOKEN}"}
        )
        assert ok.status_code == 200 and ok.json()["ok"] is True
        assert (await client.get("/health")).status_code == 200


async def test_token_compared_in_constant_time(
    token_cfg: ServerConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check goes through hmac.compare_digest with the presented and configured tokens."""
    seen: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        seen.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    async with running(app_for(token_cfg)) as client:
        await client.get("/v1/tools", headers={"Authorization": "Bearer guess"})
    assert seen == [(b"guess", TOKEN.encode())]


async def test_admin_disabled_without_token_even_on_loopback() -> None:
    """No token configured: /admin answers 403 although the server is on 127.0.0.1."""
    async with running(app_for(make_config())) as client:
        reply = await client.post("/admin/backends/search", json={"model": "b"})
        assert reply.status_code == 403
        assert (await client.post("/v1/tools/search", json={"text": "x"})).status_code == 200


async def test_admin_needs_the_token(token_cfg: ServerConfig) -> None:
    """With a token configured, /admin without it is 401 and with it works."""
    async with running(app_for(token_cfg)) as client:
        assert (await client.post("/admin/backends/search", json={"model": "b"})).status_code == 401
        reply = await client.post("/admin/backends/search", json={"model": "b"}, headers=AUTH)
    assert reply.status_code == 200 and reply.json() == {"tool": "search", "model_id": "fake:b"}


def test_refuses_to_bind_beyond_loopback_without_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """Binding 0.0.0.0 with no token fails at construction; with a token it is allowed."""
    cfg = make_config(host="0.0.0.0")
    with pytest.raises(RuntimeError, match="no token"):
        app_for(cfg)
    with pytest.raises(RuntimeError, match="no token"):
        serve(cfg)  # the CLI's entry point refuses before binding anything
    monkeypatch.setenv(cfg.token_env, TOKEN)
    app_for(cfg)
    assert [is_loopback(h) for h in ("127.0.0.1", "::1", "localhost", "0.0.0.0", "example.org")] == [
        True, True, True, False, False,
    ]  # fmt: skip


async def test_token_file_is_read(tmp_path: Path) -> None:
    """A token in token_file (first line) guards the server when the variable is unset."""
    path = tmp_path / "token"
    path.write_text(f"{TOKEN}\n")
    async with running(app_for(make_config(token_file=path))) as client:
        assert (await client.get("/v1/tools")).status_code == 401
        assert (await client.get("/v1/tools", headers=AUTH)).status_code == 200


# ---------------------------------------------------------------- body size


async def test_body_over_limit_is_413() -> None:
    """A body over max_body_bytes is refused by its Content-Length before the tool sees it."""
    async with running(app_for(make_config(max_body_bytes=1000))) as client:
        big = await client.post("/v1/tools/search", json={"text": "x" * 2000})
        small = await client.post("/v1/tools/search", json={"text": "x" * 500})
    assert big.status_code == 413 and big.json()["error"]["kind"] == "too_large"
    assert small.status_code == 200


async def test_streamed_body_over_limit_is_413() -> None:
    """A chunked body (no Content-Length) is counted as it streams and refused past the limit."""

    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"text": "'
        for _ in range(10):
            yield b"x" * 200
        yield b'"}'

    async with running(app_for(make_config(max_body_bytes=1000))) as client:
        reply = await client.post("/v1/tools/search", content=chunks())
    assert reply.status_code == 413


# ---------------------------------------------------------------- overload


async def test_burst_beyond_capacity_gets_429_and_nothing_hangs() -> None:
    """3x the concurrency cap at once: the cap runs, the rest get 429 + Retry-After within the queue
    deadline; every request finishes within a bound."""
    limits = ToolLimits(max_concurrency=2, queue_timeout_s=0.2, call_timeout_s=5)
    app = app_for(make_config(tools=with_limits(search=limits)))
    async with running(app) as client:
        started = time.monotonic()
        replies = await asyncio.gather(
            *(client.post("/v1/tools/search", json={"text": str(i), "delay_s": 0.6}) for i in range(6))
        )
        elapsed = time.monotonic() - started
        metrics = (await client.get("/metrics")).json()["tools"]["search"]
    assert sorted(r.status_code for r in replies) == [200, 200, 429, 429, 429, 429]
    assert elapsed < 2.0
    for reply in (r for r in replies if r.status_code == 429):
        assert reply.headers["Retry-After"] == "1"
        assert reply.json()["error"] == {
            "kind": "overloaded",
            "message": reply.json()["error"]["message"],
            "retryable": True,
        }
    assert metrics["errors_by_kind"] == {"overloaded": 4}


async def test_overload_inside_a_batch_is_a_result() -> None:
    """In a batch an overloaded call is an `overloaded` result; the others still answer."""
    limits = ToolLimits(max_concurrency=1, queue_timeout_s=0.1)
    calls = [{"name": "search", "arguments": {"text": str(i), "delay_s": 0.4}} for i in range(2)]
    async with running(app_for(make_config(tools=with_limits(search=limits)))) as client:
        results = (await client.post("/v1/batch", json={"calls": calls})).json()["results"]
    assert sorted(r["ok"] for r in results) == [False, True]
    assert [r["error"]["kind"] for r in results if not r["ok"]] == ["overloaded"]


# ---------------------------------------------------------------- hot swap


def own_model_tools(name: str, model: str) -> ToolsConfig:
    tools = ToolsConfig()
    return replace(tools, **{name: replace(tools.settings(name), model=BackendConfig(model=model))})


async def test_hot_swap_mid_traffic(token_cfg: ServerConfig) -> None:
    """Calls running on backend A finish on A, calls after the swap run on B, and A is closed only once
    its in-flight calls have drained."""
    factory = FakeFactory()
    app = app_for(replace(token_cfg, tools=own_model_tools("image_ops", "A")), factory)
    async with running(app, headers=AUTH) as client:
        slow = [
            asyncio.create_task(client.post("/v1/tools/image_ops", json={"text": str(i), "delay_s": 0.5}))
            for i in range(3)
        ]
        await asyncio.sleep(0.15)
        swap = await client.post("/admin/backends/image_ops", json={"model": "B"})
        (model_a,) = [llm for llm in factory.built if llm.model_id == "fake:A"]
        assert swap.json()["model_id"] == "fake:B" and not model_a.closed
        fresh = (await client.post("/v1/tools/image_ops", json={"text": "after"})).json()
        assert not model_a.closed
        drained = [(await task).json() for task in slow]
        assert model_a.closed
        health = (await client.get("/health")).json()
    assert [d["model"] for d in drained] == ["fake:A"] * 3
    assert fresh["model"] == "fake:B"
    assert health["models"]["image_ops"] == "fake:B"


async def test_swap_changes_cache_key(token_cfg: ServerConfig) -> None:
    """After a swap the same cacheable request is answered by the new model, not from the old one's cache."""
    async with running(app_for(token_cfg), headers=AUTH) as client:
        before = (await client.post("/v1/tools/page_qa", json={"text": "q"})).json()
        await client.post("/admin/backends/page_qa", json={"model": "B"})
        after = (await client.post("/v1/tools/page_qa", json={"text": "q"})).json()
    assert (before["model"], after["model"], after["cached"]) == (
        "fake:smollm2-135m-instruct",
        "fake:B",
        False,
    )


async def test_swap_with_bad_config_keeps_old_backend(token_cfg: ServerConfig) -> None:
    """An invalid BackendConfig or a model that fails to build is a 422; the tool keeps its backend."""

    class Failing(FakeFactory):
        def __call__(self, cfg: BackendConfig) -> Any:
            if cfg.model == "missing":
                raise BackendError("no such model", retryable=False)
            return super().__call__(cfg)

    async with running(app_for(token_cfg, Failing()), headers=AUTH) as client:
        bad_field = await client.post("/admin/backends/search", json={"backend": "llamacpp"})
        typo = await client.post("/admin/backends/search", json={"modle": "B"})
        bad_model = await client.post("/admin/backends/search", json={"model": "missing"})
        still = (await client.post("/v1/tools/search", json={"text": "x"})).json()
    assert (bad_field.status_code, bad_field.json()["error"]["kind"]) == (422, "invalid_args")
    assert typo.status_code == 422 and "unknown key 'modle'" in typo.json()["error"]["message"]
    assert (bad_model.status_code, bad_model.json()["error"]["kind"]) == (422, "backend_error")
    assert still["model"] == "fake:smollm2-135m-instruct"
