"""The tool server's routes, schemas and MCP endpoint, with fake sub-agents and fake models
(plus real-loopback tests: uvicorn on 127.0.0.1, the SDK's MCP client, and the real sub-agents)."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.types import TextContent
from pydantic import BaseModel, Field

from subagents import SUBAGENTS
from subagents.fetch import FetchConfig
from subagents.image_ops import Config as ImageConfig
from tests.tool_server_fakes import (
    PAGE,
    FakeFactory,
    fake_subagents,
    make_config,
    page_server,
    running,
    serving,
    with_limits,
)
from tool_server.app import create_app
from tool_server.config import ToolLimits, ToolsConfig
from tool_server.host import tool_schema

# ---------------------------------------------------------------- schemas


class Inner(BaseModel):
    x: int = Field(description="a number")


class Outer(BaseModel):
    title: str = Field(description="a field named like a schema keyword")
    inner: Inner
    items: list[Inner] = Field(default_factory=list)


def test_tool_schema_inlines_refs_and_drops_titles() -> None:
    """The published schema has no $defs/$ref/title keywords but keeps a property called `title`."""
    module = type("M", (), {"NAME": "m", "DESCRIPTION": "d", "Request": Outer})
    schema = tool_schema(module)  # type: ignore[arg-type]
    params = schema["function"]["parameters"]
    text = str(params)
    assert "$defs" not in text and "$ref" not in text
    assert "title" in params["properties"] and "title" not in params["properties"]["title"]
    assert params["properties"]["inner"]["properties"]["x"] == {"description": "a number", "type": "integer"}
    assert schema["function"]["name"] == "m" and schema["type"] == "function"
    jsonschema.Draft202012Validator.check_schema(params)
    jsonschema.validate({"title": "t", "inner": {"x": 1}}, params)


def test_real_subagents_publish_valid_schemas() -> None:
    """The four real sub-agents' schemas are valid JSON Schema objects with the expected names."""
    schemas = [tool_schema(module) for module in SUBAGENTS.values()]
    assert [s["function"]["name"] for s in schemas] == ["page_qa", "image_ops", "video_summary", "search"]
    for schema in schemas:
        params = schema["function"]["parameters"]
        jsonschema.Draft202012Validator.check_schema(params)
        assert params["type"] == "object" and "$defs" not in str(params)
        assert schema["function"]["description"]


# ---------------------------------------------------------------- routes (in-process, fake sub-agents)


def fake_app(calls: Counter[str] | None = None, **cfg: Any) -> Any:
    return create_app(
        make_config(**cfg),
        subagents=fake_subagents(Counter() if calls is None else calls),
        llm_factory=FakeFactory(),
    )


async def test_tools_route_lists_the_four_tools() -> None:
    """GET /v1/tools returns one OpenAI function schema per hosted tool."""
    async with running(fake_app()) as client:
        tools = (await client.get("/v1/tools")).json()
    assert [t["function"]["name"] for t in tools] == ["page_qa", "image_ops", "video_summary", "search"]
    assert tools[0]["function"]["parameters"]["required"] == ["text"]


async def test_call_returns_response_and_observation() -> None:
    """A call answers with the Response fields plus the observation, run under the caller's session."""
    async with running(fake_app()) as client:
        reply = await client.post(
            "/v1/tools/search", json={"text": "hi"}, headers={"X-Conductor-Session": "ep7"}
        )
    body = reply.json()
    assert reply.status_code == 200
    assert (body["ok"], body["echo"], body["session"]) == (True, "hi", "ep7")
    assert body["observation"] == "hi (by fake:smollm2-135m-instruct)"
    assert body["latency_ms"] > 0


async def test_invalid_arguments_are_an_observation() -> None:
    """Arguments that fail validation give 200 + invalid_args naming the field: the policy can fix them."""
    async with running(fake_app()) as client:
        replies = [
            await client.post("/v1/tools/page_qa", json={"txt": "hi"}),
            await client.post("/v1/tools/page_qa", content=b"{not json"),
        ]
    for reply in replies:
        body = reply.json()
        assert reply.status_code == 200 and body["ok"] is False
        assert body["error"]["kind"] == "invalid_args" and body["error"]["retryable"] is False
    assert "text: Field required" in replies[0].json()["error"]["message"]
    assert "txt: Extra inputs are not permitted" in replies[0].json()["observation"]


