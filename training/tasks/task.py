"""A task instance, its data folder, its split, and what every family's scripted expert shares.

A `Task` is a question, the sub-agents that may answer it and a gold answer, with `TaskMeta` holding what rewards
and experts need beyond what the policy is shown (a field is empty where a family has no use for it). Tasks are
plain JSON lines (`save_tasks` / `load_tasks`), so a run's task list can be kept beside its rollouts.

Splits of the photo and video families come from a fixed hash of the file name (`hash_split`): sha1, first 8
bytes / 2**64 in [0, 1); < 0.7 train, < 0.85 dev, else test; stable across machines, file orders and additions.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from main_agent.parse import ANSWER_CLOSE, ANSWER_OPEN, CALL_CLOSE, CALL_OPEN
from main_agent.types import ToolResult, Turn
from subagents.handles import Attachment

SPLITS = ("train", "dev", "test")
REPO = Path(__file__).resolve().parents[2]
NO_ANSWER = "unknown"  # what an expert answers when its observations offer nothing


@dataclass(frozen=True)
class TaskMeta:
    """What rewards and experts need beyond the question; a field is empty where a family has no use for it."""

    supporting_titles: tuple[str, ...] = ()  # multihop: titles of the paragraphs holding the supporting facts
    page_titles: tuple[str, ...] = ()  # multihop: each page's title, in page order
    page_paths: tuple[str, ...] = ()  # multihop: each page's path under the pages root, "<task_id>/<n>.html"
    hops: tuple[
        tuple[str, int], ...
    ] = ()  # multihop (MuSiQue): (sub-question with #k placeholders, page index)
    image_path: str | None = None  # plates: absolute path of the photo (the policy sees its handle)
    plate_box: tuple[int, int, int, int] | None = None  # plates: (x, y, w, h) of the plate, in pixels
    video_path: str | None = None  # video: absolute path of the clip the policy is pointed at
    subtitle: str | None = None  # video: the sentence `prepared` muxes in; None: the clip is used as is
    split: str = ""  # train, dev or test
    media_root: str | None = None  # item tasks: the folder their items' short media names are relative to
    corpus: str | None = None  # search families: the folder the tool server's search indexes


@dataclass(frozen=True)
class Task:
    """One task instance, serialisable to a JSON line (`save_tasks` / `load_tasks`)."""

    task_id: str  # unique across families; letters, digits, '-' and '_' (it names page folders and videos)
    family: str  # a key of tasks.FAMILIES
    question: str
    tools: tuple[str, ...]  # the sub-agents the policy may call
    reference: str  # the gold answer
    context: str = ""  # lines appended to the question, e.g. "Image: img_8bf8dd" or "Page: d_3fa9c1 <title>"
    meta: TaskMeta = TaskMeta()
    items: tuple[Task, ...] = ()  # an item task's items (training/tasks/batch.py), one answer line each
    attachments: tuple[Attachment, ...] = ()  # what the context names by handle, registered before turn 1


def save_tasks(path: Path, tasks: Iterable[Task]) -> None:
    """Write one JSON object per task; written to a temporary file and renamed, so readers never see half a file."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for task in tasks:
            f.write(json.dumps(dataclasses.asdict(task), ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def load_tasks(path: Path) -> list[Task]:
    """Read what `save_tasks` wrote. Every JSON list is a tuple in the dataclasses, so the round trip is exact."""
    return [_task(json.loads(line)) for line in path.read_text(encoding="utf-8").splitlines()]


def _task(row: dict) -> Task:
    meta = TaskMeta(**{k: _tuples(v) for k, v in row.pop("meta").items()})  # type: ignore[arg-type]
    items = tuple(_task(item) for item in row.pop("items", []))
    attachments = tuple(Attachment(**a) for a in row.pop("attachments", []))
    return Task(
        **{**row, "tools": tuple(row["tools"]), "meta": meta, "items": items, "attachments": attachments}
    )


def _tuples(value: object) -> object:
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def data_root(data_dir: Path | None = None) -> Path:
    """The shared data folder: `data_dir`, else $CONDUCTOR_DATA, else ../shared/data beside the repository."""
    path = data_dir or Path(os.environ.get("CONDUCTOR_DATA", REPO.parent / "shared" / "data"))
    if not path.is_dir():
        raise FileNotFoundError(f"task data folder not found: {path} (set CONDUCTOR_DATA to the shared data)")
    return path


def hash_split(name: str) -> str:
    """train / dev / test from sha1(name) read as a number in [0, 1): < 0.7, < 0.85, else."""
    x = int.from_bytes(hashlib.sha1(name.encode()).digest()[:8], "big") / 2**64
    return "train" if x < 0.7 else "dev" if x < 0.85 else "test"


# ---------------------------------------------------------------- what every expert shares
# An expert (training/experts.py's OraclePolicy) writes replies in the policy's own format from the task and the
# turns played so far. Every argument it writes comes from what the policy has seen (the question, the context
# lines, the structured results of earlier calls); the task's metadata only chooses among those options.


def call_text(name: str, **arguments: object) -> str:
    """One call in the policy's format (see main_agent.parse)."""
    return f"{CALL_OPEN}{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}{CALL_CLOSE}"


def answer_text(answer: str) -> str:
    return f"{ANSWER_OPEN}{answer}{ANSWER_CLOSE}"


def context_lines(task: Task, label: str) -> list[str]:
    """The values of the `<label>: ...` lines of the task's context, as the policy sees them."""
    prefix = f"{label}: "
    return [line[len(prefix) :].strip() for line in task.context.splitlines() if line.startswith(prefix)]


def results(turns: list[Turn]) -> list[ToolResult]:
    """Every call result of the turns so far, in order."""
    return [r for turn in turns for r in turn.results]


def payload_field(result: ToolResult, key: str) -> object:
    """One field of a result's structured payload (None when absent)."""
    return (result.payload or {}).get(key)
