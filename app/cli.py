"""The `conductor` command line: one entry point, subcommands that call into the packages.

    conductor models prepare | list      the built-in model, converted once to a dense checkpoint
    conductor serve --config FILE [--set k=v]  the tool server with the frozen sub-agents
    conductor ask "QUESTION" [...]       the research assistant: one episode, shown live
    conductor trace EPISODES.jsonl       render episodes as a self-contained HTML trace
    conductor train [CONFIG] [--set k=v]  multi-turn RL of the main policy (sync, or --async; --ray [ADDRESS])
    conductor sft [CONFIG] [--set k=v]   warm start from scripted-expert episodes
    conductor eval --policy P --task T   success, tool use and context size on a split
    conductor plot RUN_DIR               PNG curves from a run's metrics.jsonl

Each command is a thin wrapper: parse options, configure logging, call one library function, print what it
returned. Settings come from a TOML file and `--set key=value` overrides (conductor/settings.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, TypeVar

import typer

from conductor.models import DEFAULT_MODEL, DEFAULT_POLICY

T = TypeVar("T")
# `ask -v` counts its cold start from here; Python's and typer's start-up (~0.1 s) come before.
STARTED = time.perf_counter()

app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="Train and run tool-using orchestrator agents."
)
models_app = typer.Typer(no_args_is_help=True, help="Prepare and list the built-in models.")
app.add_typer(models_app, name="models")


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    for noisy in ("httpx", "httpcore", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _quiet_logging() -> None:
    """`ask` without -v: no log line under ERROR and no progress bar from the libraries it loads.

    Called before those libraries are imported. Levels are set on the handlers, not only on the root logger:
    bm25s sets its own logger to DEBUG at import. transformers and rapidocr give their loggers handlers of their
    own (set through TRANSFORMERS_VERBOSITY, and pre-empted for rapidocr, which adds one only to a logger that
    has none). transformers' "Loading weights" bar and huggingface_hub's bars follow HF_HUB_DISABLE_PROGRESS_BARS,
    other tqdm bars TQDM_DISABLE; Python warnings become log records at WARNING, so they are dropped too.
    """
    for name, value in (("HF_HUB_DISABLE_PROGRESS_BARS", "1"), ("TQDM_DISABLE", "1")):
        os.environ.setdefault(name, value)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    handler = logging.StreamHandler()
    handler.setLevel(logging.ERROR)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.ERROR, handlers=[handler])
    logging.getLogger("RapidOCR").addHandler(handler)
    logging.captureWarnings(True)


@models_app.command("prepare")
def models_prepare(
    name: Annotated[
        str, typer.Argument(help="Which built-in model (`conductor models list`).")
    ] = DEFAULT_MODEL,
    force: Annotated[bool, typer.Option(help="Convert again even if a checkpoint exists.")] = False,
) -> None:
    """Convert a built-in model's GGUF (SmolLM2-135M-Instruct unless named) into a dense HF checkpoint under
    $CONDUCTOR_HOME."""
    from conductor import models

    _setup_logging(False)
    if name not in models.BUILTIN_MODELS:
        raise typer.BadParameter(f"{name!r} is not a built-in model ({', '.join(models.BUILTIN_MODELS)})")
    try:
        path = models.prepare_default(name, force=force)
    except models.ModelNotFound as exc:
        raise typer.BadParameter(str(exc)) from exc
    typer.echo(f"{name}: {path}")
    if name != models.DEFAULT_MODEL:
        return
    try:  # the shipped default policy is an adapter over that model: ready once the model is
        typer.echo(f"{models.DEFAULT_POLICY}: {models.resolve_model(models.DEFAULT_POLICY)}")
    except models.ModelNotFound as exc:
        typer.echo(f"warning: {exc}", err=True)


@models_app.command("list")
def models_list() -> None:
    """Show each built-in model and whether it is prepared."""
    from conductor import models

    for name, status, where in models.list_models():
        typer.echo(f"{name:24s} {status:13s} {where}")


READER_URL_HELP = (
    "OpenAI-compatible endpoint (e.g. vLLM serve) whose model answers for page_qa instead of the built-in one. "
    'page_qa then answers in the model\'s words (answer_mode "auto" is "free" there; "align" from a server TOML): '
    '"extract" scores page spans, which only the in-process model can.'
)
READER_MODEL_HELP = (
    "Model name served at --reader-url (default: the first it lists); without --reader-url, a built-in model "
    "page_qa runs in process (`conductor models list`)."
)


@app.command()
def serve(
    config: Annotated[
        Path | None, typer.Option(help="Server TOML config; defaults run every sub-agent on SmolLM2.")
    ] = None,
    host: Annotated[
        str | None, typer.Option(help="Bind address (default 127.0.0.1 from the config).")
    ] = None,
    port: Annotated[int | None, typer.Option(help="Port (default 8700 from the config).")] = None,
    set_: Annotated[
        list[str] | None,
        typer.Option("--set", help="Override one setting: key=value, e.g. page_qa.limits.max_concurrency=2."),
    ] = None,
    reader_url: Annotated[str | None, typer.Option(help=READER_URL_HELP)] = None,
    reader_model: Annotated[str | None, typer.Option(help=READER_MODEL_HELP)] = None,
    replicas: Annotated[
        int | None,
        typer.Option(
            help="Run N replicas on Ray Serve behind one proxy on loopback (the distributed extra)."
        ),
    ] = None,
    ray: Annotated[
        str | None,
        typer.Option(
            "--ray", help="With --replicas: the Ray cluster (default: a local one; auto, HOST:PORT)."
        ),
    ] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Run the tool server: /v1/tools, /v1/tools/{name}, /v1/batch, /health, /metrics, /mcp."""
    import dataclasses

    from tool_server.app import serve as run_server
    from tool_server.config import load_config
    from tool_server.limits import UnsafeBind

    _setup_logging(verbose)
    overrides = [*(set_ or ()), *_reader_overrides(reader_url, reader_model)]
    cfg = _settings(lambda: load_config(config, overrides), where="--config / --set")
    cfg = dataclasses.replace(cfg, host=host or cfg.host, port=port if port is not None else cfg.port)
    if replicas is not None or ray is not None:
        _serve_replicas(cfg, replicas or 1, ray or None)
        return
    try:
        run_server(cfg)
    except UnsafeBind as exc:  # refused before anything was bound: a setting to fix, said in one line
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc


