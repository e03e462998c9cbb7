"""plate_audit: read the licence plates of N photos in one episode, one plate per line, in order.

The items are plate_reading tasks of one split (training/tasks/batch.py bundles them; photos never cross splits),
listed to the policy by handle as "Image i: img_8bf8dd" (the photos are attached to the episode; a path would
cost ~30 tokens a line, ~500 more over 32 photos, and the policy copied them badly). A photo takes the plate expert ~3-4 image_ops calls (load,
find_text, zoom, read), so N = 32 is a ~100-call episode. Reward: the fraction of lines that match their plate
(`plate_match`; graded: the mean `plate_similarity`); success: every line right. Expert: the plate expert photo by photo, recording each plate.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from pathlib import Path

from main_agent.types import Turn
from training.tasks import batch, plates
from training.tasks.family import Family
from training.tasks.task import Task

NAME = "plate_audit"
QUESTION = "Read the licence plate in each of these {n} photos; answer with one plate per line, in order."
DEFAULT_ITEMS = 4  # photos per task unless the run says otherwise (`[horizon] items`)


def item_lines(i: int, item: Task) -> str:
    return f"Image {i}: {item.attachments[0].handle}"


def load(data_dir: Path, split: str, *, limit: int | None = None, items: int = DEFAULT_ITEMS) -> list[Task]:
    """Bundles of `items` photos of the split (batch.bundle), each item's photo named by its handle."""
    photos = plates.load(data_dir, split)
    bundles = batch.bundle(NAME, photos, items, question=QUESTION, item_lines=item_lines, limit=limit)
    root = str(Path(str(photos[0].meta.image_path)).parents[1]) if photos else None
    return [dataclasses.replace(t, meta=dataclasses.replace(t.meta, media_root=root)) for t in bundles]


def reward(answer: str, reference: str) -> float:
    return batch.reward(answer, reference, plates.FAMILY)


def success(answer: str, reference: str) -> bool:
    return batch.success(answer, reference, plates.FAMILY)


def graded_reward(answer: str, reference: str) -> float:
    return batch.mean_item_score(answer, reference, plates.graded_reward)


def item_reward(text: str, reference: str) -> float:
    return plates.reward(text, reference)


@contextlib.contextmanager
def prepared(tasks: Sequence[Task], work_dir: Path, *, data_dir: Path | None = None) -> Iterator[list[Task]]:
    with batch.prepared(tasks, work_dir, plates.FAMILY, item_lines, data_dir=data_dir) as ready:
        yield ready


def oracle_reply(task: Task, turns: list[Turn], *, trust_reference: bool) -> str:
    return batch.oracle_reply(task, turns, plates.FAMILY, trust_reference=trust_reference)


def mistake_reply(task: Task, turns: list[Turn]) -> str | None:
    """The plate expert's mistake at the first turn of each photo (`plates.mistake_reply`)."""
    return batch.mistake_reply(task, turns, plates.FAMILY)


FAMILY = Family(
    name=NAME, tools=plates.TOOLS, load=load, reward=reward, success=success, prepared=prepared,
    oracle_reply=oracle_reply, graded_reward=graded_reward, mistake_reply=mistake_reply, item_reward=item_reward,
)  # fmt: skip
