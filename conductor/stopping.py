"""A long command told to stop closes what it opened, whichever signal told it.

    stop_like_ctrl_c()            at an entry point: SIGTERM (`kill`, a scheduler, a session's end) raises
                                  KeyboardInterrupt as Ctrl-C does
    raise_if_stopped()            after a library call that swallows KeyboardInterrupt (vLLM's engine start)
    wait_or_stop(child)           a child command's exit code; stopped as the parent is, with time to close

Python dies at once on SIGTERM: no `finally` runs, so a vLLM engine's core process, the Ray cluster a command
started or a tool server's page fetchers outlive it. Ctrl-C instead raises KeyboardInterrupt, and asyncio.run
cancels every task and lets each close (a policy's `aclose`, `async with` blocks). A command that runs another
(the studies run `conductor` as a user does) passes the stop on and waits for it to close before it goes.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import threading

logger = logging.getLogger(__name__)

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


def raise_if_stopped() -> None:
    """KeyboardInterrupt if a SIGTERM came and was swallowed: vLLM's engine start-up catches KeyboardInterrupt
    in its handshake (vllm.utils.network_utils.zmq_socket_ctx), and a command stopped then went on training."""
    if STOPPED.is_set():
        raise KeyboardInterrupt


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
