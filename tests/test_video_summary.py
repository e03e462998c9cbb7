"""video_summary: path checks, the ffmpeg stderr probe parser, SRT cues, prompts, killing ffmpeg on deadlines,
and the whole pipeline on real ffmpeg with generated clips and the shared GRID / Kinetics videos."""

from __future__ import annotations

import asyncio
import csv
import dataclasses
import io
import os
import subprocess
import tempfile
import time
from pathlib import Path

import pydantic
import pytest
from PIL import Image, ImageDraw, ImageFont

from subagents import media
from subagents import video_summary as vs
from subagents.backends import build_llm
from subagents.common import Runtime, ToolFailure
from subagents.llm import BackendConfig, BackendError, Generation, Message
from subagents.media import Cue

# ---------------------------------------------------------------- doubles and helpers


class FakeLLM:
    """Records every prompt; answers with a fixed text or raises a fixed error."""

    model_id = "fake"

    def __init__(self, *, multimodal: bool = False, error: BackendError | None = None) -> None:
        self.multimodal = multimodal
        self.error = error
        self.calls: list[list[Message]] = []

    async def generate(self, messages: list[Message], *, max_new_tokens: int) -> Generation:
        self.calls.append(messages)
        if self.error is not None:
            raise self.error
        return Generation(text=" They say set white [00:00.5]. ", prompt_tokens=123, completion_tokens=9)

    def count_tokens(self, text: str) -> int:
        return len(text.split())

    async def aclose(self) -> None:
        pass

    @property
    def prompt(self) -> str:
        return self.calls[-1][-1].content


def runtime(llm: FakeLLM, *roots: Path) -> Runtime[None]:
    folders = tuple(str(r) for r in roots)
    return Runtime(llm=llm, fetcher=None, state=None, roots=folders, count_tokens=llm.count_tokens)  # type: ignore[arg-type]


def config(**changes: object) -> vs.Config:
    return dataclasses.replace(vs.Config(ocr=False), **changes)  # type: ignore[arg-type]


def resolve(name: str, *roots: Path, **changes: object) -> Path:
    return vs.resolve_video(name, config(**changes), tuple(str(r) for r in roots))


def ffmpeg(*args: str) -> None:
    """Make test media with the same ffmpeg binary the sub-agent uses (lavfi is fine here, not there)."""
    argv = [media.ffmpeg_exe(), "-nostdin", "-hide_banner", "-loglevel", "error", "-y", *args]
    subprocess.run(argv, check=True, timeout=60)


def write_srt(path: Path, cues: list[tuple[float, float, str]]) -> Path:
    def stamp(t: float) -> str:
        ms = round(t * 1000)
        return f"{ms // 3_600_000:02d}:{ms // 60_000 % 60:02d}:{ms // 1000 % 60:02d},{ms % 1000:03d}"

    blocks = [f"{n}\n{stamp(a)} --> {stamp(b)}\n{text}\n" for n, (a, b, text) in enumerate(cues, 1)]
    path.write_text("\n".join(blocks), encoding="utf-8")
    return path


TINY_CUES = [(0.2, 0.9, "hello from the test"), (1.5, 1.9, "second cue")]


