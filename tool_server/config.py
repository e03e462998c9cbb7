"""The tool server's settings: frozen dataclasses read from one TOML file.

    [server]            host, port, token_env, token_file, max_body_bytes, max_batch_calls, allowed_hosts, ...
    [fetch]             subagents.fetch.FetchConfig (SSRF guard limits)
    [cache]             CacheConfig
    [page_qa]           the sub-agent's own Config (subagents/page_qa.py)
    [page_qa.model]     its BackendConfig: which frozen model answers for it
    [page_qa.limits]    ToolLimits: concurrency cap, queue deadline, call deadline
    ... the same three sections for image_ops, video_summary and search.

Every section is optional; a missing file means all defaults (the built-in SmolLM2-135M-Instruct for every
sub-agent, bound to 127.0.0.1). Unknown keys are errors that name the key and the valid ones: a typo must
not silently fall back to a default. TOML arrays become tuples (the dataclasses are frozen); strings become
`Path` where the field is a path. Paths are used as written, i.e. relative to the working directory.
See examples/server.toml for a documented file.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Generic, TypeVar, get_type_hints

from conductor.settings import ConfigError, build, coerce
from subagents import image_ops, page_qa, search, video_summary
from subagents.backends import BackendConfig
from subagents.fetch import FetchConfig

C = TypeVar("C")
D = TypeVar("D")

TOOL_NAMES = ("page_qa", "image_ops", "video_summary", "search")


@dataclass(frozen=True)
class ToolLimits:
    """How much of the server one tool may hold. Read from `[<tool>.limits]`."""

    max_concurrency: int = 8
    """Calls of this tool running at once; matches the transformers micro-batch (8) so a full batch can form."""
    queue_timeout_s: float = 20.0
    """Longest wait for a slot before the call is refused (HTTP 429 + Retry-After): never an unbounded hang.
    Queue plus call deadline (170 s) stays under the client's 180 s read timeout."""
    call_timeout_s: float = 150.0
    """Deadline for one run once it has a slot; past it the caller gets a `timeout` result. Above the
    sub-agents' own budgets (video_summary: 120 s) so their more precise timeout result wins; a 135M model
    on 2 CPU cores answers a page question in 10-20 s, more when batched behind others."""


@dataclass(frozen=True)
class ToolSettings(Generic[C]):
    """Everything the server needs to host one sub-agent."""

    config: C
    """The sub-agent's own Config (its `[<tool>]` section)."""
    model: BackendConfig = field(default_factory=BackendConfig)
    """The frozen model answering for it (`[<tool>.model]`); replaceable at run time via /admin/backends."""
    limits: ToolLimits = field(default_factory=ToolLimits)
    """Concurrency cap and deadlines (`[<tool>.limits]`)."""


@dataclass(frozen=True)
class ToolsConfig:
    """One typed entry per sub-agent in subagents.SUBAGENTS."""

    page_qa: ToolSettings[page_qa.Config] = field(default_factory=lambda: ToolSettings(page_qa.Config()))
    """Question answering over one web page."""
    image_ops: ToolSettings[image_ops.Config] = field(
        default_factory=lambda: ToolSettings(image_ops.Config())
    )
    """Load, zoom and read images in a per-session store."""
    video_summary: ToolSettings[video_summary.Config] = field(
        default_factory=lambda: ToolSettings(video_summary.Config())
    )
    """Frames + OCR/ASR summary of a short video."""
    search: ToolSettings[search.Config] = field(default_factory=lambda: ToolSettings(search.Config()))
    """BM25 search over a local corpus."""

    def settings(self, name: str) -> ToolSettings[Any]:
        """The settings of tool `name`; KeyError for a name that is not one of TOOL_NAMES."""
        if name not in TOOL_NAMES:
            raise KeyError(f"no settings for tool {name!r}; tools: {', '.join(TOOL_NAMES)}")
        settings: ToolSettings[Any] = getattr(self, name)
        return settings


@dataclass(frozen=True)
class CacheConfig:
    """The frozen-result cache (tool_server/cache.py). Read from `[cache]`."""

    enabled: bool = True
    """Serve repeated identical calls from the cache: frozen sub-agents are deterministic (greedy decoding)."""
    max_entries: int = 10_000
    """In-memory LRU bound; a cached page answer is a few KB, so this is tens of MB at most."""
    directory: Path | None = None
    """Optional folder of JSON files that survives restarts (not bounded: delete it to reset). None: memory only."""