def _reader_overrides(url: str | None, model: str | None) -> tuple[str, ...]:
    """`serve --reader-url [--reader-model]` as settings overrides (tool_server.config.reader_overrides); the
    endpoint must list its models now, or that is one line and exit code 2. `--reader-model` alone: a built-in."""
    from subagents.llm import BackendError
    from subagents.openai_llm import served_model
    from tool_server.config import reader_overrides

    if url is None:
        try:
            return () if model is None else reader_overrides(None, model)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--reader-model") from exc
    try:
        return reader_overrides(url, served_model(url, model))
    except BackendError as exc:  # nothing there to read with: said in one line, as `ask` does
        typer.echo(f"error: --reader-url: {exc}", err=True)
        raise typer.Exit(2) from exc


def _serve_replicas(cfg, replicas: int, address: str | None) -> None:
    """`conductor serve --replicas N`: the tool server on Ray Serve until Ctrl-C (tool_server/ray_serve.py)."""
    import signal

    from conductor.cluster import LOCAL, RayConfig, cluster
    from tool_server import ray_serve
    from tool_server.limits import is_loopback

    if not is_loopback(cfg.host):
        raise typer.BadParameter("Serve's proxy listens on loopback only", param_hint="--host")
    ray_cfg = RayConfig(address=address or LOCAL, tool_replicas=replicas)
    with cluster(ray_cfg):
        # `kill` stops it as Ctrl-C does (Ctrl-C may be ignored: a background job of a script): leaving the
        # cluster block deletes the app and stops a local cluster. Set after ray.init, which installs its own.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        url = ray_serve.deploy(cfg, ray_cfg, port=cfg.port)
        typer.echo(f"tool server on {url}: {replicas} replicas on Ray Serve (Ctrl-C or kill stops it)")
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()