async def test_unknown_tool_is_404() -> None:
    """A tool name the server does not host is an HTTP 404 (the client maps it to an observation)."""
    async with running(fake_app()) as client:
        assert (await client.post("/v1/tools/nope", json={})).status_code == 404


async def test_subagent_failure_is_structured_and_not_cached() -> None:
    """A sub-agent's error result reaches the caller as ok=false and is recomputed on the next call."""
    calls: Counter[str] = Counter()
    async with running(fake_app(calls)) as client:
        for _ in range(2):
            body = (await client.post("/v1/tools/page_qa", json={"text": "x", "fail": True})).json()
            assert (body["ok"], body["error"]["kind"], body["cached"]) == (False, "fetch_failed", False)
    assert calls["page_qa"] == 2


async def test_escaped_bug_is_500_without_traceback() -> None:
    """An exception escaping a sub-agent is an infrastructure failure: 500, kind internal, no traceback."""
    async with running(fake_app()) as client:
        reply = await client.post("/v1/tools/page_qa", json={"text": "x", "crash": True})
    assert reply.status_code == 500
    assert reply.json()["error"]["kind"] == "internal"
    assert "Traceback" not in reply.text and "RuntimeError" not in reply.text


async def test_cacheable_tools_hit_the_cache_and_image_ops_never_does() -> None:
    """Repeated page_qa calls are served from the cache; image_ops (session state) always runs."""
    calls: Counter[str] = Counter()
    async with running(fake_app(calls)) as client:
        for tool in ("page_qa", "image_ops"):
            bodies = [(await client.post(f"/v1/tools/{tool}", json={"text": " q "})).json() for _ in range(2)]
            assert bodies[0]["cached"] is False
            assert bodies[1]["cached"] is (tool == "page_qa")
    assert calls == Counter({"page_qa": 1, "image_ops": 2})


async def test_call_deadline_gives_timeout_result() -> None:
    """A run past its call deadline returns a retryable `timeout` result instead of hanging."""
    app = create_app(
        make_config(tools=with_limits(page_qa=ToolLimits(call_timeout_s=0.1))),
        subagents=fake_subagents(Counter()),
        llm_factory=FakeFactory(),
    )
    async with running(app) as client:
        started = time.monotonic()
        body = (await client.post("/v1/tools/page_qa", json={"text": "x", "delay_s": 5})).json()
    assert time.monotonic() - started < 2
    assert (body["ok"], body["error"]["kind"], body["error"]["retryable"]) == (False, "timeout", True)


async def test_batch_runs_concurrently_and_keeps_order() -> None:
    """/v1/batch answers every call in request order; the calls overlap in time."""
    calls = [{"name": "search", "arguments": {"text": str(i), "delay_s": 0.3}} for i in range(4)]
    calls.append({"name": "nope", "arguments": {}})
    calls.append({"name": "page_qa", "arguments": {"bad": 1}})
    async with running(fake_app()) as client:
        started = time.monotonic()
        results = (await client.post("/v1/batch", json={"calls": calls})).json()["results"]
    assert time.monotonic() - started < 1.0  # sequential would take 1.2 s
    assert [r.get("echo") for r in results[:4]] == ["0", "1", "2", "3"]
    assert [r["error"]["kind"] for r in results[4:]] == ["invalid_args", "invalid_args"]
    assert "unknown tool 'nope'" in results[4]["observation"]


async def test_batch_size_is_bounded() -> None:
    """More calls than max_batch_calls in one batch is refused outright."""
    calls = [{"name": "search", "arguments": {"text": "x"}}] * 3
    async with running(fake_app(max_batch_calls=2)) as client:
        assert (await client.post("/v1/batch", json={"calls": calls})).status_code == 422


