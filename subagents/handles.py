"""Handles: the short names the policy uses for what it has seen, never paths or long URLs it would copy.

A small policy copies badly: given `file:///home/.../examples/corpus/smollm2.html` it writes another host, and
given a box it gets the arithmetic wrong. So every thing a tool shows that the policy may act on later carries a
short handle, and every tool that takes such a thing accepts the handle:

    kind    handle         shown by                          taken by
    page    d_3fa9c1       search hits, attached pages       page_qa(url=...)
    video   v_91c2e0       attached clips                    video_summary(video=...)
    image   img_8bf8dd     attached images, image_ops ops    image_ops(image=...)  (the image store's own ids)
    region  r1 .. rk       find_text, within its image       image_ops zoom/crop/read(region=...)

A handle is derived from a stable `key`, never drawn at random (`handle_for`): a page's key is its URL or its
path inside a corpus, a file's key is its content (`file_key`). So group episodes, exact replays and the result
cache see the same handles, and two checkouts at different paths show the policy the same prompt.

`Handles` (part of every call's Runtime, subagents/common.py) is the server's table of what each session (one
episode) has been shown: search registers its hits, a client registers what a user or a task attached
(`POST /v1/attach`) before the first turn. A handle resolves
only in the session that was shown it; anything else is an `invalid_args` failure listing the valid ones.

Handles are 6 hex digits (24 bits): two keys in one session share a handle with odds of about n^2 / 3.4e7 for n
things shown (a session of 50 hits: 1 in 13,000); the later registration then wins, except that `POST /v1/attach`
refuses two such keys in one call (422: the caller can pick another key). Across sessions handles
never mix, and the result cache is keyed by what a handle resolves to, not by the handle.
"""

from __future__ import annotations

import hashlib
import re
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from subagents.errors import ToolFailure

HandleKind = Literal["page", "video", "image"]
PREFIX: dict[str, str] = {"page": "d_", "video": "v_", "image": "img_"}
HANDLE = re.compile(r"^(d|v|img)_[0-9a-f]{6}$")
# What a policy meant as a handle, even miscopied (a digit short or long): no URL or path starts like this, so
# such a value is answered with the valid handles rather than as a malformed URL.
MEANT_AS_HANDLE = re.compile(r"^(d|v|img)_[0-9A-Za-z]{0,16}$")


def handle_for(kind: HandleKind, key: str) -> str:
    """The handle of the `kind` thing with this stable key: its prefix and 6 hex digits of sha1 of the key,
    for an image of its `load_derivation` (so an attached photo has the id image_ops gives it when loaded)."""
    text = load_derivation(key) if kind == "image" else key
    return PREFIX[kind] + hashlib.sha1(text.encode()).hexdigest()[:6]


def load_derivation(key: str) -> str:
    """How image_ops names a loaded image: from its bytes' key, whatever path or URL it came from."""
    return f"load\n{key}"


