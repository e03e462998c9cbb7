"""What every HTTP client of the project reads from a reply's headers the same way: numbers and the wait asked for.

The tool client (tool_server/client.py) and the OpenAI-compatible reader (subagents/openai_llm.py) both honour a
reply's Retry-After; a header is untrusted input, so a value that is no plain number counts as absent, never as
an error: `str.isdigit()` accepts "²" and other Unicode digits that `float()` refuses, and a `Retry-After: ²`
from a reader was an HTTP 500 of the tool server.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

# A number in a header (Retry-After, retry-after-ms, Content-Length): ASCII digits, an optional ASCII fraction.
_ASCII_NUMBER = re.compile(r"[0-9]+(?:\.[0-9]+)?")


def header_number(value: str) -> float | None:
    """A header's non-negative decimal number, or None for anything else (treated as absent)."""
    if _ASCII_NUMBER.fullmatch(value.strip()) is None:
        return None
    return float(value)  # past 1e308: inf, which every caller's own cap bounds


def retry_after(headers: Mapping[str, str]) -> float | None:
    """The wait a reply asks for, in seconds: `retry-after-ms` (OpenAI's) or `Retry-After` in seconds. An HTTP
    date, or anything that is no plain number, is None: the caller's backoff then."""
    for name, scale in (("retry-after-ms", 0.001), ("retry-after", 1.0)):
        value = header_number(headers.get(name, ""))
        if value is not None:
            return value * scale
    return None
