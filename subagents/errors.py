"""How a sub-agent says that a call did not produce a result: a `ToolError` of one `ErrorKind`, raised inside its
helpers as a `ToolFailure` and returned in its response (subagents/common.py: `fail`, `guarded`).

Its own module, below the contract (subagents/common.py) and the handle table (subagents/handles.py), which both
raise it; sub-agents import it from the contract with the rest. Imports nothing else of the project.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

ErrorKind = Literal[
    "invalid_args",  # the caller's arguments are wrong: the policy can fix them
    "blocked_url",  # the SSRF guard refused the URL
    "fetch_failed",  # the remote answered badly or not at all
    "too_large",  # a body, image or video exceeded a cap
    "timeout",  # a deadline ran out
    "unsupported_media",  # a format we refuse to decode (EPS, broken files, no video stream ...)
    "backend_error",  # the model behind the sub-agent failed (refused connection, 5xx, context length ...)
    "not_found",  # an id, file or page that does not exist
    "overloaded",  # the per-tool concurrency cap and queue deadline were hit
    "internal",  # a bug in the tool server or a sub-agent (logged server-side with its traceback)
]

# The kinds a caller may retry unchanged: the outside world may behave differently next time.
RETRYABLE_KINDS: frozenset[str] = frozenset({"fetch_failed", "timeout", "backend_error", "overloaded"})


class ToolError(BaseModel):
    """Why a call did not produce a result, in a form the policy can read and the trainer can count."""

    model_config = ConfigDict(frozen=True)
    kind: ErrorKind
    message: str
    retryable: bool = False


class ToolFailure(Exception):
    """Raised inside a sub-agent's helpers and turned into `ToolError` at the top of its `run`."""

    def __init__(self, kind: ErrorKind, message: str, *, retryable: bool | None = None) -> None:
        super().__init__(f"{kind}: {message}")
        self.error = ToolError(
            kind=kind, message=message, retryable=kind in RETRYABLE_KINDS if retryable is None else retryable
        )
