"""How a run reaches its tools: a running server at a URL, or one started in this process for the caller.

    access = ToolAccess()                                          # [tools] of a run's settings: no URL
    async with open_tools(access, roots=["/data/plates"], loopback=True) as tools:    # a ToolClient
        await tools.call("image_ops", {"op": "load", "image": "/data/plates/a.jpg"})

The in-process server is the real app (tool_server/app.py) driven through httpx's ASGI transport: no port is
opened. It starts from `access.config` (a server TOML: which models answer for the sub-agents, their limits) or
the defaults, plus what the caller's own inputs need (`embedded_config`): their folders readable, loopback pages
fetchable, a corpus (or SearXNG) to search. This is the one place `conductor ask`, training, evaluation and
SFT get tools.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

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
) -> AsyncIterator[ToolClient]:
    """A client for `access.url` (checked with /health), or for a server started here (`embedded_config`;
    `corpus`, `persist_index` and `search_url` configure its search tool; `overrides` are `--set` overrides of
    its settings, e.g. config.reader_overrides).

    `transport` (tests) stands in for the server. Raises ToolServerError when the URL does not answer.
    """
    async with contextlib.AsyncExitStack() as stack:
        if transport is None and access.url is None:
            from tool_server.app import create_app

            base = load_config(access.config, overrides)
            cfg = embedded_config(
                base, roots=roots, loopback=loopback, corpus=corpus, persist_index=persist_index,
                search_url=search_url,
            )  # fmt: skip
            app = create_app(cfg)
            await stack.enter_async_context(app.router.lifespan_context(app))
            transport = httpx.ASGITransport(app=app)
        url = access.url or EMBEDDED_URL
        client = ToolClient(url, transport=transport, max_concurrency=access.max_inflight_calls)
        tools = await stack.enter_async_context(client)
        if access.url is not None and transport is None:
            await tools.health()  # fail here, with the URL, rather than in the first episode
        yield tools