@dataclass(frozen=True)
class ServerConfig:
    """The whole tool server. `[server]` holds the scalar fields; the nested ones have their own sections."""

    host: str = "127.0.0.1"
    """Interface to bind. Anything but loopback requires a token (the server refuses to start without one)."""
    port: int = 8700
    """TCP port; 0 picks a free one (tests)."""
    token_env: str = "CONDUCTOR_TOKEN"
    """Environment variable holding the bearer token; checked before `token_file`."""
    token_file: Path | None = None
    """File whose first line is the bearer token (keeps it out of the process environment)."""
    max_body_bytes: int = 2_000_000
    """Request body cap (HTTP 413 above it): tool arguments are a URL, a question, an id; 2 MB is generous."""
    max_batch_calls: int = 32
    """Most calls in one /v1/batch request: a group of 8 episodes with a few parallel calls each."""
    allowed_hosts: tuple[str, ...] = ()
    """Extra Host header values every route (REST and /mcp) accepts, e.g. "gpu-box:8700" (DNS-rebinding
    guard, limits.HostGuardMiddleware; compared case-insensitively, exact host:port). 127.0.0.1:<port>,
    localhost:<port> and [::1]:<port> are always accepted; a server reached by any other name or address
    (bound off loopback, behind a port forward) must list it here, or clients get 421."""
    allowed_origins: tuple[str, ...] = ()
    """Extra Origin header values every route accepts, e.g. "https://dashboard.example". An Origin of
    http:// plus an accepted Host value is always accepted; any other Origin gets 403 (no Origin: fine)."""
    request_timeout_s: float = 10.0
    """A connection must send each request whole (headers and body) within this many seconds of opening,
    or of its next request's first byte, or it is closed: idle and slow-sending sockets cannot pile up
    and hold the server's connection slots. Real clients send their <= 2 MB body in well under a second."""
    fetch: FetchConfig = field(default_factory=FetchConfig)
    """SSRF-guarded page fetching shared by page_qa and image loading (`[fetch]`)."""
    cache: CacheConfig = field(default_factory=CacheConfig)
    """The frozen-result cache (`[cache]`)."""
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    """Per-sub-agent settings (`[page_qa]`, `[page_qa.model]`, `[page_qa.limits]`, ...)."""


def load_config(path: Path | None) -> ServerConfig:
    """Read `path` (TOML); None means all defaults. Raises ConfigError naming any unknown key."""
    if path is None:
        return ServerConfig()
    with path.open("rb") as file:
        return parse_config(tomllib.load(file))


def parse_config(data: Mapping[str, Any]) -> ServerConfig:
    """Build a ServerConfig from parsed TOML (see the module docstring for the layout)."""
    _check_keys(data, ("server", "fetch", "cache", *TOOL_NAMES), "the top level")
    tools = ToolsConfig(
        page_qa=_tool(page_qa.Config, data, "page_qa"),
        image_ops=_tool(image_ops.Config, data, "image_ops"),
        video_summary=_tool(video_summary.Config, data, "video_summary"),
        search=_tool(search.Config, data, "search"),
    )
    nested = ("fetch", "cache", "tools")
    scalars = _values(ServerConfig, _table(data, "server", "[server]"), "[server]", skip=nested)
    return ServerConfig(
        **scalars,
        fetch=build(FetchConfig, _table(data, "fetch", "[fetch]"), "[fetch]"),
        cache=build(CacheConfig, _table(data, "cache", "[cache]"), "[cache]"),
        tools=tools,
    )


def _tool(config_type: type[C], data: Mapping[str, Any], name: str) -> ToolSettings[C]:
    table = _table(data, name, f"[{name}]")
    own = {key: value for key, value in table.items() if key not in ("model", "limits")}
    return ToolSettings(
        config=build(config_type, own, f"[{name}]"),
        model=build(BackendConfig, _table(table, "model", f"[{name}.model]"), f"[{name}.model]"),
        limits=build(ToolLimits, _table(table, "limits", f"[{name}.limits]"), f"[{name}.limits]"),
    )


def _table(data: Mapping[str, Any], key: str, section: str) -> Mapping[str, Any]:
    value = data.get(key, {})
    if not isinstance(value, dict):
        raise ConfigError(f"{section} must be a table, got {type(value).__name__}")
    return value


def _values(
    cls: type, table: Mapping[str, Any], section: str, *, skip: tuple[str, ...] = ()
) -> dict[str, Any]:
    valid = tuple(f.name for f in fields(cls) if f.name not in skip)
    _check_keys(table, valid, section)
    hints = get_type_hints(cls)
    return {key: coerce(value, hints[key], f"{section} {key}") for key, value in table.items()}


def _check_keys(table: Mapping[str, Any], valid: tuple[str, ...], section: str) -> None:
    for key in table:
        if key not in valid:
            raise ConfigError(f"unknown key {key!r} in {section}; valid keys: {', '.join(valid)}")
