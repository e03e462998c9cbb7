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

`Handles` (subagents/common.py, part of every call's Runtime) is the server's table of what each session (one episode) has been shown: search registers its hits,
a client registers what a user or a task attached (`POST /v1/attach`) before the first turn. A handle resolves
only in the session that was shown it; anything else is an `invalid_args` failure listing the valid ones.

Handles are 6 hex digits (24 bits): two keys in one session share a handle with odds of about n^2 / 3.4e7 for n
things shown (a session of 50 hits: 1 in 13,000); the later registration then wins, except that `POST /v1/attach`
refuses two such keys in one call (422: the caller can pick another key). Across sessions handles
never mix, and the result cache is keyed by what a handle resolves to, not by the handle.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from subagents.common import HandleKind

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
