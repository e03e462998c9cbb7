"""A long command told to stop closes what it opened, whichever signal told it.

    stop_like_ctrl_c()            at an entry point: SIGTERM (`kill`, a scheduler, a session's end) raises
                                  KeyboardInterrupt as Ctrl-C does
    with held(): ...              a SIGTERM during the block waits for its end (vLLM's engine start-up)
    raise_if_stopped()            after it: the held stop, raised
    started(start, close)         start() held; if a stop came meanwhile, close(what it started) and stop
    only_stops(error)             whether a task group's error is the stop and nothing else
    wait_or_stop(child)           a child command's exit code; stopped as the parent is, with time to close

Python dies at once on SIGTERM: no `finally` runs, so a vLLM engine's core process, the Ray cluster a command
started or a tool server's page fetchers outlive it. Ctrl-C instead raises KeyboardInterrupt, and asyncio.run
cancels every task and lets each close (a policy's `aclose`, `async with` blocks). A command that runs another
(the studies run `conductor` as a user does) passes the stop on and waits for it to close before it goes.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import subprocess
import threading
from collections.abc import Callable
from typing import TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

CLOSE_S = 60.0
"""How long a stopped child may take to close before it is killed: a vLLM engine's shutdown and a checkpoint's
last write take seconds; a minute is a hung child, not a slow one."""


STOPPED = threading.Event()
"""Set by a SIGTERM once `stop_like_ctrl_c` is in place: `raise_if_stopped` raises it again where a library
swallowed the KeyboardInterrupt."""


def stop_like_ctrl_c() -> None:
    """SIGTERM raises KeyboardInterrupt in the main thread from now on (call it from the main thread)."""
    signal.signal(signal.SIGTERM, _stop)


def _stop(signum: int, frame: object) -> None:
    STOPPED.set()
    raise KeyboardInterrupt


def _hold(signum: int, frame: object) -> None:
    STOPPED.set()


@contextlib.contextmanager
def held():
    """A SIGTERM during the block only sets STOPPED; `raise_if_stopped` after it raises the stop. For code that an
    interrupt leaves in a state that never ends: vLLM's engine start-up catches KeyboardInterrupt inside its
    handshake (vllm.utils.network_utils.zmq_socket_ctx), then waits out VLLM_ENGINE_READY_TIMEOUT_S (600 s) for
    an engine that stopped listening. Where SIGTERM is not `stop_like_ctrl_c`'s (a library caller, a worker
    thread, which cannot set handlers) the block runs as it is."""
    main = threading.current_thread() is threading.main_thread()
    if not main or signal.getsignal(signal.SIGTERM) is not _stop:
        yield
        return
    signal.signal(signal.SIGTERM, _hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, _stop)


def raise_if_stopped() -> None:
    """KeyboardInterrupt if a SIGTERM came while `held` (or was swallowed by a library): the command stops there,
    having closed what the block opened."""
    if STOPPED.is_set():
        raise KeyboardInterrupt


def started(start: Callable[[], T], close: Callable[[T], object]) -> T:
    """What `start()` returns, a SIGTERM held meanwhile (`held`); if one came, `close` it and raise the stop. For
    vLLM's engines. The result is never left a local of this frame: a module vLLM imports during start-up keeps an
    exception whose traceback keeps the calling frames, and an engine referenced from one outlives its owner's
    `aclose` until interpreter exit, where vLLM's `__del__` fails ("Exception ignored in ...")."""
    with held():
        box = [start()]
    if STOPPED.is_set():
        close(box.pop())
        raise KeyboardInterrupt
    return box.pop()


def wait_or_stop(child: subprocess.Popen) -> int:
    """The child's exit code; if this process is stopped meanwhile (KeyboardInterrupt), the child is asked to stop
    too (SIGTERM), given CLOSE_S to close, killed past that, and the stop raised on."""
    try:
        return child.wait()
    except KeyboardInterrupt:
        child.terminate()
        try:
            child.wait(timeout=CLOSE_S)
        except subprocess.TimeoutExpired:
            logger.warning("pid %d did not close within %.0f s of SIGTERM: killed", child.pid, CLOSE_S)
            child.kill()
            child.wait()
        raise


def only_stops(error: BaseException) -> bool:
    """Whether `error` is a stop: KeyboardInterrupt, or a task group's exception group (anyio's, the embedded tool
    server's) whose every exception is one. A stop raised inside a task arrives wrapped, and a command would
    otherwise end on a traceback instead of exiting 130 as after Ctrl-C."""
    if isinstance(error, BaseExceptionGroup):
        return error.split(KeyboardInterrupt)[1] is None
    return isinstance(error, KeyboardInterrupt)
