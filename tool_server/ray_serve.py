"""Tool-server replicas on Ray Serve: `deploy(cfg, ray_cfg) -> base URL`, `shutdown(name)`.

    with cluster(RayConfig(tool_replicas=2)):                  # conductor/cluster.py: Ray is up
        url = deploy(load_config(path), ray_cfg)               # Serve's HTTP proxy on 127.0.0.1, a free port
        async with ToolClient(url) as tools:                   # any number of clients, as with one server
            await tools.call("search", {"query": "..."})
        shutdown()                                             # or leave it to cluster()'s exit

Each replica runs the app `create_app` builds (`serve.ingress` with a builder evaluated on the replica, so
its lifespan loads that replica's own models), behind Serve's proxy on 127.0.0.1. There are
`ray_cfg.tool_replicas` of them, or Serve autoscales between that and `tool_max_replicas` on calls in
flight per replica (`tool_target_ongoing_requests`; Serve's default delays kept: measured, a second replica
answered ~30 s into a steady 16 calls in flight); each reserves `cpus_per_tool_replica` Ray CPUs. Serve
replaces a replica that dies, with no limit: `RayConfig.max_restarts` does not apply to Serve replicas.
Every answer carries the header `X-Conductor-Replica` (the Serve replica id); `ReplicaCounts` counts calls
per replica. (/metrics answers for whichever replica Serve picks; sequential requests tend to stick to one.)

The app's guards hold as they are: the Host guard sees the proxy's port (the replica's ASGI scope carries
the proxy's address) and the config's `port` is set to it as well; the proxy binds loopback only, so
`require_token_off_loopback` is satisfied, and a token in `$<token_env>` is passed on to the replicas (in
their runtime env, readable by whoever can run jobs on the cluster) so they check it as one server would.

Cache: shared across replicas through the disk folder when `[cache] directory` is set (every replica gets
the same folder; entries are atomic files, safe with concurrent writers); without one each replica keeps
its own memory LRU. Measured (2 replicas, fake models; 16 distinct cacheable calls, then the same 16
again, 5 times with fresh calls): memory only, 34 of the 80 repeats were hits (4 to 10 of 16 per burst:
a repeat routed to the other replica recomputes); with a folder, 80 of 80. So set `[cache] directory` for
multi-replica runs; it is not made up here because it outlives the run (delete it to reset). In-flight
coalescing stays per replica: identical calls arriving together on R replicas are computed up to R times.

Faults (measured, Ray 2.60): a call in flight on a replica that is SIGKILLed gets from Serve's proxy an
immediate HTTP 500, body "Internal Server Error" (text/plain); Serve does not retry a call a replica had
accepted, while calls still queued in its router go to live replicas. ToolClient retries that 500 and only
that one (the tool server's own 500s are JSON and mean a bug: tool_server/client.py), so no call is lost.
Serve lists the dead replica as RUNNING until a health check fails (HEALTH_CHECK_PERIOD_S); its
replacement answered ~4.5 s after the kill with fake models, a real one adds its model loading.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import httpx
from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from conductor.cluster import RayConfig, require_ray
from subagents import SUBAGENTS
from subagents.backends import build_llm
from tool_server.app import GRACEFUL_SHUTDOWN_S, LLMFactory, create_app
from tool_server.config import ServerConfig
from tool_server.host import SubAgent

logger = logging.getLogger(__name__)

DEFAULT_NAME = "conductor-tools"
DEPLOYMENT = "ToolServer"  # the application's one deployment (Serve's status and logs name it)
LOOPBACK = "127.0.0.1"
REPLICA_HEADER = "x-conductor-replica"
# Deploy budget: a replica loads every sub-agent's model before it answers (seconds to minutes on CPU);
# 10 minutes fails a broken deploy (a model that cannot load, no CPUs left for the replicas) without
# hanging a run for ever.
READY_TIMEOUT_S = 600.0
HEALTH_CHECK_PERIOD_S = 2.0  # see _deployment_options
POLL_S = 0.25  # status and /health polling while deploying: Serve's own control loop ticks every 0.1 s
HTTP_TIMEOUT_S = 10.0  # one /health request on loopback; they answer in milliseconds


def deploy(
    cfg: ServerConfig,
    ray_cfg: RayConfig,
    *,
    subagents: Mapping[str, SubAgent] = SUBAGENTS,
    llm_factory: LLMFactory = build_llm,
    port: int | None = None,
    name: str = DEFAULT_NAME,
) -> str:
    """Deploy the tool server as the Serve application `name` and return its base URL once it is RUNNING
    and answers /health (blocking). Call inside `conductor.cluster.cluster(...)`. `port`: the proxy's port (None: a free
    one); a Serve already running on the cluster keeps its proxy, so then `port` must name it."""
    serve = _serve()
    port = _start_proxy(serve, port, keep_alive_s=cfg.keep_alive_s)
    cfg = replace(cfg, host=LOOPBACK, port=port)
    ingress = serve.ingress(_builder(cfg, subagents, llm_factory))()
    app = serve.deployment(ingress, name=DEPLOYMENT, **_deployment_options(cfg, ray_cfg)).bind()
    # Not serve.run: it waits for RUNNING without a deadline; _wait_ready has one.
    serve.run_many([serve.RunTarget(app, name=name, route_prefix="/")], wait_for_applications_running=False)
    url = f"http://{LOOPBACK}:{port}"
    _wait_ready(serve, name, url)
    logger.info("tool server %r on %s: %s", name, url, _describe(ray_cfg))
    return url


def shutdown(name: str = DEFAULT_NAME) -> None:
    """Delete the application `name` (its replicas finish their calls first, up to GRACEFUL_SHUTDOWN_S); with
    nothing else served, stop Serve and its proxy too, so that a later `deploy` starts afresh on a free port."""
    serve = _serve()
    serve.delete(name)
    if not serve.status().applications:
        serve.shutdown()


class ReplicaCounts(httpx.AsyncHTTPTransport):
    """An httpx transport that counts answers per replica (REPLICA_HEADER; "?" for answers no replica gave,
    such as the proxy's 500 for a dead one), for benchmarks: `counts = ReplicaCounts(limits=...)`,
    `ToolClient(url, transport=counts)`, then `counts.seen`. Keyword arguments go to httpx's transport (a
    client given a transport does not apply its own pool limits to it)."""

    def __init__(self, **transport: Any) -> None:
        super().__init__(**transport)
        self.seen: Counter[str] = Counter()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await super().handle_async_request(request)
        self.seen[response.headers.get(REPLICA_HEADER, "?")] += 1
        return response


def _serve() -> Any:
    """The ray.serve module (ImportError with the install command when Ray is missing)."""
    require_ray()
    from ray import serve

    return serve


def _builder(
    cfg: ServerConfig, subagents: Mapping[str, SubAgent], llm_factory: LLMFactory
) -> Callable[[], FastAPI]:
    """The function Serve calls on each replica to build its app (a plain function, as serve.ingress needs)."""

    def build() -> FastAPI:
        app = create_app(cfg, subagents=subagents, llm_factory=llm_factory)
        replica = _serve().get_replica_context().replica_id.unique_id
        app.add_middleware(ReplicaHeader, replica=replica)
        return app

    return build


def _deployment_options(cfg: ServerConfig, ray_cfg: RayConfig) -> dict[str, Any]:
    scaling: dict[str, Any] = {"num_replicas": ray_cfg.tool_replicas}
    if ray_cfg.tool_max_replicas > ray_cfg.tool_replicas:
        bounds = {"min_replicas": ray_cfg.tool_replicas, "max_replicas": ray_cfg.tool_max_replicas}
        autoscaling = {**bounds, "target_ongoing_requests": ray_cfg.tool_target_ongoing_requests}
        scaling = {"autoscaling_config": autoscaling}
    actor: dict[str, Any] = {"num_cpus": ray_cfg.cpus_per_tool_replica}
    token = os.environ.get(cfg.token_env, "").strip()
    if token:
        actor["runtime_env"] = {"env_vars": {cfg.token_env: token}}
    return {
        **scaling,
        "ray_actor_options": actor,
        # Calls a replica holds at once: one full micro-batch of a tool (its max_concurrency; the app's own
        # gates queue the rest with a deadline). Serve's default, 5, would never let a batch of 8 form; much
        # more skews bursts, as Serve's router keeps routing to a replica whose queue length it has cached
        # until that replica is full (measured: 16 calls split 15/1 at 32, 8/8 at 8). The rest wait in
        # Serve's router for the first replica with a free slot, bounded by the client's deadline.
        "max_ongoing_requests": max(tool.limits.max_concurrency for tool in cfg.tools.values()),
        "graceful_shutdown_timeout_s": GRACEFUL_SHUTDOWN_S,  # as the standalone server on Ctrl-C
        # Serve learns that a replica died from this check (measured: a SIGKILLed one stays RUNNING until it
        # fails), so the period is how long the deployment runs a replica short before the replacement
        # starts: Serve's 10 s default made it ~10 s; a check is one small RPC. The timeout stays Serve's 30 s:
        # a replica busy with a model must not be taken for dead.
        "health_check_period_s": HEALTH_CHECK_PERIOD_S,
    }


def _start_proxy(serve: Any, port: int | None, *, keep_alive_s: float) -> int:
    """Start Serve with its HTTP proxy on loopback at `port` (None: a free one); return the port."""
    if serve.status().proxies:  # running already: its proxy options cannot change
        if port is None:
            raise ValueError("Ray Serve already runs on this cluster: pass its proxy's port to deploy()")
        return port
    port = port or _free_port()
    http = {"host": LOOPBACK, "port": port, "keep_alive_timeout_s": keep_alive_s}
    # HeadOnly: one proxy, on this (the head) node, where the loopback URL returned reaches it. No proxy
    # request timeout: the app's per-tool deadlines and the client's total deadline bound every call.
    serve.start(proxy_location="HeadOnly", http_options=http)
    return port


def _free_port() -> int:
    """A port free now. Another process could take it before Serve binds it; then the deploy times out."""
    with socket.socket() as probe:
        probe.bind((LOOPBACK, 0))
        port: int = probe.getsockname()[1]
        return port


def _wait_ready(serve: Any, name: str, url: str) -> None:
    """Until `name` is RUNNING and /health answers 200; RuntimeError if it failed or READY_TIMEOUT_S passed."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        app = serve.status().applications.get(name)
        if app is not None and app.status == "DEPLOY_FAILED":
            raise RuntimeError(f"deploying {name!r} failed: {app.message}")
        if app is not None and app.status == "RUNNING" and _healthy(url):
            return
        time.sleep(POLL_S)
    status = serve.status().applications.get(name)
    raise RuntimeError(f"{name!r} not ready within {READY_TIMEOUT_S:.0f} s: {status}")


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=HTTP_TIMEOUT_S).status_code == 200
    except httpx.TransportError:  # the proxy is not listening yet
        return False


def _describe(ray_cfg: RayConfig) -> str:
    if ray_cfg.tool_max_replicas > ray_cfg.tool_replicas:
        return f"{ray_cfg.tool_replicas}-{ray_cfg.tool_max_replicas} replicas (autoscaled)"
    return f"{ray_cfg.tool_replicas} replicas"


class ReplicaHeader:
    """ASGI middleware: every HTTP answer names the replica that gave it (REPLICA_HEADER)."""

    def __init__(self, app: ASGIApp, *, replica: str) -> None:
        self.app = app
        self._header = (REPLICA_HEADER.encode(), replica.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def tagged(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self._header]}
            await send(message)

        await self.app(scope, receive, tagged)
