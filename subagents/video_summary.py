"""Summarise a local video, or answer a question about it, with timestamps the policy can cite.

The pipeline: validate the path (local files under configured roots only) -> probe with ffmpeg -> grab
`max_frames` evenly spaced keyframes as PNG -> pull a text subtitle stream if there is one -> read on-screen
text with rapidocr (text-only model) or hand the frames over as images (multimodal model) -> one prompt to
the frozen model with a timeline like `[00:01.5] said: set white`.

Frames: one ffmpeg call per frame with `-ss` before `-i` (demuxer seek, then decode from the nearest
keyframe). Measured on 2 CPU cores, 8 frames at 640 px: 0.46 s for a 300 s 640x360 H.264 file against 2.0 s
for one decoding pass with an fps filter, and the single pass grows with the duration while seeking does not.

Limits admitted: audio is not transcribed (speech reaches the model only through subtitles); a text-only
model with neither subtitles nor on-screen text gets no call at all — the response says there is nothing
to read instead of letting the model invent content. Path checks resolve symlinks once; a file swapped for
a symlink between the check and ffmpeg's open is not caught (the roots are meant to be trusted folders).
"""

from __future__ import annotations

import asyncio
import io
import logging
import math
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from PIL import Image
from pydantic import BaseModel, ConfigDict, Field

from subagents import media, ocr
from subagents.common import Runtime, ToolFailure, ToolResponse, guarded, local_file, truncate
from subagents.llm import LLM, BackendError, Message
from subagents.media import Cue

logger = logging.getLogger(__name__)

NAME = "video_summary"
CACHEABLE = True  # a summary depends only on the file, the question and the frozen model
DESCRIPTION = (
    "Summarise a local video file or answer a question about it from its subtitles and frames, "
    "citing timestamps like [00:01.5]."
)

# Frames closer than this are near-duplicates at 25-30 fps; a 1 s clip gets 4 frames, not max_frames.
MIN_FRAME_GAP_S = 0.25
# An SRT track for a two-hour film is ~100 KiB; more than this is not a subtitle track.
MAX_SUBTITLE_BYTES = 1 << 20
SYSTEM_PROMPT = (
    "You describe videos from a timeline of what is said and what text is on screen. "
    "Answer in at most three sentences and cite timestamps exactly as given, like [00:01.5]."
)


class Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # like the other sub-agents: no guessing at input
    video: str = Field(
        min_length=1,
        description="the video's id (v_...) from the task, or a local file path",
        json_schema_extra={"handle": "video"},  # the server resolves a handle before the call (and the cache)
    )
    question: str | None = Field(
        default=None, max_length=500, description="What to find out; omit for a short summary."
    )


@dataclass(frozen=True)
class FrameText:
    """On-screen text read from the frame at `t_s` (empty when none was found)."""

    t_s: float
    text: str


class Response(ToolResponse):
    answer: str = ""
    duration_s: float | None = None
    covered_s: float | None = None
    resolution: str = ""
    timestamps: list[float] = Field(default_factory=list)
    subtitles: list[Cue] = Field(default_factory=list)
    frame_texts: list[FrameText] = Field(default_factory=list)

    def summary(self) -> str:
        facts = [f"video {_duration(self.duration_s)}", self.resolution, f"{len(self.timestamps)} frames"]
        facts.append(f"{len(self.subtitles)} subtitle cues")
        if self.covered_s is not None and self.duration_s is not None and self.covered_s < self.duration_s:
            facts.append(f"only the first {self.covered_s:g} s read")
        return f"{self.answer}\n({', '.join(f for f in facts if f)})"


@dataclass(frozen=True)
class Config:
    max_frames: int = 8
    """Most frames sampled per video: 8 PNGs of 640 px are ~8 OCR passes (~4 s on 2 cores) or 8 VLM images."""
    max_duration_s: float = 600.0
    """Longer videos are read only over their first `max_duration_s` (frames and subtitle cues) and the
    summary says so, rather than refused: the start of a long video still answers many questions."""
    frame_side: int = 640
    """Longest side of an extracted frame in pixels: enough for OCR of captions, small for a VLM prompt."""
    ocr: bool = True
    """Read on-screen text with rapidocr when the model is text-only (ignored for multimodal models)."""
    deadline_s: float = 120.0
    """Total budget per call: probe + frames ~1-2 s, OCR ~4 s, and SmolLM2-135M on 2 CPU cores needs
    10-30 s per answer when micro-batched with other calls; 120 s bounds a stuck call with room to spare."""
    max_file_bytes: int = 512 << 20
    """Largest file accepted (bytes); seeking keeps the cost low, the cap stops disk-filling uploads."""
    max_new_tokens: int = 96
    """Answer length bound: three sentences with timestamps."""
    max_timeline_chars: int = 4000
    """Timeline text in the prompt is cut with a marker beyond this: ~1000 tokens, since a 135M model
    loses the thread in long prompts well before its context is full."""
    formats: tuple[str, ...] = ("mov", "matroska", "mpeg", "mpegts", "avi", "flv", "asf", "ogg", "gif")
    """ffmpeg demuxers allowed to open files; excludes hls, concat and image2, which can open other files."""

    @property
    def demuxers(self) -> str:
        """`formats` as ffmpeg's -format_whitelist value."""
        return ",".join(self.formats)


