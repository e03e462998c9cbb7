"""conductor/stopping.py: a command told to stop with SIGTERM closes what it opened, as after Ctrl-C, and a
command that runs another stops it too and waits for it to close (real processes, real signals)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from conductor import stopping

COMMAND = """
import asyncio, pathlib, sys
from conductor.stopping import stop_like_ctrl_c

out = pathlib.Path(sys.argv[1])

async def main():
    try:
        (out / "started").write_text("")
        await asyncio.sleep(600)
    finally:
        await asyncio.sleep(0.1)  # closing awaits, as a policy's aclose does
        (out / "closed").write_text("")

stop_like_ctrl_c()
try:
    asyncio.run(main())
except KeyboardInterrupt:
    sys.exit(130)
"""

PARENT = """
import pathlib, subprocess, sys
from conductor.stopping import stop_like_ctrl_c, wait_or_stop

stop_like_ctrl_c()
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]])
pathlib.Path(sys.argv[2], "child").write_text(str(child.pid))
try:
    wait_or_stop(child)
except KeyboardInterrupt:
    sys.exit(130)
"""


def started(out: Path, name: str = "started", timeout_s: float = 30.0) -> None:
    """Wait until the script under test wrote `name` (its Python start-up takes a second or two)."""
    deadline = time.monotonic() + timeout_s
    while not (out / name).exists():
        assert time.monotonic() < deadline, f"the script never wrote {name}"
        time.sleep(0.05)


def run(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", *args], env={**os.environ, "PYTHONPATH": os.getcwd()})


def test_sigterm_runs_the_cleanup_of_a_running_asyncio_command(tmp_path: Path) -> None:
    """A command in asyncio.run, sent SIGTERM, runs its `finally` (awaits included) and exits 130 as after
    Ctrl-C; without stop_like_ctrl_c Python would die with nothing closed."""
    command = run(textwrap.dedent(COMMAND), str(tmp_path))
    started(tmp_path)
    command.send_signal(signal.SIGTERM)
    assert command.wait(timeout=30) == 130
    assert (tmp_path / "closed").exists()


def test_a_stopped_parent_stops_its_child_and_waits_for_it_to_close(tmp_path: Path) -> None:
    """SIGTERM to a study that runs a command: the command gets SIGTERM, closes, and has exited by the time
    the study has; nothing is left running."""
    parent = run(textwrap.dedent(PARENT), textwrap.dedent(COMMAND), str(tmp_path))
    started(tmp_path)
    parent.send_signal(signal.SIGTERM)
    assert parent.wait(timeout=60) == 130
    assert (tmp_path / "closed").exists()
    child = int((tmp_path / "child").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)


def test_a_child_that_does_not_close_in_time_is_killed(tmp_path: Path, monkeypatch) -> None:
    """A child that ignores SIGTERM is killed after CLOSE_S, and the stop still reaches the caller."""
    monkeypatch.setattr(stopping, "CLOSE_S", 0.5)
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)",
        ]
    )
    time.sleep(1.0)  # its handler set

    calls = []

    def interrupted(timeout: float | None = None) -> int:
        calls.append(timeout)
        if len(calls) == 1:
            raise KeyboardInterrupt  # the parent is stopped while it waits
        return subprocess.Popen.wait(child, timeout=timeout)

    monkeypatch.setattr(child, "wait", interrupted)
    with pytest.raises(KeyboardInterrupt):
        stopping.wait_or_stop(child)
    assert calls == [None, 0.5, None] and child.returncode == -signal.SIGKILL


START_UP = """
import contextlib, pathlib, sys, time
from conductor.stopping import held, raise_if_stopped, stop_like_ctrl_c

out, way = pathlib.Path(sys.argv[1]), sys.argv[2]
stop_like_ctrl_c()
try:
    with held() if way == "held" else contextlib.nullcontext():
        (out / "started").write_text("")
        try:  # a library that catches KeyboardInterrupt, as vLLM's engine start-up does
            time.sleep(3 if way == "held" else 30)
        except KeyboardInterrupt:
            if way == "held":  # and one an interrupt leaves waiting, as vLLM's handshake does
                time.sleep(600)
        (out / "went on").write_text("")
    raise_if_stopped()
    time.sleep(600)  # training, had the stop been lost
except KeyboardInterrupt:
    sys.exit(130)
"""


@pytest.mark.parametrize("way", ["swallowed", "held"])
def test_a_stop_during_a_start_up_stops_the_command_once_it_is_over(tmp_path: Path, way: str) -> None:
    """A SIGTERM during a library's start-up is not lost: one the library swallowed, or one `held()` kept from
    interrupting a start-up that would then hang (vLLM's handshake waits 10 minutes), stops the command at
    `raise_if_stopped` once the start-up returned."""
    command = run(textwrap.dedent(START_UP), str(tmp_path), way)
    started(tmp_path)
    command.send_signal(signal.SIGTERM)
    assert command.wait(timeout=30) == 130 and (tmp_path / "went on").exists()


def test_held_runs_the_block_as_it_is_off_the_main_thread() -> None:
    """`held()` in a worker thread (which cannot set signal handlers) or without `stop_like_ctrl_c` runs its block
    and leaves the SIGTERM handler as it was."""
    before = signal.getsignal(signal.SIGTERM)
    ran = []

    def block() -> None:
        with stopping.held():
            ran.append(True)

    worker = threading.Thread(target=block)
    worker.start()
    worker.join()
    block()
    assert ran == [True, True] and signal.getsignal(signal.SIGTERM) is before


def test_only_stops_sees_a_stop_through_task_groups_and_nothing_else() -> None:
    """A stop raised inside a task group's task arrives as an exception group: `conductor` exits 130 for it only
    when every exception inside is a stop, and shows any real error that came with it."""
    stop = KeyboardInterrupt()
    assert stopping.only_stops(stop)
    assert stopping.only_stops(BaseExceptionGroup("tasks", [stop, BaseExceptionGroup("inner", [stop])]))
    assert not stopping.only_stops(BaseExceptionGroup("tasks", [stop, ValueError("a real error")]))
    assert not stopping.only_stops(ValueError("a real error"))
