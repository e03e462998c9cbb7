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
SSRF-safe fetcher. CPU work runs in the image worker threads (subagents/workers.py: a small pool of its own,
refusing as `overloaded` when full), each op holding its pixels in the process's working budget while it runs
(subagents/pixels.py: `WORKING`), so that neither the threads nor the memory of image work grow with the number of
callers, and a call whose deadline passed frees its thread within the caps' bound.

`tokens_read`: the text `read` recognised, in `rt.count_tokens`; 0 for pixel ops and `find_text` (no text).
"""

from __future__ import annotations

import base64
import binascii
import functools
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Literal, TypeVar

from PIL import Image, ImageOps
from pydantic import BaseModel, ConfigDict, Field, model_validator

from conductor.plates import plate_shaped
from subagents import workers
from subagents.common import Runtime, ToolFailure, ToolResponse, guarded, local_file, shown_path
from subagents.handles import content_key, load_derivation, looks_like_handle
from subagents.image_store import ImageStore, derived_id
from subagents.image_text import TextBox, find_text, read_text
from subagents.llm import LLM
from subagents.pixels import WORKING, area, check_pixels, decode, pixel_box, region_box

T = TypeVar("T")

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
    """Largest decoded image (width x height): a 48 MP phone photo; 200 MB as Pillow keeps RGB (4 bytes a
    pixel). Also PIL's bomb ceiling."""
    max_output_pixels: int = 16_000_000
    """Largest image zoom or rotate may produce (64 MB as RGB): a 4x zoom of a 1000x1000 crop."""
    max_images_per_session: int = 32
    """Images whose pixels a session keeps; the least recently used go first (and are made again from their
    recipe when named: subagents/image_store.py). An episode on one photo uses a handful."""
    max_sessions: int = 64
    """Sessions whose pixels are kept; the least recently used session's go whole. Eight groups of eight."""
    max_total_pixels: int = 200_000_000
    """Pixels kept over all sessions (800 MB: Pillow keeps RGB in 4 bytes a pixel); least recently used images are
    evicted past it. 64 audit episodes reach it (a zoom of a plate is ~9 MP): an evicted image is made again,
    never refused. Pixels in work beside it are bounded apart (subagents/pixels.py: WORKING_PIXELS)."""
    max_recipes: int = 512
    """Images a session can name (each kept as its ~300-byte recipe): a 32-photo audit makes ~100."""
    max_known_sessions: int = 256
    """Sessions whose images can be made again, as many as the handle table keeps (its photos' sources): at
    most 256 x 512 recipes, ~40 MB, in the worst case."""
    max_recipe_chars: int = 4096
    """Longest load source kept as a recipe: a path or URL is; a data URI (up to ~27 MB) is not, so an image
    uploaded inline whose pixels were evicted is unknown until it is loaded again."""
    reader_side: int = 384
    """Longest side `read` sees, like a small vision model's input size: small text needs a zoom first."""
    find_text_top: int = 8
    """Most text boxes `find_text` returns (highest confidence first): keeps the observation short."""
    thumbnail_side: int = 256
    """Longest side of the PNG thumbnails served at /v1/images/{id}."""


def start(cfg: Config, roots: tuple[str, ...]) -> ImageStore:
    """The server's image store: every session's images, bounded as `cfg` says."""
    return image_store(cfg)