async def test_metrics_reflect_counts_errors_and_cache_hits() -> None:
    """/metrics shows per-tool calls, errors by kind, latency percentiles and cache hit rate."""
    async with running(fake_app()) as client:
        for body in ({"text": "a"}, {"text": "a"}, {"text": "b", "fail": True}, {"bad": 1}):
            await client.post("/v1/tools/page_qa", json=body)
        page_qa = (await client.get("/metrics")).json()["tools"]["page_qa"]
        health = (await client.get("/health")).json()
    assert (page_qa["calls"], page_qa["errors"]) == (4, 2)
    assert page_qa["errors_by_kind"] == {"fetch_failed": 1, "invalid_args": 1}
    assert page_qa["cache"] == {"hits": 1, "misses": 2, "hit_rate": 1 / 3}
    assert (
        page_qa["latency_ms"]["window"] == 4 and page_qa["latency_ms"]["p95"] >= page_qa["latency_ms"]["p50"]
    )
    assert (page_qa["queue_depth"], page_qa["in_flight"]) == (0, 0)
    assert health["status"] == "ok" and health["models"]["search"] == "fake:smollm2-135m-instruct"


async def test_unknown_image_is_404() -> None:
    """An image id the session does not hold is a 404, not a 500."""
    async with running(fake_app()) as client:
        assert (await client.get("/v1/images/img-nope")).status_code == 404


async def test_shared_backend_config_builds_one_model() -> None:
    """Tools with equal BackendConfigs share one LLM (one model in memory); it is closed at shutdown."""
    factory = FakeFactory()
    app = create_app(make_config(), subagents=fake_subagents(Counter()), llm_factory=factory)
    async with running(app):
        assert len(factory.built) == 1 and not factory.built[0].closed
    assert factory.built[0].closed


# ---------------------------------------------------------------- real loopback HTTP


def test_real_server_over_loopback() -> None:
    """uvicorn on 127.0.0.1 serves tools, a call and metrics over real HTTP."""
    with serving(fake_app()) as url, httpx.Client(base_url=url, timeout=10) as client:
        assert len(client.get("/v1/tools").json()) == 4
        assert client.post("/v1/tools/search", json={"text": "over tcp"}).json()["echo"] == "over tcp"
        assert client.get("/metrics").json()["tools"]["search"]["calls"] == 1


async def test_mcp_client_lists_and_calls_tools_over_loopback() -> None:
    """The SDK's streamable-HTTP client sees the four tools and gets a structured result for a call."""
    with serving(fake_app(port=0)) as url:
        async with (
            streamable_http_client(f"{url}/mcp") as (read, write),
            ClientSession(read, write) as session,
        ):
            await session.initialize()
            listed = await session.list_tools()
            result = await session.call_tool("page_qa", {"text": "via mcp"})
            bad = await session.call_tool("page_qa", {"wrong": 1})
    assert sorted(t.name for t in listed.tools) == ["image_ops", "page_qa", "search", "video_summary"]
    assert "$defs" not in str(listed.tools[0].input_schema)
    text, bad_text = result.content[0], bad.content[0]
    assert isinstance(text, TextContent) and isinstance(bad_text, TextContent)
    assert result.is_error is False and text.text.startswith("via mcp")
    assert result.structured_content["echo"] == "via mcp"
    assert bad.is_error is True and "invalid_args" in bad_text.text


@pytest.mark.parametrize(
    ("headers", "status"),
    [({"Host": "evil.example:8700"}, 421), ({"Origin": "http://evil.example"}, 403)],
)
async def test_mcp_refuses_foreign_host_or_origin(headers: dict[str, str], status: int) -> None:
    """DNS-rebinding guard: a request whose Host or Origin is not this loopback server is refused."""
    message = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
    base = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
    async with running(fake_app()) as client:
        good = await client.post("/mcp", json=message, headers=base)
        bad = await client.post("/mcp", json=message, headers={**base, **headers})
    assert good.status_code != status
    assert bad.status_code == status


