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
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from conductor.models import DEFAULT_MODEL, ModelNotFound
from main_agent.parse import CALL_CLOSE, CALL_OPEN
from main_agent.policy import SamplingConfig, load_policy
from main_agent.rollout import ProgressHook, RolloutConfig, RolloutTask, rollout
from main_agent.types import Episode
from tool_server.client import ToolClient, ToolServerError
from tool_server.embedded import ToolAccess, open_tools

logger = logging.getLogger(__name__)

# The assistant must start with a tool call (OpenAI's tool_choice="required"): the untrained 135M policy
# otherwise answers from memory in prose. Later turns are free to answer. `first_turn_prefix` writes the whole
# opening call when it knows what to open; this bare opening is the fallback.
FIRST_TURN_PREFIX = '<tool_call>{"name": "'
EXAMPLE_CORPUS = Path(__file__).resolve().parent.parent / "examples" / "corpus"


class AskError(Exception):
    """A problem with what the user asked for (missing file, unreachable server, unknown model)."""


@dataclass(frozen=True)
class AskOptions:
    question: str
    """The question; must not be empty."""
    urls: tuple[str, ...] = ()
    """Pages the policy may open with page_qa."""
    image: Path | None = None
    """An image the policy may load with image_ops."""
    video: Path | None = None
    """A video the policy may summarise with video_summary."""
    corpus: Path | None = None
    """Folder indexed for search (in-process tool server only); default: the project's example corpus."""
    policy: str = DEFAULT_MODEL
    """Built-in model name, local checkpoint or LoRA adapter dir (its tokenizer renders the prompts)."""
    sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(temperature=0.0))
    """Who samples the policy: in this process (default), or a server at `sampling.url` (e.g. vLLM serve).
    Temperature 0 decodes greedily: the assistant answers the same way each time."""
    tools_url: str | None = None
    """A running tool server; None starts one in-process."""
    max_turns: int = 6
    """Policy turns before giving up."""
    require_call: bool = True
    """Open the first turn with a tool call (see FIRST_TURN_PREFIX); off for policies trained on the format,
    which write the whole call themselves (a forced prefix can split tokens they would have merged)."""
    tools: tuple[str, ...] = ()
    """Offer only these sub-agents (e.g. the ones a policy was trained with); empty: all of them."""


def validate(opts: AskOptions) -> AskOptions:
    """Clear errors for an empty question or missing attachments; paths made absolute."""
    if not opts.question.strip():
        raise AskError("the question is empty")
    for label, path in (("image", opts.image), ("video", opts.video)):
        if path is not None and not path.is_file():
            raise AskError(f"--{label} {path}: no such file")
    if opts.corpus is not None and not opts.corpus.is_dir():
        raise AskError(f"--corpus {opts.corpus}: no such folder")
    return dataclasses.replace(
        opts,
        image=opts.image.resolve() if opts.image else None,
        video=opts.video.resolve() if opts.video else None,
        corpus=(opts.corpus or EXAMPLE_CORPUS).resolve(),
    )


def attachments(opts: AskOptions) -> str:
    """The lines appended to the question so the policy knows what it may open."""
    lines = [f"Page: {url}" for url in opts.urls]
    if opts.image:
        lines.append(f"Image: {opts.image}")
    if opts.video:
        lines.append(f"Video: {opts.video}")
    return "\n".join(lines)


@contextlib.asynccontextmanager
async def tool_client(opts: AskOptions) -> AsyncIterator[ToolClient]:
    """A client for `opts.tools_url`, or for a tool server started in this process that may read what the
    user attached and search `opts.corpus` (tool_server.embedded)."""
    roots = [str(p.parent) for p in (opts.image, opts.video) if p is not None]
    async with contextlib.AsyncExitStack() as stack:
        try:
            tools = open_tools(ToolAccess(url=opts.tools_url), roots=roots, corpus=opts.corpus)
            client = await stack.enter_async_context(tools)
        except ToolServerError as exc:  # the URL does not answer: the user's to fix
            raise AskError(f"--tools-url {opts.tools_url}: {exc}") from exc
        yield client


