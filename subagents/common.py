"""The contract every sub-agent shares: structured errors, the response envelope, and the runtime it may use.

A sub-agent module defines exactly these names, and the tool server learns everything about it from them:

    NAME, DESCRIPTION  the tool's name (its key in `SUBAGENTS` and its `[NAME]` section) and what the policy reads
    CACHEABLE          whether a result may be served again from the frozen-result cache
    Request            pydantic model: the tool's arguments (its JSON schema is the tool schema the policy sees)
    Response           pydantic model derived from `ToolResponse`: the payload plus the common envelope
    Config             frozen dataclass: limits and knobs, read from the server's `[NAME]` section
    start              `start(cfg, roots) -> State`: what the tool keeps while the server runs (an image store, a
                       search index; None for most), built once at start-up in a worker thread
    check_model        `check_model(cfg, llm)`: ConfigError when `cfg` cannot run on the model built for the tool
                       (page_qa's "extract" on a model that cannot score), at start-up and before a hot swap
    run                `async def run(request, cfg, rt: Runtime[State]) -> Response`

`run` never raises for a problem with the request or the outside world: it returns `fail(...)` with a
`ToolError` whose `kind` says what happened. Only bugs raise. The tool server adds latency and the cache flag.

Token accounting: `tokens_read` counts what the sub-agent consumed on the caller's behalf (page text it ranked,
prompt tokens it fed its model); `tokens_returned` counts the tokens of `observation()`, the compact text the
main policy actually reads. Their ratio is how the project shows that delegation keeps the main context small.

This module imports nothing else from the project (the sub-agents' model contract, subagents/llm.py, only for a
type hint).
"""

from __future__ import annotations

import stat
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Generic, Literal, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:  # only for type hints: the contract of the sub-agents' models imports nothing back
    from subagents.llm import LLM

ErrorKind = Literal[
    "invalid_args",  # the caller's arguments are wrong: the policy can fix them
    "blocked_url",  # the SSRF guard refused the URL
    "fetch_failed",  # the remote answered badly or not at all
    "too_large",  # a body, image or video exceeded a cap
    "timeout",  # a deadline ran out
    "unsupported_media",  # a format we refuse to decode (EPS, broken files, no video stream ...)
    "backend_error",  # the model behind the sub-agent failed (refused connection, 5xx, context length ...)
    "not_found",  # an id, file or page that does not exist
    "overloaded",  # the per-tool concurrency cap and queue deadline were hit
    "internal",  # a bug in the tool server or a sub-agent (logged server-side with its traceback)
]

# The kinds a caller may retry unchanged: the outside world may behave differently next time.
RETRYABLE_KINDS: frozenset[str] = frozenset({"fetch_failed", "timeout", "backend_error", "overloaded"})

# Observations longer than this many characters are cut with a visible marker (roughly 300 tokens of
# English for SmolLM2's tokenizer): the main policy's context is the scarce resource.
MAX_OBSERVATION_CHARS = 1200
TRUNCATION_MARKER = " …[truncated {n} chars]"


class ToolError(BaseModel):
    """Why a call did not produce a result, in a form the policy can read and the trainer can count."""

    model_config = ConfigDict(frozen=True)
    kind: ErrorKind
    message: str
    retryable: bool = False


class ToolFailure(Exception):
    """Raised inside a sub-agent's helpers and turned into `ToolError` at the top of its `run`."""

    def __init__(self, kind: ErrorKind, message: str, *, retryable: bool | None = None) -> None:
        super().__init__(f"{kind}: {message}")
        self.error = ToolError(
            kind=kind, message=message, retryable=kind in RETRYABLE_KINDS if retryable is None else retryable
        )