def content_key(data: bytes) -> str:
    """The key of a file or upload by its bytes: the same photo or clip has the same handle wherever it lies."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def file_key(path: Path) -> str:
    """`content_key` of a file, read in 1 MiB blocks (clips are tens of MB)."""
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return "sha256:" + digest.hexdigest()


def looks_like_handle(value: str) -> bool:
    """Whether `value` was meant as a handle (`MEANT_AS_HANDLE`): resolved, or refused naming the valid ones."""
    return MEANT_AS_HANDLE.match(value) is not None


@dataclass(frozen=True)
class Attachment:
    """Something a user or a task hands the policy before its first turn: its kind, where the tool opens it
    (a page's http(s) or file:// URL; a video's or image's path under the server's files roots), the stable
    key its handle derives from, and a label shown beside the handle (a page title; "" for media)."""

    kind: HandleKind
    source: str
    key: str
    label: str = ""

    @property
    def handle(self) -> str:
        return handle_for(self.kind, self.key)

    @property
    def line(self) -> str:
        """How the prompt lists it: `Page: d_3fa9c1 SmolLM2`, `Image: img_8bf8dd`, `Video: v_91c2e0`."""
        noun = {"page": "Page", "video": "Video", "image": "Image"}[self.kind]
        return f"{noun}: {self.handle}" + (f" {self.label}" if self.label else "")


# ---------------------------------------------------------------- the table of what each session was shown
MAX_LISTED = 8  # valid handles named in an invalid_args message: enough to pick from, short to read


@dataclass(frozen=True)
class Ref:
    """What a handle stands for: its kind, what the tool opens (a URL or a path under the files roots) and a
    short label for listings (a title or a file name; never a path)."""

    kind: HandleKind
    source: str
    label: str = ""


# What one entry of the handle table costs beyond its strings: the Ref, the table's slot and links (measured with
# tracemalloc on CPython 3.11: ~160 bytes; rounded up).
HANDLE_ENTRY_BYTES = 256


class Handles:
    """handle -> Ref per session, bounded like the image store: at most `max_per_session` handles per session,
    `max_sessions` sessions and `max_bytes` in all (strings included), the least recently used first out: a
    registration, `resolve` and `get` count as use of the handle's session. One lock guards the maps."""

    def __init__(
        self, *, max_per_session: int = 256, max_sessions: int = 256, max_bytes: int = 32 << 20
    ) -> None:
        # 256 per session: a 100-call episode of 5-hit searches shows ~500 hits, but reads a few of the recent.
        # 256 sessions: 64 concurrent episodes (the image store's bound) with room for finished ones' replays.
        # 32 MiB: 64 sessions of 256 search hits (~400 bytes each with a corpus URL) take 6.5 MB; the count bounds
        # alone let 2 KB sources take 150 MB, and an attacker's 4 KB ones 2 GB.
        self.max_per_session = max_per_session
        self.max_sessions = max_sessions
        self.max_bytes = max_bytes
        self.bytes = 0
        """What the table holds now, by `entry_bytes`."""
        self._lock = threading.Lock()
        self._sessions: OrderedDict[str, OrderedDict[str, Ref]] = OrderedDict()

    def add(self, session: str, handle: str, ref: Ref) -> None:
        """Register `handle` for `ref` in `session` (a later registration of the same handle replaces it)."""
        with self._lock:
            table = self._sessions.get(session)
            if table is None:
                if len(self._sessions) >= self.max_sessions:
                    self._drop_session()
                table = self._sessions[session] = OrderedDict()
            self._sessions.move_to_end(session)
            old = table.pop(handle, None)
            self.bytes -= 0 if old is None else entry_bytes(handle, old)
            table[handle] = ref
            self.bytes += entry_bytes(handle, ref)
            if len(table) > self.max_per_session:
                self._drop_entry(table)
            while (
                self.bytes > self.max_bytes
            ):  # other sessions first; a session alone past it loses its oldest
                self._drop_session() if len(self._sessions) > 1 else self._drop_entry(table)

    def resolve(self, session: str, handle: str, kind: HandleKind) -> Ref:
        """The Ref of `handle` in `session`; invalid_args naming the valid handles of `kind` for anything else."""
        with self._lock:
            table = self._sessions.get(session, OrderedDict())
            ref = table.get(handle)
            if ref is not None and ref.kind == kind:
                table.move_to_end(handle)
                self._sessions.move_to_end(session)
                return ref
            valid = _of_kind(table, kind)
        raise ToolFailure("invalid_args", unknown_message(handle[:40], kind, valid))

    def get(self, session: str, handle: str) -> Ref | None:
        """The Ref of `handle` in `session`, or None (no error: for callers that fall back to another store)."""
        with self._lock:
            ref = self._sessions.get(session, OrderedDict()).get(handle)
            if ref is not None:
                self._sessions.move_to_end(session)
            return ref

    def listed(self, session: str, kind: HandleKind) -> list[str]:
        """The session's handles of `kind`, most recently registered or used first, at most MAX_LISTED."""
        with self._lock:
            return _of_kind(self._sessions.get(session, OrderedDict()), kind)

    def _drop_session(self) -> None:
        """Forget the least recently used session (call with the lock held)."""
        _, table = self._sessions.popitem(last=False)
        self.bytes -= sum(entry_bytes(handle, ref) for handle, ref in table.items())

    def _drop_entry(self, table: OrderedDict[str, Ref]) -> None:
        """Forget the least recently used handle of `table` (call with the lock held)."""
        handle, ref = table.popitem(last=False)
        self.bytes -= entry_bytes(handle, ref)


def entry_bytes(handle: str, ref: Ref) -> int:
    """What one handle of the table costs: its strings as Python holds them, plus HANDLE_ENTRY_BYTES."""
    strings = (handle, ref.source, ref.label)
    return sum(map(sys.getsizeof, strings)) + HANDLE_ENTRY_BYTES


def _of_kind(table: OrderedDict[str, Ref], kind: HandleKind) -> list[str]:
    """A session's handles of `kind`, most recent first, at most MAX_LISTED (call with the lock held)."""
    return [h for h, r in reversed(table.items()) if r.kind == kind][:MAX_LISTED]


def unknown_message(handle: str, kind: HandleKind, valid: list[str]) -> str:
    """`no page d_000000 in this episode; pages shown: d_3fa9c1, d_77aa01` (or how to get one)."""
    if valid:
        return f"no {kind} {handle!r} in this episode; {kind}s shown: {', '.join(valid)}"
    how = {"page": "search first, or use a page listed in the task", "video": "use the video listed in the task",
           "image": "use an image id a tool returned"}[kind]  # fmt: skip
    return f"no {kind} {handle!r} in this episode: {how}"
