"""The tool server's settings: frozen dataclasses read from one TOML file.

    [server]            host, port, token_env, token_file, max_body_bytes, max_batch_calls, allowed_hosts,
                        allowed_api_key_envs, ...
    [files]             subagents.common.Files: the local folders the tools may read
    [fetch]             subagents.fetch.FetchConfig (SSRF guard limits)
    [cache]             CacheConfig
    [<tool>]            each sub-agent's own Config (subagents/<tool>.py), for every tool in subagents.SUBAGENTS
    [<tool>.model]      its BackendConfig: which frozen model answers for it
    [<tool>.limits]     ToolLimits: concurrency cap, queue deadline, call deadline

Every section is optional; a missing file means all defaults (the built-in SmolLM2-135M-Instruct for every
sub-agent, bound to 127.0.0.1, no local files). The file and `--set` overrides (`server.port=0`) are read and
checked by conductor.settings like every config of the project: unknown keys are errors that name the key and the
valid ones, and keys that moved name their new place. The tool sections come from
`SUBAGENTS`: a new sub-agent brings its own. Paths are used as written, i.e. relative to the working directory.
See examples/server.toml for a documented file.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Generic, TypeVar

from conductor.models import BUILTIN_MODELS, DEFAULT_READER
from conductor.settings import ConfigError, build, check_keys, check_range, read_settings, sub_table
from subagents import SUBAGENTS
from subagents.common import Files
from subagents.fetch import FetchConfig
from subagents.llm import BackendConfig
from subagents.spans import RULES

C = TypeVar("C")

# Keys that moved, and where to: the readable folders were three settings before `[files] roots`.
MOVED = {
    "fetch.allow_file_roots": "files.roots",
    "image_ops.allowed_roots": "files.roots",
    "video_summary.allowed_roots": "files.roots",
}


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

    def __post_init__(self) -> None:
        """Finite numbers in sane ranges: a NaN deadline or a zero cap would refuse or hang every call."""
        check_range("max_concurrency", self.max_concurrency, 1, 4096)  # each a running model call
        check_range("queue_timeout_s", self.queue_timeout_s, 0, 600)  # 0: refuse at once when full
        check_range("call_timeout_s", self.call_timeout_s, 0.01, 86400)  # a day: past any real call


@dataclass(frozen=True)
class ToolSettings(Generic[C]):
    """Everything the server needs to host one sub-agent."""

    config: C
    """The sub-agent's own Config (its `[<tool>]` section)."""
    model: BackendConfig = field(default_factory=BackendConfig)
    """The frozen model answering for it (`[<tool>.model]`); replaceable at run time via /admin/backends."""
    limits: ToolLimits = field(default_factory=ToolLimits)
    """Concurrency cap and deadlines (`[<tool>.limits]`)."""


ToolsConfig = Mapping[str, ToolSettings[Any]]
"""Each sub-agent's settings, under its name in subagents.SUBAGENTS."""


# The model a sub-agent runs on when its `[<tool>.model]` names none other: the strongest frozen reader built in.
# page_qa reads with it (docs/reader.md); video_summary writes with it, which puts the spoken sentence in its
# answer on 11 of 12 video_qa clips against SmolLM2's 2 (tune 6 of 7 against 2, report 5 of 5 against 0;
# benchmarks/studies/reader/video_text.py); image_ops and search ask no model, and naming the same one keeps the
# default server at one model in memory (equal BackendConfigs share it, tool_server/host.py).
DEFAULT_MODELS: dict[str, BackendConfig] = {
    "page_qa": BackendConfig(model=DEFAULT_READER),
    "video_summary": BackendConfig(model=DEFAULT_READER),
    "image_ops": BackendConfig(model=DEFAULT_READER),
    "search": BackendConfig(model=DEFAULT_READER),
}


def default_tools() -> dict[str, ToolSettings[Any]]:
    """Every sub-agent of `SUBAGENTS` with its default Config, model and limits."""
    return {name: _defaults(name, module.Config()) for name, module in SUBAGENTS.items()}


