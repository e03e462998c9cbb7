"""The research assistant behind `conductor ask`: one episode of the policy against the tool server.

Embedded default: with no `tools_url`, the tool server runs in this process (tool_server.embedded: its ASGI app
driven through httpx, no port opened) on the built-in model, with search over `corpus` (default:
examples/corpus) and local access limited to the folders of the files the user attached.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlsplit

from conductor.models import BUILTIN_MODELS, DEFAULT_MODEL, DEFAULT_POLICY, DEFAULT_TURNS, ModelNotFound
from main_agent.backends import load_policy
from main_agent.parse import ANSWER_OPEN, CALL_CLOSE, CALL_OPEN
from main_agent.policy import SamplingConfig
from main_agent.rollout import ProgressHook, RolloutConfig, RolloutTask, rollout
from main_agent.types import Episode
from subagents import search
from subagents.common import ToolFailure
from subagents.documents import SUFFIXES, Progress
from subagents.handles import Attachment, file_key
from subagents.llm import BackendError
from subagents.openai_llm import served_model
from tool_server.client import ToolClient, ToolServerError
from tool_server.config import reader_overrides
from tool_server.embedded import ToolAccess, open_tools

logger = logging.getLogger(__name__)

# The assistant must start with a tool call (OpenAI's tool_choice="required"): the untrained 135M policy
# otherwise answers from memory in prose. Later turns are free to answer. `first_turn_prefix` writes the whole
# opening call when it knows what to open; this bare opening is the fallback.
FIRST_TURN_PREFIX = '<tool_call>{"name": "'
EXAMPLE_CORPUS = Path(__file__).resolve().parent.parent / "examples" / "corpus"
_URL = re.compile(r"^[a-zA-Z][\w+.-]*://")  # http://, https://, file:// ...: anything else is a local path


class AskError(Exception):
    """A problem with what the user asked for (missing file, unreachable server, unknown model)."""


@dataclass(frozen=True)
class AskOptions:
    question: str
    """The question; must not be empty."""
    urls: tuple[str, ...] = ()
    """Pages the policy may open with page_qa: http(s) URLs, or local files (HTML, Markdown, text, PDF), which
    `validate` turns into file:// URLs the in-process tools may read."""
    image: Path | None = None
    """An image the policy may load with image_ops."""
    video: Path | None = None
    """A video the policy may summarise with video_summary."""
    corpus: Path | None = None
    """Folder indexed for search (in-process tool server only); default: the project's example corpus. Its
    extracted text is kept under $CONDUCTOR_HOME/indexes and reused while the folder is unchanged."""
    search_url: str | None = None
    """A SearXNG instance the in-process tool server searches the web through instead of a corpus."""
    reader_url: str | None = None
    """An OpenAI-compatible endpoint (e.g. vLLM serve of a bigger model) that answers for the in-process page_qa
    instead of the built-in model (tool_server.config.reader_overrides); page_qa's "auto" mode then answers "free"."""
    reader_model: str | None = None
    """The model name served at `reader_url`; None: the first its /models lists (`validate` fills it in).
    Without `reader_url`: a built-in model (conductor.models.BUILTIN_MODELS) page_qa runs in process."""
    policy: str = DEFAULT_POLICY
    """Built-in model name, local checkpoint or LoRA adapter dir (its tokenizer renders the prompts)."""
    sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(temperature=0.0))
    """Who samples the policy: in this process (default), or a server at `sampling.url` (e.g. vLLM serve).
    Temperature 0 decodes greedily: the assistant answers the same way each time."""
    tools_url: str | None = None
    """A running tool server; None starts one in-process."""
    max_turns: int = DEFAULT_TURNS
    """Policy turns; the last one is asked for the answer."""
    require_call: bool | None = None
    """Open the first turn with a tool call (see FIRST_TURN_PREFIX), for policies never trained on the format;
    None: only for the untrained built-in model. A trained policy writes the whole call itself (a forced prefix
    can split tokens it would have merged)."""
    tools: tuple[str, ...] = ()
    """Offer only these sub-agents; empty: the ones for what was attached (`default_tools`)."""


