"""The tool server: `create_app(cfg) -> FastAPI`, and `serve(cfg)` to run it with uvicorn.

Routes (bodies are JSON):
    GET  /v1/tools               OpenAI function schemas of the hosted sub-agents (`tool_schema`)
    POST /v1/tools/{name}        body = the tool's Request; answer = its Response + "observation"
    POST /v1/batch               {"calls": [{"name", "arguments"}, ...]} -> {"results": [...]}, in order
    POST /v1/attach              {"attachments": [{"kind", "source", "key", "label"}, ...]} -> {"handles": [...]}:
                                 what a user or task attached, registered in the session before its first turn
    GET  /v1/images/{id}         PNG thumbnail from the caller's image session, or 404
    GET  /health, GET /metrics   liveness; per-tool counts, errors, latency p50/p95, cache, queue depth
    POST /admin/backends/{tool}  body = BackendConfig: hot-swap the model behind one tool (token required)
    /mcp                         the same tools over MCP (mcp_server.py); POST only, a GET stream is 405

Outcome policy. A policy's mistake is an observation, not an HTTP error: arguments that fail validation
give 200 with `{"ok": false, "error": {"kind": "invalid_args", ...}}`, as do the sub-agents' own
structured errors. HTTP errors are for the caller's program or the infrastructure: 404 unknown tool,
401/403 auth, 413 body too large, 422 a malformed batch or swap body (strict JSON: no NaN, no lone
surrogates), 429 + Retry-After when a tool's queue is full or its deadline passes (gates.py) or when a call that
only waits has its connection reclaimed for another's, 503 + Retry-After when every connection slot runs a
request (connections.py; /health keeps a reserve), 400 for a request head that could be read two ways (both
Content-Length and chunked, a folded header line, two Authorization headers), and 500
`{"error": {"kind": "internal"}}` (no traceback; logged) when a bug escapes a sub-agent. In a batch or over
MCP each call is independent: an overload or an escaped bug is that call's own `overloaded` or `internal`
result, and the other calls keep theirs. Header `X-Conductor-Session` names the caller's session (default
"default"): its images and the handles it was shown (subagents/handles.py); the rollout sends one per episode.

Every route, /mcp included, answers only requests addressed to this server (limits.HostGuardMiddleware:
Host 127.0.0.1/localhost/[::1] at the connection's port or in `allowed_hosts`, else 421; a foreign Origin
403); in-process calls (httpx.ASGITransport, no socket) are exempt. A client that goes away before its
request is read whole is logged as a disconnect (an info line, at most one per 10 s) and counted `cancelled`, not
as a bug.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import resource
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any, Literal

import pydantic_core
import uvicorn
from fastapi import APIRouter, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import ClientDisconnect
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from conductor.settings import ConfigError, build
from subagents import SUBAGENTS, image_ops
from subagents.backends import build_llm
from subagents.common import ToolResponse, fail
from subagents.llm import LLM, BackendConfig, BackendError
from tool_server.config import ServerConfig, check_api_key_env
from tool_server.connections import guarded_h11
from tool_server.gates import Caller, Overloaded, caller_of
from tool_server.host import (
    INTERNAL_MESSAGE,
    SESSION_HEADER,
    SubAgent,
    ToolHost,
    echo,
    errors_message,
    invalid_args_message,
    tool_schema,
)
from tool_server.limits import (
    OPEN_PATHS,
    AuthMiddleware,
    BodyLimitMiddleware,
    HostGuardMiddleware,
    is_loopback,
    load_token,
    require_token_off_loopback,
)
from tool_server.mcp_server import build_mcp
from tool_server.registry import HEALTH_RESERVE, LogThrottle

logger = logging.getLogger(__name__)

LLMFactory = Callable[[BackendConfig], LLM]
router = APIRouter()


class BatchCall(BaseModel):
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class BatchRequest(BaseModel):
    calls: list[BatchCall]


class Attachment(BaseModel):
    """One thing a user or a task attached: what it is, where the tool opens it (a page's http(s) or file://
    URL, a video's or image's path under the files roots) and the stable key its handle derives from."""

    model_config = ConfigDict(extra="forbid", strict=True)
    kind: Literal["page", "video", "image"]
    # 2,048: what page_qa takes as a URL (a handle's source reaches the tool unchecked by its Request); no real
    # path is longer, and the handle table holds at most 32 MiB of them (subagents.handles.Handles).
    source: str = Field(min_length=1, max_length=2048)
    key: str = Field(min_length=1, max_length=300)
    label: str = Field(default="", max_length=200)


class AttachRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    attachments: list[Attachment] = Field(max_length=64)  # a task lists a few pages; 32 photos for an audit


def create_app(
    cfg: ServerConfig, *, subagents: Mapping[str, SubAgent] = SUBAGENTS, llm_factory: LLMFactory = build_llm
) -> FastAPI:
    """The ASGI app. Backends, fetcher and the tools' states are built in its lifespan, not here.

    `subagents` and `llm_factory` are injected by tests (fake sub-agents, fake models); each must be named like
    a tool of `cfg.tools`, whose settings it uses.
    """
    _check_subagents(subagents, cfg)
    token = load_token(cfg)
    require_token_off_loopback(cfg, token)
    mcp = build_mcp(cfg, subagents=subagents, get_host=lambda: host_of(app))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.host = await ToolHost.start(cfg, subagents=subagents, llm_factory=llm_factory)
        try:
            async with mcp.manager.run():
                yield
        finally:
            await app.state.host.aclose()

    app = FastAPI(title="Conductor tool server", lifespan=lifespan)
    app.include_router(router)
    app.router.routes.append(Route("/mcp", endpoint=NoStreams(mcp.app), include_in_schema=False))
    app.add_middleware(BodyLimitMiddleware, max_bytes=cfg.max_body_bytes)
    app.add_middleware(AuthMiddleware, token=token)  # outside the body limit: no body read before auth
    hosts = {"allowed_hosts": cfg.allowed_hosts, "allowed_origins": cfg.allowed_origins}
    app.add_middleware(HostGuardMiddleware, port=cfg.port, **hosts)  # added last = outermost
    app.add_exception_handler(ClientDisconnect, functools.partial(_client_gone, LogThrottle()))
    app.add_exception_handler(RequestValidationError, _invalid_request)
    app.add_exception_handler(Exception, _internal_error)
    return app


class NoStreams:
    """/mcp without the server-to-client stream: a GET (the only way to open one) is 405, as the Streamable HTTP
    spec lets a server without one answer. The endpoint is stateless and never sends on such a stream, which
    stayed open for ever (a ping every 15 s) and held a connection each: 2,100 of them starved the server."""

    def __init__(self, mcp_app: ASGIApp) -> None:
        self.mcp_app = mcp_app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "GET":
            body = _error_body("method_not_allowed", "/mcp offers no GET stream; POST JSON-RPC messages")
            await JSONResponse(body, 405, headers={"Allow": "POST"})(scope, receive, send)
            return
        await self.mcp_app(scope, receive, send)


def _check_subagents(subagents: Mapping[str, SubAgent], cfg: ServerConfig) -> None:
    unknown = sorted(set(subagents) - set(cfg.tools))
    if unknown:
        raise ValueError(f"no settings for sub-agents {unknown}; configured: {', '.join(cfg.tools)}")
    misnamed = [(key, module.NAME) for key, module in subagents.items() if key != module.NAME]
    assert not misnamed, f"each sub-agent must be listed under its NAME: {misnamed}"


def host_of(app: FastAPI) -> ToolHost:
    """The app's ToolHost (set by the lifespan); app.state holds nothing else of ours."""
    host: ToolHost = app.state.host
    return host


