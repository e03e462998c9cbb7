"""ffmpeg as a sandboxed, killable subprocess: probe a file, grab frames, pull a text subtitle stream.

The ffmpeg binary is the static build shipped by `imageio-ffmpeg`; `ffmpeg-python` only builds argv lists.
Every process starts in its own process group (`start_new_session=True`) and the whole group gets SIGKILL
when the awaiting task ends early — a deadline (`asyncio.timeout` around the caller) or a cancelled task
(the HTTP client went away). Nothing here has its own timeout: the caller owns one total deadline.

Every ffmpeg call reads one local file through `file:` with `-nostdin`, `-protocol_whitelist file,pipe`
and a demuxer whitelist, so no network protocol, playlist (hls), concat script or image-sequence pattern
can be reached even if a hostile file asks for one.

There is no ffprobe in imageio-ffmpeg, so `probe` runs `ffmpeg -i FILE` (which exits 1: no output given) and
`parse_probe` reads the stream summary ffmpeg prints to stderr.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import re
import signal
from dataclasses import dataclass
from pathlib import Path

import ffmpeg
import imageio_ffmpeg

from subagents.common import ToolFailure

# Options every call starts with: never read the terminal, no banner, errors only (info for the probe).
_GLOBAL_ARGS = ("-nostdin", "-hide_banner")
_PROTOCOLS = "file,pipe"
# Probe stderr is a few KiB even with many streams and metadata; more than this is not a summary.
MAX_STDERR_BYTES = 1 << 20
# Subtitle codecs ffmpeg can convert to SRT text; bitmap subtitles (dvd_subtitle, pgs, dvb) would need OCR.
TEXT_SUBTITLE_CODECS = frozenset({"subrip", "srt", "mov_text", "ass", "ssa", "webvtt", "text"})


@dataclass(frozen=True)
class ProcessResult:
    returncode: int
    stdout: bytes
    stderr: str
    stdout_overflow: bool
    """More than the allowed stdout bytes arrived; `stdout` holds only the first part."""


@dataclass(frozen=True)
class Stream:
    """One stream line of ffmpeg's input summary."""

    index: int
    kind: str  # "video", "audio", "subtitle", "data", "attachment"
    codec: str
    width: int | None = None
    height: int | None = None
    attached_pic: bool = False  # cover art shown as a video stream


@dataclass(frozen=True)
class MediaInfo:
    container: str
    duration_s: float | None  # None when ffmpeg reports N/A (live-style or broken files)
    streams: tuple[Stream, ...]

    @property
    def video(self) -> Stream | None:
        return next((s for s in self.streams if s.kind == "video" and not s.attached_pic), None)

    @property
    def text_subtitle(self) -> int | None:
        """Position among subtitle streams (for `-map 0:s:N`) of the first text subtitle, if any."""
        subtitles = [s for s in self.streams if s.kind == "subtitle"]
        return next((n for n, s in enumerate(subtitles) if s.codec in TEXT_SUBTITLE_CODECS), None)


@dataclass(frozen=True)
class Cue:
    """One subtitle cue, times in seconds from the start of the video."""

    start_s: float
    end_s: float
    text: str


@functools.cache
def ffmpeg_exe() -> str:
    return imageio_ffmpeg.get_ffmpeg_exe()


def _head(args: tuple[str, ...] = ("-loglevel", "error")) -> list[str]:
    return [ffmpeg_exe(), *_GLOBAL_ARGS, *args]


def _input(path: Path, formats: str, *, seek_s: float | None = None) -> ffmpeg.nodes.FilterableStream:
    options: dict[str, str] = {"protocol_whitelist": _PROTOCOLS, "format_whitelist": formats}
    if seek_s is not None:  # before -i: seek in the demuxer, then decode only from the nearest keyframe
        options["ss"] = f"{seek_s:.3f}"
    return ffmpeg.input(f"file:{path}", **options)


# ---------------------------------------------------------------- processes


async def run_process(argv: list[str], *, max_stdout_bytes: int) -> ProcessResult:
    """Run `argv` in a new process group; if this coroutine is cancelled or times out, SIGKILL the group."""
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        (out, overflow), (err, _) = await asyncio.gather(
            _drain(proc.stdout, max_stdout_bytes), _drain(proc.stderr, MAX_STDERR_BYTES)
        )
        returncode = await proc.wait()
    finally:
        if proc.returncode is None:
            kill_group(proc.pid)
            await proc.wait()
    return ProcessResult(returncode, out, err.decode("utf-8", "replace"), overflow)