@dataclass(frozen=True)
class Startup:
    """Where the seconds before the first policy turn went (`conductor ask -v` prints them)."""

    policy_s: float
    """Loading the policy, its imports (torch, transformers) included."""
    tools_s: float
    """Reaching the tool server, or starting it in this process (sub-agent models loaded, corpus indexed)."""


def validate(opts: AskOptions) -> AskOptions:
    """Clear errors for an empty question or missing attachments; paths made absolute."""
    if not opts.question.strip():
        raise AskError("the question is empty")
    for label, path in (("image", opts.image), ("video", opts.video)):
        if path is not None and not path.is_file():
            raise AskError(f"--{label} {path}: no such file")
    if opts.corpus is not None and not opts.corpus.is_dir():
        raise AskError(f"--corpus {opts.corpus}: no such folder")
    if opts.search_url is not None:
        check_search_url(opts)
    if opts.reader_model is not None and opts.reader_url is None and opts.reader_model not in BUILTIN_MODELS:
        raise AskError(
            f"--reader-model {opts.reader_model}: without --reader-url, one of the built-in models "
            f"({', '.join(BUILTIN_MODELS)})"
        )
    return dataclasses.replace(
        opts,
        reader_model=check_reader_url(opts) if opts.reader_url is not None else opts.reader_model,
        urls=tuple(map(page_url, opts.urls)),
        image=opts.image.resolve() if opts.image else None,
        video=opts.video.resolve() if opts.video else None,
        corpus=None if opts.search_url else (opts.corpus or EXAMPLE_CORPUS).resolve(),
    )


def page_url(raw: str) -> str:
    """A URL as given; a local file as its absolute file:// URL (an AskError when there is no such file)."""
    if _URL.match(raw):
        if (path := local_page(raw)) is not None and not path.is_file():
            raise AskError(f"--url {raw}: no such file")
        return raw
    path = Path(raw).expanduser()
    if not path.is_file():
        raise AskError(f"--url {raw}: neither a URL nor a file")
    return path.resolve().as_uri()


def local_page(url: str) -> Path | None:
    """The file a file:// URL names (None for any other URL)."""
    parts = urlsplit(url)
    return Path(unquote(parts.path)) if parts.scheme == "file" else None


def check_search_url(opts: AskOptions) -> None:
    """--search-url configures the in-process tools' search and must answer a JSON search now, before the policy
    loads (3 s to connect, 15 s to answer: search.SEARXNG_TIMEOUT)."""
    if opts.tools_url is not None:
        raise AskError("--search-url is for the in-process tools; with --tools-url set [search] in its TOML")
    if opts.corpus is not None:
        raise AskError("--corpus and --search-url both choose what search reads: give one of them")
    try:
        search.probe_searxng(opts.search_url or "")
    except ToolFailure as exc:
        raise AskError(f"--search-url: {exc.error.message}") from exc


def check_reader_url(opts: AskOptions) -> str:
    """--reader-url configures the in-process page_qa and must list its models now, before the policy loads; the
    model to ask there (--reader-model, else the first listed)."""
    if opts.tools_url is not None:
        raise AskError(
            "--reader-url is for the in-process tools; with --tools-url set [page_qa.model] in its TOML"
        )
    try:
        return served_model(opts.reader_url or "", opts.reader_model)
    except BackendError as exc:
        raise AskError(f"--reader-url: {exc}") from exc


def index_corpus(folder: Path, *, progress: Progress | None = None) -> search.Corpus:
    """Build, or reuse while `folder` is unchanged, the persistent search index the in-process tool server then
    loads (search.index_dir); the index, whose `skipped` files the user is told of. `progress(done, total)`
    hears each file extracted (a cached index extracts none). An AskError with the fix for a folder that cannot
    be read or has nothing to search."""
    defaults = search.Config()  # what the in-process server indexes with (ask passes no server TOML)
    try:
        corpus = search.Corpus.build(
            folder, max_docs=defaults.max_docs, cache_dir=search.index_dir(folder, None), progress=progress
        )
    except FileNotFoundError as exc:
        raise AskError(f"--corpus {folder}: no such folder") from exc
    except PermissionError as exc:
        raise AskError(f"--corpus {folder}: cannot read it ({exc.strerror}); check its permissions") from exc
    if not len(corpus):
        kinds = ", ".join(sorted(SUFFIXES))
        raise AskError(f"--corpus {folder}: no readable documents ({kinds}); give a folder that has some")
    return corpus