def start(cfg: Config, roots: tuple[str, ...]) -> None:
    """Nothing to keep between calls: every call probes and reads its own file."""
    return None


def check_model(cfg: Config, llm: LLM) -> None:
    """Any model serves: a text-only one reads OCR text of the frames, a multimodal one the frames."""


async def run(request: Request, cfg: Config, rt: Runtime[None]) -> Response:
    return await guarded(Response, lambda: _summarise(request, cfg, rt))


async def _summarise(request: Request, cfg: Config, rt: Runtime[None]) -> Response:
    path = resolve_video(request.video, cfg, rt.roots)
    workdir = Path(tempfile.mkdtemp(prefix="conductor-video-"))
    try:
        async with asyncio.timeout(cfg.deadline_s):
            return await _pipeline(request, path, cfg=cfg, rt=rt, workdir=workdir)
    except TimeoutError:
        raise ToolFailure("timeout", f"video_summary ran past its {cfg.deadline_s:g} s deadline") from None
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


async def _pipeline(
    request: Request, path: Path, *, cfg: Config, rt: Runtime[None], workdir: Path
) -> Response:
    info = await media.probe(path, formats=cfg.demuxers)
    covered = None if info.duration_s is None else min(info.duration_s, cfg.max_duration_s)
    frames = await _extract_frames(path, sample_times(covered, cfg.max_frames), cfg=cfg, workdir=workdir)
    if not frames:
        raise ToolFailure("unsupported_media", "no frame could be decoded from the video stream")
    cues: list[Cue] = []
    if info.text_subtitle is not None:
        cues = await media.extract_subtitles(
            path, info.text_subtitle, formats=cfg.demuxers, max_bytes=MAX_SUBTITLE_BYTES
        )
        cues = [c for c in cues if covered is None or c.start_s < covered]
    texts = await read_frame_texts(frames) if cfg.ocr and not rt.llm.multimodal else []
    video = info.video
    assert video is not None, "probe() guarantees a video stream"
    response = Response(
        duration_s=info.duration_s,
        covered_s=covered,
        resolution=f"{video.width}x{video.height}" if video.width else "",
        timestamps=[t for t, _ in frames],
        subtitles=cues,
        frame_texts=texts,
    )
    await _answer(response, request.question, images=[png for _, png in frames], cfg=cfg, rt=rt)
    return response


async def _answer(
    response: Response, question: str | None, *, images: list[bytes], cfg: Config, rt: Runtime[None]
) -> None:
    """Fill in the answer and token counts: one model call, or none when there is nothing to read."""
    multimodal = rt.llm.multimodal
    timeline = build_timeline(response.subtitles, response.frame_texts)
    if not timeline and not multimodal:
        response.answer = "Nothing to read: the video has no subtitles and no on-screen text was found."
    else:
        prompt = build_prompt(
            response, question, timeline=timeline, multimodal=multimodal, max_chars=cfg.max_timeline_chars
        )
        messages = [
            Message("system", SYSTEM_PROMPT),
            Message("user", prompt, images=tuple(images) if multimodal else ()),
        ]
        try:
            generation = await rt.llm.generate(messages, max_new_tokens=cfg.max_new_tokens)
        except BackendError as exc:
            raise ToolFailure("backend_error", str(exc), retryable=exc.retryable) from exc
        response.answer = generation.text.strip()
        response.tokens_read = generation.prompt_tokens
    response.tokens_returned = rt.count_tokens(response.summary())


# ---------------------------------------------------------------- path checks

# "concat:a|b", "http://x", "C:..." : a scheme-like prefix before the first slash.
_PROTOCOL = re.compile(r"^[^/]*:")


