"""Image operations on a per-session store: load, crop, zoom, rotate, flip, autocontrast, find and read text.

Images live in an `ImageStore` under the caller's session (one episode), named by short ids like
`img_3f2a9c`. Pixel ops store a NEW image and leave the source alone; the server serves a PNG thumbnail of
any stored image at `/v1/images/{id}`. An id is derived from how its image was made (`derivation`: the loaded
bytes' SHA-256, or the parent id and the canonical request), never drawn at random: a replay of an episode
prefix in a new session sees the same ids, so the same observations byte for byte; episodes of a group making
the same call see the same id, so their calls share anchors for turn credit; and the same photo has the same
id wherever it lies. An image a user or task attached (subagents/handles.py) has that id before its first
turn and is loaded when a call first names it. Ids are 6 hex digits: two different derivations inside one
session may collide, but for a session of 32 images the odds are about 3e-5 (`ImageStore`).

Regions. `find_text` names its regions r1..rk (largest first) within the image it ran on; zoom, crop
and read take `region="r2"` instead of a box, and image_ops grows the region by its height on every side,
clamped to the image (`region_box`): the margin the reader needs, so the policy never does box arithmetic.

Two OCR ops model two ways of looking (subagents/image_text.py): `find_text` says where text is, never what it
says; `read` is the only reader, and sees the image at `reader_side` (384 px) on its long side, so small text
needs a crop or zoom first. On the first 40 shared US plate photos `read` finds 14 plates in the full photo and
30 after a crop to 3x the plate box; on 40 train photos a zoom on the detector's box around the plate, grown by
one box height on every side, reads 32. A read whose text holds a plate-shaped part (conductor/plates.py: "PRCURITIBA
AZJ6991" -> AZJ6991) names it (`plate`, "plate-shaped: AZJ6991" in the observation), so the policy answers what it
saw; a read whose text holds none says "plate-shaped: none", the cue that another region is worth a try (a policy
conditions on a word it sees more easily than on a word that is missing), and names the regions of the image it
came from that nothing has looked at yet ("; not zoomed yet: r2, r3"), so the retry copies a handle it sees.

Decoding is guarded (subagents/pixels.py: a format allowlist checked from the header, byte and pixel caps), and
so is every output (a pixel cap); local paths only under the server's `[files] roots`, URLs only via the
SSRF-safe fetcher. No deadline inside a call: every input is bounded by the caps, and CPU work runs in worker
threads.

`tokens_read`: the text `read` recognised, in `rt.count_tokens`; 0 for pixel ops and `find_text` (no text).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import io
import json
import math
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Annotated, Literal

from PIL import Image, ImageOps
from pydantic import BaseModel, ConfigDict, Field, model_validator

from conductor.plates import plate_shaped
from subagents.common import Runtime, ToolFailure, ToolResponse, guarded, local_file, shown_path
from subagents.handles import MAX_LISTED, content_key, load_derivation, looks_like_handle
from subagents.image_text import TextBox, find_text, read_text
from subagents.llm import LLM
from subagents.pixels import check_pixels, decode, pixel_box, region_box, scaled

NAME = "image_ops"
# Not cached: a call writes into the caller's per-session image store (a load creates an image id, a zoom a new
# one), so a stored answer would name images that do not exist in another caller's session.
CACHEABLE = False
DESCRIPTION = (
    "Work on an image by its id (img_...): crop, zoom, rotate, flip or autocontrast it; find_text locates "
    "text regions (r1, r2, ...), read reads text at low resolution (zoom on a region first); load adds one."
)

Op = Literal["load", "crop", "zoom", "rotate", "flip", "autocontrast", "find_text", "read"]
REGION_OPS = ("zoom", "crop", "read")  # the ops that take `region`
_DATA_URI = re.compile(r"data:image/[\w.+-]+;base64,", re.IGNORECASE)
_WEB_URL = re.compile(r"https?://", re.IGNORECASE)  # schemes are case-insensitive (RFC 3986): HTTP:// too
_SCHEME = re.compile(r"^[a-zA-Z][\w+.-]*:")  # ftp:, file:, javascript: ... anything but a plain path


class Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # strict: "3" is no number (ints for floats pass)
    op: Op
    image: str = Field(min_length=1, description="load: file path, http(s) URL or data URI; else an image id")
    region: str | None = Field(
        default=None,
        pattern=r"^r[1-9][0-9]?$",
        description="zoom, crop, read: a region find_text gave for this image (r1, r2, ...), with a margin",
    )
    box: list[Annotated[float, Field(ge=0, allow_inf_nan=False)]] | None = Field(
        default=None, min_length=4, max_length=4, description="[x0,y0,x1,y1] pixels, or all 0-1 as fractions"
    )
    factor: float = Field(default=3.0, gt=1, le=8, allow_inf_nan=False, description="zoom factor")
    degrees: float = Field(default=90.0, ge=-360, le=360, allow_inf_nan=False, description="anticlockwise")
    direction: Literal["horizontal", "vertical"] = "horizontal"

    @model_validator(mode="after")
    def _box_not_empty(self) -> Request:
        if self.box is not None and (self.box[2] <= self.box[0] or self.box[3] <= self.box[1]):
            raise ValueError(f"box {self.box} is empty: it needs x1 > x0 and y1 > y0")
        if self.region is not None and self.box is not None:
            raise ValueError("give a region or a box, not both")
        if self.region is not None and self.op not in REGION_OPS:
            raise ValueError(f"region is for {', '.join(REGION_OPS)}; {self.op} takes none")
        return self


class Response(ToolResponse):
    op: str = ""
    image_id: str = ""
    width: int = 0
    height: int = 0
    thumbnail_url: str = ""
    text: str = ""
    plate: str = ""
    """read: the plate-shaped part of the text (`conductor.plates.plate_shaped`), "" when it holds none."""
    unzoomed: list[str] = Field(default_factory=list)
    """read without a plate: the regions of the image it looks at (the one a zoom or crop was made from) that
    no zoom, crop or read has looked at yet, in find_text's order: where to try next."""
    boxes: list[TextBox] = Field(default_factory=list)

    def summary(self) -> str:
        head = f"{self.image_id} {self.width}x{self.height}"
        if self.op == "read":
            left = f"; not zoomed yet: {', '.join(self.unzoomed)}" if self.unzoomed and not self.plate else ""
            if not self.text:
                return f"{head} read: no text found (crop or zoom on the text, then read){left}"
            plate = f" plate-shaped: {self.plate or 'none'}"
            return f'{head} read: "{" / ".join(self.text.splitlines())}"{plate}{left}'
        if self.op == "find_text":
            items = "; ".join(b.line() for b in self.boxes)
            return (
                f"{head} {len(self.boxes)} text regions: {items}" if self.boxes else f"{head} no text found"
            )
        return f"{head} ({self.op})"