def _defaults(name: str, config: C) -> ToolSettings[C]:
    return ToolSettings(config, model=DEFAULT_MODELS.get(name, BackendConfig()))


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
    allowed_api_key_envs: tuple[str, ...] = ("OPENAI_API_KEY", "CONDUCTOR_READER_API_KEY")
    """The environment variables a model's `api_key_env` may name, in this file and in a hot swap
    (/admin/backends): the variable's value is sent as a bearer token to the model's `base_url`, so a swap naming
    any other variable (a cloud credential, the server's own `token_env`, which this list may not hold) would hand
    it to whatever URL the swap gave."""
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
    min_body_rate_bytes_s: float = 1024.0
    """Once a request's headers are in, its body must arrive at this average rate (judged after a 2 s grace,
    connections.BODY_GRACE_S) or the connection is closed. 1 KB/s (8 kbit/s) is below any working link (GPRS moves
    ~5 KB/s), so only a stalled or deliberately trickling client falls under it: one sending a byte a second held its
    connection slot for the whole request deadline, and a few hundred of them filled a peer's share."""
    response_timeout_s: float = 300.0
    """A response not finished this long after its request arrived has its connection closed: no stream or stuck
    handler holds a connection for ever. Above the longest call (queue 20 s + call 150 s) and a model swap."""
    send_timeout_s: float = 30.0
    """A reply the client stops reading, more than 64 KiB of it (asyncio's write high-water mark) waiting unsent,
    has its connection aborted after this and the reply dropped. A live client drains a reply in milliseconds; one
    that never read held its reply in server memory until it hung up (500 of them held 1.8 GB)."""
    keep_alive_s: float = 5.0
    """An idle connection between requests is closed after this. Rollout clients call again within seconds and
    retry a closed pooled connection; a new loopback connection costs well under a millisecond."""
    max_connections: int = 2048
    """Open connections in all (tool_server/connections.py): past it the longest-idle one is closed to make room,
    else one whose calls only wait is answered 503 and closed; requests past this many running at once get 503
    (/health excepted). Far above the real peak (rollout clients pool <= 16 connections each) and below the
    file-descriptor limit (one each, 64 more for /health; raise `ulimit -n` above ~2,500)."""
    max_connections_per_peer: int = 256
    """Open connections and running requests from one IP address, under the same rule (a reclaimed one answered
    429): sixteen rollout clients of 16 connections on one host. On loopback every client is one peer, so there
    this is the bound that matters."""
    max_queued_calls: int = 256
    """Tool calls that may wait for a slot at the per-tool gates at once, all tools together (tool_server/gates.py):
    a call that would wait past it is refused at once with HTTP 429 + Retry-After. A queue deeper than its tools
    turn over within their queue deadline (page_qa: 8 slots, 10-20 s a call, 20 s) only holds connections for 429s
    later; 256 is eight clients' 32 concurrent calls. Bounded in time only, 280 calls waiting on a silent reader
    held every connection of their address."""
    max_queued_calls_per_peer: int = 64
    """Of those, the calls from one IP address: one client cannot fill the queue for the others (four rollout
    clients' 16 concurrent calls). On loopback every client is one peer, so this is the bound that matters there;
    the calls over it free their connections at once, never more than the gates' slots plus this many wait."""
    files: Files = field(default_factory=Files)
    """The local folders the tools may read (`[files]`)."""
    fetch: FetchConfig = field(default_factory=FetchConfig)
    """SSRF-guarded page fetching shared by page_qa and image loading (`[fetch]`)."""
    cache: CacheConfig = field(default_factory=CacheConfig)
    """The frozen-result cache (`[cache]`)."""
    tools: ToolsConfig = field(default_factory=default_tools)
    """Per-sub-agent settings (`[page_qa]`, `[page_qa.model]`, `[page_qa.limits]`, ...), one per SUBAGENTS entry."""

    def __post_init__(self) -> None:
        check_server(self)


# What [server] accepts for its numbers: past these a value is a mistake (or NaN, which TOML can spell).
SERVER_BOUNDS: dict[str, tuple[float, float]] = {
    "port": (0, 65535),  # 0: a free port
    "max_body_bytes": (1, 1 << 30),  # a GiB is far past any tool's arguments
    "max_batch_calls": (1, 4096),  # a batch is answered at once: thousands would only queue into 429s
    "request_timeout_s": (0.1, 600),  # past minutes an idle socket is held, which this deadline prevents
    "min_body_rate_bytes_s": (1, 1 << 30),  # 1 B/s lets a byte hold a slot a second; a GB/s is no client
    "response_timeout_s": (1, 86400),  # a day: the longest a response may hold a connection
    "send_timeout_s": (0.1, 3600),  # past an hour an unread reply is held, which this deadline prevents
    "keep_alive_s": (0.1, 600),  # as request_timeout_s, for the gap between requests
    "max_connections": (1, 1_000_000),  # one file descriptor each: a million is past any OS limit
    "max_connections_per_peer": (1, 1_000_000),  # and at most max_connections (check_server)
    "max_queued_calls": (0, 1_000_000),  # 0: never wait, refuse when every slot is taken
    "max_queued_calls_per_peer": (0, 1_000_000),  # and at most max_queued_calls (check_server)
}


def check_server(cfg: ServerConfig) -> None:
    """ValueError for a [server] number out of SERVER_BOUNDS or a per-peer cap above the total."""
    for name, (low, high) in SERVER_BOUNDS.items():
        check_range(name, getattr(cfg, name), low, high)
    if cfg.max_connections_per_peer > cfg.max_connections:
        raise ValueError("max_connections_per_peer must not exceed max_connections")
    if cfg.max_queued_calls_per_peer > cfg.max_queued_calls:
        raise ValueError("max_queued_calls_per_peer must not exceed max_queued_calls")
    if cfg.token_env in cfg.allowed_api_key_envs:
        raise ValueError(
            f"allowed_api_key_envs must not hold token_env ({cfg.token_env}): the server's own token"
        )
    for name, tool in cfg.tools.items():
        check_api_key_env(tool.model, cfg.allowed_api_key_envs, where=f"[{name}.model]")


