"""Pixels, safely: decoding an image under byte and pixel caps, boxes in whole pixels, resizing (image_ops and the
text finder and reader, subagents/image_text.py).

Decoding is guarded: a format allowlist checked from the header before decoding, byte and pixel caps (PIL's bomb
warning raised as an error too), truncated files refused, EXIF orientation applied. Every refusal is a
ToolFailure the policy reads.
"""

from __future__ import annotations

import io
import math
import struct
import warnings

from PIL import Image, ImageOps, UnidentifiedImageError

from subagents.common import ToolFailure

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
                img.load()  # a GIF or TIFF loads its first frame
                return ImageOps.exif_transpose(img).convert("RGB")
    except (Image.DecompressionBombWarning, Image.DecompressionBombError) as exc:
        raise ToolFailure("too_large", f"the image has too many pixels: {exc}") from None
    except UnidentifiedImageError:
        raise ToolFailure("unsupported_media", f"not an image in one of {ALLOWED_FORMATS}") from None
    except (OSError, SyntaxError, ValueError, EOFError, struct.error) as exc:  # truncated or corrupt data
        raise ToolFailure("unsupported_media", f"the image cannot be decoded: {exc}") from None


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