def kill_group(pgid: int) -> None:
    """SIGKILL a whole process group; a group that is already gone is fine."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


async def _drain(stream: asyncio.StreamReader, cap: int) -> tuple[bytes, bool]:
    """Read a pipe to EOF (so the writer never blocks), keeping at most `cap` bytes."""
    chunks: list[bytes] = []
    size = 0
    while chunk := await stream.read(1 << 16):
        if size < cap:
            chunks.append(chunk[: cap - size])
        size += len(chunk)
    return b"".join(chunks), size > cap


def _last_error(stderr: str) -> str:
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    return lines[-1][:200] if lines else "ffmpeg failed without a message"


# ---------------------------------------------------------------- probe

_INPUT = re.compile(r"^Input #0, (?P<container>.+?), from ", re.M)
_DURATION = re.compile(r"^\s*Duration: (?:(?P<h>\d+):(?P<m>\d\d):(?P<s>\d\d(?:\.\d+)?)|N/A)", re.M)
_STREAM = re.compile(
    r"^\s*Stream #0:(?P<index>\d+)(?:\[[^\]]*\])?(?:\([^)]*\))?: "
    r"(?P<kind>Video|Audio|Subtitle|Data|Attachment): (?P<codec>[\w-]+)(?P<rest>.*)$",
    re.M,
)
# "360x288" but not "0x31637661" (a fourcc) nor "1:1" (an aspect ratio).
_SIZE = re.compile(r"(?<![\w/])([1-9]\d{0,4})x([1-9]\d{0,4})(?![\w])")


def parse_probe(stderr: str) -> MediaInfo:
    """Read container, duration and streams from `ffmpeg -i FILE` stderr; unsupported_media when absent."""
    container = _INPUT.search(stderr)
    if container is None:
        raise ToolFailure("unsupported_media", f"ffmpeg cannot read the file: {_last_error(stderr)}")
    duration = _DURATION.search(stderr)
    seconds = None
    if duration is not None and duration["h"] is not None:
        seconds = int(duration["h"]) * 3600 + int(duration["m"]) * 60 + float(duration["s"])
    streams = tuple(_parse_stream(m) for m in _STREAM.finditer(stderr))
    return MediaInfo(container=container["container"], duration_s=seconds, streams=streams)


def _parse_stream(match: re.Match[str]) -> Stream:
    kind, rest = match["kind"].lower(), match["rest"]
    size = _SIZE.search(rest) if kind == "video" else None
    return Stream(
        index=int(match["index"]),
        kind=kind,
        codec=match["codec"],
        width=int(size[1]) if size else None,
        height=int(size[2]) if size else None,
        attached_pic="(attached pic)" in rest,
    )


async def probe(path: Path, *, formats: str) -> MediaInfo:
    """Container, duration and streams of a local file; the file must hold a video stream."""
    argv = [*_head(("-loglevel", "info")), "-protocol_whitelist", _PROTOCOLS, "-format_whitelist", formats]
    result = await run_process([*argv, "-i", f"file:{path}"], max_stdout_bytes=1 << 16)
    info = parse_probe(result.stderr)
    if info.video is None:
        raise ToolFailure("unsupported_media", f"no video stream in the file ({info.container})")
    return info


# ---------------------------------------------------------------- frames and subtitles


async def extract_frame(path: Path, seek_s: float, *, out: Path, side: int, formats: str) -> bool:
    """Write the frame at `seek_s` as a PNG at most `side` pixels on its long side; False past the end."""
    scaled = _input(path, formats, seek_s=seek_s).video.filter(
        "scale", w=f"min({side},iw)", h=f"min({side},ih)", force_original_aspect_ratio="decrease"
    )
    argv = scaled.output(str(out), vframes=1, update=1).overwrite_output().compile(cmd=_head())
    result = await run_process(argv, max_stdout_bytes=1 << 16)
    if result.returncode != 0:
        raise ToolFailure("unsupported_media", f"cannot decode a frame: {_last_error(result.stderr)}")
    return out.is_file() and out.stat().st_size > 0


async def extract_subtitles(path: Path, position: int, *, formats: str, max_bytes: int) -> list[Cue]:
    """The text subtitle stream `0:s:position` converted to SRT by ffmpeg and parsed into cues."""
    selected = _input(path, formats)[f"s:{position}"]
    argv = selected.output("pipe:1", format="srt").compile(cmd=_head())
    result = await run_process(argv, max_stdout_bytes=max_bytes)
    if result.returncode != 0:
        raise ToolFailure("unsupported_media", f"cannot read subtitles: {_last_error(result.stderr)}")
    if result.stdout_overflow:
        raise ToolFailure("too_large", f"the subtitle stream is over {max_bytes} bytes")
    return parse_srt(result.stdout.decode("utf-8", "replace"))


_SRT_TIME = r"(\d+):(\d\d):(\d\d)[,.](\d{1,3})"
_SRT_TIMING = re.compile(rf"^\s*{_SRT_TIME}\s*-->\s*{_SRT_TIME}")
_MARKUP = re.compile(r"<[^>]*>|\{\\[^}]*\}")  # <i>…</i>, <font …>, ASS override tags like {\an8}


def parse_srt(text: str) -> list[Cue]:
    """Cues from SRT text; tolerates CRLF, a BOM, missing counters, '.' decimals and junk blocks."""
    cues: list[Cue] = []
    normalised = text.lstrip("\ufeff").replace("\r\n", "\n").replace("\r", "\n")
    for block in re.split(r"\n\s*\n", normalised):
        lines = block.strip("\n").split("\n")
        timing = next((i for i, line in enumerate(lines) if _SRT_TIMING.match(line)), None)
        if timing is None:
            continue
        parts = _SRT_TIMING.match(lines[timing]).groups()  # type: ignore[union-attr]
        body = " ".join(_MARKUP.sub("", line).strip() for line in lines[timing + 1 :])
        body = re.sub(r"\s+", " ", body).strip()
        if body:
            cues.append(Cue(_seconds(parts[:4]), _seconds(parts[4:]), body))
    return cues


def _seconds(parts: tuple[str, ...]) -> float:
    hours, minutes, seconds, fraction = parts
    return int(hours) * 3600 + int(minutes) * 60 + int(seconds) + int(fraction.ljust(3, "0")) / 1000