class ToolResponse(BaseModel):
    """The envelope every sub-agent response carries besides its payload."""

    ok: bool = True
    error: ToolError | None = None
    latency_ms: float = 0.0
    tokens_read: int = 0
    tokens_returned: int = 0
    cached: bool = False

    def observation(self) -> str:
        """The compact text the main policy reads; sub-agents override `summary()` for the success case."""
        if self.error is not None:
            return f"error ({self.error.kind}): {self.error.message}"
        return truncate(self.summary(), MAX_OBSERVATION_CHARS)

    def summary(self) -> str:
        raise NotImplementedError

    def refs(self) -> list[tuple[str, Ref]]:
        """The handles this response shows the caller, with what each stands for: the server registers them
        in the caller's session (subagents/handles.py), for cached answers too. Most tools show none."""
        return []


R = TypeVar("R", bound=ToolResponse)


def fail(response_type: type[R], kind: ErrorKind, message: str, *, retryable: bool | None = None) -> R:
    """A failed response of `response_type`; payload fields keep their defaults."""
    return response_type(ok=False, error=ToolFailure(kind, message, retryable=retryable).error)


async def guarded(response_type: type[R], body: Callable[[], Awaitable[R]]) -> R:
    """Run a sub-agent body, turning `ToolFailure` into a failed response. Other exceptions are bugs and raise."""
    start = time.perf_counter()
    try:
        response = await body()
    except ToolFailure as exc:
        response = response_type(ok=False, error=exc.error)
    response.latency_ms = (time.perf_counter() - start) * 1000
    return response


def local_file(
    raw: str, roots: Sequence[str], *, what: str, outside: ErrorKind = "invalid_args"
) -> tuple[Path, int]:
    """The resolved path and size of the regular file `raw` names under one of `roots` (relative names start
    in the first; symlinks are resolved, so a link out of the roots is refused as `outside`), or a ToolFailure.

    Every OS error on the caller's path (a name too long, a symlink loop, no permission) is the caller's
    problem, `not_found` or `invalid_args`, told with the OS reason and never the server's absolute path, a
    root or a symlink's target (`shown_path`)."""
    if not roots:
        raise ToolFailure("invalid_args", f"this server reads no local {what} files ([files] roots is empty)")
    folders = [Path(root).resolve() for root in roots]
    shown = shown_path(raw, roots)
    try:
        path = (folders[0] / raw).resolve()  # an absolute `raw` replaces the root
        if not any(path.is_relative_to(folder) for folder in folders):
            raise ToolFailure(outside, f"the {what} path {shown!r} is outside the allowed file roots")
        status = path.stat()
    except (FileNotFoundError, NotADirectoryError):
        raise ToolFailure("not_found", f"no such {what} file: {shown!r}") from None
    except RuntimeError:  # pathlib's symlink-loop error, whose text names the server path
        raise ToolFailure("invalid_args", f"symlink loop in the {what} path {shown!r}") from None
    except (OSError, ValueError) as exc:  # ENAMETOOLONG, EACCES, a NUL byte ...
        reason = exc.strerror if isinstance(exc, OSError) else exc  # strerror: the reason without the path
        raise ToolFailure("invalid_args", f"cannot open the {what} path {shown!r}: {reason}") from None
    if not stat.S_ISREG(status.st_mode):  # directories, FIFOs (opening one would block), devices
        raise ToolFailure("invalid_args", f"not a regular file: {shown!r}")
    return path, status.st_size


def shown_path(raw: str, roots: Sequence[str]) -> str:
    """How a message names the path `raw`: relative to the files root it lies under (an absolute path in a
    handle's source or a search hit's URL, never shown to the policy), else as given; at most 80 characters."""
    path = Path(raw)
    if path.is_absolute():
        for root in roots:
            for folder in (Path(root).absolute(), Path(root).resolve()):  # as configured, or links resolved
                if path.is_relative_to(folder):
                    return str(path.relative_to(folder))[:80]
    return raw[:80]


def truncate(text: str, limit: int) -> str:
    """Cut `text` to at most `limit` characters plus a marker that says how much was dropped."""
    if len(text) <= limit:
        return text
    return text[:limit] + TRUNCATION_MARKER.format(n=len(text) - limit)


def approx_tokens(text: str) -> int:
    """A tokenizer-free token estimate (4 characters per token) for places with no tokenizer at hand."""
    return (len(text) + 3) // 4


class TokenCounter(Protocol):
    def __call__(self, text: str) -> int: ...