@dataclass(frozen=True)
class Config:
    max_bytes: int = 20 << 20
    """Largest encoded image accepted (bytes): a 24 MP camera JPEG is ~10 MB."""
    max_input_pixels: int = 50_000_000
    """Largest decoded image (width x height): a 48 MP phone photo; 150 MB as RGB. Also PIL's bomb ceiling."""
    max_output_pixels: int = 16_000_000
    """Largest image zoom or rotate may produce (48 MB as RGB): a 4x zoom of a 1000x1000 crop."""
    max_images_per_session: int = 32
    """Images kept per session; the least recently used goes first. An episode uses a handful."""
    max_sessions: int = 64
    """Sessions kept; the least recently used session is dropped whole. Eight groups of eight episodes."""
    max_total_pixels: int = 200_000_000
    """Pixels kept over all sessions (600 MB as RGB); least recently used images are evicted past it."""
    reader_side: int = 384
    """Longest side `read` sees, like a small vision model's input size: small text needs a zoom first."""
    find_text_top: int = 8
    """Most text boxes `find_text` returns (highest confidence first): keeps the observation short."""
    thumbnail_side: int = 256
    """Longest side of the PNG thumbnails served at /v1/images/{id}."""


def start(cfg: Config, roots: tuple[str, ...]) -> ImageStore:
    """The server's image store: every session's images, bounded as `cfg` says."""
    return ImageStore(cfg)


def check_model(cfg: Config, llm: LLM) -> None:
    """Any model serves: image_ops asks none (OCR reads the text)."""


async def run(request: Request, cfg: Config, rt: Runtime[ImageStore]) -> Response:
    return await guarded(Response, lambda: _run(request, cfg, rt))


