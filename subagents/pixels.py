"""Pixels, safely: decoding an image under byte and pixel caps, boxes in whole pixels, resizing (image_ops and the
text finder and reader, subagents/image_text.py), and the process's budget of pixels being worked on.

Decoding is guarded: a format allowlist checked from the header before decoding, byte and pixel caps (PIL's bomb
warning raised as an error too), truncated files refused, EXIF orientation applied. Every refusal is a
ToolFailure the policy reads.

The image store bounds the pixels that stay (subagents/image_store.py); `WORKING` bounds the pixels passing
through: images being decoded or made and the copies OCR takes of them. Without it 8 clients running find_text
on 7000x7000 PNGs at once took a server from 3.5 to 5.55 GB, and 4.8 GB stayed: the copies of every call in
flight at once, and heap pages glibc kept after they were freed. So image work waits for room in the budget (or
is refused as `overloaded`), and once no image work is in flight the freed pages go back to the system
(conductor/heap.py).
"""

from __future__ import annotations

import io
import logging
import math
import struct
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

from PIL import Image, ImageOps, UnidentifiedImageError

from conductor.heap import trim_heap
from subagents.common import ToolFailure

logger = logging.getLogger(__name__)

ALLOWED_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")  # for GIF and TIFF only frame 0 is read


def decode(data: bytes, *, max_bytes: int, max_pixels: int) -> Image.Image:
    """RGB pixels of an allowed format with EXIF orientation applied, at most `max_bytes` encoded and `max_pixels`
    decoded; ToolFailure for anything refused."""
    if len(data) > max_bytes:
        raise ToolFailure("too_large", f"the image is {len(data)} bytes, over {max_bytes}")
    Image.MAX_IMAGE_PIXELS = max_pixels  # process-wide, but a server runs one image_ops Config
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data), formats=ALLOWED_FORMATS) as img:
                # `formats=` already refuses others; MPO is a camera JPEG with a second picture (read frame 0)
                if img.format not in (*ALLOWED_FORMATS, "MPO"):
                    raise ToolFailure("unsupported_media", f"{img.format} images are not accepted")
                check_pixels(img.size, max_pixels, what="the image")
                with WORKING.hold(img.width * img.height):
                    return _rgb(img)
    except (Image.DecompressionBombWarning, Image.DecompressionBombError) as exc:
        raise ToolFailure("too_large", f"the image has too many pixels: {exc}") from None
    except UnidentifiedImageError:
        raise ToolFailure("unsupported_media", f"not an image in one of {ALLOWED_FORMATS}") from None
    except (OSError, SyntaxError, ValueError, EOFError, struct.error) as exc:  # truncated or corrupt data
        raise ToolFailure("unsupported_media", f"the image cannot be decoded: {exc}") from None


def _rgb(img: Image.Image) -> Image.Image:
    """The opened image's first frame as RGB, upright. Two copies of the pixels at most, the decoded one closed
    (freed) before returning, inside the caller's hold of the working budget."""
    try:
        img.load()  # a GIF or TIFF loads its first frame
        ImageOps.exif_transpose(img, in_place=True)  # in place: no third copy
        return img.convert("RGB")
    finally:
        img.close()


def area(size: tuple[int, int]) -> int:
    """Pixels in an image of `size` (width, height)."""
    return size[0] * size[1]


def check_pixels(size: tuple[int, int], limit: int, *, what: str) -> None:
    if size[0] * size[1] > limit:
        raise ToolFailure("too_large", f"{what} would be {size[0]}x{size[1]}, over {limit} pixels")


def pixel_box(box: list[float] | None, size: tuple[int, int]) -> tuple[int, int, int, int]:
    """`box` in whole pixels (fractions when every value is at most 1); the whole image when None."""
    width, height = size
    if box is None:
        return (0, 0, width, height)
    if len(box) != 4 or not all(map(math.isfinite, box)) or min(box) < 0:
        raise ToolFailure("invalid_args", f"box {box} must be 4 finite numbers >= 0: [x0,y0,x1,y1]")
    x0, y0, x1, y1 = box
    if max(box) <= 1:
        x0, y0, x1, y1 = x0 * width, y0 * height, x1 * width, y1 * height
    if x1 > width or y1 > height:
        raise ToolFailure("invalid_args", f"box {box} is not inside the {width}x{height} image")
    left, top, right, bottom = math.floor(x0), math.floor(y0), math.ceil(x1), math.ceil(y1)
    if right <= left or bottom <= top:
        raise ToolFailure("invalid_args", f"box {box} is empty: it needs x1 > x0 and y1 > y0")
    return (left, top, right, bottom)


