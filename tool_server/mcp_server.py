"""The hosted tools over MCP (official `mcp` SDK 2.x, low-level Server), Streamable HTTP at /mcp.

Stateless with JSON responses: every POST is answered on its own, so any number of rollout workers can
share the endpoint and no session state outlives a request. Tool results carry the observation as text,
the full Response as `structured_content`, and `is_error` for a failed call (the policy reads the error
like any observation). An unknown tool name is a protocol error (INVALID_PARAMS).

Errors carry a kind and a short message, never exception text: a bug escaping a call is an `internal`
result (ToolHost.call_as_result logs its traceback). An exception raised out of `call_tool` would reach
the wire as the SDK's JSON-RPC error with `str(exc)` as its message (OS errors name server paths).

DNS-rebinding guard: limits.HostGuardMiddleware, which the app puts in front of every route, /mcp
included, so REST and MCP follow one Host/Origin policy (Host 127.0.0.1, localhost or [::1] at the
connection's port, or one of `allowed_hosts`, else 421; a foreign Origin 403). The SDK's own check
(TransportSecuritySettings) is switched off: its lists could drift from ours, and it compares Host
case-sensitively.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import mcp_types as types
from mcp.server import Server, ServerRequestContext
from mcp.server.streamable_http_manager import StreamableHTTPASGIApp, StreamableHTTPSessionManager
from mcp.server.transport_security import TransportSecuritySettings
from mcp.shared.exceptions import MCPError
from starlette.requests import Request

from tool_server.config import ServerConfig
from tool_server.host import SESSION_HEADER, SubAgent, ToolHost, compact_schema, echo


@dataclass(frozen=True)
class McpEndpoint:
    """The session manager (run it in the app's lifespan) and the ASGI app to route /mcp to."""

    manager: StreamableHTTPSessionManager
    app: StreamableHTTPASGIApp


def build_mcp(
    cfg: ServerConfig, *, subagents: Mapping[str, SubAgent], get_host: Callable[[], ToolHost]
) -> McpEndpoint:
    """An MCP server publishing `subagents`; calls go through the same ToolHost as the HTTP routes."""

    async def list_tools(
        ctx: ServerRequestContext[Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        return types.ListToolsResult(tools=[mcp_tool(module) for module in subagents.values()])

    async def call_tool(
        ctx: ServerRequestContext[Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        if params.name not in subagents:
            raise MCPError(
                types.INVALID_PARAMS, f"unknown tool {echo(params.name)!r}; tools: {', '.join(subagents)}"
            )
        host = get_host()
        response = await host.call_as_result(params.name, params.arguments or {}, session=_session(ctx))
        return types.CallToolResult(
            content=[types.TextContent(text=response.observation())],
            structured_content=response.model_dump(mode="json"),
            is_error=not response.ok,
        )

    server: Server[Any] = Server("conductor-tools", on_list_tools=list_tools, on_call_tool=call_tool)
    manager = StreamableHTTPSessionManager(
        app=server,
        json_response=True,
        stateless=True,
        # Host/Origin are checked by limits.HostGuardMiddleware in front of /mcp (see the module docstring).
        security_settings=TransportSecuritySettings(enable_dns_rebinding_protection=False),
        max_request_body_size=cfg.max_body_bytes,
    )
    return McpEndpoint(manager=manager, app=StreamableHTTPASGIApp(manager))


def mcp_tool(module: SubAgent) -> types.Tool:
    return types.Tool(
        name=module.NAME,
        description=module.DESCRIPTION,
        input_schema=compact_schema(module.Request.model_json_schema()),
    )


def _session(ctx: ServerRequestContext[Any]) -> str:
    """The image session named by the HTTP request's header, as on the REST routes."""
    if isinstance(ctx.request, Request):
        return ctx.request.headers.get(SESSION_HEADER, "default")
    return "default"