async def _run(request: Request, cfg: Config, rt: Runtime[ImageStore]) -> Response:
    """Pixel ops store a new image and describe it; OCR ops describe their source and add the text. `load` of an
    id (`img_...`, an attached image's handle or an image a tool gave) is that image, not a file of that name."""
    image_id = request.image  # what the response describes, unless the op makes a new image
    if request.op == "load" and looks_like_handle(request.image):
        image = await stored(request.image, cfg, rt)
    elif request.op == "load":
        data = await source_bytes(request.image, cfg, rt)
        image = await asyncio.to_thread(
            decode, data, max_bytes=cfg.max_bytes, max_pixels=cfg.max_input_pixels
        )
        image_id = rt.state.put(rt.session, image, load_derivation(content_key(data)))
    else:
        image = await stored(request.image, cfg, rt)
        region = request.region
        if region is not None:  # the tool does the box arithmetic, never the policy
            box = region_box(rt.state.region(rt.session, request.image, region), image.size)
            request = request.model_copy(update={"box": box, "region": None})
        if request.op not in ("find_text", "read"):
            image = await asyncio.to_thread(transform, image, request, cfg)
            image_id = rt.state.put(rt.session, image, derivation(request))
        if region is not None:
            rt.state.looked_at(rt.session, request.image, region, image_id)
    response = Response(op=request.op, image_id=image_id, width=image.width, height=image.height)
    response.thumbnail_url = f"/v1/images/{image_id}"
    if request.op == "read":
        lines = await asyncio.to_thread(read_text, image, request.box, side=cfg.reader_side)
        response.text = "\n".join(lines)
        response.plate = plate_shaped(response.text) or ""
        response.unzoomed = [] if response.plate else rt.state.unzoomed(rt.session, image_id)
        response.tokens_read = rt.count_tokens(response.text)
    elif request.op == "find_text":
        boxes = await asyncio.to_thread(find_text, image, request.box)
        response.boxes = [
            b.model_copy(update={"id": f"r{i}"}) for i, b in enumerate(boxes[: cfg.find_text_top], 1)
        ]
        rt.state.set_regions(rt.session, image_id, [b.box for b in response.boxes])
    response.tokens_returned = rt.count_tokens(response.summary())
    return response


async def stored(image_id: str, cfg: Config, rt: Runtime[ImageStore]) -> Image.Image:
    """The session's image `image_id`; an image attached to the session under that id is loaded on first use
    (its bytes must still be the ones attached). invalid_args naming the session's images, those in the store
    and those attached, otherwise."""
    if rt.state.has(rt.session, image_id):
        return rt.state.get(rt.session, image_id)
    ref = rt.handles.get(rt.session, image_id)
    if ref is None or ref.kind != "image":
        held = list(dict.fromkeys([*rt.state.held(rt.session), *rt.handles.listed(rt.session, "image")]))
        shown = f"images here: {', '.join(held[:MAX_LISTED])}" if held else "use the image id the task gave"
        raise ToolFailure("invalid_args", f"no image {image_id[:40]!r} in this episode; {shown}")
    data = await source_bytes(ref.source, cfg, rt)
    made = load_derivation(content_key(data))
    if derived_id(made) != image_id:
        raise ToolFailure("not_found", f"image {image_id} changed since it was attached")
    image = await asyncio.to_thread(decode, data, max_bytes=cfg.max_bytes, max_pixels=cfg.max_input_pixels)
    rt.state.put(rt.session, image, made)
    return image


def derivation(request: Request) -> str:
    """How a pixel op's image is made, the text its id is hashed from: the parent id and the whole request as
    canonical JSON (sorted keys, compact, defaults filled in, a region replaced by its box), so every field
    that can change the pixels is in it and an omitted default names the same image as an explicit one.
    A load's derivation is its bytes' key (`_run`)."""
    fields = request.model_dump(mode="json", exclude={"region"})  # resolved to its box by now
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return f"{request.image}\n{canonical}"


def derived_id(derivation: str) -> str:
    """`img_` and the first 6 hex digits of the derivation's SHA-1: short, as the policy reads ids."""
    return "img_" + hashlib.sha1(derivation.encode()).hexdigest()[:6]


async def source_bytes(source: str, cfg: Config, rt: Runtime[ImageStore]) -> bytes:
    """The encoded bytes `load` names: a data URI, an http(s) URL (via the fetcher) or a local file."""
    if source[:5].lower() == "data:":
        return data_uri_bytes(source, cfg)
    if _WEB_URL.match(source):
        return (await rt.fetcher.fetch(source)).body  # the fetcher caps the body; decode() caps it again
    if _SCHEME.match(source):
        raise ToolFailure("invalid_args", "load takes a local path, an http(s) URL or a data:image/... URI")
    return await asyncio.to_thread(read_local, source, cfg, rt.roots)