def resolve_video(raw: str, cfg: Config, roots: tuple[str, ...]) -> Path:
    """The resolved path of a regular file under `roots`, or a ToolFailure saying why not."""
    if not raw or raw.startswith("-") or "|" in raw or "\0" in raw or _PROTOCOL.match(raw):
        raise ToolFailure("invalid_args", f"video must be a plain local file path, not {raw[:80]!r}")
    path, size = local_file(raw, roots, what="video")
    if size == 0:
        raise ToolFailure("unsupported_media", f"the video file is empty: {raw[:80]!r}")
    if size > cfg.max_file_bytes:
        raise ToolFailure("too_large", f"the video is {size} bytes, over {cfg.max_file_bytes}")
    return path


# ---------------------------------------------------------------- frames and OCR


def sample_times(covered_s: float | None, max_frames: int) -> list[float]:
    """Midpoints of equal slices of [0, covered_s]; one frame at 0 when the duration is unknown."""
    if not covered_s or covered_s <= 0:
        return [0.0]
    count = max(1, min(max_frames, math.ceil(covered_s / MIN_FRAME_GAP_S)))
    return [round((i + 0.5) * covered_s / count, 3) for i in range(count)]


async def _extract_frames(
    path: Path, times: list[float], *, cfg: Config, workdir: Path
) -> list[tuple[float, bytes]]:
    """PNG bytes per timestamp, in order; timestamps past the last decodable frame are dropped."""
    frames: list[tuple[float, bytes]] = []
    for n, t in enumerate(times):
        out = workdir / f"frame_{n:03d}.png"
        if await media.extract_frame(path, t, out=out, side=cfg.frame_side, formats=cfg.demuxers):
            frames.append((t, out.read_bytes()))
    return frames


# Scores under 0.7 and single characters were noise on frames without text (a lone CJK glyph on a face). Frames
# are at most `frame_side` (640) px, which the detector sees as they are: 6x faster than rapidocr's default of
# raising the short side to 736 px on 7 real frames (2.8 s vs 16.8 s on 2 cores), the same captions found.
FRAME_TEXT_SCORE = 0.7


def _ocr_text(png: bytes) -> str:
    """On-screen text of one frame, lines of two or more characters joined by ' | '."""
    with Image.open(io.BytesIO(png)) as frame:
        lines = ocr.read(frame.convert("RGB"), text_score=FRAME_TEXT_SCORE)
    return " | ".join(text for text in lines if len(text) > 1)


async def read_frame_texts(frames: list[tuple[float, bytes]]) -> list[FrameText]:
    """OCR every frame in a worker thread (rapidocr is blocking CPU work)."""
    return [FrameText(t, await asyncio.to_thread(_ocr_text, png)) for t, png in frames]


# ---------------------------------------------------------------- prompt


def format_ts(seconds: float) -> str:
    """`[MM:SS.s]` without brackets, e.g. 61.25 -> '01:01.2'; minutes grow past 59 for long videos."""
    tenths = round(seconds * 10)
    return f"{tenths // 600:02d}:{tenths % 600 // 10:02d}.{tenths % 10}"


def build_timeline(cues: list[Cue], texts: list[FrameText]) -> list[str]:
    """Chronological lines: subtitle cues as 'said', frame text as 'on screen' (repeats of the previous frame
    dropped, since captions and logos stay on screen for many frames)."""
    events = [(c.start_s, f"[{format_ts(c.start_s)}] said: {c.text}") for c in cues]
    previous = ""
    for frame in texts:
        if frame.text and frame.text != previous:
            events.append((frame.t_s, f"[{format_ts(frame.t_s)}] on screen: {frame.text}"))
        previous = frame.text
    return [line for _, line in sorted(events, key=lambda event: event[0])]


def build_prompt(
    response: Response, question: str | None, *, timeline: list[str], multimodal: bool, max_chars: int
) -> str:
    """The user message: video facts, the timeline (cut with a marker past `max_chars`), then the task."""
    lines = [f"Video: {_duration(response.duration_s)}, {response.resolution or 'unknown size'}."]
    if multimodal:
        stamps = ", ".join(f"[{format_ts(t)}]" for t in response.timestamps)
        lines.append(f"Frames attached in order, taken at {stamps}.")
    if timeline:
        lines += ["Timeline:", truncate("\n".join(timeline), max_chars)]
    task = f"Question: {question.strip()}" if question else "Task: Summarise the video in two sentences."
    return "\n".join([*lines, task])


def _duration(seconds: float | None) -> str:
    return "of unknown length" if seconds is None else f"{seconds:.1f} s"