@dataclass(frozen=True)
class Files:
    """The local folders the tools may read (`[files]` of the server's TOML), one setting for all of them."""

    roots: tuple[str, ...] = ()
    """Folders whose files image_ops may load, video_summary may watch and page_qa may open as file:// URLs
    (search hands out such URLs, so a search corpus belongs under a root). Relative names start in the first.
    Empty: no local files at all."""


# ---------------------------------------------------------------- handles (subagents/handles.py says why)
HandleKind = Literal["page", "video", "image"]
MAX_LISTED = 8  # valid handles named in an invalid_args message: enough to pick from, short to read


@dataclass(frozen=True)
class Ref:
    """What a handle stands for: its kind, what the tool opens (a URL or a path under the files roots) and a
    short label for listings (a title or a file name; never a path)."""

    kind: HandleKind
    source: str
    label: str = ""


# What one entry of the handle table costs beyond its strings: the Ref, the table's slot and links (measured with
# tracemalloc on CPython 3.11: ~160 bytes; rounded up).
HANDLE_ENTRY_BYTES = 256


class Handles:
    """handle -> Ref per session, bounded like the image store: at most `max_per_session` handles per session,
    `max_sessions` sessions and `max_bytes` in all (strings included), the least recently used first out: a
    registration, `resolve` and `get` count as use of the handle's session. One lock guards the maps."""

    def __init__(
        self, *, max_per_session: int = 256, max_sessions: int = 256, max_bytes: int = 32 << 20
    ) -> None:
        # 256 per session: a 100-call episode of 5-hit searches shows ~500 hits, but reads a few of the recent.
        # 256 sessions: 64 concurrent episodes (the image store's bound) with room for finished ones' replays.
        # 32 MiB: 64 sessions of 256 search hits (~400 bytes each with a corpus URL) take 6.5 MB; the count bounds
        # alone let 2 KB sources take 150 MB, and an attacker's 4 KB ones 2 GB.
        self.max_per_session = max_per_session
        self.max_sessions = max_sessions
        self.max_bytes = max_bytes
        self.bytes = 0
        """What the table holds now, by `entry_bytes`."""
        self._lock = threading.Lock()
        self._sessions: OrderedDict[str, OrderedDict[str, Ref]] = OrderedDict()

    def add(self, session: str, handle: str, ref: Ref) -> None:
        """Register `handle` for `ref` in `session` (a later registration of the same handle replaces it)."""
        with self._lock:
            table = self._sessions.get(session)
            if table is None:
                if len(self._sessions) >= self.max_sessions:
                    self._drop_session()
                table = self._sessions[session] = OrderedDict()
            self._sessions.move_to_end(session)
            old = table.pop(handle, None)
            self.bytes -= 0 if old is None else entry_bytes(handle, old)
            table[handle] = ref
            self.bytes += entry_bytes(handle, ref)
            if len(table) > self.max_per_session:
                self._drop_entry(table)
            while (
                self.bytes > self.max_bytes
            ):  # other sessions first; a session alone past it loses its oldest
                self._drop_session() if len(self._sessions) > 1 else self._drop_entry(table)

    def resolve(self, session: str, handle: str, kind: HandleKind) -> Ref:
        """The Ref of `handle` in `session`; invalid_args naming the valid handles of `kind` for anything else."""
        with self._lock:
            table = self._sessions.get(session, OrderedDict())
            ref = table.get(handle)
            if ref is not None and ref.kind == kind:
                table.move_to_end(handle)
                self._sessions.move_to_end(session)
                return ref
            valid = _of_kind(table, kind)
        raise ToolFailure("invalid_args", unknown_message(handle[:40], kind, valid))

    def get(self, session: str, handle: str) -> Ref | None:
        """The Ref of `handle` in `session`, or None (no error: for callers that fall back to another store)."""
        with self._lock:
            ref = self._sessions.get(session, OrderedDict()).get(handle)
            if ref is not None:
                self._sessions.move_to_end(session)
            return ref

    def listed(self, session: str, kind: HandleKind) -> list[str]:
        """The session's handles of `kind`, most recently registered or used first, at most MAX_LISTED."""
        with self._lock:
            return _of_kind(self._sessions.get(session, OrderedDict()), kind)

    def _drop_session(self) -> None:
        """Forget the least recently used session (call with the lock held)."""
        _, table = self._sessions.popitem(last=False)
        self.bytes -= sum(entry_bytes(handle, ref) for handle, ref in table.items())

    def _drop_entry(self, table: OrderedDict[str, Ref]) -> None:
        """Forget the least recently used handle of `table` (call with the lock held)."""
        handle, ref = table.popitem(last=False)
        self.bytes -= entry_bytes(handle, ref)