def image_store(cfg: Config) -> ImageStore:
    return ImageStore(
        max_images_per_session=cfg.max_images_per_session, max_sessions=cfg.max_sessions,
        max_total_pixels=cfg.max_total_pixels, max_recipes=cfg.max_recipes,
        max_known_sessions=cfg.max_known_sessions, thumbnail_side=cfg.thumbnail_side,
    )  # fmt: skip


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
        image = await decoded(data, cfg)
        recipe = request.model_dump_json() if len(request.image) <= cfg.max_recipe_chars else None
        image_id = rt.state.put(rt.session, image, load_derivation(content_key(data)), recipe)
    else:
        image = await stored(request.image, cfg, rt)
        region = request.region
        if region is not None:  # the tool does the box arithmetic, never the policy
            box = region_box(rt.state.region(rt.session, request.image, region), image.size)
            request = request.model_copy(update={"box": box, "region": None})
        if request.op not in ("find_text", "read"):
            image = await made(image, request, cfg)
            image_id = rt.state.put(rt.session, image, derivation(request), request.model_dump_json())
        if region is not None:
            rt.state.looked_at(rt.session, request.image, region, image_id)
    response = Response(op=request.op, image_id=image_id, width=image.width, height=image.height)
    response.thumbnail_url = f"/v1/images/{image_id}"
    if request.op == "read":
        reader = functools.partial(read_text, side=cfg.reader_side)
        lines = await in_work(area(image.size), reader, image, request.box)
        response.text = "\n".join(lines)
        response.plate = plate_shaped(response.text) or ""
        response.unzoomed = [] if response.plate else rt.state.unzoomed(rt.session, image_id)
        response.tokens_read = rt.count_tokens(response.text)
    elif request.op == "find_text":
        boxes = await in_work(area(image.size), find_text, image, request.box)
        response.boxes = [
            b.model_copy(update={"id": f"r{i}"}) for i, b in enumerate(boxes[: cfg.find_text_top], 1)
        ]
        rt.state.set_regions(rt.session, image_id, [b.box for b in response.boxes])
    response.tokens_returned = rt.count_tokens(response.summary())
    return response


async def stored(image_id: str, cfg: Config, rt: Runtime[ImageStore]) -> Image.Image:
    """The session's image `image_id`: its pixels if the store holds them, else made again from its recipe, from
    the nearest image up its chain still held or attached (iteratively: a chain may be hundreds of flips long).
    invalid_args naming the session's images for an id it does not know (not_found if it was evicted with the
    session: `attached`)."""
    chain: list[Request] = []  # the recipes from image_id up to that image, image_id's first
    current = image_id
    for _ in range(cfg.max_recipes + 1):  # a chain is at most a session's recipes long
        image = rt.state.pixels(rt.session, current, use=current == image_id)
        if image is not None:
            break
        recipe = rt.state.recipe(rt.session, current)
        if recipe is None:
            image = await attached(current, cfg, rt, use=not chain)
            break
        request = Request.model_validate_json(recipe)
        if request.op == "load":
            changed = "changed at its source since it was loaded: load it again"
            image = await loaded_again(
                current, request.image, cfg, rt, recipe=recipe, changed=changed, use=not chain
            )
            break
        chain.append(request)
        current = request.image
    else:
        raise ToolFailure("internal", f"the recipe of {image_id} is a chain longer than {cfg.max_recipes}")
    for k, request in reversed(list(enumerate(chain))):  # only image_id's own (k = 0) is the call's use
        image = await made(image, request, cfg)
        rt.state.put(rt.session, image, derivation(request), request.model_dump_json(), use=k == 0)
    return image


async def attached(image_id: str, cfg: Config, rt: Runtime[ImageStore], *, use: bool = True) -> Image.Image:
    """An image attached to the session under `image_id`, loaded (its bytes must still be the ones attached);
    otherwise not_found if it was evicted with the session, else invalid_args naming the session's images, those
    in the store and those attached (`ImageStore.unknown`)."""
    ref = rt.handles.get(rt.session, image_id)
    if ref is None or ref.kind != "image":
        raise rt.state.unknown(rt.session, image_id, also=rt.handles.listed(rt.session, "image"))
    return await loaded_again(
        image_id, ref.source, cfg, rt, recipe=None, changed="changed since it was attached", use=use
    )


async def loaded_again(
    image_id: str,
    source: str,
    cfg: Config,
    rt: Runtime[ImageStore],
    *,
    recipe: str | None,
    changed: str,
    use: bool = True,
) -> Image.Image:
    """The image `image_id` loaded from `source` (an attachment's, or a load's path or URL) into the store;
    not_found saying it `changed`, never other pixels under the id, if its bytes are not the ones it was made of."""
    data = await source_bytes(source, cfg, rt)
    made = load_derivation(content_key(data))
    if derived_id(made) != image_id:
        raise ToolFailure("not_found", f"image {image_id} {changed}")
    image = await decoded(data, cfg)
    rt.state.put(rt.session, image, made, recipe, use=use)  # use=False: the root of another image's re-make
    return image