def region_box(box: list[int], size: tuple[int, int]) -> list[int]:
    """A found region [x0, y0, x1, y1] grown by its height on every side, inside the `size` image: the margin
    the reader needs (on 40 train plate photos a tight box read 15 plates, this one 32)."""
    width, height = size
    pad = box[3] - box[1]
    x0, y0 = max(0, box[0] - pad), max(0, box[1] - pad)
    return [x0, y0, max(x0 + 1, min(width, box[2] + pad)), max(y0 + 1, min(height, box[3] + pad))]


def scaled(image: Image.Image, side: int, resample: Image.Resampling) -> Image.Image:
    """`image` resized (up or down) so that its longest side is `side` pixels."""
    scale = side / max(image.size)
    size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
    return image.resize(size, resample)


# Pixels image work may hold at once over the whole process: every image being decoded, made by a pixel op, or
# looked at by find_text or read (Pillow keeps RGB in 4 bytes a pixel, and an op makes one or two copies). 64 Mpx
# lets one image at image_ops' 50 Mpx input cap through at a time, or dozens of ordinary 1-3 Mpx photos at once:
# measured on a 7000x7000 PNG (49 Mpx), a decode peaks at +370 MB and a find_text at +840 MB (the text detector's
# own ~780 MB at its 2000 px side, one pass at a time: subagents/ocr.py). The price is time: 8 clients'
# find_text on such PNGs at once (benchmarks/perf/image_memory.py) peaked at 2.4-2.5 GB in 45-53 s, against
# 2.6 GB in 31 s with a budget the image pool's 2 threads never reach (two large images at once), 2 shared cores.
WORKING_PIXELS = 64_000_000
# Longest wait for room in the budget before `overloaded` (retryable): a 49 Mpx find_text takes ~5 s alone on 2
# cores, so a call that waited 30 s is behind several of them and does better to retry than to wait on; it stays
# well inside the tool's 150 s call deadline, so the caller reads why.
WORKING_WAIT_S = 30.0
# Pixels of image work (or of images the store evicted) after which freed heap pages are handed back once no image
# work is in flight: a trim costs ~1 ms, the pages it frees are faulted in again by the next large image, so small
# photos' ops (1-3 Mpx) trim every few calls and one large image's work is trimmed when it ends.
TRIM_AFTER_PIXELS = 16_000_000


class PixelBudget:
    """Pixels of image work in flight over the process, at most `limit` (one image larger than `limit` runs alone).
    A thread waits up to `wait_s` for room, then gets ToolFailure("overloaded"). When the last hold ends and at
    least `trim_after` pixels were worked on or freed since, the heap is trimmed (conductor/heap.py): glibc keeps
    freed pages of its heaps otherwise, and after a burst of large images those are gigabytes."""

    def __init__(self, limit: int, *, wait_s: float, trim_after: int) -> None:
        self.limit, self.wait_s, self.trim_after = limit, wait_s, trim_after
        self._room = threading.Condition()
        self.in_flight = 0
        """Pixels held now."""
        self._untrimmed = 0  # pixels worked on or freed since the last trim

    @contextmanager
    def hold(self, pixels: int) -> Iterator[None]:
        """Hold `pixels` of the budget while the block runs (blocking: call it in a worker thread)."""
        with self._room:
            if not self._room.wait_for(lambda: self._fits(pixels), timeout=self.wait_s):
                raise ToolFailure("overloaded", self._busy_message(pixels))
            self.in_flight += pixels
        try:
            yield
        finally:
            with self._room:
                self.in_flight -= pixels
                self._untrimmed += pixels
                self._room.notify_all()
            self._trim_when_idle()

    def freed(self, pixels: int) -> None:
        """`pixels` were freed outside a hold (the store evicted images): trimmed now if no image work is in
        flight, else when it ends."""
        with self._room:
            self._untrimmed += pixels
        self._trim_when_idle()

    def _fits(self, pixels: int) -> bool:
        return self.in_flight == 0 or self.in_flight + pixels <= self.limit

    def _busy_message(self, pixels: int) -> str:
        return (
            f"the server is busy with other large images ({self.in_flight / 1e6:.0f} of {self.limit / 1e6:.0f} "
            f"Mpx in work; this one is {pixels / 1e6:.1f} Mpx): retry in a few seconds"
        )

    def _trim_when_idle(self) -> None:
        with self._room:
            if self.in_flight or self._untrimmed < self.trim_after:
                return
            self._untrimmed = 0
        trim_heap()
        logger.debug("image work idle: freed heap pages returned to the system")


WORKING = PixelBudget(WORKING_PIXELS, wait_s=WORKING_WAIT_S, trim_after=TRIM_AFTER_PIXELS)
"""The process's one budget of pixels in work (image_ops' decodes, pixel ops, find_text and read)."""