@pytest.fixture(scope="module")
def tiny_video(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2 s 160x120 test pattern with an SRT subtitle track, in Matroska."""
    folder = tmp_path_factory.mktemp("tiny")
    subs = write_srt(folder / "subs.srt", TINY_CUES)
    out = folder / "tiny.mkv"
    ffmpeg(
        *("-f", "lavfi", "-i", "testsrc=size=160x120:rate=10:duration=2", "-i", str(subs)),
        *("-c:v", "libx264", "-preset", "ultrafast", "-c:s", "srt", str(out)),
    )
    return out


# ---------------------------------------------------------------- path checks

HOSTILE = [
    "-i",
    "-f lavfi",
    "concat:a|b",
    "http://x",
    "pipe:0",
    "file:/etc/passwd",
    "subfile:x",
    "a|b",
    "",
    "C:x.mp4",
]


@pytest.mark.parametrize("name", [*HOSTILE, "../escape.mp4", "/etc/passwd", "sub/../../escape.mp4"])
def test_hostile_or_outside_names_are_invalid_args(tmp_path: Path, name: str) -> None:
    """Option-like names, protocol strings and paths leaving the root never reach ffmpeg."""
    root = tmp_path / "root"
    root.mkdir()
    (tmp_path / "escape.mp4").write_bytes(b"x")
    with pytest.raises(ToolFailure) as info:
        resolve(name, root)
    assert info.value.error.kind == "invalid_args", info.value.error


def test_symlink_escaping_the_root_is_refused_and_inner_symlink_resolves(tmp_path: Path) -> None:
    """Symlinks are judged by their target: out of the root is refused, inside it is followed."""
    root, outside = tmp_path / "root", tmp_path / "outside.mp4"
    root.mkdir()
    outside.write_bytes(b"video")
    (root / "out.mp4").symlink_to(outside)
    (root / "real.mp4").write_bytes(b"video")
    (root / "in.mp4").symlink_to(root / "real.mp4")
    with pytest.raises(ToolFailure) as info:
        resolve("out.mp4", root)
    assert info.value.error.kind == "invalid_args"
    assert resolve("in.mp4", root) == (root / "real.mp4").resolve()


@pytest.mark.parametrize(
    ("name", "kind"),
    [("empty.mp4", "unsupported_media"), ("missing.mp4", "not_found"), ("folder", "invalid_args"),
     ("fifo", "invalid_args"), ("big.mp4", "too_large")],
)  # fmt: skip
def test_file_checks_map_to_error_kinds(tmp_path: Path, name: str, kind: str) -> None:
    """Zero-byte, missing, directory, FIFO and oversized inputs each get their own error kind."""
    (tmp_path / "empty.mp4").touch()
    (tmp_path / "folder").mkdir()
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "big.mp4").write_bytes(b"0123456789")
    with pytest.raises(ToolFailure) as info:
        resolve(name, tmp_path, max_file_bytes=9)
    assert info.value.error.kind == kind, info.value.error


def test_relative_paths_start_in_the_first_root_and_absolute_ones_may_use_any(tmp_path: Path) -> None:
    """A relative name is looked up in the first root; an absolute path in the second root is accepted."""
    first, second = tmp_path / "a", tmp_path / "b"
    for folder in (first, second):
        folder.mkdir()
        (folder / "v.mp4").write_bytes(b"x")
    assert resolve("v.mp4", first, second) == (first / "v.mp4").resolve()
    assert resolve(str(second / "v.mp4"), first, second) == (second / "v.mp4").resolve()


def test_os_errors_on_the_path_are_structured_without_the_server_path(tmp_path: Path) -> None:
    """A name too long for the OS, a path through a file and a symlink loop are `invalid_args` or
    `not_found` (never an OSError escaping), and the message does not show the server's folder."""
    (tmp_path / "file.mp4").write_bytes(b"video")
    (tmp_path / "loop.mp4").symlink_to(tmp_path / "loop.mp4")
    cases = {"v" * 300 + ".mp4": "invalid_args", "file.mp4/x.mp4": "not_found", "loop.mp4": "invalid_args"}
    for name, kind in cases.items():
        with pytest.raises(ToolFailure) as info:
            resolve(name, tmp_path)
        assert info.value.error.kind == kind, (name[:20], info.value.error)
        assert str(tmp_path) not in info.value.error.message


@pytest.mark.parametrize("extra", [{"videos": "a.mp4"}, {"question": "q", "frames": 4}])
def test_unknown_request_fields_are_refused(extra: dict[str, object]) -> None:
    """Like the other sub-agents, a misspelt or invented argument is an error the policy sees, not ignored."""
    with pytest.raises(pydantic.ValidationError):
        vs.Request.model_validate({"video": "a.mp4", **extra})


def test_no_roots_means_no_local_files(tmp_path: Path) -> None:
    """Empty roots refuse every path, even an existing one."""
    (tmp_path / "v.mp4").write_bytes(b"x")
    with pytest.raises(ToolFailure) as info:
        resolve(str(tmp_path / "v.mp4"))
    assert info.value.error.kind == "invalid_args"


async def test_run_returns_structured_errors_without_calling_the_model(tmp_path: Path) -> None:
    """Bad input comes back as ok=False with a kind; nothing raises and the model is not asked."""
    (tmp_path / "empty.mp4").touch()
    llm = FakeLLM()
    for name, kind in [
        ("-f lavfi", "invalid_args"),
        ("empty.mp4", "unsupported_media"),
        ("no.mp4", "not_found"),
    ]:
        response = await vs.run(vs.Request(video=name), config(), runtime(llm, tmp_path))
        assert not response.ok and response.error is not None and response.error.kind == kind
        assert response.observation().startswith(f"error ({kind})")
    assert llm.calls == []


# ---------------------------------------------------------------- probe parser

GRID_STDERR = """Input #0, mpeg, from 'file:/data/grid/bbaf2n.mpg':
  Duration: 00:00:02.98, start: 0.000000, bitrate: 1215 kb/s
  Stream #0:0[0x1e0]: Video: mpeg1video, yuv420p(tv, progressive), 360x288 [SAR 1:1 DAR 5:4], 104857 kb/s, 25 fps, 50 tbr, 90k tbn
    Side data:
      CPB properties: bitrate max/min/avg: 0/0/0 buffer size: 229376 vbv_delay: N/A
  Stream #0:1[0x1c0]: Audio: mp2, 44100 Hz, stereo, s16p, 224 kb/s
At least one output file must be specified
"""
MP4_STDERR = """Input #0, mov,mp4,m4a,3gp,3g2,mj2, from 'file:/data/kinetics/demo.mp4':
  Metadata:
    major_brand     : isom
    encoder         : Lavf56.40.101
  Duration: 01:02:03.50, start: 0.066733, bitrate: 508 kb/s
  Stream #0:0[0x1](eng): Video: h264 (High) (avc1 / 0x31637661), yuv420p(progressive), 340x256 [SAR 64:51 DAR 5:3], 505 kb/s, 28 fps, 28 tbr, 14336 tbn (default)
    Metadata:
      handler_name    : VideoHandler
  Stream #0:1[0x2](und): Subtitle: mov_text (tx3g / 0x67337874), 0 kb/s (default)
At least one output file must be specified
"""
MKV_STDERR = """Input #0, matroska,webm, from 'file:/v/film.mkv':
  Duration: N/A, start: 0.000000, bitrate: N/A
  Stream #0:0: Audio: aac (LC), 48000 Hz, stereo, fltp (default)
  Stream #0:1(eng): Subtitle: hdmv_pgs_subtitle (pgssub), 1920x1080
  Stream #0:2(eng): Subtitle: subrip (srt) (default)
  Stream #0:3: Video: mjpeg (Baseline), yuvj420p(pc, bt470bg/unknown/unknown), 600x600 [SAR 1:1 DAR 1:1], 90k tbr, 90k tbn (attached pic)
  Stream #0:4: Video: hevc (Main 10), yuv420p10le(tv, bt2020nc/bt2020/smpte2084), 3840x2160, SAR 1:1 DAR 16:9, 23.98 fps
  Stream #0:5: Attachment: ttf
"""


def test_probe_parser_reads_real_ffmpeg_summaries() -> None:
    """Duration, container, stream kinds, codecs and sizes come out right; fourccs are not read as sizes."""
    grid = media.parse_probe(GRID_STDERR)
    assert (grid.container, grid.duration_s) == ("mpeg", pytest.approx(2.98))
    assert grid.video == media.Stream(0, "video", "mpeg1video", 360, 288)
    assert [s.kind for s in grid.streams] == ["video", "audio"] and grid.text_subtitle is None
    mp4 = media.parse_probe(MP4_STDERR)
    assert mp4.duration_s == pytest.approx(3723.5)
    assert (mp4.video.codec, mp4.video.width, mp4.video.height) == ("h264", 340, 256)  # type: ignore[union-attr]
    assert mp4.text_subtitle == 0


def test_probe_parser_skips_cover_art_bitmap_subtitles_and_unknown_duration() -> None:
    """Cover art is not the video; the text subtitle's position counts subtitle streams only."""
    info = media.parse_probe(MKV_STDERR)
    assert info.duration_s is None
    assert info.video is not None and (info.video.index, info.video.codec, info.video.width) == (
        4,
        "hevc",
        3840,
    )
    assert info.text_subtitle == 1  # 0:s:0 is the PGS bitmap track, 0:s:1 the SRT one
    assert [s.kind for s in info.streams].count("attachment") == 1


@pytest.mark.parametrize(
    "stderr",
    [
        "[in#0 @ 0x55] moov atom not found\nError opening input files: Invalid data found when processing input\n",
        "[in#0 @ 0x55] Format not on whitelist 'mov,matroska'\nError opening input file file:/x/a.m3u8.\n",
        "",
    ],
)
def test_probe_parser_refuses_unreadable_files(stderr: str) -> None:
    """No 'Input #0' summary means ffmpeg could not open the file: unsupported_media, with its last line."""
    with pytest.raises(ToolFailure) as info:
        media.parse_probe(stderr)
    assert info.value.error.kind == "unsupported_media"
    if stderr:
        assert stderr.strip().splitlines()[-1][:40] in info.value.error.message


# ---------------------------------------------------------------- SRT, sampling, prompts


def test_srt_parser_handles_real_world_variants() -> None:
    """CRLF, BOM, '.' decimals, missing counters, markup and multi-line cues parse; junk is skipped."""
    text = (
        "\ufeff1\r\n00:00:00,490 --> 00:00:00,770\r\n<i>set</i>\r\n\r\n"
        "00:00:01.5 --> 00:00:02.000\nwhite\nwith p\n\n"
        "not a cue at all\n\n"
        "7\n01:00:00,000 --> 01:00:01,000 X1:0 X2:10\n{\\an8}top line\n\n"
        "8\n00:00:03,000 --> 00:00:04,000\n\n"
    )
    assert media.parse_srt(text) == [
        Cue(0.49, 0.77, "set"),
        Cue(1.5, 2.0, "white with p"),
        Cue(3600.0, 3601.0, "top line"),
    ]


@pytest.mark.parametrize(
    ("covered", "count"), [(10.0, 8), (600.0, 8), (1.0, 4), (0.1, 1), (None, 1), (0.0, 1)]
)
def test_sample_times_are_bounded_and_inside_the_clip(covered: float | None, count: int) -> None:
    """At most max_frames timestamps, evenly spaced midpoints strictly inside [0, covered]."""
    times = vs.sample_times(covered, 8)
    assert len(times) == count
    if covered:
        assert all(0 < t < covered for t in times) and times == sorted(times)
    else:
        assert times == [0.0]


@pytest.mark.parametrize(
    ("seconds", "text"), [(0, "00:00.0"), (1.54, "00:01.5"), (61.25, "01:01.2"), (3599.96, "60:00.0")]
)
def test_timestamps_format_as_minutes_seconds_tenths(seconds: float, text: str) -> None:
    """The [MM:SS.s] citation format the policy is told to copy."""
    assert vs.format_ts(seconds) == text


def test_timeline_interleaves_cues_and_screen_text_and_drops_repeats() -> None:
    """Lines are in time order; a caption repeated on consecutive frames appears once."""
    cues = [Cue(2.0, 2.5, "two"), Cue(0.5, 1.0, "one")]
    texts = [
        vs.FrameText(0.2, "LOGO"),
        vs.FrameText(1.2, "LOGO"),
        vs.FrameText(2.2, ""),
        vs.FrameText(3.0, "LOGO"),
    ]
    assert vs.build_timeline(cues, texts) == [
        "[00:00.2] on screen: LOGO",
        "[00:00.5] said: one",
        "[00:02.0] said: two",
        "[00:03.0] on screen: LOGO",
    ]


def test_prompt_carries_facts_timeline_and_task_and_is_cut_visibly() -> None:
    """The prompt names duration, size, the timeline and the question; a long timeline gets a marker."""
    response = vs.Response(duration_s=3.0, resolution="360x288", timestamps=[0.5, 1.5])
    timeline = [f"[00:0{i}.0] said: word{i}" for i in range(10)]
    prompt = vs.build_prompt(response, "Who speaks?", timeline=timeline, multimodal=False, max_chars=10_000)
    assert "3.0 s, 360x288" in prompt and "[00:09.0] said: word9" in prompt
    assert prompt.endswith("Question: Who speaks?")
    short = vs.build_prompt(response, None, timeline=timeline, multimodal=True, max_chars=60)
    assert "word9" not in short and "[truncated" in short and "Summarise" in short
    assert "taken at [00:00.5], [00:01.5]" in short


def test_summary_is_compact_and_leaves_frame_text_to_the_trace() -> None:
    """summary() holds the answer and the facts, not OCR text; partial coverage is stated."""
    response = vs.Response(
        answer="A man talks [00:01.0].",
        duration_s=900.0,
        covered_s=600.0,
        resolution="640x360",
        timestamps=[1.0, 2.0],
        frame_texts=[vs.FrameText(1.0, "SECRET OCR TEXT")],
    )
    summary = response.summary()
    assert summary.startswith("A man talks [00:01.0].") and "900.0 s, 640x360, 2 frames" in summary
    assert "only the first 600 s read" in summary and "SECRET" not in summary


# ---------------------------------------------------------------- killing ffmpeg


def _dead(pid: int) -> bool:
    """Gone or a zombie (an orphan waiting for a reaper is no longer running)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


async def _assert_group_dies(tmp_path: Path, stop: str) -> None:
    pids = tmp_path / "pids"
    script = f"sleep 30 & echo $$ $! > {pids}; wait"
    task = asyncio.create_task(media.run_process(["/bin/sh", "-c", script], max_stdout_bytes=100))
    for _ in range(100):  # up to 5 s for the shell to start on a loaded machine
        if pids.exists() and pids.read_text().endswith("\n"):
            break
        await asyncio.sleep(0.05)
    shell, child = (int(p) for p in pids.read_text().split())
    # The outer bound fails the test fast if stopping hangs: asyncio's wait() also waits for the pipes to
    # close, so a surviving child that holds stdout would stall the call for the child's whole life.
    async with asyncio.timeout(5):
        if stop == "cancel":
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        else:
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.01):
                    await task
    deadline = time.monotonic() + 2
    while not (_dead(shell) and _dead(child)) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert _dead(shell) and _dead(child), (shell, child)


@pytest.mark.parametrize("stop", ["cancel", "timeout"])
async def test_cancel_or_deadline_kills_the_whole_process_group(tmp_path: Path, stop: str) -> None:
    """A cancelled call (client gone) or a deadline SIGKILLs the process and its children too."""
    await _assert_group_dies(tmp_path, stop)


async def test_process_output_is_capped_but_drained() -> None:
    """stdout past the cap is dropped and flagged; the process still finishes instead of blocking."""
    result = await media.run_process(["/bin/sh", "-c", "head -c 200000 /dev/zero"], max_stdout_bytes=1000)
    assert (result.returncode, len(result.stdout), result.stdout_overflow) == (0, 1000, True)


def _ffmpeg_children() -> list[int]:
    me, found = os.getpid(), []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)
        except (FileNotFoundError, ProcessLookupError):
            continue
        if "ffmpeg" in fields[0] and int(fields[1].split()[1]) == me:
            found.append(int(stat.parent.name))
    return found


async def test_too_short_deadline_times_out_and_leaves_no_ffmpeg_or_temp_dir(
    tiny_video: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 10 ms budget returns a retryable timeout, kills ffmpeg and removes the per-request temp dir."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    response = await vs.run(
        vs.Request(video=tiny_video.name), config(deadline_s=0.01), runtime(FakeLLM(), tiny_video.parent)
    )
    assert response.error is not None and (response.error.kind, response.error.retryable) == ("timeout", True)
    assert _ffmpeg_children() == [] and list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- real ffmpeg, generated media


async def test_subtitled_clip_reaches_the_model_with_timestamps(
    tiny_video: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Probe, frames and SRT cues flow into one prompt; tokens and the temp dir are accounted for."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    llm = FakeLLM()
    response = await vs.run(
        vs.Request(video=tiny_video.name), config(max_frames=3), runtime(llm, tiny_video.parent)
    )
    assert response.ok, response.error
    assert (response.duration_s, response.resolution) == (pytest.approx(2.0, abs=0.1), "160x120")
    assert len(response.timestamps) == 3 and [c.text for c in response.subtitles] == [
        t for *_, t in TINY_CUES
    ]
    assert "[00:00.2] said: hello from the test" in llm.prompt and "[00:01.5] said: second cue" in llm.prompt
    assert response.answer == "They say set white [00:00.5]."
    assert response.tokens_read == 123 and response.tokens_returned == len(response.summary().split())
    assert list(tmp_path.iterdir()) == []


async def test_only_the_first_max_duration_is_read(tiny_video: Path) -> None:
    """Past max_duration_s no frame is taken and no cue is kept, and the summary says so."""
    llm = FakeLLM()
    cfg = config(max_duration_s=1.0)
    response = await vs.run(vs.Request(video=tiny_video.name), cfg, runtime(llm, tiny_video.parent))
    assert response.ok and response.covered_s == 1.0 and max(response.timestamps) < 1.0
    assert [c.text for c in response.subtitles] == ["hello from the test"] and "second cue" not in llm.prompt
    assert "only the first 1 s read" in response.summary()


async def test_backend_failure_becomes_backend_error(tiny_video: Path) -> None:
    """A model failure is a structured backend_error carrying the backend's retryable flag."""
    llm = FakeLLM(error=BackendError("context length exceeded", retryable=False))
    response = await vs.run(vs.Request(video=tiny_video.name), config(), runtime(llm, tiny_video.parent))
    assert response.error is not None and (response.error.kind, response.error.retryable) == (
        "backend_error",
        False,
    )


async def test_nothing_to_read_skips_the_text_model(tmp_path: Path) -> None:
    """Without subtitles or screen text a text-only model is not asked to invent content."""
    ffmpeg(
        "-f",
        "lavfi",
        "-i",
        "color=c=gray:size=64x48:rate=5:duration=1",
        "-c:v",
        "mpeg4",
        str(tmp_path / "g.mp4"),
    )
    llm = FakeLLM()
    response = await vs.run(vs.Request(video="g.mp4"), config(max_frames=2), runtime(llm, tmp_path))
    assert response.ok and llm.calls == [] and response.answer.startswith("Nothing to read")


@pytest.mark.parametrize(
    ("name", "content"),
    [
        ("junk.mp4", "this is not a video\n"),
        ("list.mp4", "ffconcat version 1.0\nfile '{target}'\n"),
        ("play.mp4", "#EXTM3U\n#EXT-X-TARGETDURATION:10\n#EXTINF:10,\n{target}\n#EXT-X-ENDLIST\n"),
    ],
)
async def test_junk_and_indirection_files_are_unsupported(
    tmp_path: Path, tiny_video: Path, name: str, content: str
) -> None:
    """Non-video bytes, concat scripts and HLS playlists (could read files outside the root) are refused."""
    (tmp_path / name).write_text(content.format(target=tiny_video))
    response = await vs.run(vs.Request(video=name), config(), runtime(FakeLLM(), tmp_path))
    assert response.error is not None and response.error.kind == "unsupported_media", response.error


@pytest.mark.slow
async def test_real_ocr_reads_on_screen_text(tmp_path: Path) -> None:
    """With a text-only model, rapidocr's bundled models read a caption into frame texts and the prompt."""
    image = Image.new("RGB", (480, 270), "white")
    ImageDraw.Draw(image).text((30, 100), "GATE 42 OPEN", fill="black", font=ImageFont.load_default(size=48))
    image.save(tmp_path / "caption.png")
    ffmpeg(
        "-loop",
        "1",
        "-i",
        str(tmp_path / "caption.png"),
        "-t",
        "1",
        "-r",
        "5",
        "-c:v",
        "mpeg4",
        str(tmp_path / "c.mp4"),
    )
    llm = FakeLLM()
    response = await vs.run(vs.Request(video="c.mp4"), config(max_frames=2, ocr=True), runtime(llm, tmp_path))
    assert response.ok, response.error
    assert [f.text for f in response.frame_texts] == ["GATE 42 OPEN"] * 2
    assert llm.prompt.count("on screen: GATE 42 OPEN") == 1


# ---------------------------------------------------------------- shared real data


def grid_clip_with_subtitles(shared_data: Path, folder: Path, *, container: str) -> tuple[Path, list[Cue]]:
    """GRID clip swwp2s with its transcript muxed in as subtitles, timed by the upstream word alignment."""
    grid = shared_data / "video" / "grid"
    with (grid / "transcripts.tsv").open(newline="") as f:
        transcript = {row["file"]: row["transcript"] for row in csv.DictReader(f, delimiter="\t")}[
            "swwp2s.mpg"
        ]
    align = [line.split() for line in (grid / "swwp2s.align").read_text().splitlines()]
    cues = [Cue(int(a) / 25_000, int(b) / 25_000, word) for a, b, word in align if word != "sil"]
    assert [c.text for c in cues] == transcript.split()
    subs = write_srt(folder / "swwp2s.srt", [(c.start_s, c.end_s, c.text) for c in cues])
    out = folder / f"swwp2s.{container}"
    codec = "srt" if container == "mkv" else "mov_text"
    ffmpeg(
        "-i",
        str(grid / "swwp2s.mpg"),
        "-i",
        str(subs),
        "-map",
        "0",
        "-map",
        "1",
        "-c",
        "copy",
        "-c:s",
        codec,
        str(out),
    )
    return out, cues


@pytest.mark.parametrize("container", ["mkv", "mp4"])
async def test_grid_transcript_reaches_the_prompt_with_timestamps(
    shared_data: Path, tmp_path: Path, container: str
) -> None:
    """Every spoken GRID word reaches the prompt as a timed cue (subrip in MKV, mov_text in MP4)."""
    clip, cues = grid_clip_with_subtitles(shared_data, tmp_path, container=container)
    llm = FakeLLM()
    response = await vs.run(
        vs.Request(video=clip.name, question="What is said?"), config(), runtime(llm, tmp_path)
    )
    assert response.ok, response.error
    assert response.duration_s == pytest.approx(2.98, abs=0.05) and response.resolution == "360x288"
    assert [c.text for c in response.subtitles] == [c.text for c in cues]
    for cue in cues:
        assert f"[{vs.format_ts(cue.start_s)}] said: {cue.text}" in llm.prompt
    assert "[00:00.5] said: set" in llm.prompt and llm.prompt.endswith("Question: What is said?")


async def test_kinetics_clip_probe_and_frames_for_a_multimodal_model(shared_data: Path) -> None:
    """Duration and size are probed right; a bounded number of downscaled PNG frames go to a VLM, no OCR."""
    video = shared_data / "video" / "kinetics" / "demo.mp4"
    llm = FakeLLM(multimodal=True)
    cfg = config(max_frames=4, frame_side=128, ocr=True)
    response = await vs.run(vs.Request(video=str(video)), cfg, runtime(llm, video.parent))
    assert response.ok, response.error
    assert (response.duration_s, response.resolution) == (pytest.approx(10.0), "340x256")
    assert response.timestamps == [1.25, 3.75, 6.25, 8.75] and response.frame_texts == []
    images = llm.calls[0][-1].images
    sizes = [Image.open(io.BytesIO(png)).size for png in images]
    assert sizes == [(128, 96)] * 4, sizes
    assert "taken at [00:01.2], [00:03.8], [00:06.2], [00:08.8]" in llm.prompt


@pytest.mark.slow
async def test_real_smollm2_answers_about_the_grid_clip(
    shared_data: Path, smollm2_path: Path, tmp_path: Path
) -> None:
    """End to end with the real default model: a non-empty answer and real prompt-token accounting."""
    clip, _ = grid_clip_with_subtitles(shared_data, tmp_path, container="mkv")
    llm = build_llm(BackendConfig(model=str(smollm2_path), max_new_tokens=48))
    try:
        rt = Runtime(llm=llm, fetcher=None, state=None, roots=(str(tmp_path),), count_tokens=llm.count_tokens)  # type: ignore[arg-type]
        cfg = config(max_new_tokens=48)
        response = await vs.run(vs.Request(video=clip.name, question="What does the speaker say?"), cfg, rt)
    finally:
        await llm.aclose()
    assert response.ok, response.error
    assert response.answer.strip() and response.tokens_read > 50
    assert response.tokens_returned == llm.count_tokens(response.summary())


async def test_audio_only_file_is_unsupported(tmp_path: Path) -> None:
    """A file ffmpeg opens but that has no video stream is unsupported_media, not an empty summary."""
    ffmpeg("-f", "lavfi", "-i", "sine=duration=1", "-c:a", "libvorbis", str(tmp_path / "a.ogg"))
    response = await vs.run(vs.Request(video="a.ogg"), config(), runtime(FakeLLM(), tmp_path))
    assert response.error is not None and response.error.kind == "unsupported_media"
    assert "no video stream" in response.error.message


@pytest.mark.slow
@pytest.mark.parametrize("size", [(640, 1), (1, 640), (640, 8), (3, 3)])
def test_frames_of_any_shape_go_through_ocr(size: tuple[int, int]) -> None:
    """A frame of a one-pixel-high, thin or tiny video (what ffmpeg's scale to `frame_side` gives) is read
    as a frame without text, not an error out of the OCR engine."""
    buffer = io.BytesIO()
    Image.new("RGB", size, "gray").save(buffer, format="PNG")
    assert vs._ocr_text(buffer.getvalue()) == ""
