"""The tool server's routes, schemas and MCP endpoint, with fake sub-agents and fake models
(plus real-loopback tests: uvicorn on 127.0.0.1, the SDK's MCP client, and the real sub-agents)."""

from __future__ import annotations

import asyncio
import re
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import httpx
import jsonschema
import pytest
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.types import TextContent
from PIL import Image
from pydantic import BaseModel, Field

from conductor.models import DEFAULT_READER
from main_agent.rollout import RolloutConfig, RolloutTask, rollout
from subagents import SUBAGENTS
from subagents.common import Files
from subagents.fetch import FetchConfig
from tests.fakes import TOOLS, ScriptedPolicy, call_text
from tests.tool_server_fakes import (
    PAGE,
    FakeFactory,
    fake_subagents,
    make_config,
    page_server,
    redirect_server,
    running,
    serving,
    with_limits,
)
from tool_server.app import create_app
from tool_server.client import ToolClient
from tool_server.config import ToolLimits, default_tools
from tool_server.host import INTERNAL_MESSAGE, tool_schema

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
    assert body["observation"] == f"hi (by fake:{DEFAULT_READER})"
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


async def test_a_bug_in_one_batch_item_is_that_items_internal_result(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An exception escaping one call of a batch becomes that call's own `internal` result (no exception text,
    traceback in the server log); the batch answers 200 and the other calls keep their results."""
    calls = [
        {"name": "search", "arguments": {"text": "before", "delay_s": 0.2}},
        {"name": "page_qa", "arguments": {"text": "x", "crash": True}},
        {"name": "image_ops", "arguments": {"text": "after"}},
    ]
    async with running(fake_app()) as client:
        reply = await client.post("/v1/batch", json={"calls": calls})
        metrics = (await client.get("/metrics")).json()["tools"]["page_qa"]
    results = reply.json()["results"]
    assert reply.status_code == 200
    assert [r.get("echo") for r in (results[0], results[2])] == ["before", "after"]
    assert results[1]["ok"] is False
    assert results[1]["error"] == {"kind": "internal", "message": INTERNAL_MESSAGE, "retryable": False}
    assert "a bug in the fake" not in reply.text and "Traceback" not in reply.text
    logged = [r for r in caplog.records if r.exc_info and "page_qa" in r.getMessage()]
    assert len(logged) == 1 and "a bug in the fake sub-agent" in caplog.text
    assert metrics["errors_by_kind"] == {"internal": 1}


async def test_cache_keys_on_the_exact_request() -> None:
    """A request differing only in whitespace ("ok.mp4\n" names no file) is computed, not served the
    answer cached for "ok.mp4"; the exact same request is still a hit."""
    calls: Counter[str] = Counter()
    async with running(fake_app(calls)) as client:
        first = (await client.post("/v1/tools/video_summary", json={"text": "ok.mp4"})).json()
        other = (await client.post("/v1/tools/video_summary", json={"text": "ok.mp4\n"})).json()
        again = (await client.post("/v1/tools/video_summary", json={"text": "ok.mp4"})).json()
    assert (first["cached"], other["cached"], other["echo"]) == (False, False, "ok.mp4\n")
    assert (again["cached"], again["echo"]) == (True, "ok.mp4")
    assert calls["video_summary"] == 2


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
    assert health["status"] == "ok" and health["models"]["search"] == f"fake:{DEFAULT_READER}"


async def test_unknown_image_is_404() -> None:
    """An image id the session does not hold is a 404, not a 500."""
    async with running(fake_app()) as client:
        assert (await client.get("/v1/images/img-nope")).status_code == 404


async def test_shared_backend_config_builds_one_model() -> None:
    """Tools with equal BackendConfigs share one LLM (one model in memory): by default every tool names the
    default reader, so one model is built; it is closed at shutdown."""
    factory = FakeFactory()
    app = create_app(make_config(), subagents=fake_subagents(Counter()), llm_factory=factory)
    async with running(app):
        assert [llm.model_id for llm in factory.built] == [f"fake:{DEFAULT_READER}"]
        assert not any(llm.closed for llm in factory.built)
    assert all(llm.closed for llm in factory.built)


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


MCP_HEADERS = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}


async def mcp_call(client: httpx.AsyncClient, name: str, arguments: dict[str, Any]) -> httpx.Response:
    """One tools/call over /mcp as raw JSON-RPC (stateless JSON mode: one POST, one JSON answer)."""
    message = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "tools/call",
        "params": {"name": name, "arguments": arguments},
    }
    return await client.post("/mcp", json=message, headers=MCP_HEADERS)


async def test_mcp_bug_is_an_internal_result_without_exception_text() -> None:
    """A bug escaping a call over MCP is an is_error result of kind `internal` with a short message; the
    exception text never reaches the client (the SDK would send str(exc) as the JSON-RPC error message)."""
    async with running(fake_app()) as client:
        reply = await mcp_call(client, "page_qa", {"text": "x", "crash": True})
    result = reply.json()["result"]
    assert result["isError"] is True
    assert result["structuredContent"]["error"]["kind"] == "internal"
    assert result["content"][0]["text"] == f"error (internal): {INTERNAL_MESSAGE}"
    assert "a bug in the fake" not in reply.text and "RuntimeError" not in reply.text


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


async def test_lifespan_builds_each_tools_state_and_shares_the_roots(tmp_path: Path) -> None:
    """At start-up every sub-agent's `start` builds its state (search indexes [search] corpus_dir; image_ops its
    image store), and the one [files] roots setting reaches the fetcher (page_qa's file:// hits) and each call."""
    from subagents import SUBAGENTS
    from subagents.common import Files
    from subagents.image_ops import ImageStore
    from subagents.search import Corpus

    (tmp_path / "a.txt").write_text("Ada Lovelace wrote the first program.")
    tools = default_tools()
    search = replace(tools["search"], config=replace(tools["search"].config, corpus_dir=str(tmp_path)))
    cfg = make_config(tools={**tools, "search": search}, files=Files(roots=(str(tmp_path),)))
    app = create_app(cfg, subagents=SUBAGENTS, llm_factory=FakeFactory())
    async with running(app) as client:
        host = app.state.host
        assert isinstance(host.states["search"], Corpus) and len(host.states["search"]) == 1
        assert isinstance(host.states["image_ops"], ImageStore)
        assert host.states["page_qa"] is None and host.states["video_summary"] is None
        hits = (await client.post("/v1/tools/search", json={"query": "Ada Lovelace"})).json()["hits"]
        page = await client.post("/v1/tools/page_qa", json={"url": hits[0]["url"], "question": "Who?"})
    assert page.json()["ok"], page.json()


ROUTES = [
    ("GET", "/health"),
    ("GET", "/v1/tools"),
    ("GET", "/metrics"),
    ("POST", "/v1/tools/search"),
    ("POST", "/v1/batch"),
    ("GET", "/v1/images/img_1"),
    ("POST", "/admin/backends/search"),
    ("POST", "/mcp"),
]


def test_every_route_refuses_a_foreign_host_or_origin_over_real_sockets() -> None:
    """DNS-rebinding guard on every route, not only /mcp: over real loopback HTTP a foreign Host (or the
    right name at another port) is 421 and a foreign Origin 403, each with a JSON error; loopback names
    in any case, with the connection's port, and their http:// origins pass."""
    with serving(fake_app()) as url, httpx.Client(base_url=url, timeout=10) as client:
        port = int(url.rsplit(":", 1)[1])
        for method, path in ROUTES:
            for headers, status, kind in [
                ({"Host": f"evil.example:{port}"}, 421, "bad_host"),
                ({"Host": f"localhost:{port + 1}"}, 421, "bad_host"),
                ({"Origin": "http://evil.example"}, 403, "bad_origin"),
                ({"Origin": "null"}, 403, "bad_origin"),
            ]:
                reply = client.request(method, path, json={"text": "x"}, headers=headers)
                assert (reply.status_code, reply.json()["error"]["kind"]) == (status, kind), (path, headers)
        for host in (f"127.0.0.1:{port}", f"LocalHost:{port}", f"[::1]:{port}"):
            assert client.get("/health", headers={"Host": host}).status_code == 200, host
        origin = {"Origin": f"http://localhost:{port}"}
        assert client.post("/v1/tools/search", json={"text": "x"}, headers=origin).json()["echo"] == "x"


async def test_allowed_hosts_and_origins_extend_the_policy_and_in_process_calls_are_exempt() -> None:
    """allowed_hosts / allowed_origins (any case) are accepted; a request with no socket behind it (an
    ASGITransport client on "http://embedded", as `conductor ask` and training use) needs neither."""
    app = fake_app(allowed_hosts=("GPU-Box:8700",), allowed_origins=("https://Dash.example",))
    async with running(app) as client:  # base URL http://127.0.0.1:8700: judged like a socket
        assert (await client.get("/health", headers={"Host": "gpu-box:8700"})).status_code == 200
        assert (await client.get("/health", headers={"Host": "gpu-box:8701"})).status_code == 421
        for origin in ("https://dash.example", "http://gpu-box:8700"):
            assert (await client.get("/health", headers={"Origin": origin})).status_code == 200, origin
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://embedded") as embedded:
            reply = await embedded.post("/v1/tools/search", json={"text": "in process"})
    assert reply.status_code == 200 and reply.json()["echo"] == "in process"


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
    [reader] = [llm for llm in factory.built if llm.model_id == f"fake:{DEFAULT_READER}"]
    assert "When was Ada Lovelace born?" in reader.prompts[0][-1].content


# Issue 66: bidi embeddings, overrides, isolates and marks, and zero-width characters, as a hostile page sends them.
HIDDEN = (
    "\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u200e\u200f\u061c\u200b\u200c\u200d\u2060\ufeff"
)


def test_no_observation_carries_bidi_controls_or_zero_width_characters(tmp_path: Path) -> None:
    """A text page and a model's answer holding right-to-left overrides, isolates, direction marks and zero-width
    characters (which can make what a page says display as something else) reach the policy without any of them,
    while accents, Chinese and Arabic letters stay as they were (before: all passed into the observation)."""
    text = f"Ada Lovelace (艾达 · آدا لاوليس) was born in London on 10{HIDDEN} December 1815, née Byron."
    (tmp_path / "ada.txt").write_text(text)
    factory = FakeFactory(answer=f"10{HIDDEN} December 1815, née Byron")
    with (
        serving(real_app(factory, files=Files(roots=(str(tmp_path),)))) as url,
        httpx.Client(base_url=url, timeout=30) as client,
    ):
        question = {"url": (tmp_path / "ada.txt").as_uri(), "question": "When was Ada Lovelace born?"}
        body = client.post("/v1/tools/page_qa", json=question).json()
    observation = body["observation"]
    assert body["ok"] is True and not set(observation) & set(HIDDEN), ascii(observation)
    assert "answer: 10 December 1815, née Byron" in observation, observation
    assert "(艾达 · آدا لاوليس) was born in London on 10 December 1815" in observation, observation


UNUSABLE_LOCATIONS = ["mailto:x@y", "javascript:alert(1)", "data:text/html,hi", "http:127.0.0.1:8080/x"]


def test_redirects_to_unusable_locations_are_results_alone_and_in_a_batch() -> None:
    """A page redirecting to mailto:, javascript:, data: or a host-less http: Location gives page_qa a
    blocked_url / fetch_failed result over real HTTP, never a 500, and a batch of them keeps every result."""
    with (
        redirect_server() as redirects,
        page_server() as pages,
        serving(real_app(FakeFactory(answer="1815"))) as url,
        httpx.Client(base_url=url, timeout=30) as client,
    ):
        questions = [
            {"url": f"{redirects}/go?{urlencode({'to': loc})}", "question": "When?"}
            for loc in UNUSABLE_LOCATIONS
        ]
        single = [client.post("/v1/tools/page_qa", json=q) for q in questions]
        calls = [{"name": "page_qa", "arguments": q} for q in questions]
        calls.append(
            {"name": "page_qa", "arguments": {"url": f"{pages}/ada", "question": "When was she born?"}}
        )
        batch = client.post("/v1/batch", json={"calls": calls})
    assert [r.status_code for r in single] == [200] * 4 and batch.status_code == 200
    kinds = [r.json()["error"]["kind"] for r in single]
    assert kinds == ["blocked_url", "blocked_url", "blocked_url", "fetch_failed"]
    results = batch.json()["results"]
    assert [r["error"]["kind"] for r in results[:4]] == kinds and results[4]["ok"] is True


def test_overlong_paths_are_invalid_args_over_rest_and_mcp_without_server_paths(tmp_path: Path) -> None:
    """A 300-character file name for image_ops `load` or video_summary is `invalid_args` (not a 500 from
    ENAMETOOLONG) over REST, and over MCP an is_error result; neither names the server's folders."""
    files = Files(roots=(str(tmp_path),))
    calls = [
        ("image_ops", {"op": "load", "image": "a" * 300 + ".png"}),
        ("video_summary", {"video": "v" * 300}),
    ]
    with serving(real_app(FakeFactory(), files=files, port=0)) as url:

        async def over_mcp() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                return [await mcp_call(client, name, args) for name, args in calls]

        rest = [httpx.post(f"{url}/v1/tools/{name}", json=args, timeout=30) for name, args in calls]
        mcp = asyncio.run(over_mcp())
    for reply in rest:
        assert reply.status_code == 200 and reply.json()["error"]["kind"] == "invalid_args", reply.text
        assert "name too long" in reply.json()["error"]["message"]
    for reply in mcp:
        result = reply.json()["result"]
        assert result["isError"] is True and result["structuredContent"]["error"]["kind"] == "invalid_args"
    assert all(str(tmp_path) not in reply.text for reply in [*rest, *mcp])


@pytest.mark.slow
def test_real_image_ops_zoom_then_read_a_plate(shared_data: Path) -> None:
    """The real image_ops over real HTTP: load a shared plate photo, zoom on the plate, read it; the
    thumbnail route serves the zoomed image to its session only."""
    root = shared_data / "images" / "plates" / "endtoend" / "us"
    name, x, y, w, h, plate = (root / "1e241dc8-8f18-4955-8988-03a0ab49f813.txt").read_text().split()
    x0, y0, width, height = map(int, (x, y, w, h))
    box = [x0 - width, y0 - height, x0 + 2 * width, y0 + 2 * height]  # 3x the plate box, as a policy would
    session = {"X-Conductor-Session": "episode-1"}
    with (
        serving(real_app(FakeFactory(), files=Files(roots=(str(root),)))) as url,
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


def odd_shapes_script(history: str, turn: int) -> str:
    """A policy that loads a photo and a 1x2001 PNG, zooms to an 8x6000 strip of the photo, then looks for and
    reads text on both odd shapes (each call's image id taken from the observations so far)."""
    photo, thin = (re.findall(rf"(img_[0-9a-f]{{6}}) {size}", history) for size in ("600x800", "1x2001"))
    if turn == 0:
        return call_text("image_ops", op="load", image="photo.png") + call_text(
            "image_ops", op="load", image="thin.png"
        )
    if turn == 1:
        zoom = call_text("image_ops", op="zoom", image=photo[-1], box=[0, 0, 1, 750], factor=8)
        return zoom + call_text("image_ops", op="find_text", image=thin[-1])
    if turn == 2:
        strip = re.findall(r"(img_[0-9a-f]{6}) 8x6000", history)[-1]
        return call_text("image_ops", op="find_text", image=strip) + call_text(
            "image_ops", op="read", image=strip
        )
    return "<answer>no text</answer>"


@pytest.mark.slow
async def test_odd_image_shapes_through_the_client_and_the_rollout_are_observations(tmp_path: Path) -> None:
    """A policy's own odd shapes (an 8x6000 zoom, a 1x2001 PNG) through ToolClient and the rollout, with the
    real image_ops: every call is an ok observation and the episode ends with the policy's answer, never an
    infrastructure failure (find_text on them was an HTTP 500, i.e. ToolServerError and a dropped episode)."""
    Image.new("RGB", (600, 800), "white").save(tmp_path / "photo.png")
    Image.new("RGB", (1, 2001), "gray").save(tmp_path / "thin.png")
    app = real_app(FakeFactory(), files=Files(roots=(str(tmp_path),)))
    policy = ScriptedPolicy(odd_shapes_script)
    task = RolloutTask("odd", "What text is there?", TOOLS)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with ToolClient("http://embedded", transport=transport, deadline_s=120) as tools:
            episode = await rollout(task, policy, tools, policy.tokenizer, RolloutConfig())
    assert (episode.stop_reason, episode.infra_error, episode.answer) == ("answer", None, "no text")
    results = [result for turn in episode.turns for result in turn.results]
    assert len(results) == 6 and episode.tool_errors == 0, [r.observation for r in results]
    seen = " ".join(turn.observation_text for turn in episode.turns)
    assert "1x2001 no text found" in seen and "8x6000 no text found" in seen and "8x6000 read:" in seen


def test_symlinks_in_a_files_root_are_results_and_never_leak_over_http(tmp_path: Path) -> None:
    """Over real HTTP: page_qa on a symlink loop inside a files root is an invalid_args result (it was a 500),
    on a link out of the roots a blocked_url result that names neither the target nor a root, and search
    never indexes that link's text; /health answers afterwards."""
    root, outside = tmp_path / "corpus", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "tea.txt").write_text("Green tea is steamed soon after picking.")
    (outside / "passwd").write_text("root:x:0:0:swordfish:/root:/bin/bash")
    (root / "loop.html").symlink_to(root / "loop.html")
    (root / "leak.txt").symlink_to(outside / "passwd")
    tools = default_tools()
    search = replace(tools["search"], config=replace(tools["search"].config, corpus_dir=str(root)))
    app = real_app(FakeFactory(), files=Files(roots=(str(root),)), tools={**tools, "search": search})
    with serving(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        loop = client.post(
            "/v1/tools/page_qa", json={"url": (root / "loop.html").as_uri(), "question": "What?"}
        )
        leak = client.post(
            "/v1/tools/page_qa", json={"url": (root / "leak.txt").as_uri(), "question": "Who?"}
        )
        hits = client.post("/v1/tools/search", json={"query": "root bash swordfish"})
        health = client.get("/health")
    assert (loop.status_code, loop.json()["error"]["kind"]) == (200, "invalid_args"), loop.text
    assert (leak.status_code, leak.json()["error"]["kind"]) == (200, "blocked_url"), leak.text
    assert "outside the allowed file roots" in leak.json()["error"]["message"]
    assert str(outside) not in leak.text and "swordfish" not in leak.text
    assert hits.json()["ok"] is True and hits.json()["hits"] == []
    assert health.status_code == 200


# The attack's bodies: NaN and Infinity where JSON has none, lone surrogates no UTF-8 answer can carry, and
# nesting deep enough to exhaust a recursive parser.
UNENCODABLE_BODIES = [
    b'{"calls": NaN}',
    b'{"calls": Infinity}',
    b'{"query": "\\ud800"}',
    b'{"calls": [{"name": "search", "arguments": {"text": "\\udfff"}}]}',
    b'{"calls": [{"name": "search", "arguments": {"text": "x", "delay_s": NaN}}]}',
    b"[" * 100_000 + b"]" * 100_000,
]


def test_bodies_no_json_answer_can_echo_are_refused_on_every_route() -> None:
    """/v1/batch answers NaN, Infinity, a lone surrogate or 100,000-deep nesting with 422 invalid_args (its
    validation error echoed the input and could not encode it: a 500); /v1/tools/* with an invalid_args
    result and /mcp with 400, as before; the server stays healthy."""
    with serving(fake_app()) as url, httpx.Client(base_url=url, timeout=30) as client:
        headers = {"Content-Type": "application/json"}
        for body in UNENCODABLE_BODIES:
            batch = client.post("/v1/batch", content=body, headers=headers)
            assert (batch.status_code, batch.json()["error"]["kind"]) == (422, "invalid_args"), body[:60]
            tool = client.post("/v1/tools/search", content=body, headers=headers)
            assert (tool.status_code, tool.json()["error"]["kind"]) == (200, "invalid_args"), body[:60]
            mcp = client.post("/mcp", content=body, headers={**headers, **MCP_HEADERS})
            assert mcp.status_code == 400, body[:60]
        assert client.get("/health").status_code == 200
        calls = [{"name": "search", "arguments": {"text": "fine"}}]
        assert client.post("/v1/batch", json={"calls": calls}).json()["results"][0]["echo"] == "fine"


def test_two_origins_are_refused_and_a_hosts_trailing_dot_is_the_same_name() -> None:
    """Over real sockets: two Origin headers are 403 whichever comes first (the first used to win), and
    `localhost.:<port>` (the same name with its root dot, which got 421) is accepted as Host and in an Origin,
    while a foreign name with a dot stays 421."""
    with serving(fake_app()) as url, httpx.Client(base_url=url, timeout=10) as client:
        port = int(url.rsplit(":", 1)[1])
        mine, evil = f"http://127.0.0.1:{port}", "http://evil.example"
        for first, second in ((mine, evil), (evil, mine)):
            reply = client.get("/v1/tools", headers=[("Origin", first), ("Origin", second)])
            assert (reply.status_code, reply.json()["error"]["kind"]) == (403, "bad_origin")
        dotted = client.get(
            "/health", headers={"Host": f"localhost.:{port}", "Origin": f"http://localhost.:{port}"}
        )
        foreign = client.get("/health", headers={"Host": f"evil.example.:{port}"})
    assert dotted.status_code == 200 and foreign.status_code == 421


class Declared(BaseModel):
    text: str
    count: int


def test_a_route_with_a_pydantic_body_refuses_unencodable_input_without_echoing_it() -> None:
    """Any route whose body FastAPI validates (as /v1/batch did) answers NaN, Infinity or lone-surrogate input
    that fails validation with 422 invalid_args naming the field, never FastAPI's echo of the input, which
    could not be encoded: a 500."""
    app = fake_app()

    @app.post("/test/declared")
    async def declared(body: Declared) -> dict[str, str]:
        return {"text": body.text}

    headers = {"Content-Type": "application/json"}
    with serving(app) as url, httpx.Client(base_url=url, timeout=10) as client:
        replies = [
            client.post("/test/declared", content=body, headers=headers)
            for body in (
                b'{"text": NaN, "count": 1}',
                b'{"text": "x", "count": Infinity}',
                b'{"text": "\\ud800"}',
            )
        ]
        health = client.get("/health").status_code
    for reply in replies:
        assert (reply.status_code, reply.json()["error"]["kind"]) == (422, "invalid_args"), reply.text
    assert "count:" in replies[1].json()["error"]["message"] and health == 200