@app.command()
def ask(
    question: Annotated[str, typer.Argument(help="What to find out.")],
    url: Annotated[
        list[str] | None,
        typer.Option("--url", help="A page the policy may read: a URL or a local file (repeatable)."),
    ] = None,
    image: Annotated[Path | None, typer.Option(help="An image the policy may inspect.")] = None,
    video: Annotated[Path | None, typer.Option(help="A video the policy may summarise.")] = None,
    corpus: Annotated[
        Path | None,
        typer.Option(help="Folder of HTML, Markdown, text and PDF files to search (indexed once)."),
    ] = None,
    search_url: Annotated[
        str | None, typer.Option(help="Search the web through this SearXNG instance instead of a folder.")
    ] = None,
    policy: Annotated[
        str,
        typer.Option(
            help="Policy: the shipped default, a built-in model name, a checkpoint or an adapter dir."
        ),
    ] = DEFAULT_POLICY,
    policy_url: Annotated[
        str | None, typer.Option(help="OpenAI-compatible endpoint serving the policy (e.g. vLLM serve).")
    ] = None,
    policy_model: Annotated[
        str | None, typer.Option(help="Model name served at --policy-url (default: the first it lists).")
    ] = None,
    reader_url: Annotated[str | None, typer.Option(help=READER_URL_HELP)] = None,
    reader_model: Annotated[str | None, typer.Option(help=READER_MODEL_HELP)] = None,
    tools_url: Annotated[
        str | None, typer.Option(help="A running tool server (default: start one in-process).")
    ] = None,
    max_turns: Annotated[int, typer.Option(help="Policy turns before giving up.")] = 6,
    tool: Annotated[
        list[str] | None, typer.Option("--tool", help="Offer only this sub-agent (repeatable).")
    ] = None,
    require_call: Annotated[
        bool | None,
        typer.Option(
            help="Open the first turn with a tool call (default: only for the untrained built-in model)."
        ),
    ] = None,
    trace: Annotated[Path | None, typer.Option(help="Write a self-contained HTML trace here.")] = None,
    json_out: Annotated[
        bool, typer.Option("--json", help="Print the episode as JSON instead of the live view.")
    ] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Answer a question with the policy and the frozen sub-agents, showing every call."""
    if verbose:
        _setup_logging(verbose)
    else:
        _quiet_logging()  # before the imports: some libraries read their settings when imported
    from app.ask import AskOptions
    from main_agent.policy import SamplingConfig

    imported = time.perf_counter()
    sampling = SamplingConfig(temperature=0.0)  # greedy: the assistant answers the same way each time
    if policy_url:
        sampling = SamplingConfig(backend="server", url=policy_url, model=policy_model, temperature=0.0)
    opts = AskOptions(
        question=question,
        urls=tuple(url or ()),
        image=image,
        video=video,
        corpus=corpus,
        search_url=search_url,
        reader_url=reader_url,
        reader_model=reader_model,
        policy=policy,
        sampling=sampling,
        tools_url=tools_url,
        max_turns=max_turns,
        tools=tuple(tool or ()),
        require_call=require_call,
    )
    _index_corpus(opts)
    _run_ask(opts, json_out=json_out, trace=trace, imported=imported if verbose else None)


def _index_corpus(opts) -> None:
    """Index the in-process tools' corpus now, or find its index unchanged, so the tool server loads it from the
    cache; a bar on stderr while a large folder is extracted (display.IndexBar). Errors exit with 2."""
    from app import ask as assistant
    from app import display

    if opts.tools_url is not None or opts.search_url is not None:
        return  # the corpus is another server's, or search reads the web
    bar = display.IndexBar()
    try:
        assistant.index_corpus((opts.corpus or assistant.EXAMPLE_CORPUS).resolve(), progress=bar)
    except assistant.AskError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    finally:
        bar.close()


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


@app.command("trace")
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


@app.command()
def train(
    config: Annotated[
        Path | None, typer.Argument(help="Training TOML config (default: the CPU defaults).")
    ] = None,
    set_: Annotated[
        list[str] | None,
        typer.Option("--set", help="Override one setting: key=value, e.g. credit.mode=turn."),
    ] = None,
    resume: Annotated[
        Path | None, typer.Option(help="Continue this run directory from its newest checkpoint.")
    ] = None,
    force: Annotated[bool, typer.Option(help="Resume even if batch/group/task settings changed.")] = False,
    async_: Annotated[
        bool, typer.Option("--async", help="Overlap rollouts for step k+1 with training step k.")
    ] = False,
    ray: Annotated[
        str | None,
        typer.Option(
            "--ray",
            help="Run on Ray: --ray alone uses \\[ray] address (default: a local cluster for the run); "
            "--ray auto joins the cluster of this machine, --ray HOST:PORT another. Put it after CONFIG.",
        ),
    ] = None,
) -> None:
    """Train the orchestrator policy with multi-turn RL against the frozen tool server."""
    import dataclasses
    import functools

    from tqdm import tqdm

    from training.config import config_hash, load_train_config
    from training.loop import train
    from training.metrics import step_line

    _setup_logging(False)
    cfg = _settings(lambda: load_train_config(config, list(set_ or ())))
    if ray is not None:
        from training.ray_session import check_supported

        if ray:  # `--ray` alone keeps [ray] address (default: a local cluster)
            cfg = dataclasses.replace(cfg, ray=dataclasses.replace(cfg.ray, address=ray))
        _settings(lambda: check_supported(cfg))
    loop = functools.partial(train, overlap=async_, on_ray=ray is not None)
    bar = tqdm(total=cfg.steps, unit="step", desc=f"train {config_hash(cfg)}", file=sys.stderr)

    def on_step(row) -> None:  # one fixed-shape line per step above the progress bar
        bar.n = int(row["step"])
        bar.refresh()
        tqdm.write(step_line(row))

    with bar:
        run_dir = _user_errors(lambda: loop(cfg, resume=resume, force=force, on_step=on_step))
    typer.echo(f"run directory: {run_dir}")


@app.command()
def sft(
    config: Annotated[
        Path | None, typer.Argument(help="SFT TOML config (default: the CPU defaults).")
    ] = None,
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="Override one setting: key=value, e.g. limit=48.")
    ] = None,
) -> None:
    """Fine-tune the policy on successful scripted-expert episodes run through the real tool server."""
    from training.evaluate import format_table
    from training.sft import load_sft_config, run_sft

    _setup_logging(False)
    cfg = _settings(lambda: load_sft_config(list(set_ or ()), config))
    report = _user_errors(lambda: run_sft(cfg))
    reports = [r for r in (report.before, report.after) if r is not None]
    typer.echo(format_table(reports) if reports else "no evaluation (eval_n=0)")
    typer.echo(
        f"{report.expert_episodes} expert episodes of {report.expert_tasks} tasks; model: {report.model_dir}"
    )


@app.command("eval")
def eval_cmd(
    config: Annotated[Path | None, typer.Argument(help="Evaluation TOML config (optional).")] = None,
    policy: Annotated[str | None, typer.Option(help="Built-in name, checkpoint or adapter dir.")] = None,
    task: Annotated[
        str | None,
        typer.Option(
            help="Task family, e.g. research_corpus, corpus_qa, multihop_pages, plate_reading, video_qa."
        ),
    ] = None,
    split: Annotated[str | None, typer.Option(help="train, dev or test.")] = None,
    n: Annotated[
        int | None, typer.Option(help="The first n tasks of the split (the same for every policy).")
    ] = None,
    out: Annotated[Path | None, typer.Option(help="Write the report here as JSON.")] = None,
    set_: Annotated[
        list[str] | None,
        typer.Option("--set", help="Override one setting: key=value, e.g. sampling.backend=vllm."),
    ] = None,
) -> None:
    """Evaluate a policy with greedy decoding on fixed task instances; prints a table, writes JSON."""
    from training.evaluate import load_eval_config, run_eval

    flags = {"policy": policy, "task": task, "split": split, "limit": n}
    given = [f"{key}={json.dumps(value)}" for key, value in flags.items() if value is not None]
    _setup_logging(False)
    cfg = _settings(lambda: load_eval_config(config, [*given, *(set_ or ())]))
    typer.echo(_user_errors(lambda: run_eval(cfg, out)).table())


def _settings(load: Callable[[], T], *, where: str = "CONFIG / --set") -> T:
    """Settings from a file and --set overrides; a mistake in them is one line and exit code 2."""
    from conductor.settings import ConfigError

    try:
        return load()
    except (ConfigError, FileNotFoundError) as exc:
        raise typer.BadParameter(str(exc), param_hint=where) from exc


def _user_errors(work: Callable[[], T]) -> T:
    """Run a command's work; what a user can fix (a missing model or checkpoint, an unreachable server, a
    failing sampler, too many infrastructure failures) is one line and exit code 1, without a traceback."""
    from conductor.models import ModelNotFound
    from main_agent.policy import PolicyError
    from tool_server.client import ToolServerError
    from training.checkpoint import CheckpointError
    from training.step import InfraFailure

    try:
        return work()
    except (CheckpointError, ModelNotFound, PolicyError, InfraFailure, ToolServerError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc


@app.command()
def plot(run_dir: Annotated[Path, typer.Argument(help="A training run directory.")]) -> None:
    """Write PNG curves (reward, success, tool calls, context, loss, clip fraction) from metrics.jsonl."""
    from training.plot import plot_run

    for path in plot_run(run_dir):
        typer.echo(str(path))


def optional_value(argv: list[str], option: str, default: str) -> list[str]:
    """`argv` with `default` after a bare `option` that ends the line or precedes another option: click has no
    options whose value may be left out (`--ray` vs `--ray auto`)."""
    out = []
    for i, arg in enumerate(argv):
        out.append(arg)
        if arg == option and (i + 1 == len(argv) or argv[i + 1].startswith("-")):
            out.append(default)
    return out


def main() -> None:
    app(args=optional_value(sys.argv[1:], "--ray", ""))  # `--ray` alone: the address [ray] names


if __name__ == "__main__":
    main()
