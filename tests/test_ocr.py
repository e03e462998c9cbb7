"""subagents/ocr.py: one engine per process, shared by image_ops and video_summary, built once."""

from __future__ import annotations

import io

import pytest
from PIL import Image, ImageDraw, ImageFont

from subagents import image_ops, ocr
from subagents import video_summary as vs


def text_image(text: str, size: tuple[int, int] = (400, 100)) -> Image.Image:
    image = Image.new("RGB", size, "white")
    ImageDraw.Draw(image).text((20, 20), text, fill="black", font=ImageFont.load_default(size=48))
    return image


@pytest.mark.slow
def test_one_engine_serves_image_ops_and_video_frames(monkeypatch: pytest.MonkeyPatch) -> None:
    """image_ops's reader, its detector and video_summary's frame OCR all run on one engine, built once."""
    built, make = [], ocr.make_engine

    def counted():
        built.append(1)
        return make()

    monkeypatch.setattr(ocr, "_engine", None)
    monkeypatch.setattr(ocr, "make_engine", counted)
    png = io.BytesIO()
    text_image("FRAME 7").save(png, format="PNG")
    assert "OCR 42" in " ".join(image_ops.read_text(text_image("OCR 42"), None, side=384))
    assert image_ops.find_text(text_image("HELLO"), None)
    assert "FRAME 7" in vs._ocr_text(png.getvalue())
    assert built == [1]


@pytest.mark.slow
def test_a_text_score_given_to_one_call_does_not_leak_into_the_next() -> None:
    """video_summary reads frames at a stricter text score than image_ops; each call states its own, so the
    engine's setting after a frame read does not change what image_ops reads."""
    image = text_image("OCR 42")
    before = ocr.read(image)
    ocr.read(image, text_score=0.99)
    assert ocr.read(image) == before and before