def _host(request: Request) -> ToolHost:
    return host_of(request.app)


async def _internal_error(request: Request, exc: Exception) -> Response:
    """A bug escaped: 500 with a kind and no traceback (Starlette re-raises after this, so the server logs
    the traceback)."""
    logger.error("internal error on %s %s: %r", request.method, request.url.path, exc)
    return JSONResponse({"error": {"kind": "internal", "message": INTERNAL_MESSAGE}}, status_code=500)


async def _invalid_request(request: Request, exc: Exception) -> Response:
    """A body FastAPI validated for a route (one declared with a pydantic parameter) and refused: 422
    invalid_args naming the fields and problems (`errors_message`: names cut, a few problems), without FastAPI's
    default echo of the input, which may hold what no JSON answer can encode (NaN, a lone surrogate): that echo
    made /v1/batch answer 500."""
    assert isinstance(exc, RequestValidationError), type(exc)
    return _invalid_body(errors_message(exc.errors()))


async def _client_gone(said: LogThrottle, request: Request, exc: Exception) -> Response:
    """The client went away before its request was read whole (or was cut off by the request deadline or the
    body rate, or closed to make room): nothing is broken, so an info line and no traceback, at most one per
    LOG_EVERY_S (`said`: an attack of slow bodies disconnects hundreds a second). The answer is never delivered."""
    count = said.occurred(now=time.monotonic())
    if count is not None:
        logger.info(
            "client disconnected during %s %s (%d since last said)", request.method, request.url.path, count
        )
    return Response(status_code=400)


def _dump(response: ToolResponse) -> dict[str, Any]:
    return {**response.model_dump(mode="json"), "observation": response.observation()}


