"""video_qa: answer a question about a short clip with video_summary.

GRID clips ("What sentence is spoken in this video?", the transcript as gold) and a Kinetics clip ("What action is
shown?", its label), split by a hash of the file name (the set is tiny: train 7, dev 2, test 3). A GRID sentence
reaches the sub-agent only once `prepared` has muxed it into the clip as a subtitle track (the sub-agent does not
transcribe audio). The clip is attached to the episode and the context names it by handle ("Video: v_91c2e0",
from the clip's bytes), never by path.

Reward: token F1; success: normalised exact match. Expert: one video_summary call with the question, then the first
line of its answer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

from main_agent.types import Turn
from subagents.handles import Attachment, file_key
from training.rewards import contains_evidence, exact_match, token_f1
from training.tasks.family import Family
from training.tasks.task import (
    NO_ANSWER,
    Task,
    TaskMeta,
    answer_text,
    call_text,
    context_lines,
    hash_split,
    payload_field,
    results,
)

NAME = "video_qa"
TOOLS = ("video_summary",)
SPEECH_QUESTION = "What sentence is spoken in this video?"
ACTION_QUESTION = "What action is shown in this video?"
# One 3-second GRID clip re-encodes in about 0.5 s on one core; 120 s leaves room on a loaded CI machine.
FFMPEG_TIMEOUT_S = 120.0


def reward(answer: str, reference: str) -> float:
    return token_f1(answer, reference)


def success(answer: str, reference: str) -> bool:
    return exact_match(answer, reference) == 1.0


def _attached(task: Task, clip: Path) -> Task:
    """The task with `clip` attached and named by its handle in the context."""
    video = Attachment("video", str(clip), file_key(clip))
    meta = dataclasses.replace(task.meta, video_path=str(clip))
    return dataclasses.replace(task, context=video.line, meta=meta, attachments=(video,))


def _task(task_id: str, question: str, answer: str, clip: Path, subtitle: str | None) -> Task:
    clip = clip.resolve()
    meta = TaskMeta(video_path=str(clip), subtitle=subtitle, split=hash_split(clip.name))
    return _attached(Task(task_id, NAME, question, TOOLS, answer, "", meta), clip)


def load(data_dir: Path, split: str, *, limit: int | None = None) -> list[Task]:
    """GRID clips (transcripts.tsv: header, then `file<TAB>sentence`) and the Kinetics clip, split by file name."""
    grid, kinetics = data_dir / "video" / "grid", data_dir / "video" / "kinetics"
    tsv = (grid / "transcripts.tsv").read_text(encoding="utf-8")
    rows = [line.split("\t") for line in tsv.splitlines()[1:]]
    tasks = [_task(f"grid-{Path(n).stem}", SPEECH_QUESTION, text, grid / n, text) for n, text in rows]
    label = json.loads((kinetics / "label.json").read_text(encoding="utf-8"))
    clip, action = kinetics / label["video"], label["expected_top1_label"]
    tasks.append(_task(f"kinetics-{clip.stem}", ACTION_QUESTION, action, clip, None))
    return [t for t in tasks if t.meta.split == split][:limit]


# ---------------------------------------------------------------- preparation: subtitles muxed in


def mux_subtitles(clip: Path, sentence: str, out_path: Path) -> Path:
    """Write `clip` to `out_path` (.mp4) with `sentence` as one mov_text cue spanning the whole clip.

    Video is re-encoded to H.264 and audio to AAC: stream-copying GRID's MPEG-1 video and MP2 audio into MP4 also
    works with ffmpeg, but few players decode MPEG-1 from MP4, and re-encoding a 3-s clip costs ~0.5 s. Written to a
    temporary name and renamed, so an existing `out_path` is always complete.
    """
    import imageio_ffmpeg  # imported here: finding the bundled binary is not needed to define tasks

    seconds = imageio_ffmpeg.count_frames_and_secs(str(clip))[1]
    end = f"{int(seconds // 3600):02d}:{int(seconds // 60 % 60):02d}:{seconds % 60:06.3f}".replace(".", ",")
    srt = out_path.with_suffix(".srt")  # kept beside the video: it shows what the sub-agent was given
    srt.write_text(f"1\n00:00:00,000 --> {end}\n{sentence}\n", encoding="utf-8")
    partial = out_path.with_name(out_path.name + ".part")
    maps = ["-i", str(clip), "-i", str(srt), "-map", "0:v:0", "-map", "0:a?", "-map", "1:0"]
    codecs = "-c:v libx264 -preset veryfast -pix_fmt yuv420p -c:a aac -c:s mov_text -f mp4".split()
    argv = [imageio_ffmpeg.get_ffmpeg_exe(), "-nostdin", "-y", "-v", "error", *maps, *codecs, str(partial)]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=FFMPEG_TIMEOUT_S, check=False)
    if result.returncode != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"ffmpeg could not mux {clip}: {result.stderr.strip()[-500:]}")
    os.replace(partial, out_path)
    return out_path


def prepare_videos(tasks: Sequence[Task], out_dir: Path) -> list[Task]:
    """Point every task with a subtitle at `<out_dir>/<task_id>.mp4`, muxed unless already there; others as is."""
    out_dir.mkdir(parents=True, exist_ok=True)
    return [_subtitled(t, out_dir) if t.meta.subtitle is not None else t for t in tasks]


def _subtitled(task: Task, out_dir: Path) -> Task:
    assert task.meta.video_path is not None and task.meta.subtitle is not None, task
    out = (out_dir / f"{task.task_id}.mp4").resolve()
    if not out.exists():
        mux_subtitles(Path(task.meta.video_path), task.meta.subtitle, out)
    return _attached(task, out)


@contextlib.contextmanager
def prepared(tasks: Sequence[Task], work_dir: Path, *, data_dir: Path | None = None) -> Iterator[list[Task]]:
    """The tasks with their subtitled clips under `work_dir/videos` (muxed once, reused after)."""
    yield prepare_videos(tasks, work_dir / "videos")


# ---------------------------------------------------------------- the expert


def oracle_reply(task: Task, turns: list[Turn], *, trust_reference: bool) -> str:
    """Turn 0: video_summary with the question. Then: the first line of its answer."""
    videos = context_lines(task, "Video")
    if not videos:
        raise ValueError(f"task {task.task_id} has no video line in its context")
    if not turns:
        return call_text("video_summary", video=videos[0], question=task.question)
    answers = [str(payload_field(r, "answer") or "") for r in results(turns) if r.ok]
    guess = answers[-1].strip().splitlines()[0] if answers and answers[-1].strip() else NO_ANSWER
    seen = "\n".join(r.observation for r in results(turns) if r.ok)
    return answer_text(
        task.reference if trust_reference or contains_evidence(seen, task.reference) else guess
    )


FAMILY = Family(
    name=NAME, tools=TOOLS, load=load, reward=reward, success=success, prepared=prepared,
    oracle_reply=oracle_reply,
)  # fmt: skip