def attachments(opts: AskOptions) -> tuple[Attachment, ...]:
    """What the user attached, registered in the episode's session before the first turn; the policy sees
    each by its handle ("Image: img_8bf8dd"), never the path. A page's handle derives from its URL, a file's
    from its bytes (subagents/handles.py)."""
    pages = [
        Attachment("page", url, file_key(path), path.name)  # a local file by its bytes, not its path
        if (path := local_page(url)) is not None and path.is_file()
        else Attachment("page", url, url)
        for url in opts.urls
    ]  # fmt: skip
    media = [Attachment(kind, str(path), file_key(path)) for kind, path in (("image", opts.image), ("video", opts.video))
             if path is not None]  # fmt: skip
    return (*pages, *media)


TOOLS_URL_HINT = "start one with `conductor serve`, or leave out --tools-url to run the tools in-process"


async def reach(url: str) -> None:
    """An AskError naming `url` and the fix unless a tool server answers its /health there."""
    try:
        async with ToolClient(url) as probe:
            await probe.health()
    except ToolServerError as exc:
        raise AskError(f"--tools-url {url}: {exc}; {TOOLS_URL_HINT}") from exc


@contextlib.asynccontextmanager
async def tool_client(opts: AskOptions) -> AsyncIterator[ToolClient]:
    """A client for `opts.tools_url`, or for a tool server started in this process that may read what the
    user attached and search `opts.corpus` (tool_server.embedded)."""
    files = [opts.image, opts.video, *map(local_page, opts.urls)]
    roots = list(dict.fromkeys(str(p.parent) for p in files if p is not None))
    async with contextlib.AsyncExitStack() as stack:
        try:
            tools = open_tools(
                ToolAccess(url=opts.tools_url), roots=roots, corpus=opts.corpus, persist_index=True,
                search_url=opts.search_url, overrides=reader_settings(opts),
            )  # fmt: skip
            client = await stack.enter_async_context(tools)
        except ToolServerError as exc:  # the URL does not answer: the user's to fix
            raise AskError(f"--tools-url {opts.tools_url}: {exc}; {TOOLS_URL_HINT}") from exc
        except BackendError as exc:  # a sub-agent's model cannot be built, e.g. not prepared yet
            raise AskError(f"the in-process tool server cannot start: {exc}") from exc
        yield client


def reader_settings(opts: AskOptions) -> tuple[str, ...]:
    """The in-process server's overrides for --reader-url / --reader-model (none without them); `opts` validated."""
    if opts.reader_model is None:
        return ()
    return reader_overrides(opts.reader_url, opts.reader_model)


async def ask(
    opts: AskOptions,
    *,
    on_turn: ProgressHook | None = None,
    on_ready: Callable[[Startup], None] | None = None,
) -> Episode:
    """Validate, load the policy, start or reach the tools, play one episode; `on_ready` hears, just before the
    first turn, how long the start took."""
    opts = validate(opts)
    if opts.tools_url is not None:
        await reach(opts.tools_url)  # at once, not after the seconds the policy takes to load
    started = time.perf_counter()
    try:
        policy, tokenizer = load_policy(opts.policy, opts.sampling, max_batch=1)
    except ModelNotFound as exc:
        raise AskError(str(exc)) from exc
    loaded = time.perf_counter()
    try:
        async with tool_client(opts) as tools:
            schemas = offered(await tools.tools(), opts.tools or default_tools(opts))
            startup = Startup(policy_s=loaded - started, tools_s=time.perf_counter() - loaded)
            logger.info("ready: policy %.1f s, tools %.1f s", startup.policy_s, startup.tools_s)
            if on_ready is not None:
                on_ready(startup)
            attached = attachments(opts)
            context = "\n".join(a.line for a in attached)
            task = RolloutTask("ask", opts.question, schemas, context=context, attachments=attached)
            cfg = RolloutConfig(
                max_turns=opts.max_turns,
                max_new_tokens=192,  # as the default policy was trained: a few page_qa calls by handle, or an answer
                first_turn_prefix=first_turn_prefix(opts, [str(t["function"]["name"]) for t in schemas]),
                untagged_is_answer=True,
                last_turn_prefix=ANSWER_OPEN,  # a user gets an answer from what it read, not "max_turns"
            )
            return await rollout(task, policy, tools, tokenizer, cfg, on_turn=on_turn)
    finally:
        await policy.aclose()


