"""`conductor train`, `sft`, `eval` and `plot`: training the policy, its warm start, its evaluation and its
curves.

    conductor train [CONFIG] [--set k=v]  multi-turn RL of the main policy (sync, or --async; --ray [ADDRESS])
    conductor sft [CONFIG] [--set k=v]   warm start from scripted-expert episodes
    conductor eval --policy P --task T   success, tool use and context size on a split
    conductor plot RUN_DIR               PNG curves from a run's metrics.jsonl

Registered on the `conductor` command by app/cli.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from app.cli_common import settings, setup_logging, user_errors


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

    setup_logging(False)
    cfg = settings(lambda: load_train_config(config, list(set_ or ())))
    if ray is not None:
        from training.ray_session import check_supported

        if ray:  # `--ray` alone keeps [ray] address (default: a local cluster)
            cfg = dataclasses.replace(cfg, ray=dataclasses.replace(cfg.ray, address=ray))
        settings(lambda: check_supported(cfg))
    loop = functools.partial(train, overlap=async_, on_ray=ray is not None)
    bar = tqdm(total=cfg.steps, unit="step", desc=f"train {config_hash(cfg)}", file=sys.stderr)

    def on_step(row) -> None:  # one fixed-shape line per step above the progress bar
        bar.n = int(row["step"])
        bar.refresh()
        tqdm.write(step_line(row))

    with bar:
        run_dir = user_errors(lambda: loop(cfg, resume=resume, force=force, on_step=on_step))
    typer.echo(f"run directory: {run_dir}")


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

    setup_logging(False)
    cfg = settings(lambda: load_sft_config(list(set_ or ()), config))
    report = user_errors(lambda: run_sft(cfg))
    reports = [r for r in (report.before, report.after) if r is not None]
    typer.echo(format_table(reports) if reports else "no evaluation (eval_n=0)")
    typer.echo(
        f"{report.expert_episodes} expert episodes of {report.expert_tasks} tasks; model: {report.model_dir}"
    )


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
    setup_logging(False)
    cfg = settings(lambda: load_eval_config(config, [*given, *(set_ or ())]))
    typer.echo(user_errors(lambda: run_eval(cfg, out)).table())


def plot(run_dir: Annotated[Path, typer.Argument(help="A training run directory.")]) -> None:
    """Write PNG curves (reward, success, tool calls, context, loss, clip fraction) from metrics.jsonl."""
    from training.plot import plot_run

    for path in plot_run(run_dir):
        typer.echo(str(path))
