"""`conductor models` and `conductor serve`: the built-in models, and the tool server that runs them.

    conductor models prepare | list      the built-in model, converted once to a dense checkpoint
    conductor serve --config FILE [--set k=v]  the tool server with the frozen sub-agents

Registered on the `conductor` command by app/cli.py.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Annotated

import typer

from app.cli_common import READER_MODEL_HELP, READER_URL_HELP, settings, setup_logging
from conductor.models import DEFAULT_MODEL

models_app = typer.Typer(no_args_is_help=True, help="Prepare and list the built-in models.")


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

    setup_logging(False)
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

    setup_logging(verbose)
    overrides = [*(set_ or ()), *_reader_overrides(reader_url, reader_model)]
    cfg = settings(lambda: load_config(config, overrides), where="--config / --set")
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
