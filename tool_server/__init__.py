"""The HTTP tool server: hosts the frozen sub-agents behind /v1/tools, /v1/batch and an MCP endpoint.

config.py      ServerConfig and load_config(path, overrides): the TOML file read by conductor.settings
cache.py       ResultCache: frozen results keyed by (tool, model id, exact request), single-flight
limits.py      Host/Origin guard, bearer-token auth, body-size cap, request deadline, per-tool gate, metrics
host.py        ToolHost: what the running server holds and how one call goes through it; tool_schema
app.py         create_app(cfg) -> FastAPI and serve(cfg); the routes
mcp_server.py  the same tools over MCP (Streamable HTTP, stateless) mounted at /mcp
client.py      ToolClient, what the rollout uses to call the server
embedded.py    ToolAccess and open_tools: a server at a URL, or one started here (in this process or on Ray Serve)
ray_serve.py   the same app as replicas on Ray Serve (`conductor train --ray`)
"""