def _overloaded_json(exc: Overloaded) -> JSONResponse:
    error = {"kind": "overloaded", "message": str(exc), "retryable": True}
    body = {"ok": False, "error": error, "observation": f"error (overloaded): {exc}"}
    return JSONResponse(body, status_code=429, headers={"Retry-After": str(exc.retry_after_s)})


@router.get("/v1/tools")
async def list_tools(request: Request) -> list[dict[str, Any]]:
    return [tool_schema(module) for module in _host(request).subagents.values()]


@router.post("/v1/tools/{name}")
async def call_tool(name: str, request: Request) -> Response:
    host = _host(request)
    if name not in host.subagents:
        raise HTTPException(404, f"unknown tool {echo(name)!r}; tools: {', '.join(host.subagents)}")
    session = request.headers.get(SESSION_HEADER, "default")
    started = time.perf_counter()
    try:
        body = await request.body()
    except ClientDisconnect:  # counted with the calls whose caller went away, then logged by _client_gone
        host.metrics[name].record(seconds=time.perf_counter() - started, error="cancelled")
        raise
    try:
        response = await host.call(name, body, session=session, caller=caller_of(request.scope))
    except Overloaded as exc:
        return _overloaded_json(exc)
    return JSONResponse(_dump(response))


@router.post("/v1/batch")
async def call_batch(request: Request) -> Response:
    host = _host(request)
    try:
        batch = _batch_request(await request.body())
    except ValueError as exc:  # not JSON, NaN or Infinity, a lone surrogate, too deep, not a batch
        return _invalid_body(str(exc))
    if len(batch.calls) > host.cfg.max_batch_calls:
        return _invalid_body(f"{len(batch.calls)} calls in one batch; at most {host.cfg.max_batch_calls}")
    session = request.headers.get(SESSION_HEADER, "default")
    # Each item is its own result (call_as_result answers a bug as `internal`), so none can fail the batch.
    caller = caller_of(request.scope)
    results = await asyncio.gather(*(_batch_item(host, call, session, caller=caller) for call in batch.calls))
    return JSONResponse({"results": [_dump(result) for result in results]})


def json_body(body: bytes) -> Any:
    """A request body as JSON, strictly: NaN and Infinity, lone surrogates (which no JSON answer can carry back)
    and nesting past pydantic's depth limit (200) are ValueErrors whose text gives a position, never the input."""
    try:
        return pydantic_core.from_json(body, allow_inf_nan=False)
    except ValueError as exc:
        raise ValueError(
            f"the body is not valid JSON ({exc}; no NaN or Infinity, no lone surrogates)"
        ) from None


def _batch_request(body: bytes) -> BatchRequest:
    """The batch envelope; ValueError saying what is wrong with it (the input itself is never echoed)."""
    try:
        return BatchRequest.model_validate(json_body(body))
    except ValidationError as exc:
        raise ValueError(invalid_args_message(exc)) from None


def _invalid_body(message: str) -> JSONResponse:
    """422 for a body the caller's program got wrong (not a policy's call: those are results)."""
    return JSONResponse(_error_body("invalid_args", message), status_code=422)


def _error_body(kind: str, message: str) -> dict[str, Any]:
    return {"error": {"kind": kind, "message": message}}


async def _batch_item(host: ToolHost, call: BatchCall, session: str, *, caller: Caller) -> ToolResponse:
    module = host.subagents.get(call.name)
    if module is None:
        message = f"unknown tool {echo(call.name)!r}; tools: {', '.join(host.subagents)}"
        return fail(ToolResponse, "invalid_args", message)
    return await host.call_as_result(module.NAME, call.arguments, session=session, caller=caller)


@router.post("/v1/attach")
async def attach(request: Request) -> Response:
    try:
        body = _attach_request(await request.body())
    except (
        ValueError
    ) as exc:  # not JSON, NaN, a lone surrogate (it would be stored and shown), not attachments
        return _invalid_body(str(exc))
    session = request.headers.get(SESSION_HEADER, "default")
    items = [(a.kind, a.source, a.key, a.label) for a in body.attachments]
    try:
        return JSONResponse({"handles": _host(request).attach(session, items)})
    except ValueError as exc:  # two keys sharing a handle
        return _invalid_body(str(exc))


def _attach_request(body: bytes) -> AttachRequest:
    """The attachments; ValueError saying what is wrong with them (the input itself is never echoed)."""
    try:
        return AttachRequest.model_validate(json_body(body))
    except ValidationError as exc:
        raise ValueError(invalid_args_message(exc)) from None


