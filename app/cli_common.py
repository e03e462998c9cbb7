"""What every `conductor` command shares (app/cli.py and its command groups): logging set up one way, and
mistakes a user can fix said in one line with an exit code instead of a traceback.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import TypeVar

import typer

T = TypeVar("T")
# `ask -v` counts its cold start from here; Python's and typer's start-up (~0.1 s) come before.
STARTED = time.perf_counter()

READER_URL_HELP = (
    "OpenAI-compatible endpoint (e.g. vLLM serve) whose model answers for page_qa instead of the built-in one. "
    'page_qa then answers in the model\'s words (answer_mode "auto" is "free" there; "align" from a server TOML): '
    '"extract" scores page spans, which only the in-process model can.'
)
READER_MODEL_HELP = (
    "Model name served at --reader-url for page_qa (default: the first it lists); without --reader-url, a "
    "built-in model every sub-agent runs in process (`conductor models list`)."
)


def setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    for noisy in ("httpx", "httpcore", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def quiet_logging() -> None:
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


def settings(load: Callable[[], T], *, where: str = "CONFIG / --set") -> T:
    """Settings from a file and --set overrides; a mistake in them is one line and exit code 2."""
    from conductor.settings import ConfigError

    try:
        return load()
    except (ConfigError, FileNotFoundError) as exc:
        raise typer.BadParameter(str(exc), param_hint=where) from exc


def user_errors(work: Callable[[], T]) -> T:
    """Run a command's work; what a user can fix (a missing model or checkpoint, an unreachable server, a
    failing sampler, too many infrastructure failures, a setting the run's tasks cannot honour) is one line and
    exit code 1, without a traceback."""
    from conductor.models import ModelNotFound
    from conductor.settings import ConfigError
    from main_agent.policy import PolicyError
    from tool_server.client import ToolServerError
    from training.checkpoint import CheckpointError
    from training.step import InfraFailure

    try:
        return work()
    except (CheckpointError, ConfigError, ModelNotFound, PolicyError, InfraFailure, ToolServerError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