def entry_bytes(handle: str, ref: Ref) -> int:
    """What one handle of the table costs: its strings as Python holds them, plus HANDLE_ENTRY_BYTES."""
    strings = (handle, ref.source, ref.label)
    return sum(map(sys.getsizeof, strings)) + HANDLE_ENTRY_BYTES


def _of_kind(table: OrderedDict[str, Ref], kind: HandleKind) -> list[str]:
    """A session's handles of `kind`, most recent first, at most MAX_LISTED (call with the lock held)."""
    return [h for h, r in reversed(table.items()) if r.kind == kind][:MAX_LISTED]


def unknown_message(handle: str, kind: HandleKind, valid: list[str]) -> str:
    """`no page d_000000 in this episode; pages shown: d_3fa9c1, d_77aa01` (or how to get one)."""
    if valid:
        return f"no {kind} {handle!r} in this episode; {kind}s shown: {', '.join(valid)}"
    how = {"page": "search first, or use a page listed in the task", "video": "use the video listed in the task",
           "image": "use an image id a tool returned"}[kind]  # fmt: skip
    return f"no {kind} {handle!r} in this episode: {how}"


@dataclass(frozen=True)
class FetchedPage:
    """A 2xx response: `url` as requested, `final_url` after redirects (normalised), the status (200 for
    file://), the Content-Type header ('' when absent; guessed from the name for file://) and the decoded
    body, at most `FetchConfig.max_bytes` bytes."""

    url: str
    final_url: str
    status: int
    content_type: str
    body: bytes


class PageFetcher(Protocol):
    """What a sub-agent fetches pages with (`subagents.fetch.Fetcher`, the SSRF-safe one; tests pass fakes)."""

    async def fetch(self, url: str) -> FetchedPage: ...


S = TypeVar("S")


@dataclass(frozen=True)
class Runtime(Generic[S]):
    """What a sub-agent's `run` may use. The tool server builds one per sub-agent and call.

    `llm` is the frozen model configured for this sub-agent (hot-swappable: the server hands each call the
    backend current when the call started). `roots` are the readable folders (`Files.roots`). `state` is what
    the module's `start` built. `session` names the caller's namespace (one episode): its images and the
    handles it was shown (`handles`, the server's one table).
    """

    llm: LLM
    fetcher: PageFetcher
    state: S
    roots: tuple[str, ...] = ()
    session: str = "default"
    count_tokens: TokenCounter = field(default=approx_tokens)
    handles: Handles = field(default_factory=lambda: Handles())


# Question words NLTK's English list (bm25s "en_plus") lacks; its 33-word "en" list would keep "what", "when",
# "who" ...: queries here are often questions.
EXTRA_STOPWORDS = ("whose", "many", "much")


def bm25_terms(texts: list[str]) -> list[list[str]]:
    """BM25 terms of each text: lower-cased words of 2+ characters, English stopwords removed.

    bm25s is imported here, not at module level: where numba is installed (vLLM brings it) bm25s loads it, and
    vLLM's CPU workers, which re-import the launching script's modules when they spawn, fail on llvmlite.
    """
    import bm25s
    from bm25s.stopwords import STOPWORDS_EN_PLUS

    stopwords = [*STOPWORDS_EN_PLUS, *EXTRA_STOPWORDS]
    return bm25s.tokenize(texts, stopwords=stopwords, return_ids=False, show_progress=False)