async def test_lifespan_builds_corpus_when_configured(tmp_path: Path) -> None:
    """With [search] corpus_dir set, the lifespan indexes it and page_qa may open its file:// URLs."""
    (tmp_path / "a.txt").write_text("Ada Lovelace wrote the first program.")
    tools = ToolsConfig()
    search = replace(tools.search, config=replace(tools.search.config, corpus_dir=str(tmp_path)))
    tools = replace(tools, search=search)
    app = create_app(make_config(tools=tools), subagents=fake_subagents(Counter()), llm_factory=FakeFactory())
    async with running(app):
        host = app.state.host
        assert host.corpus is not None and len(host.corpus) == 1
        assert str(tmp_path) in host.fetcher.cfg.allow_file_roots


# ---------------------------------------------------------------- real sub-agents, fake model


def real_app(factory: FakeFactory, **cfg: Any) -> Any:
    fetch = FetchConfig(allow_private_cidrs=("127.0.0.0/8",))  # the test page server is on loopback
    return create_app(make_config(fetch=fetch, **cfg), llm_factory=factory)


def test_real_page_qa_over_http_quotes_the_page() -> None:
    """The real page_qa behind real HTTP reads a loopback page and returns a verbatim supporting quote."""
    factory = FakeFactory(answer="10 December 1815")
    with (
        page_server() as page_url,
        serving(real_app(factory)) as url,
        httpx.Client(base_url=url, timeout=30) as client,
    ):
        question = {"url": f"{page_url}/ada", "question": "When was Ada Lovelace born?"}
        body = client.post("/v1/tools/page_qa", json=question).json()
        again = client.post("/v1/tools/page_qa", json=question).json()
    assert body["ok"] is True, body
    assert body["answer"] == "10 December 1815"
    assert body["quote"] and body["quote"] in " ".join(PAGE.split())
    assert "1815" in body["quote"]
    assert body["tokens_read"] > 0 and body["observation"].count("1815") >= 1
    assert again["cached"] is True and again["quote"] == body["quote"]
    assert (
        len(factory.built) == 1 and "When was Ada Lovelace born?" in factory.built[0].prompts[0][-1].content
    )


@pytest.mark.slow
def test_real_image_ops_zoom_then_read_a_plate(shared_data: Path) -> None:
    """The real image_ops over real HTTP: load a shared plate photo, zoom on the plate, read it; the
    thumbnail route serves the zoomed image to its session only."""
    root = shared_data / "images" / "plates" / "endtoend" / "us"
    name, x, y, w, h, plate = (root / "1e241dc8-8f18-4955-8988-03a0ab49f813.txt").read_text().split()
    x0, y0, width, height = map(int, (x, y, w, h))
    box = [x0 - width, y0 - height, x0 + 2 * width, y0 + 2 * height]  # 3x the plate box, as a policy would
    tools = ToolsConfig()
    tools = replace(tools, image_ops=replace(tools.image_ops, config=ImageConfig(allowed_roots=(str(root),))))
    session = {"X-Conductor-Session": "episode-1"}
    with (
        serving(real_app(FakeFactory(), tools=tools)) as url,
        httpx.Client(base_url=url, timeout=60) as client,
    ):
        loaded = client.post(
            "/v1/tools/image_ops", json={"op": "load", "image": name}, headers=session
        ).json()
        zoom = {"op": "zoom", "image": loaded["image_id"], "box": box, "factor": 2}
        zoomed = client.post("/v1/tools/image_ops", json=zoom, headers=session).json()
        read = {"op": "read", "image": zoomed["image_id"]}
        text = client.post("/v1/tools/image_ops", json=read, headers=session).json()
        thumbnail = client.get(zoomed["thumbnail_url"], headers=session)
        foreign = client.get(zoomed["thumbnail_url"], headers={"X-Conductor-Session": "episode-2"})
    assert (loaded["ok"], loaded["width"], loaded["height"]) == (True, 1280, 720)
    assert (zoomed["width"], zoomed["height"]) == (2 * 3 * width, 2 * 3 * height)
    assert plate in "".join(ch for ch in text["text"] if ch.isalnum()), text
    assert thumbnail.status_code == 200 and thumbnail.content.startswith(b"\x89PNG")
    assert foreign.status_code == 404
