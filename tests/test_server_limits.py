"""What protects the tool server: auth, body size, overload refusal, and hot swapping a backend under load."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import resource
import socket
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from subagents.backends import BackendConfig, BackendError, build_llm
from tests.tool_server_fakes import FakeFactory, fake_subagents, make_config, running, serving, with_limits
from tool_server.app import create_app, serve, uvicorn_config
from tool_server.config import ServerConfig, ToolLimits, ToolsConfig, default_tools
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


# ---------------------------------------------------------------- idle, slow and vanishing clients


def closed_by_server(sock: socket.socket, *, within_s: float) -> bool:
    """Whether the server closes `sock` (EOF or reset) within `within_s` seconds."""
    sock.settimeout(within_s)
    try:
        return sock.recv(1024) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def health_on(sock: socket.socket, port: int) -> bytes:
    """GET /health on an open socket; the raw response (its JSON body ends with '}')."""
    sock.sendall(f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
    data = b""
    while not data.endswith(b"}"):
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


def test_idle_and_slow_connections_are_closed_and_never_block_other_clients() -> None:
    """600 sockets that open and send nothing (more than the old 512-connection cap) leave /health at 200;
    the server closes each of them, and a slow sender trickling a header, after request_timeout_s, while a
    kept-alive connection idle for longer than that between two requests still serves the second."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2000:  # 600 client and 600 server sockets in this one process
        if hard != resource.RLIM_INFINITY and hard < 2000:
            pytest.skip(f"open-file limit {soft}/{hard} is too low for 1200 sockets")
        resource.setrlimit(resource.RLIMIT_NOFILE, (2000, hard))
    cfg = make_config(port=0, request_timeout_s=1.0)
    app = app_for(cfg)
    with (
        serving(app, config=uvicorn_config(cfg, app)) as url,
        httpx.Client(base_url=url, timeout=5) as client,
    ):
        port = int(url.rsplit(":", 1)[1])
        kept = socket.create_connection(("127.0.0.1", port))
        assert health_on(kept, port).startswith(b"HTTP/1.1 200")
        opened = time.monotonic()
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(600)]
        slow = socket.create_connection(("127.0.0.1", port))
        try:
            assert client.get("/health").status_code == 200
            for _ in range(2):  # a byte of a header now and then: alive, but never a whole request
                slow.sendall(b"G")
                time.sleep(0.3)
            assert closed_by_server(slow, within_s=3)
            assert all(closed_by_server(s, within_s=max(0.1, opened + 5 - time.monotonic())) for s in idle)
            assert time.monotonic() - opened < 6
            assert health_on(kept, port).startswith(b"HTTP/1.1 200")  # idle > request_timeout_s, kept alive
            assert client.get("/metrics").status_code == 200
        finally:
            for sock in [*idle, slow, kept]:
                sock.close()


