"""Text in an image, two ways of looking (subagents/ocr.py: the process's one rapidocr engine).

`find_text` runs the text detector alone at the image's own resolution up to 2000 px on the long side (larger
images are reduced to it, as the detector always did: subagents/ocr.py) and returns where text is, labelled by
shape and confidence, never what it says: it tells the caller where to zoom. `read_text` is the only reader: it
sees the image resized to a fixed side (image_ops' `reader_side`, 384 px) on the long side, like a vision model's
fixed input, so small text needs a crop or zoom first.
"""

from __future__ import annotations

import math

from PIL import Image
from pydantic import BaseModel

from subagents import ocr
from subagents.pixels import pixel_box, scaled


class TextBox(BaseModel):
    """One detected text region: its id within the image (r1 is the largest), its box [x0,y0,x1,y1] in
    the image's pixels, the detector's confidence and a label from its shape and confidence (`region_label`).
    Its text is not read: `read` is the only reader."""

    id: str = ""
    box: list[int]
    score: float
    label: str

    def line(self) -> str:
        """`r1 plate-like 133x35 0.73`: what the policy reads of it (the size tells a plate from a sign)."""
        width, height = self.box[2] - self.box[0], self.box[3] - self.box[1]
        return f"{self.id} {self.label} {width}x{height} {self.score:.2f}"


# Detector confidence under this is labelled "faint": on the shared plate photos most regions scoring 0.5-0.6
# (rapidocr keeps boxes from 0.5) were shadows, grilles and logos, though a few plates score there too.
FAINT_SCORE = 0.6
# Width / height of a text region. Plates the detector boxed on the shared photos measure 2.1-5.1 (EU and US);
# a caption or a street sign's line of words runs past 7; single glyphs and stacked text fall under 2.
PLATE_ASPECT = (2.0, 7.0)


def region_label(box: list[int], score: float) -> str:
    """A coarse kind from shape and confidence: faint, line (long), plate-like, or block (short or stacked)."""
    aspect = (box[2] - box[0]) / max(1, box[3] - box[1])
    if score < FAINT_SCORE:
        return "faint"
    if aspect >= PLATE_ASPECT[1]:
        return "line"
    return "plate-like" if aspect >= PLATE_ASPECT[0] else "block"


def find_text(image: Image.Image, box: list[float] | None) -> list[TextBox]:
    """Text regions in `box` (or everywhere), largest first (then most confident), in image pixels. The largest
    text is what a photo is about: on the shared plate photos the plate is the largest region in 194 of 230 train
    photos and 40 of 47 dev ones, the most confident in 96 and 22 (regions of a sign, a grille or a sticker often
    score higher), so r1 is the one to read first."""
    left, top, right, bottom = pixel_box(box, image.size)
    region = image if box is None else image.crop((left, top, right, bottom))  # no copy of a whole image
    return sorted(detect(region, offset=(left, top)), key=lambda b: (-area(b.box), -b.score))


def area(box: list[int]) -> int:
    """Pixels in a [x0, y0, x1, y1] box."""
    return (box[2] - box[0]) * (box[3] - box[1])


def read_text(image: Image.Image, box: list[float] | None, *, side: int) -> list[str]:
    """Text lines of `box` (or the whole image) seen at `side` pixels on its longest side, in reading order."""
    region = image if box is None else image.crop(pixel_box(box, image.size))
    return ocr.read(scaled(region, side, Image.Resampling.BICUBIC))


def detect(image: Image.Image, *, offset: tuple[int, int] = (0, 0)) -> list[TextBox]:
    """Text regions from the detector alone, boxes shifted by `offset`, each labelled (`region_label`)."""
    regions = []
    for quad, score in ocr.detect(image):
        xs, ys = [p[0] + offset[0] for p in quad], [p[1] + offset[1] for p in quad]
        box = [math.floor(min(xs)), math.floor(min(ys)), math.ceil(max(xs)), math.ceil(max(ys))]
        regions.append(TextBox(box=box, score=round(score, 3), label=region_label(box, score)))
    return regions
