"""The one OCR engine of the process: rapidocr on the PP-OCR models bundled in its wheel, shared by image_ops
(find_text, read) and video_summary (on-screen text of frames).

    regions = detect(image)                  # the detector alone: [(quad, score)], boxes in the image's pixels
    lines = read(image, text_score=0.5)      # detection and recognition: the text lines, in reading order

Built once, on first use (onnxruntime start-up is ~1 s), with the models given by path so nothing is ever
downloaded. Calls are serialised by a lock: onnxruntime already spreads one call over `THREADS` cores, and two
concurrent calls would only fight for them.

The detector sees an image at its own size up to `MAX_SIDE` on the long side (rapidocr's default instead
raises the short side to 736 px): measured on 40 train plate photos, a 384-px `read` of the plate crop read the
same 32 plates either way, at 157 ms p50 instead of 737 ms, and `find_text` found every plate in both, at 133 ms
instead of 501 ms (2 cores, another job running).

An image larger than that is reduced here (`reduced`), as rapidocr itself would (its `reduce_max_side`: the same
cv2 resize to the same sides, its boxes mapped back by its own `map_boxes_to_original`), so the regions are the
same quad for quad, from one array of the pixels freed before detection: given a 7000x7000 image the engine
copied it whole twice (RGB, then BGR) and held both through the detection, ~300 MB beside the detector's own
~780 MB (the find_text's peak went from +954 to +841 MB).

Any shape is accepted (`fitted`): rapidocr rounds both sides to multiples of 32 after scaling the long side to
`MAX_SIDE`, and raises when the short side rounds to 0 (an 8x6000 zoom, a 1x2001 PNG). Such images are scaled
and padded into a shape it takes before they reach it; ordinary images go through untouched.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image

if TYPE_CHECKING:  # imported lazily at run time: onnxruntime start-up is ~1 s
    from rapidocr import RapidOCR

# Longest side the detector sees; larger images are scaled down to it (a 48 MP photo would take seconds).
MAX_SIDE = 2000
# Shortest side the engine is given: rapidocr rounds sides to multiples of 32 (and raises when one rounds to 0), so
# a short side of at least 32 px once the long side is at most MAX_SIDE always rounds to a whole block.
MIN_SIDE = 32
# onnxruntime threads per call: every core this process may run on.
THREADS = len(os.sched_getaffinity(0))
# rapidocr drops recognised lines scoring under this (its default): what image_ops reads.
TEXT_SCORE = 0.5

_lock = threading.Lock()  # guards the lazy engine and serialises calls
_engine: RapidOCR | None = None


def make_engine() -> RapidOCR:
    """A RapidOCR engine on the models bundled in its wheel, given by path so that nothing is downloaded."""
    import rapidocr

    models = Path(rapidocr.__file__).parent / "models"
    paths = {task: sorted(models.glob(f"*_{task}_*.onnx")) for task in ("det", "cls", "rec")}
    assert all(len(p) == 1 for p in paths.values()), f"one bundled model per task expected: {paths}"
    params: dict[str, object] = {f"{task.capitalize()}.model_path": str(p[0]) for task, p in paths.items()}
    params["Global.log_level"] = "error"  # "text detection result is empty" is a warning per text-free image
    params["Det.limit_type"], params["Det.limit_side_len"] = "max", MAX_SIDE
    params["Global.max_side_len"] = MAX_SIDE  # its own reduction (`reduced` does it first, the same way)
    params["EngineConfig.onnxruntime.intra_op_num_threads"] = THREADS
    return rapidocr.RapidOCR(params=params)


def _run(image: Image.Image, *, recognise: bool, text_score: float):
    """One rapidocr pass under the lock (the engine is built on first use); blocking CPU work."""
    global _engine
    with _lock:
        if _engine is None:
            _engine = make_engine()
        return _engine(image, use_det=True, use_cls=False, use_rec=recognise, text_score=text_score)


def fitted(image: Image.Image) -> tuple[Image.Image, float]:
    """`image` in a shape the engine takes, and the scale from the image's pixels to the fitted one's.

    Unchanged (scale 1) when its short side is at least MIN_SIDE once the long side is cut to MAX_SIDE, as for
    every photo and frame. Otherwise the long side is cut to MAX_SIDE here (at least 1 px left on the short one)
    and the short side padded to MIN_SIDE by repeating its edge pixels (no new contrast, so no new text), on
    the right or bottom: fitted pixels keep the image's coordinates times the scale."""
    width, height = image.size
    scale = min(1.0, MAX_SIDE / max(width, height))
    if min(width, height) * scale >= MIN_SIDE:
        return image, 1.0
    if scale < 1:
        size = (max(1, round(width * scale)), max(1, round(height * scale)))
        image = image.resize(size, Image.Resampling.BICUBIC)
    pixels = np.asarray(image)
    pad = [(0, max(0, MIN_SIDE - pixels.shape[0])), (0, max(0, MIN_SIDE - pixels.shape[1]))]
    pad += [(0, 0)] * (pixels.ndim - 2)  # colour channels are not padded
    return Image.fromarray(np.pad(pixels, pad, mode="edge")), scale