def test_a_client_gone_mid_request_is_a_logged_disconnect_not_an_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A client that sends half a body and hangs up is logged as one info line (no error, no traceback)
    and counted as `cancelled` in /metrics."""
    uvicorn_logger = logging.getLogger("uvicorn")  # uvicorn's own loggers do not propagate to the root
    uvicorn_logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO), serving(app_for(make_config())) as url:
            port = int(url.rsplit(":", 1)[1])
            body = json.dumps({"text": "x" * 100}).encode()
            head = (
                f"POST /v1/tools/search HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json"
            )
            with socket.create_connection(("127.0.0.1", port)) as sock:
                sock.sendall(f"{head}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body[:20])
                time.sleep(0.3)
            time.sleep(0.5)
            metrics = httpx.get(f"{url}/metrics", timeout=5).json()["tools"]["search"]
    finally:
        uvicorn_logger.removeHandler(caplog.handler)
    assert metrics["errors_by_kind"] == {"cancelled": 1}
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], caplog.text
    assert "client disconnected during POST /v1/tools/search" in caplog.text


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
    tools = default_tools()
    return {**tools, name: replace(tools[name], model=BackendConfig(model=model))}


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


async def test_swap_to_an_unknown_model_or_a_bad_path_is_422(token_cfg: ServerConfig, tmp_path: Path) -> None:
    """With the real model factory, a model name that is not built in, a missing folder and a folder that is
    not a loadable checkpoint are each a 422 saying what is wrong, not a 500; the tool keeps its backend."""

    def real_for_swaps(cfg: BackendConfig) -> Any:  # the start-up model stays fake: no weights needed
        return FakeFactory()(cfg) if cfg.model == BackendConfig().model else build_llm(cfg)

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("not json")
    async with running(app_for(token_cfg, real_for_swaps), headers=AUTH) as client:  # type: ignore[arg-type]
        replies = [
            await client.post("/admin/backends/search", json={"model": model})
            for model in ("no-such-model", str(tmp_path / "missing"), str(broken))
        ]
        still = (await client.post("/v1/tools/search", json={"text": "x"})).json()
    for reply in replies:
        assert (reply.status_code, reply.json()["error"]["kind"]) == (422, "backend_error"), reply.text
    assert "neither a built-in model" in replies[0].json()["error"]["message"]
    assert "missing" in replies[1].json()["error"]["message"]
    assert still["model"] == "fake:smollm2-135m-instruct"


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


# The attack's swaps: each was accepted (200) or crashed the route (500); a NaN wait then failed every call.
REFUSED_SWAPS = [
    b'{"max_batch": -1}',
    b'{"max_batch": 0}',
    b'{"batch_wait_ms": NaN}',
    b'{"batch_wait_ms": Infinity}',
    b'{"batch_wait_ms": 1e308}',
    b'{"batch_wait_ms": -5}',
    b'{"max_new_tokens": 1000000000000}',
    b'{"request_timeout_s": 0}',
    b'{"max_retries": -1}',
    b'{"model": ""}',
    b'{"model": "B", "extra": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
]


async def test_a_swap_is_validated_like_the_start_up_config_and_leaves_the_tool_as_it_was(
    token_cfg: ServerConfig,
) -> None:
    """Every out-of-range, non-finite or 100,000-deep swap body is a 422 invalid_args naming the problem; no
    model is built, the tool keeps answering on its old backend, and a valid swap still works afterwards."""
    factory = FakeFactory()
    async with running(app_for(token_cfg, factory), headers=AUTH) as client:
        replies = [await client.post("/admin/backends/page_qa", content=body) for body in REFUSED_SWAPS]
        assert len(factory.built) == 1  # the start-up model only
        still = (await client.post("/v1/tools/page_qa", json={"text": "q"})).json()
        ok = await client.post("/admin/backends/page_qa", json={"model": "B", "batch_wait_ms": 0})
        health = await client.get("/health")
    assert still["ok"] is True and still["model"] == "fake:smollm2-135m-instruct"
    assert ok.status_code == 200 and health.json()["models"]["page_qa"] == "fake:B"
    for body, reply in zip(REFUSED_SWAPS, replies, strict=True):
        assert (reply.status_code, reply.json()["error"]["kind"]) == (422, "invalid_args"), body[:60]
    assert "not valid JSON" in replies[2].json()["error"]["message"]
    assert "batch_wait_ms must be a finite number from 0 to 1000" in replies[4].json()["error"]["message"]


def test_the_start_up_config_refuses_the_same_values(tmp_path: Path) -> None:
    """A TOML [<tool>.model] table with nan, inf or an out-of-range number is a ConfigError at start-up, the
    same check a swap gets (TOML spells nan and inf)."""
    from conductor.settings import ConfigError
    from tool_server.config import load_config

    for line in ("batch_wait_ms = nan", "batch_wait_ms = inf", "max_batch = 0", "max_new_tokens = 1_000_000"):
        path = tmp_path / "server.toml"
        path.write_text(f"[page_qa.model]\n{line}\n")
        with pytest.raises(ConfigError, match=line.split(" ")[0]):
            load_config(path)