def first_turn_prefix(opts: AskOptions, tools: list[str]) -> str:
    """How the first turn opens when a call is required: the opening call, written out in full.

    The user's question goes to what they attached (page_qa on the page, video_summary on the video; an image is
    searched for text), else to search over the corpus; the policy takes over from the observation. An untrained 135M
    policy asked to complete such a call writes its own question and breaks the JSON (`"question": "Q?": "..."`),
    so the call is not left to it. With no attachment and no search tool, only `<tool_call>{"name": "` is written
    and the policy picks the tool. Whatever the policy writes after the closing tag in that turn is ignored by
    the parser unless it is another call.
    """
    if not requires_call(opts):
        return ""
    handle = {a.kind: a.handle for a in reversed(attachments(opts))}  # the first page
    opening = [  # (tool, arguments); the first whose target exists and whose tool is offered
        ("page_qa", {"url": handle["page"], "question": opts.question} if "page" in handle else None),
        ("image_ops", {"op": "find_text", "image": handle["image"]} if "image" in handle else None),
        (
            "video_summary",
            {"video": handle["video"], "question": opts.question} if "video" in handle else None,
        ),
        ("search", {"query": opts.question}),
    ]
    for tool, arguments in opening:
        if arguments is not None and tool in tools:
            call = json.dumps({"name": tool, "arguments": arguments}, ensure_ascii=False)
            return f"{CALL_OPEN}{call}{CALL_CLOSE}"
    return FIRST_TURN_PREFIX


def requires_call(opts: AskOptions) -> bool:
    """Whether the first turn is forced to call: as asked, else only for the untrained built-in model."""
    return opts.require_call if opts.require_call is not None else opts.policy == DEFAULT_MODEL


def default_tools(opts: AskOptions) -> tuple[str, ...]:
    """The sub-agents offered when the user names none, as the default policy was trained (one kind of
    question each): the attached page, image or video's reader, else search and page_qa over the corpus."""
    if opts.urls:
        return ("page_qa",)
    if opts.image is not None:
        return ("image_ops",)
    if opts.video is not None:
        return ("video_summary",)
    return ("search", "page_qa")


def offered(schemas: list[dict[str, object]], names: tuple[str, ...]) -> list[dict[str, object]]:
    """The schemas of the tools named (all when none are), in the server's order: the order training's prompts
    list them in (training/play.rollout_task), which a small policy keys on. An unknown name is an AskError."""
    if not names:
        return schemas
    known = [str(s["function"]["name"]) for s in schemas]  # type: ignore[index]
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise AskError(f"--tool {', '.join(unknown)}: the tool server offers {', '.join(sorted(known))}")
    return [s for s, name in zip(schemas, known, strict=True) if name in names]


def sources(episode: Episode) -> list[str]:
    """What the answer rests on: the pages opened, images made and video moments; the search hits only when
    nothing was opened (a hit that was never read is not a source)."""
    read: list[str] = []
    hits: list[str] = []
    for turn in episode.turns:
        for result in turn.results:
            payload = result.payload or {}
            if not result.ok:
                continue
            if result.name == "page_qa":
                read.append(f"{payload.get('title') or 'page'} <{payload.get('url')}>")
            elif result.name == "image_ops":
                read.append(f"image {payload.get('image_id')}")
            elif result.name == "video_summary":
                moments = ", ".join(str(t) for t in payload.get("timestamps") or [])
                read.append(f"video at {moments or 'whole clip'}")
            elif result.name == "search":
                hits.extend(
                    f"{hit.get('title') or 'page'} <{hit.get('url')}>" for hit in payload.get("hits", [])
                )
    return list(dict.fromkeys(read or hits))