@router.get("/v1/images/{image_id}")
async def image_thumbnail(image_id: str, request: Request) -> Response:
    """The one route a sub-agent adds: image_ops's images as PNG thumbnails for trace viewers. An id is
    derived from how its image was made, so the same id in two sessions is the same picture and a viewer may
    fetch one without the session header; with the header, only that session's images are found."""
    session = request.headers.get(SESSION_HEADER)
    store = _host(request).states.get(image_ops.NAME)
    png = None
    if isinstance(store, image_ops.ImageStore):
        png = await asyncio.to_thread(store.thumbnail_png, image_id, session=session)
    if png is None:
        raise HTTPException(404, f"no image {echo(image_id)!r}")
    return Response(png, media_type="image/png")


@router.get("/health")
async def health(request: Request) -> dict[str, Any]:
    host = _host(request)
    return {"status": "ok", "tools": list(host.subagents), "models": host.model_ids()}


@router.get("/metrics")
async def metrics(request: Request) -> dict[str, Any]:
    return _host(request).metrics_snapshot()


@router.post("/admin/backends/{tool}")
async def swap_backend(tool: str, request: Request) -> Response:
    """Build the model the BackendConfig body names (in a thread) and make it answer `tool`'s new calls."""
    host = _host(request)
    if tool not in host.subagents:
        raise HTTPException(404, f"unknown tool {echo(tool)!r}; tools: {', '.join(host.subagents)}")
    try:
        backend_cfg = _backend_config(await request.body())
        check_api_key_env(backend_cfg, host.cfg.allowed_api_key_envs, where="the BackendConfig body")
    except ValueError as exc:  # not strict JSON or an object, an unknown key, a bad value or base_url, a key
        return _invalid_body(str(exc))  # variable [server] allowed_api_key_envs does not list
    try:
        model_id = await host.swap_backend(tool, backend_cfg)
    except (BackendError, OSError) as exc:  # what building a model raises for a bad name, path or device
        return JSONResponse({"error": {"kind": "backend_error", "message": str(exc)}}, status_code=422)
    except ConfigError as exc:  # the tool's settings cannot run on that model (page_qa: "extract")
        return JSONResponse({"error": {"kind": "invalid_config", "message": str(exc)}}, status_code=422)
    return JSONResponse({"tool": tool, "model_id": model_id})


def _backend_config(body: bytes) -> BackendConfig:
    """A BackendConfig from JSON, checked like the TOML file: unknown keys and wrong types are errors."""
    data = json_body(body)
    if not isinstance(data, dict):
        raise ValueError("the body must be a JSON object of BackendConfig fields")
    return build(BackendConfig, data, "the BackendConfig body")


GRACEFUL_SHUTDOWN_S = 30  # in-flight model calls get this long to finish on Ctrl-C
# File descriptors besides the connections: fetches, model files, ffmpeg pipes, the OCR models, logs.
SPARE_FDS = 512


def uvicorn_config(cfg: ServerConfig, app: FastAPI, *, log_level: str = "info") -> uvicorn.Config:
    """uvicorn settings for `app`: the guarded h11 protocol (tool_server/connections.py) with `cfg`'s deadlines
    and connection caps in place of uvicorn's `limit_concurrency`, which counts idle sockets and /health alike."""
    http = guarded_h11(
        request_timeout_s=cfg.request_timeout_s,
        response_timeout_s=cfg.response_timeout_s,
        min_body_rate=cfg.min_body_rate_bytes_s,
        send_timeout_s=cfg.send_timeout_s,
        max_connections=cfg.max_connections,
        per_peer=cfg.max_connections_per_peer,
        open_paths=OPEN_PATHS,
    )
    return uvicorn.Config(
        app,
        host=cfg.host,
        port=cfg.port,
        http=http,
        ws="none",  # no WebSocket routes; an upgrade would hand its socket to a protocol the guard cannot see
        timeout_keep_alive=cfg.keep_alive_s,  # type: ignore[arg-type]  # uvicorn types it int; a float works
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        log_level=log_level,
    )


def check_fd_limit(cfg: ServerConfig) -> None:
    """Raise the soft open-file limit to what `max_connections` needs (the hard limit allows), or warn."""
    needed = cfg.max_connections + HEALTH_RESERVE + SPARE_FDS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        if hard == resource.RLIM_INFINITY or hard >= needed:
            resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
        else:
            logger.warning(
                "open-file limit %d < %d: lower max_connections or raise `ulimit -n`", hard, needed
            )


def serve(cfg: ServerConfig) -> None:
    """Run the server until interrupted (blocking). Raises limits.UnsafeBind before binding anything."""
    app = create_app(cfg)
    if not is_loopback(cfg.host) and not cfg.allowed_hosts:
        logger.warning("bound to %s with no allowed_hosts: any Host but loopback names gets 421", cfg.host)
    check_fd_limit(cfg)
    logger.info("tool server on http://%s:%d (MCP at /mcp)", cfg.host, cfg.port)
    uvicorn.Server(uvicorn_config(cfg, app)).run()
