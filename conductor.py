"""The `conductor` command line: one entry point, subcommands that call into the packages.

    conductor models prepare | list      the built-in model, converted once to a dense checkpoint
    conductor serve --config FILE        the tool server with the frozen sub-agents

Each command is a thin wrapper: parse options, configure logging, call one library function.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Train and run tool-using orchestrator agents.")
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


@models_app.command("prepare")
def models_prepare(
    force: Annotated[bool, typer.Option(help="Convert again even if a checkpoint exists.")] = False,
) -> None:
    """Convert the built-in SmolLM2-135M-Instruct GGUF into a dense HF checkpoint under $CONDUCTOR_HOME."""
    from subagents import models

    _setup_logging(False)
    try:
        path = models.prepare_default(force=force)
    except models.ModelNotFound as exc:
        raise typer.BadParameter(str(exc)) from exc
    typer.echo(f"{models.DEFAULT_MODEL}: {path}")


@models_app.command("list")
def models_list() -> None:
    """Show each built-in model and whether it is prepared."""
    from subagents import models

    for name, status, where in models.list_models():
        typer.echo(f"{name:24s} {status:13s} {where}")


@app.command()
def serve(
    config: Annotated[Path | None, typer.Option(help="Server TOML config; defaults run every sub-agent on SmolLM2.")] = None,
    host: Annotated[str | None, typer.Option(help="Bind address (default 127.0.0.1 from the config).")] = None,
    port: Annotated[int | None, typer.Option(help="Port (default 8700 from the config).")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Run the tool server: /v1/tools, /v1/tools/{name}, /v1/batch, /health, /metrics, /mcp."""
    import dataclasses

    from tool_server.app import serve as run_server
    from tool_server.config import ConfigError, load_config

    _setup_logging(verbose)
    try:
        cfg = load_config(config)
    except (ConfigError, FileNotFoundError) as exc:
        raise typer.BadParameter(str(exc), param_hint="--config") from exc
    run_server(dataclasses.replace(cfg, host=host or cfg.host, port=port if port is not None else cfg.port))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