def read(image: Image.Image, *, text_score: float = TEXT_SCORE) -> list[str]:
    """Recognised lines in rapidocr's reading order (empty texts and those under `text_score` dropped)."""
    from rapidocr.ch_ppocr_det.utils import TextDetOutput  # loaded with the engine
    from rapidocr.utils.output import RapidOCROutput

    result = _run(reduced(fitted(image)[0])[0], recognise=True, text_score=text_score)
    # rapidocr answers a RapidOCROutput (an empty one when nothing is found), or the detector's own output when
    # it found regions but recognition kept no text in them.
    assert isinstance(result, RapidOCROutput | TextDetOutput), f"unexpected rapidocr result {type(result)}"
    texts = result.txts if isinstance(result, RapidOCROutput) else None
    return [text.strip() for text in texts or () if text.strip()]


def detect(image: Image.Image) -> list[tuple[list[list[float]], float]]:
    """The detector's text regions: each a quad of four [x, y] corners in the image's pixels (clipped to it)
    and a score."""
    from rapidocr.ch_ppocr_det.utils import TextDetOutput  # loaded with the engine
    from rapidocr.utils.output import RapidOCROutput

    fit, scale = fitted(image)
    small, ratios = reduced(fit)
    result = _run(small, recognise=False, text_score=TEXT_SCORE)
    # With recognition off, rapidocr returns the detector's output (quads [N, 4, 2], one score per quad), or an
    # empty RapidOCROutput when the detector found no region at all.
    if isinstance(result, RapidOCROutput) and result.boxes is None:
        return []
    assert isinstance(result, TextDetOutput), f"unexpected rapidocr result {type(result).__name__}"
    boxes = [] if result.boxes is None else _enlarged(result.boxes, ratios, fit.size)
    quads = [_in_image(quad.tolist(), scale, image.size) for quad in boxes]
    return [(quad, float(score)) for quad, score in zip(quads, result.scores or (), strict=True)]


def reduced(image: Image.Image) -> tuple[Image.Image, tuple[float, float] | None]:
    """`image` as the engine reduces one past MAX_SIDE (rapidocr's `reduce_max_side`, called here on one array of
    the pixels, so the engine gets an image it leaves as it is), and rapidocr's (height, width) ratios back to
    `image`'s pixels; `image` itself and None when it is within MAX_SIDE (or so thin that `fitted` cut it)."""
    if max(image.size) <= MAX_SIDE:
        return image, None
    from rapidocr.utils.process_img import reduce_max_side  # loaded with the engine

    # cv2 resizes each channel alike, so RGB reduced then made BGR (by the engine) is BGR reduced (its order)
    small, ratio_h, ratio_w = reduce_max_side(np.asarray(image), MAX_SIDE)
    return Image.fromarray(small), (ratio_h, ratio_w)


def _enlarged(boxes: np.ndarray, ratios: tuple[float, float] | None, size: tuple[int, int]) -> np.ndarray:
    """Quads found on `reduced`'s image in the pixels of the `size` image it reduced, mapped by rapidocr's own
    `map_boxes_to_original` as the engine maps those of an image it reduced itself."""
    if ratios is None:
        return boxes
    from rapidocr.utils.process_img import map_boxes_to_original

    record = {"preprocess": {"ratio_h": ratios[0], "ratio_w": ratios[1]}}
    return map_boxes_to_original(boxes, record, size[1], size[0])


def _in_image(quad: list[list[float]], scale: float, size: tuple[int, int]) -> list[list[float]]:
    """A quad found on the fitted image, in the image's pixels: unscaled, and clipped off the padding."""
    return [[min(max(0.0, x / scale), size[0]), min(max(0.0, y / scale), size[1])] for x, y in quad]
