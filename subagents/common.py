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

The errors are defined in subagents/errors.py and the handle table in subagents/handles.py (both part of this
contract, and importable from here); this module imports nothing else from the project (the sub-agents' model
contract, subagents/llm.py, only for a type hint).
"""

from __future__ import annotations

import stat
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from pydantic import BaseModel

from subagents.errors import ErrorKind, ToolError, ToolFailure
from subagents.handles import Handles, Ref

if TYPE_CHECKING:  # only for type hints: the contract of the sub-agents' models imports nothing back
    from subagents.llm import LLM

# Observations longer than this many characters are cut with a visible marker (roughly 300 tokens of
# English for SmolLM2's tokenizer): the main policy's context is the scarce resource.
MAX_OBSERVATION_CHARS = 1200
TRUNCATION_MARKER = " …[truncated {n} chars]"
# Characters that change how text is shown without being text, dropped from every observation (`visible`): the
# bidi embeddings, overrides and isolates (U+202A-U+202E, U+2066-U+2069) and direction marks (U+200E, U+200F,
# U+061C) let a hostile page make what it says display as something else (the "Trojan Source" trick), and the
# zero-width characters (U+200B-U+200D, U+2060, U+FEFF) hide words inside others. The policy reads the characters,
# not their rendering; a person reading a trace reads the rendering. Ordinary letters of any script are kept; the
# cost is a joiner inside an emoji sequence or a Persian word, which then shows as its separate parts.
INVISIBLE = frozenset(
    [*range(0x202A, 0x202F), *range(0x2066, 0x206A), 0x200E, 0x200F, 0x061C]  # bidi controls and marks
    + [*range(0x200B, 0x200E), 0x2060, 0xFEFF]  # zero-width characters
)
_DROP_INVISIBLE = dict.fromkeys(INVISIBLE)


class ToolResponse(BaseModel):
    """The envelope every sub-agent response carries besides its payload."""

    ok: bool = True
    error: ToolError | None = None
    latency_ms: float = 0.0
    tokens_read: int = 0
    tokens_returned: int = 0
    cached: bool = False

    def observation(self) -> str:
        """The compact text the main policy reads, without INVISIBLE characters; sub-agents override `summary()`
        for the success case."""
        if self.error is not None:
            return visible(f"error ({self.error.kind}): {self.error.message}")
        return truncate(visible(self.summary()), MAX_OBSERVATION_CHARS)

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


def visible(text: str) -> str:
    """`text` without the INVISIBLE characters (bidi controls, zero-width characters); all else as it was."""
    return text.translate(_DROP_INVISIBLE)


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
