"""The `conductor` command line: one entry point, subcommands that call into the packages.

    conductor models prepare | list      the built-in model, converted once to a dense checkpoint  (cli_serve.py)
    conductor serve --config FILE [--set k=v]  the tool server with the frozen sub-agents           (cli_serve.py)
    conductor ask "QUESTION" [...]       the research assistant: one episode, shown live            (cli_ask.py)
    conductor trace EPISODES.jsonl       render episodes as a self-contained HTML trace            (cli_ask.py)
    conductor train [CONFIG] [--set k=v]  multi-turn RL of the main policy (sync, or --async; --ray [ADDRESS])
    conductor sft [CONFIG] [--set k=v]   warm start from scripted-expert episodes                  (cli_train.py)
    conductor eval --policy P --task T   success, tool use and context size on a split             (cli_train.py)
    conductor plot RUN_DIR               PNG curves from a run's metrics.jsonl                     (cli_train.py)

Each command is a thin wrapper in the module of its group: parse options, configure logging, call one library
function, print what it returned (what they share is app/cli_common.py). Settings come from a TOML file and
`--set key=value` overrides (conductor/settings.py).
"""

from __future__ import annotations

import sys

import typer

from app import cli_ask, cli_serve, cli_train
from conductor.stopping import only_stops, stop_like_ctrl_c

app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="Train and run tool-using orchestrator agents."
)
app.add_typer(cli_serve.models_app, name="models")
app.command()(cli_serve.serve)
app.command()(cli_ask.ask)
app.command("trace")(cli_ask.trace_cmd)
app.command()(cli_train.train)
app.command()(cli_train.sft)
app.command("eval")(cli_train.eval_cmd)
app.command()(cli_train.plot)


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
    stop_like_ctrl_c()  # `kill` closes engines, clusters and fetchers as Ctrl-C does (serve sets its own)
    try:
        app(args=optional_value(sys.argv[1:], "--ray", ""))  # `--ray` alone: the address [ray] names
    except BaseExceptionGroup as error:  # a stop raised in a task group's task (click handles a bare one)
        if not only_stops(error):
            raise
        print("\nAborted!", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