async def ask(opts: AskOptions, *, on_turn: ProgressHook | None = None) -> Episode:
    """Validate, start or reach the tools, load the policy, play one episode."""
    opts = validate(opts)
    try:
        policy, tokenizer = load_policy(opts.policy, opts.sampling, max_batch=1)
    except ModelNotFound as exc:
        raise AskError(str(exc)) from exc
    try:
        async with tool_client(opts) as tools:
            schemas = offered(await tools.tools(), opts.tools)
            task = RolloutTask("ask", opts.question, schemas, context=attachments(opts))
            cfg = RolloutConfig(
                max_turns=opts.max_turns,
                max_new_tokens=96,  # a call or a short answer; keeps each turn a few seconds on CPU
                first_turn_prefix=first_turn_prefix(opts, [str(t["function"]["name"]) for t in schemas]),
                untagged_is_answer=True,
            )
            return await rollout(task, policy, tools, tokenizer, cfg, on_turn=on_turn)
    finally:
        await policy.aclose()


def first_turn_prefix(opts: AskOptions, tools: list[str]) -> str:
    """How the first turn opens when a call is required: the opening call, written out in full.

    The user's question goes to what they attached (page_qa on the page, video_summary on the video; an image is
    loaded), else to search over the corpus; the policy takes over from the observation. An untrained 135M
    policy asked to complete such a call writes its own question and breaks the JSON (`"question": "Q?": "..."`),
    so the call is not left to it. With no attachment and no search tool, only `<tool_call>{"name": "` is written
    and the policy picks the tool. Whatever the policy writes after the closing tag in that turn is ignored by
    the parser unless it is another call.
    """
    if not opts.require_call:
        return ""
    opening = [  # (tool, arguments); the first whose target exists and whose tool is offered
        ("page_qa", {"url": opts.urls[0], "question": opts.question} if opts.urls else None),
        ("image_ops", {"op": "load", "image": str(opts.image)} if opts.image else None),
        ("video_summary", {"video": str(opts.video), "question": opts.question} if opts.video else None),
        ("search", {"query": opts.question}),
    ]
    for tool, arguments in opening:
        if arguments is not None and tool in tools:
            call = json.dumps({"name": tool, "arguments": arguments}, ensure_ascii=False)
            return f"{CALL_OPEN}{call}{CALL_CLOSE}"
    return FIRST_TURN_PREFIX


def offered(schemas: list[dict[str, object]], names: tuple[str, ...]) -> list[dict[str, object]]:
    """The schemas of the tools named (all when none are); an unknown name is an AskError."""
    if not names:
        return schemas
    known = {str(s["function"]["name"]): s for s in schemas}  # type: ignore[index]
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise AskError(f"--tool {', '.join(unknown)}: the tool server offers {', '.join(sorted(known))}")
    return [known[name] for name in names]


def sources(episode: Episode) -> list[str]:
    """What the answer rests on: pages opened, images made, video moments, search hits that were read."""
    found: list[str] = []
    for turn in episode.turns:
        for result in turn.results:
            payload = result.payload or {}
            if not result.ok:
                continue
            if result.name == "page_qa":
                found.append(f"{payload.get('title') or 'page'} <{payload.get('url')}>")
            elif result.name == "image_ops":
                found.append(f"image {payload.get('image_id')}")
            elif result.name == "video_summary":
                found.append(
                    f"video at {', '.join(str(t) for t in payload.get('timestamps') or []) or 'whole clip'}"
                )
            elif result.name == "search":
                found.extend(
                    f"{hit.get('title') or 'page'} <{hit.get('url')}>" for hit in payload.get("hits", [])
                )
    return list(dict.fromkeys(found))