def check_api_key_env(model: BackendConfig, allowed: Sequence[str], *, where: str) -> None:
    """ValueError when `model` names a key variable `allowed` ([server] allowed_api_key_envs) lacks."""
    if model.api_key_env is not None and model.api_key_env not in allowed:
        raise ValueError(
            f"{where} api_key_env {model.api_key_env[:64]!r} is not one of [server] allowed_api_key_envs "
            f"({', '.join(allowed) or 'none'})"
        )


TABLES = ("files", "fetch", "cache")
"""ServerConfig's fields that are tables of their own in the file; its other fields but `tools` sit in [server]."""


def load_config(path: Path | None, overrides: Sequence[str] = ()) -> ServerConfig:
    """Defaults, then the TOML file at `path` (if any), then `key=value` overrides (`server.port=0`,
    `page_qa.limits.max_concurrency=2`), read by conductor.settings; ConfigError naming any unknown key."""
    return parse_config(read_settings(path, overrides))


def reader_overrides(url: str | None, model: str) -> tuple[str, ...]:
    """`--reader-url URL --reader-model NAME` (`conductor ask`, `conductor serve`) as the overrides of the keys they
    stand for: page_qa's model behind an OpenAI-compatible endpoint, exactly `[page_qa.model] backend = "openai"`,
    `base_url`, `model` in a server TOML; page_qa's `answer_mode` "auto" then means "free" (an endpoint cannot
    score spans; an explicit "extract" is refused at start-up). `--reader-model NAME` alone: the built-in model
    NAME in process (`[page_qa.model] model = NAME`; ValueError listing them for any other name), with the
    "extract" rule chosen for it where one was (`[page_qa.extract]`, subagents/spans.py RULES), and every other
    sub-agent on NAME too (`DEFAULT_MODELS`), so `--reader-model smollm2-135m-instruct` is the whole server as it
    was before the 0.5B reader, one small model in memory."""
    if url is None:
        if model not in BUILTIN_MODELS:
            raise ValueError(f"{model!r} is not a built-in model; built in: {', '.join(BUILTIN_MODELS)}")
        rule = asdict(RULES[model]) if model in RULES else {}
        return tuple(f"{tool}.model.model={json.dumps(model)}" for tool in DEFAULT_MODELS) + tuple(
            f"page_qa.extract.{key}={json.dumps(value)}" for key, value in rule.items()
        )
    keys = {"backend": "openai", "base_url": url, "model": model}
    return tuple(f"page_qa.model.{key}={json.dumps(value)}" for key, value in keys.items())


def parse_config(data: Mapping[str, Any]) -> ServerConfig:
    """A ServerConfig from the file's tables (see the module docstring for the layout), each checked and built by
    conductor.settings: [server] holds ServerConfig's own keys, [files], [fetch] and [cache] its tables, and
    each sub-agent's [<tool>] its entry of `tools`."""
    check_keys(data, ("server", *TABLES, *SUBAGENTS), "the settings", moved=MOVED)
    server = sub_table(data, "server", "the settings")
    check_keys(server, [f.name for f in fields(ServerConfig) if f.name not in (*TABLES, "tools")], "[server]")
    tools = {name: _tool(module.Config, data, name) for name, module in SUBAGENTS.items()}
    own = build(ServerConfig, server, "[server]")
    tables = {key: data[key] for key in TABLES if key in data}
    cfg = build(ServerConfig, tables, "the settings", moved=MOVED, base=own)
    try:  # the tools last: their models are checked against [server] (allowed_api_key_envs)
        return replace(cfg, tools=tools)
    except ValueError as exc:
        raise ConfigError(f"the settings: {exc}") from exc


def _tool(config_type: type[C], data: Mapping[str, Any], name: str) -> ToolSettings[C]:
    """One sub-agent's settings: its own keys in [<tool>], its model and limits in [<tool>.model] and
    [<tool>.limits]."""
    table = sub_table(data, name, "the settings")
    own = {key: value for key, value in table.items() if key not in ("model", "limits")}
    config = build(config_type, own, f"[{name}]", moved=_moved(name))
    nested = {key: value for key, value in table.items() if key in ("model", "limits")}
    return build(ToolSettings, nested, f"[{name}]", base=_defaults(name, config))


def _moved(section: str) -> dict[str, str]:
    """The moved keys of one section, relative to it."""
    return {old.split(".", 1)[1]: new for old, new in MOVED.items() if old.split(".", 1)[0] == section}
