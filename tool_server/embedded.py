"""How a run reaches its tools: a running server at a URL, or one started for the caller, in this process or
as replicas on Ray Serve.

    access = ToolAccess()                                          # [tools] of a run's settings: no URL
    async with open_tools(access, roots=["/data/plates"], loopback=True) as tools:    # a ToolClient
        await tools.call("image_ops", {"op": "load", "image": "/data/plates/a.jpg"})

The in-process server is the real app (tool_server/app.py) driven through httpx's ASGI transport: no port is
opened. A run on Ray deploys the same app on Ray Serve instead (`replicas`, tool_server/ray_serve.py), whose URL
its rollout workers reach (`tools.url`). Either starts from `access.config` (a server TOML: which models answer
for the sub-agents, their limits) or the defaults, plus what the caller's own inputs need (`embedded_config`):
their folders readable, loopback pages fetchable, a corpus (or SearXNG) to search. This is the one place
`conductor ask`, training (in this process or on Ray), evaluation and SFT get tools.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from conductor.cluster import RayConfig
from tool_server.client import ToolClient
from tool_server.config import ServerConfig, load_config

EMBEDDED_URL = "http://embedded"  # the base URL in-process calls carry (no socket: the Host guard skips them)


@dataclass(frozen=True)
class ToolAccess:
    """Where the tools are (`[tools]` of the training, evaluation and SFT settings)."""

    url: str | None = None
    """A running tool server (`conductor serve`); None starts one in this process for the run."""
    config: Path | None = None
    """The in-process server's TOML (e.g. another model behind page_qa); None: the defaults. Unused with `url`."""
    max_inflight_calls: int = 8
    """Tool calls in flight at once across all episodes: the client's concurrency cap (the server's per-tool
    caps are 8 by default, so 8 keeps a full micro-batch of page_qa calls possible)."""


def embedded_config(
    base: ServerConfig,
    *,
    roots: Sequence[str] = (),
    loopback: bool = False,
    corpus: Path | None = None,
    persist_index: bool = False,
    search_url: str | None = None,
) -> ServerConfig:
    """`base` plus what the caller's inputs need: `roots` readable, loopback fetchable, `corpus` searched (its
    extracted text kept under $CONDUCTOR_HOME/indexes with `persist_index`), or the web through SearXNG at
    `search_url` instead.

    Limit: opening 127.0.0.0/8 lets page_qa reach any loopback service of this machine (the multihop tasks
    serve their pages there).
    """
    folders = [*base.files.roots, *roots, *([str(corpus)] if corpus is not None else [])]
    cfg = dataclasses.replace(
        base, files=dataclasses.replace(base.files, roots=tuple(dict.fromkeys(folders)))
    )
    if loopback:
        cidrs = tuple(dict.fromkeys((*base.fetch.allow_private_cidrs, "127.0.0.0/8")))
        cfg = dataclasses.replace(cfg, fetch=dataclasses.replace(base.fetch, allow_private_cidrs=cidrs))
    search = cfg.tools["search"].config
    if corpus is not None:
        search = dataclasses.replace(search, corpus_dir=str(corpus), persist_index=persist_index)
    if search_url is not None:
        search = dataclasses.replace(search, backend="searxng", searxng_url=search_url)
    if search is not cfg.tools["search"].config:
        searched = dataclasses.replace(cfg.tools["search"], config=search)
        cfg = dataclasses.replace(cfg, tools={**cfg.tools, "search": searched})
    return cfg


@contextlib.asynccontextmanager
async def open_tools(
    access: ToolAccess,
    *,
    roots: Sequence[str] = (),
    loopback: bool = False,
    corpus: Path | None = None,
    persist_index: bool = False,
    search_url: str | None = None,
    overrides: Sequence[str] = (),
    transport: httpx.AsyncBaseTransport | None = None,
    replicas: RayConfig | None = None,
    shared_cache: Path | None = None,
) -> AsyncIterator[ToolClient]:
    """A client for `access.url` (checked with /health), or for a server started here (`embedded_config`;
    `corpus`, `persist_index` and `search_url` configure its search tool; `overrides` are `--set` overrides of
    its settings, e.g. config.reader_overrides): in this process, or with `replicas` (inside
    `conductor.cluster.cluster`) `replicas.tool_replicas` replicas on Ray Serve, sharing their result cache in
    the `shared_cache` folder (`with_cache_folder`).

    `transport` (tests) stands in for the server. Raises ToolServerError when the URL does not answer.
    """
    async with contextlib.AsyncExitStack() as stack:
        if transport is None and access.url is None:
            base = load_config(access.config, overrides)
            cfg = embedded_config(
                base, roots=roots, loopback=loopback, corpus=corpus, persist_index=persist_index,
                search_url=search_url,
            )  # fmt: skip
            if replicas is None:
                transport = await stack.enter_async_context(in_process(cfg))
            else:
                served = with_cache_folder(cfg, shared_cache)
                access = dataclasses.replace(
                    access, url=await stack.enter_async_context(on_ray(served, replicas))
                )
        url = access.url or EMBEDDED_URL
        client = ToolClient(url, transport=transport, max_concurrency=access.max_inflight_calls)
        tools = await stack.enter_async_context(client)
        if access.url is not None and transport is None:
            await tools.health()  # fail here, with the URL, rather than in the first episode
        yield tools


@contextlib.asynccontextmanager
async def in_process(cfg: ServerConfig) -> AsyncIterator[httpx.AsyncBaseTransport]:
    """The tool server `cfg` describes, in this process (its models loaded, released on exit), as a transport."""
    from tool_server.app import create_app

    app = create_app(cfg)
    async with app.router.lifespan_context(app):
        yield httpx.ASGITransport(app=app)


@contextlib.asynccontextmanager
async def on_ray(cfg: ServerConfig, replicas: RayConfig) -> AsyncIterator[str]:
    """The tool server `cfg` describes, deployed on Ray Serve as `replicas` says (tool_server/ray_serve.py);
    its URL, until the deployment is deleted on exit."""
    from tool_server import ray_serve

    url = await asyncio.to_thread(ray_serve.deploy, cfg, replicas)
    try:
        yield url
    finally:
        ray_serve.shutdown()


def with_cache_folder(server: ServerConfig, folder: Path | None) -> ServerConfig:
    """`server` with its result cache on disk in `folder` unless it names one: each replica keeps its own memory
    cache, the folder is what they share (a result computed by one replica is a hit on every other; measured in
    tool_server/ray_serve.py)."""
    if folder is None or not server.cache.enabled or server.cache.directory is not None:
        return server
    return dataclasses.replace(server, cache=dataclasses.replace(server.cache, directory=folder))
