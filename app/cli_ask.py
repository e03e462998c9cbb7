"""`conductor ask` and `conductor trace`: one episode of the research assistant shown live, and episodes shown
as an HTML trace.

    conductor ask "QUESTION" [...]       the research assistant: one episode, shown live
    conductor trace EPISODES.jsonl       render episodes as a self-contained HTML trace

Registered on the `conductor` command by app/cli.py.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from app.cli_common import READER_MODEL_HELP, READER_URL_HELP, STARTED, quiet_logging, setup_logging
from conductor.models import DEFAULT_POLICY, DEFAULT_TURNS

# `ask`'s options, one line each in its signature
Urls = Annotated[
    list[str] | None,
    typer.Option("--url", help="A page the policy may read: a URL or a local file (repeatable)."),
]
ImagePath = Annotated[Path | None, typer.Option(help="An image the policy may inspect.")]
VideoPath = Annotated[Path | None, typer.Option(help="A video the policy may summarise.")]
Corpus = Annotated[
    Path | None, typer.Option(help="Folder of HTML, Markdown, text and PDF files to search (indexed once).")
]
SearchUrl = Annotated[
    str | None, typer.Option(help="Search the web through this SearXNG instance instead of a folder.")
]
PolicyRef = Annotated[
    str,
    typer.Option(help="Policy: the shipped default, a built-in model name, a checkpoint or an adapter dir."),
]
PolicyUrl = Annotated[
    str | None, typer.Option(help="OpenAI-compatible endpoint serving the policy (e.g. vLLM serve).")
]
PolicyModel = Annotated[
    str | None, typer.Option(help="Model name served at --policy-url (default: the first it lists).")
]
ReaderUrl = Annotated[str | None, typer.Option(help=READER_URL_HELP)]
ReaderModel = Annotated[str | None, typer.Option(help=READER_MODEL_HELP)]
ToolsUrl = Annotated[str | None, typer.Option(help="A running tool server (default: start one in-process).")]
MaxTurns = Annotated[int, typer.Option(help="Policy turns; the last one is asked for the answer.")]
Tools = Annotated[list[str] | None, typer.Option("--tool", help="Offer only this sub-agent (repeatable).")]
RequireCall = Annotated[
    bool | None,
    typer.Option(
        help="Open the first turn with a tool call (default: only for the untrained built-in model)."
    ),
]
TracePath = Annotated[Path | None, typer.Option(help="Write a self-contained HTML trace here.")]
JsonOut = Annotated[bool, typer.Option("--json", help="Print the episode as JSON instead of the live view.")]
Verbose = Annotated[bool, typer.Option("--verbose", "-v")]


def ask(
    question: Annotated[str, typer.Argument(help="What to find out.")],
    url: Urls = None,
    image: ImagePath = None,
    video: VideoPath = None,
    corpus: Corpus = None,
    search_url: SearchUrl = None,
    policy: PolicyRef = DEFAULT_POLICY,
    policy_url: PolicyUrl = None,
    policy_model: PolicyModel = None,
    reader_url: ReaderUrl = None,
    reader_model: ReaderModel = None,
    tools_url: ToolsUrl = None,
    max_turns: MaxTurns = DEFAULT_TURNS,
    tool: Tools = None,
    require_call: RequireCall = None,
    trace: TracePath = None,
    json_out: JsonOut = False,
    verbose: Verbose = False,
) -> None:
    """Answer a question with the policy and the frozen sub-agents, showing every call."""
    if verbose:
        setup_logging(verbose)
    else:
        quiet_logging()  # before the imports: some libraries read their settings when imported
    from app.ask import AskOptions
    from main_agent.policy import SamplingConfig

    imported = time.perf_counter()
    sampling = SamplingConfig(temperature=0.0)  # greedy: the assistant answers the same way each time
    if policy_url:
        sampling = SamplingConfig(backend="server", url=policy_url, model=policy_model, temperature=0.0)
    opts = AskOptions(
        question=question, urls=tuple(url or ()), image=image, video=video, corpus=corpus, search_url=search_url,
        reader_url=reader_url, reader_model=reader_model, policy=policy, sampling=sampling, tools_url=tools_url,
        max_turns=max_turns, tools=tuple(tool or ()), require_call=require_call,
    )  # fmt: skip
    _index_corpus(opts)
    _run_ask(opts, json_out=json_out, trace=trace, imported=imported if verbose else None)


def _index_corpus(opts) -> None:
    """Index the in-process tools' corpus now, or find its index unchanged, so the tool server loads it from the
    cache; a bar on stderr while a large folder is extracted (display.IndexBar), and a line naming the files
    search cannot find (damaged, empty, too big). Errors exit with 2."""
    from app import ask as assistant
    from app import display

    if opts.tools_url is not None or opts.search_url is not None:
        return  # the corpus is another server's, or search reads the web
    bar = display.IndexBar()
    try:
        corpus = assistant.index_corpus((opts.corpus or assistant.EXAMPLE_CORPUS).resolve(), progress=bar)
    except assistant.AskError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    finally:
        bar.close()
    if corpus.skipped:  # said even without -v, whose log alone names them
        typer.echo(f"search corpus: {corpus.summary()}", err=True)


def _run_ask(opts, *, json_out: bool, trace: Path | None, imported: float | None = None) -> None:
    """One episode with the live view (or JSON), then the optional HTML trace; user errors exit with 2.
    Given when the imports were done, one line says where the cold start went (to the first policy turn)."""
    import asyncio

    from app import ask as assistant
    from app import display

    indexed = time.perf_counter()
    view = None if json_out else display.LiveView(opts.question)

    def on_ready(startup: assistant.Startup) -> None:
        assert imported is not None
        line = (
            f"cold start: {time.perf_counter() - STARTED:.1f} s (imports {imported - STARTED:.1f} s, "
            f"index {indexed - imported:.1f} s, policy {startup.policy_s:.1f} s, tools {startup.tools_s:.1f} s)"
        )
        view.note(line) if view else typer.echo(line, err=True)

    hooks = {"on_turn": view.turn if view else None, "on_ready": on_ready if imported is not None else None}
    try:
        episode = asyncio.run(assistant.ask(opts, **hooks))
    except assistant.AskError as exc:
        if view:
            view.close()
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    if view:
        view.final(episode, assistant.sources(episode))
    else:
        typer.echo(episode.to_json())
    if trace:
        from app.trace import write_html

        write_html([episode], trace)
        typer.echo(f"trace written to {trace}", err=True)


def trace_cmd(
    episodes: Annotated[Path, typer.Argument(help="JSONL file of episodes (rollouts or `ask --json`).")],
    out: Annotated[Path, typer.Option("-o", "--out", help="HTML file to write.")] = Path("trace.html"),
) -> None:
    """Render episodes as a self-contained HTML trace tree."""
    from app.trace import write_html
    from training.metrics import load_episodes

    try:
        loaded = load_episodes(episodes)
    except (OSError, ValueError) as exc:  # no such file, or a line that is not an episode (named)
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    write_html(loaded, out)
    typer.echo(f"wrote {out}")