def derivation(request: Request) -> str:
    """How a pixel op's image is made, the text its id is hashed from: the parent id and the whole request as
    canonical JSON (sorted keys, compact, defaults filled in, a region replaced by its box), so every field
    that can change the pixels is in it and an omitted default names the same image as an explicit one.
    A load's derivation is its bytes' key (`_run`)."""
    fields = request.model_dump(mode="json", exclude={"region"})  # resolved to its box by now
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return f"{request.image}\n{canonical}"


async def source_bytes(source: str, cfg: Config, rt: Runtime[ImageStore]) -> bytes:
    """The encoded bytes `load` names: a data URI, an http(s) URL (via the fetcher) or a local file."""
    if source[:5].lower() == "data:":
        return data_uri_bytes(source, cfg)
    if _WEB_URL.match(source):
        return (await rt.fetcher.fetch(source)).body  # the fetcher caps the body; decode() caps it again
    if _SCHEME.match(source):
        raise ToolFailure("invalid_args", "load takes a local path, an http(s) URL or a data:image/... URI")
    return await workers.run("images", read_local, source, cfg, rt.roots)


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


async def decoded(data: bytes, cfg: Config) -> Image.Image:
    """`data` decoded in an image worker thread under the caps, holding its pixels in the working budget."""
    decode_capped = functools.partial(decode, max_bytes=cfg.max_bytes, max_pixels=cfg.max_input_pixels)
    return await workers.run("images", decode_capped, data)


async def made(image: Image.Image, request: Request, cfg: Config) -> Image.Image:
    """The image a pixel op makes, in an image worker thread holding its source's and its own pixels; too_large
    before any of it is held or copied when it would be over the output cap."""
    size = made_size(request, image.size, cfg)
    return await in_work(area(image.size) + area(size), transform, image, request, size)


async def in_work(pixels: int, fn: Callable[..., T], *args: object) -> T:
    """`fn(*args)` in an image worker thread (subagents/workers.py), holding `pixels` of the process's working
    budget while it runs (subagents/pixels.py)."""
    return await workers.run("images", _held, pixels, fn, *args)


def _held(pixels: int, fn: Callable[..., T], *args: object) -> T:
    with WORKING.hold(pixels):
        return fn(*args)


def made_size(request: Request, size: tuple[int, int], cfg: Config) -> tuple[int, int]:
    """The size of the image a pixel op makes from a `size` image, known before any pixel is copied;
    too_large past `max_output_pixels` for zoom and rotate (crop, flip and autocontrast never grow an image)."""
    if request.op == "crop" and request.box is None:
        raise ToolFailure("invalid_args", "crop needs a box [x0,y0,x1,y1]")
    if request.op not in ("crop", "zoom", "rotate"):
        return size
    if request.op == "rotate":  # the canvas expand=True makes
        cos, sin = abs(math.cos(math.radians(request.degrees))), abs(math.sin(math.radians(request.degrees)))
        out = (round(size[0] * cos + size[1] * sin), round(size[0] * sin + size[1] * cos))
        check_pixels(out, cfg.max_output_pixels, what="the rotated image")
        return out
    left, top, right, bottom = pixel_box(request.box, size)
    factor = request.factor if request.op == "zoom" else 1
    out = (round((right - left) * factor), round((bottom - top) * factor))
    if request.op == "zoom":
        check_pixels(out, cfg.max_output_pixels, what="the zoomed image")
    return out


def transform(image: Image.Image, request: Request, size: tuple[int, int]) -> Image.Image:
    """The new image a pixel op makes, of `size` (`made_size`); the source is never modified."""
    if request.op == "crop":
        return image.crop(pixel_box(request.box, image.size))
    if request.op == "zoom":
        return image.crop(pixel_box(request.box, image.size)).resize(size, Image.Resampling.LANCZOS)
    if request.op == "rotate":  # white corners: rotation mostly straightens scanned documents (white paper)
        return image.rotate(request.degrees, Image.Resampling.BICUBIC, expand=True, fillcolor="white")
    if request.op == "flip":
        return ImageOps.mirror(image) if request.direction == "horizontal" else ImageOps.flip(image)
    if request.op == "autocontrast":
        return ImageOps.autocontrast(image, cutoff=1)  # ignore the 1% extremes: specks and glare
    raise AssertionError(f"transform() got op {request.op!r}")