def data_uri_bytes(uri: str, cfg: Config) -> bytes:
    """The payload of `data:image/<type>;base64,<payload>` (the declared type is not trusted)."""
    match = _DATA_URI.match(uri)
    if match is None:
        raise ToolFailure("invalid_args", "a data URI must look like data:image/png;base64,...")
    payload = "".join(uri[match.end() :].split())
    if len(payload) > (cfg.max_bytes + 2) // 3 * 4:
        raise ToolFailure("too_large", f"the uploaded image is over {cfg.max_bytes} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except binascii.Error as exc:
        raise ToolFailure("invalid_args", f"the data URI is not valid base64: {exc}") from None


def read_local(raw: str, cfg: Config, roots: tuple[str, ...]) -> bytes:
    """The bytes of a regular file under `roots` (checked by `local_file`), or a ToolFailure."""
    path, _ = local_file(raw, roots, what="image")
    try:
        with path.open("rb") as file:
            return file.read(cfg.max_bytes + 1)  # one byte more than decode() accepts: it says too_large
    except OSError as exc:  # no read permission, or the file went away since the check
        shown = shown_path(raw, roots)
        raise ToolFailure("invalid_args", f"cannot read image {shown!r}: {exc.strerror}") from None


def transform(image: Image.Image, request: Request, cfg: Config) -> Image.Image:
    """The new image a pixel op makes; the source is never modified."""
    if request.op == "crop":
        if request.box is None:
            raise ToolFailure("invalid_args", "crop needs a box [x0,y0,x1,y1]")
        return image.crop(pixel_box(request.box, image.size))
    if request.op == "zoom":  # the output cap is checked from the box, before any pixel is copied
        left, top, right, bottom = box = pixel_box(request.box, image.size)
        size = (round((right - left) * request.factor), round((bottom - top) * request.factor))
        check_pixels(size, cfg.max_output_pixels, what="the zoomed image")
        return image.crop(box).resize(size, Image.Resampling.LANCZOS)
    if request.op == "rotate":
        cos, sin = abs(math.cos(math.radians(request.degrees))), abs(math.sin(math.radians(request.degrees)))
        size = (round(image.width * cos + image.height * sin), round(image.width * sin + image.height * cos))
        check_pixels(size, cfg.max_output_pixels, what="the rotated image")  # the canvas expand=True makes
        # White corners: rotation mostly straightens scanned documents, whose paper is white.
        return image.rotate(request.degrees, Image.Resampling.BICUBIC, expand=True, fillcolor="white")
    if request.op == "flip":
        return ImageOps.mirror(image) if request.direction == "horizontal" else ImageOps.flip(image)
    if request.op == "autocontrast":
        return ImageOps.autocontrast(image, cutoff=1)  # ignore the 1% extremes: specks and glare
    raise AssertionError(f"transform() got op {request.op!r}")


class ImageStore:
    """Images by (session, id), the id derived from how the image was made (`derived_id`): the same call in
    two sessions gives the same id in each, each session holding its own entry, and (files unchanged) the same
    pixels. Putting an id the session already holds replaces that entry. Two different derivations sharing 6 hex
    digits inside one session would make the later image replace the earlier: for a full session of 32 images
    the odds are 32*31/2 / 16**6, about 3e-5 (1 in 34,000), and sessions never collide with each other.

    Bounded per session, in sessions and in total pixels, evicting the least recently used (`get` and a
    repeated `put` count as use). One lock guards the maps; stored images are never modified, so callers may
    read them after the lock is released."""

    def __init__(self, cfg: Config | None = None) -> None:
        self.cfg = cfg or Config()
        self._lock = threading.Lock()
        # (session, id) -> image, least recently used first
        self._images: OrderedDict[tuple[str, str], Image.Image] = OrderedDict()
        self._sessions: OrderedDict[str, int] = OrderedDict()  # session -> images held; least recent first
        self._regions: dict[tuple[str, str], list[list[int]]] = {}  # (session, id) -> find_text's boxes
        # (session, id) -> its regions a zoom, crop or read looked at, in order
        self._looked: dict[tuple[str, str], list[str]] = {}
        # (session, id of a region's zoom or crop) -> the id of the image it was made from
        self._made_from: dict[tuple[str, str], str] = {}
        self._pixels = 0

    def put(self, session: str, image: Image.Image, derivation: str) -> str:
        """Store `image` for `session` under the id `derivation` gives (replacing the session's entry of that
        id, if any) and return the id, evicting as the bounds require."""
        check_pixels(image.size, self.cfg.max_total_pixels, what="the image to store")
        image_id = derived_id(derivation)
        key = (session, image_id)
        with self._lock:
            old = self._images.pop(key, None)
            if old is not None:  # a refresh: the session keeps its place in the count until re-added below
                self._pixels -= old.width * old.height
                self._sessions[session] -= 1
            if session not in self._sessions and len(self._sessions) >= self.cfg.max_sessions:
                oldest = next(iter(self._sessions))
                for stale in [k for k in self._images if k[0] == oldest]:
                    self._evict(stale)
            if self._sessions.get(session, 0) >= self.cfg.max_images_per_session:
                self._evict(next(k for k in self._images if k[0] == session))
            while self._pixels + image.width * image.height > self.cfg.max_total_pixels:
                self._evict(next(iter(self._images)))
            self._images[key] = image
            self._sessions[session] = self._sessions.get(session, 0) + 1
            self._sessions.move_to_end(session)
            self._pixels += image.width * image.height
        return image_id

    def get(self, session: str, image_id: str) -> Image.Image:
        """The image `image_id` of `session`; invalid_args naming the session's images for unknown, evicted or
        foreign ids."""
        key = (session, image_id)
        with self._lock:
            image = self._images.get(key)
            if image is None:
                held = [i for s, i in reversed(self._images) if s == session][:MAX_LISTED]
                shown = f"images here: {', '.join(held)}" if held else "use the image id the task gave"
                raise ToolFailure("invalid_args", f"no image {image_id[:40]!r} in this episode; {shown}")
            self._images.move_to_end(key)
            self._sessions.move_to_end(session)
            return image

    def held(self, session: str) -> list[str]:
        """The ids of the session's images, most recently used first."""
        with self._lock:
            return [i for s, i in reversed(self._images) if s == session]

    def has(self, session: str, image_id: str) -> bool:
        with self._lock:
            return (session, image_id) in self._images

    def set_regions(self, session: str, image_id: str, boxes: list[list[int]]) -> None:
        """What find_text found on the session's image, r1 first; kept while the image is. New regions
        (find_text within a box) forget which regions were looked at."""
        with self._lock:
            if (session, image_id) in self._images:
                if self._regions.get((session, image_id)) != boxes:
                    self._looked.pop((session, image_id), None)
                self._regions[(session, image_id)] = boxes

    def region(self, session: str, image_id: str, region: str) -> list[int]:
        """The box of `region` (r1, r2, ...) find_text found on the image; invalid_args naming the valid ones."""
        with self._lock:
            boxes = self._regions.get((session, image_id))
        if not boxes:
            raise ToolFailure("invalid_args", f"{image_id} has no regions yet: call find_text on it first")
        index = int(region[1:]) - 1
        if index >= len(boxes):
            valid = f"r1 to r{len(boxes)}" if len(boxes) > 1 else "r1"
            raise ToolFailure("invalid_args", f"{image_id} has no region {region}: find_text gave {valid}")
        return boxes[index]

    def looked_at(self, session: str, image_id: str, region: str, made: str) -> None:
        """A zoom, crop or read looked at `region` of the session's image; `made` is the image it made (the
        image itself for a read)."""
        with self._lock:
            if (session, image_id) in self._regions:
                looked = self._looked.setdefault((session, image_id), [])
                looked.extend([region] if region not in looked else [])
            if made != image_id and (session, made) in self._images:
                self._made_from[(session, made)] = image_id

    def unzoomed(self, session: str, image_id: str) -> list[str]:
        """The regions no zoom, crop or read has looked at yet, in find_text's order, of the image `image_id` was
        made from by a region's zoom or crop (else of `image_id` itself); [] where find_text never ran."""
        with self._lock:
            source = self._made_from.get((session, image_id), image_id)
            count = len(self._regions.get((session, source), []))
            looked = self._looked.get((session, source), [])
        return [f"r{i}" for i in range(1, count + 1) if f"r{i}" not in looked]

    def thumbnail_png(self, image_id: str, *, session: str | None = None) -> bytes | None:
        """A PNG at most `thumbnail_side` px on its longest side; None if unknown. With `session`, only that
        session's image; without, any session's image of that id (the same derivation, so the same pixels)."""
        with self._lock:
            if session is not None:
                image = self._images.get((session, image_id))
            else:  # the most recently used holder
                image = next((img for (_, i), img in reversed(self._images.items()) if i == image_id), None)
        if image is None:
            return None
        side = self.cfg.thumbnail_side
        image = scaled(image, side, Image.Resampling.BILINEAR) if max(image.size) > side else image
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        return buffer.getvalue()

    def _evict(self, key: tuple[str, str]) -> None:
        image = self._images.pop(key)
        self._regions.pop(key, None)
        self._looked.pop(key, None)
        self._made_from.pop(key, None)
        self._pixels -= image.width * image.height
        session = key[0]
        self._sessions[session] -= 1
        if self._sessions[session] == 0:
            del self._sessions[session]
