"""plate_reading: read the licence plate in a car photo with image_ops.

Photos and labels come from the shared US and EU sets (`file<TAB>x<TAB>y<TAB>w<TAB>h<TAB>PLATE` per photo), split
by a hash of the file name. The photo is attached to the episode and the context names it by handle ("Image:
img_8bf8dd", from its bytes: the same on every machine); its path and the plate box are metadata the policy never
sees.

Reward and success: `plate_match` (letters and digits only, case-insensitive); `graded_reward` is its partial
credit (`plate_similarity`: 1 - normalised edit distance), what a run with `reward_kind = "graded"` trains on.

Expert: find_text on the attached photo (where text is, never what it says) -> zoom on a returned region by its
id (image_ops adds the margin) -> read -> answer. The region is the returned one overlapping the gold box most
(the only use of the metadata: it picks among what find_text showed). When a read shows no plate-like text it
retries: first an autocontrast of the zoomed image, then the next overlapping region, before answering its best
reading.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

from main_agent.types import ToolResult, Turn
from subagents.handles import Attachment, file_key
from training.rewards import normalize_plate, plate_match, plate_similarity
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

NAME = "plate_reading"
QUESTION = "What is the licence plate number?"
# A reading that looks like a plate: 4-9 letters and digits with both present (vanity plates without digits
# read as not plate-like and get the retry, which costs a few turns, not the answer).
_PLATE_LIKE = re.compile(r"^(?=.*[A-Z])(?=.*\d)[A-Z\d]{4,9}$")


def reward(answer: str, reference: str) -> float:
    return plate_match(answer, reference)


def success(answer: str, reference: str) -> bool:
    return plate_match(answer, reference) == 1.0


def graded_reward(answer: str, reference: str) -> float:
    return plate_similarity(answer, reference)


def _task(txt: Path) -> Task:
    """One photo from its label file: `file<TAB>x<TAB>y<TAB>w<TAB>h<TAB>PLATE` (US and EU alike)."""
    fields = txt.read_text(encoding="utf-8").strip().split("\t")
    if len(fields) != 6:
        raise ValueError(f"{txt}: expected 6 tab-separated fields, got {fields}")
    image = (txt.parent / fields[0]).resolve()
    x, y, w, h = map(int, fields[1:5])
    meta = TaskMeta(image_path=str(image), plate_box=(x, y, w, h), split=hash_split(image.name))
    task_id = f"plate-{txt.parent.name}-{image.stem}"
    photo = Attachment("image", str(image), file_key(image))
    return Task(task_id, NAME, QUESTION, ("image_ops",), fields[5], photo.line, meta, attachments=(photo,))


def load(data_dir: Path, split: str, *, limit: int | None = None) -> list[Task]:
    """Licence plate photos (US, then EU, by file name) whose hashed file name falls in `split`."""
    labels = sorted((data_dir / "images" / "plates" / "endtoend").glob("*/*.txt"))
    return [t for t in map(_task, labels) if t.meta.split == split][:limit]


@contextlib.contextmanager
def prepared(tasks: Sequence[Task], work_dir: Path, *, data_dir: Path | None = None) -> Iterator[list[Task]]:
    """Photos are read where they lie: nothing to prepare."""
    yield list(tasks)


# ---------------------------------------------------------------- the expert


def oracle_reply(task: Task, turns: list[Turn], *, trust_reference: bool) -> str:
    """The next step of find_text -> zoom -> read (-> autocontrast -> read -> next region) -> answer."""
    images = context_lines(task, "Image")
    if not images or task.meta.plate_box is None:
        raise ValueError(f"task {task.task_id} has no image line in its context or no plate box")
    done = [r for r in results(turns) if r.name == "image_ops"]
    if not done:
        return call_text("image_ops", op="find_text", image=images[0])
    last = done[-1]
    step = _next_step(task, images[0], done) if last.ok else None
    return step or answer_text(_answer(task, done, trust_reference))


def _next_step(task: Task, photo: str, done: list[ToolResult]) -> str | None:
    """The call that follows the last result, or None when it is time to answer."""
    last, op = done[-1], payload_field(done[-1], "op")
    if op in ("zoom", "autocontrast"):
        return call_text("image_ops", op="read", image=str(payload_field(last, "image_id")))
    if op == "find_text" or (op == "read" and not _plate_reads(done)):
        return _retry(task, photo, done)
    return None


def _retry(task: Task, photo: str, done: list[ToolResult]) -> str | None:
    """After find_text or a failed read: autocontrast the last zoom once, else zoom on the next region."""
    ops = [payload_field(r, "op") for r in done]
    zooms = [r for r in done if payload_field(r, "op") == "zoom"]
    if ops[-1] == "read" and zooms and ops[-2] == "zoom":
        return call_text("image_ops", op="autocontrast", image=str(payload_field(zooms[-1], "image_id")))
    regions = _regions(task, done)
    if len(zooms) >= len(regions):
        return None
    return call_text("image_ops", op="zoom", image=photo, region=regions[len(zooms)])


def _regions(task: Task, done: list[ToolResult]) -> list[str]:
    """The ids of find_text's regions that overlap the gold plate box, most overlapping first (at most two)."""
    found = next((r for r in done if payload_field(r, "op") == "find_text"), None)
    boxes = [(b["id"], list(b["box"])) for b in payload_field(found, "boxes") or []] if found else []  # type: ignore[attr-defined]
    assert task.meta.plate_box is not None
    x, y, w, h = task.meta.plate_box
    gold = [x, y, x + w, y + h]
    scored = sorted(((iou(box, gold), region) for region, box in boxes), key=lambda pair: -pair[0])
    return [region for score, region in scored if score > 0][:2]


def iou(a: Sequence[float], b: Sequence[float]) -> float:
    """Intersection over union of two [x0, y0, x1, y1] boxes."""
    width = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    height = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = width * height
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def read_lines(done: list[ToolResult]) -> list[str]:
    """Every line `read` returned so far."""
    texts = [str(payload_field(r, "text") or "") for r in done if payload_field(r, "op") == "read"]
    return [line for text in texts for line in text.splitlines() if line.strip()]


def _plate_reads(done: list[ToolResult]) -> list[str]:
    """The plate-like readings of the last read."""
    last = str(payload_field(done[-1], "text") or "")
    return [n for n in map(normalize_plate, last.splitlines()) if _PLATE_LIKE.match(n)]


def _answer(task: Task, done: list[ToolResult], trust_reference: bool) -> str:
    """The reference when a read showed it (or when trusted), else the most plate-like reading."""
    lines = read_lines(done)
    if trust_reference or normalize_plate(task.reference) in normalize_plate(" ".join(lines)):
        return task.reference
    plate_like = [line for line in lines if _PLATE_LIKE.match(normalize_plate(line))]
    return max(plate_like or lines, key=lambda s: len(normalize_plate(s)), default=NO_ANSWER)
