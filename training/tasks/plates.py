"""plate_reading: read the licence plate in a car photo with image_ops.

Photos and labels come from the shared US and EU sets (`file<TAB>x<TAB>y<TAB>w<TAB>h<TAB>PLATE` per photo), split
by a hash of the file name. The photo is attached to the episode and the context names it by handle ("Image:
img_8bf8dd", from its bytes: the same on every machine); its path and the plate box are metadata the policy never
sees.

Reward and success: `plate_match` (letters and digits only, case-insensitive); `graded_reward` is its partial
credit (`plate_similarity`: 1 - normalised edit distance), what a run with `reward_kind = "graded"` trains on.

Expert: find_text on the attached photo (where text is, never what it says) -> zoom on a returned region by its
id (image_ops adds the margin) -> read -> answer the read's plate-shaped text (conductor/plates.py `plate_shaped`:
letters and digits in a plate's length, not a state, city, date or dealer line), which the read's observation
names ("plate-shaped: AZJ6991"), never the label the policy cannot see. When a read holds no plate-shaped text it
retries, up to MAX_ATTEMPTS zoomed reads: the first region not zoomed yet (which the read names), or when none is
left an autocontrast of the first zoom;
then it answers GAVE_UP, in plain words. The regions are tried in find_text's order (r1, the largest, first), as the policy sees
them: the expert uses no metadata, so every demonstration is one the policy can follow (docs/plates.md weighs this
against zooming the plate's region first). A refused call (a mistyped image, or one the store forgot) is made good from the
photo's handle, always valid; after MAX_REFUSALS refused calls it answers what it has, and plate_audit moves on to
the next photo.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path

from conductor.plates import plate_shaped
from main_agent.types import ToolCall, ToolResult, Turn
from subagents.handles import Attachment, file_key
from training.rewards import plate_match, plate_similarity
from training.tasks.family import Family
from training.tasks.task import (
    Task,
    TaskMeta,
    answer_text,
    call_text,
    context_lines,
    hash_split,
    payload_field,
)

NAME = "plate_reading"
TOOLS = ("image_ops",)
QUESTION = "What is the licence plate number?"


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
    return Task(task_id, NAME, QUESTION, TOOLS, fields[5], photo.line, meta, attachments=(photo,))


def load(data_dir: Path, split: str, *, limit: int | None = None) -> list[Task]:
    """Licence plate photos (EU, then US: the folders in order, then by file name) whose hashed file name
    falls in `split`."""
    labels = sorted((data_dir / "images" / "plates" / "endtoend").glob("*/*.txt"))
    return [t for t in map(_task, labels) if t.meta.split == split][:limit]


@contextlib.contextmanager
def prepared(tasks: Sequence[Task], work_dir: Path, *, data_dir: Path | None = None) -> Iterator[list[Task]]:
    """Photos are read where they lie: nothing to prepare."""
    yield list(tasks)


# ---------------------------------------------------------------- the expert

# Zoomed reads a photo gets (regions, then an autocontrast): find_text, three zoom -> read pairs and the answer
# fill the 8 turns of the shipped recipe (examples/default_policy_sft.toml).
MAX_ATTEMPTS = 3
# Refused calls on one photo before the expert answers what it has: plate_audit then records it and moves on.
MAX_REFUSALS = 2
# What the expert answers when no read showed plate-shaped text and its attempts ran out: what a user pointing
# the assistant at a photo should read then, rather than a line of the read or a bare "none". Demonstrations
# that end so are kept (training/experts.py `worth_imitating`): honest, though never right.
GAVE_UP = "could not read the plate"


def oracle_reply(task: Task, turns: list[Turn], *, trust_reference: bool) -> str:
    """The next step of find_text -> zoom -> read (-> the next region or an autocontrast -> read) -> answer."""
    images = context_lines(task, "Image")
    if not images:
        raise ValueError(f"task {task.task_id} has no image line in its context")
    done = image_calls(turns)
    step = _next_step(images[0], done)
    return step or answer_text(task.reference if trust_reference else _answer(done))


def mistake_reply(task: Task, turns: list[Turn]) -> str | None:
    """A policy's mistake where one fits, else None:

    - at the photo's first turn, a zoom on region r1 of the photo before find_text named any region (the audits'
      most frequent refused call: 28 of 34 in bench_credit's 32-photo audit). image_ops refuses it ("no regions
      yet: call find_text on it first") and the expert goes on with find_text;
    - right after find_text named two regions or more, a zoom on r2, not the first region. Its read usually
      shows no plate and names the regions not zoomed yet; the expert retries on the first of them (r1, then
      r3): the retry that natural demonstrations show on ~1 photo in 20, demonstrated on every photo that
      draws it.
    """
    images = context_lines(task, "Image")
    if not images:
        return None
    if not turns:
        return call_text("image_ops", op="zoom", image=images[0], region="r1")
    served = usable(image_calls(turns))
    found = regions(served)
    if served and payload_field(served[-1], "op") == "find_text" and len(found) >= 2:
        return call_text("image_ops", op="zoom", image=images[0], region=found[1])
    return None


def image_calls(turns: list[Turn]) -> list[tuple[ToolCall, ToolResult]]:
    """Every image_ops call so far with its result, in order."""
    return [
        (c, r)
        for turn in turns
        for c, r in zip(turn.calls, turn.results, strict=True)
        if c.name == "image_ops"
    ]


def usable(done: list[tuple[ToolCall, ToolResult]]) -> list[ToolResult]:
    """The served results, less those a later call was refused on (a mistyped or forgotten image: the expert
    makes it again from the photo, whose handle is always valid)."""
    return [result for _, result in usable_calls(done)]


def usable_calls(done: list[tuple[ToolCall, ToolResult]]) -> list[tuple[ToolCall, ToolResult]]:
    """`usable`, each result with the call that made it."""
    served: list[tuple[ToolCall, ToolResult]] = []
    for call, result in done:
        if not result.ok:
            image = call.arguments.get("image")
            served = [(c, r) for c, r in served if payload_field(r, "image_id") != image]
        else:
            served.append((call, result))
    return served


def _next_step(photo: str, done: list[tuple[ToolCall, ToolResult]]) -> str | None:
    """The call that follows, or None when it is time to answer: a plate-shaped read, no attempt left, or
    MAX_REFUSALS refused calls."""
    if sum(not r.ok for _, r in done) >= MAX_REFUSALS:
        return None
    served_calls = usable_calls(done)
    if not any(payload_field(r, "op") == "find_text" for _, r in served_calls):
        return call_text("image_ops", op="find_text", image=photo)
    last = served_calls[-1][1]
    op = payload_field(last, "op")
    if op in ("zoom", "autocontrast"):
        return call_text("image_ops", op="read", image=str(payload_field(last, "image_id")))
    if op == "read" and plate_shaped(str(payload_field(last, "text") or "")):
        return None
    return _retry(photo, served_calls)


def _retry(photo: str, served_calls: list[tuple[ToolCall, ToolResult]]) -> str | None:
    """After find_text or a read without plate-shaped text: zoom on the next region (`next_region`), or when
    none is left, autocontrast the first zoom; None after MAX_ATTEMPTS."""
    served = [result for _, result in served_calls]
    zooms = [r for r in served if payload_field(r, "op") == "zoom"]
    tries = len(zooms) + sum(payload_field(r, "op") == "autocontrast" for r in served)
    if tries >= MAX_ATTEMPTS:
        return None
    zoomed = [str(c.arguments.get("region")) for c, r in served_calls if payload_field(r, "op") == "zoom"]
    region = next_region(regions(served), zoomed)
    if region is not None:
        return call_text("image_ops", op="zoom", image=photo, region=region)
    if zooms and tries == len(zooms):
        return call_text("image_ops", op="autocontrast", image=str(payload_field(zooms[0], "image_id")))
    return None


def next_region(order: list[str], zoomed: list[str]) -> str | None:
    """The first region of find_text's `order` not zoomed yet, the first one a read without a plate names
    ("not zoomed yet: r1, r3"): r1, r2, r3 in turn; after r2 first (a deliberate mistake), r1, then r3. None
    when every region is zoomed."""
    return next((r for r in order if r not in zoomed), None)


def regions(served: list[ToolResult]) -> list[str]:
    """The ids of find_text's regions in its order (r1, the largest, first): the order the policy sees them in.
    The gold plate box orders nothing: a region chosen by it would be a choice the policy cannot make, and
    demonstrations zooming straight on the plate's region never show a retry (docs/plates.md)."""
    found = next((r for r in served if payload_field(r, "op") == "find_text"), None)
    return [str(b["id"]) for b in payload_field(found, "boxes") or []] if found else []  # type: ignore[attr-defined]


def read_texts(done: list[tuple[ToolCall, ToolResult]]) -> list[str]:
    """What every served read returned, in order."""
    return [str(payload_field(r, "text") or "") for _, r in done if r.ok and payload_field(r, "op") == "read"]


def _answer(done: list[tuple[ToolCall, ToolResult]]) -> str:
    """The plate-shaped text of the last read that held some, else GAVE_UP: never the label, which no
    observation shows."""
    return next((p for text in reversed(read_texts(done)) if (p := plate_shaped(text))), GAVE_UP)


FAMILY = Family(
    name=NAME, tools=TOOLS, load=load, reward=reward, success=success, prepared=prepared,
    oracle_reply=oracle_reply, graded_reward=graded_reward, mistake_reply=mistake_reply, gave_up=GAVE_UP,
)  # fmt: skip
