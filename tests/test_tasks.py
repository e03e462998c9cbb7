"""Task loaders on the real shared data: counts, fields, splits, pages over loopback, subtitles, scoring."""

from __future__ import annotations

import json
import logging
import re
import subprocess
from pathlib import Path

import httpx
import imageio_ffmpeg
import pytest
from PIL import Image

from subagents.handles import Attachment, file_key, handle_for
from training import tasks as T
from training.rewards import normalize_plate
from training.tasks import Task, TaskMeta, multihop, video

FAMILIES = tuple(T.FAMILIES)
EVAL_ONLY = ("research_corpus",)  # no train split: held out of training on purpose


def all_splits(family: str, data: Path) -> dict[str, list[Task]]:
    splits = [s for s in T.SPLITS if not (family in EVAL_ONLY and s == "train")]
    return {split: T.load_family(family, split, data_dir=data) for split in splits}


def test_counts_per_split(shared_data: Path) -> None:
    """Each family yields the documented number of tasks per split, with ids unique across all of them."""
    expected = {
        "multihop_pages": {"train": 500, "dev": 300, "test": 500},
        "plate_reading": {"train": 233, "dev": 49, "test": 48},
        "video_qa": {"train": 7, "dev": 2, "test": 3},
        "plate_audit": {
            "train": 58,
            "dev": 12,
            "test": 12,
        },  # 4 photos each (the default), remainder left out
        "multihop_batch": {"train": 125, "dev": 75, "test": 125},
        "corpus_qa": {"train": 500, "dev": 300, "test": 500},
        "research_corpus": {"dev": 36, "test": 36},  # one held-out set: dev and test are the same questions
    }
    ids: list[str] = []
    for family in FAMILIES:
        by_split = all_splits(family, shared_data)
        assert {s: len(ts) for s, ts in by_split.items()} == expected[family]
        ids += [t.task_id for s, ts in by_split.items() for t in ts if family not in EVAL_ONLY or s == "dev"]
    assert len(ids) == len(set(ids))


def test_multihop_fields(shared_data: Path) -> None:
    """Every multihop task has an answer, one page per paragraph and supporting titles among its pages."""
    by_split = all_splits("multihop_pages", shared_data)
    for split, tasks in by_split.items():
        for task in tasks:
            assert task.question and task.reference.strip() and task.tools == ("page_qa",)
            assert task.meta.split == split
            assert 2 <= len(task.meta.page_paths) == len(task.meta.page_titles) <= 20
            assert task.meta.page_paths[0] == f"{task.task_id}/0.html"
            assert task.meta.supporting_titles and set(task.meta.supporting_titles) <= set(
                task.meta.page_titles
            )
    musique = [t for t in by_split["train"] if t.task_id.startswith("musique-")]
    assert len(musique) == 100 and all(len(t.meta.page_paths) == 20 for t in musique)
    first = by_split["train"][0]
    assert (first.reference, first.meta.supporting_titles) == (
        "October 1922",
        ("Socialist Revolutionary Party", "Russian Civil War"),
    )


def test_plate_boxes_lie_inside_their_photos(shared_data: Path) -> None:
    """Plate boxes parse as four positive ints inside the image; the question, tool and context are set."""
    tasks = [t for ts in all_splits("plate_reading", shared_data).values() for t in ts]
    assert len(tasks) == 330
    for task in tasks:
        assert task.meta.image_path is not None and task.meta.plate_box is not None
        x, y, w, h = task.meta.plate_box
        width, height = Image.open(task.meta.image_path).size
        assert x >= 0 and y >= 0 and w > 0 and h > 0 and x + w <= width and y + h <= height, task.task_id
        [photo] = task.attachments
        assert (photo.kind, photo.source) == ("image", task.meta.image_path) and task.tools == ("image_ops",)
        assert task.context == f"Image: {photo.handle}" and photo.handle.startswith("img_")
        assert re.fullmatch(r"[A-Z0-9]{4,8}", task.reference), task.reference
    eu1 = next(t for t in tasks if t.task_id == "plate-eu-eu1")
    assert (eu1.reference, eu1.meta.plate_box) == ("M5XSX", (396, 340, 203, 46))


def test_hash_split_is_fixed_deterministic_and_disjoint(shared_data: Path) -> None:
    """The split of a file name never changes; loading twice gives the same tasks; splits share no task."""
    names = ("eu1.jpg", "test_008.jpg", "bbaf2n.mpg", "brbk7n.mpg", "lbax4n.mpg")
    assert [T.hash_split(n) for n in names] == ["train", "dev", "train", "test", "dev"]
    for family in ("plate_reading", "video_qa"):
        first, second = all_splits(family, shared_data), all_splits(family, shared_data)
        assert first == second
        ids = [{t.task_id for t in first[s]} for s in T.SPLITS]
        assert not (ids[0] & ids[1] or ids[0] & ids[2] or ids[1] & ids[2])


def test_limit_keeps_the_first_tasks(shared_data: Path) -> None:
    """`limit` is a prefix of the full, fixed order."""
    full = T.load_family("multihop_pages", "dev", data_dir=shared_data)
    assert T.load_family("multihop_pages", "dev", data_dir=shared_data, limit=3) == full[:3]


def test_jsonl_round_trip_is_lossless(shared_data: Path, tmp_path: Path) -> None:
    """Tasks of every family (tuples, None, boxes, unicode titles) survive save_tasks -> load_tasks unchanged."""
    tasks = [
        t
        for family in FAMILIES
        for t in T.load_family(
            family, "dev" if family in EVAL_ONLY else "train", data_dir=shared_data, limit=20
        )
    ]
    path = tmp_path / "tasks.jsonl"
    T.save_tasks(path, tasks)
    assert T.load_tasks(path) == tasks
    assert len(path.read_text(encoding="utf-8").splitlines()) == len(tasks)


def test_page_server_serves_written_pages(shared_data: Path, tmp_path: Path) -> None:
    """write_pages writes one HTML page per paragraph, attached by URL (over real loopback HTTP) and listed by
    handle and title; the handles come from the pages' paths, not the server's port."""
    tasks = T.load_family("multihop_pages", "dev", data_dir=shared_data, limit=2)
    assert multihop.write_pages(tasks, tmp_path, data_dir=shared_data) == sum(
        len(t.meta.page_paths) for t in tasks
    )
    with multihop.PageServer(tmp_path) as server:
        task = multihop.with_base_url(tasks[0], server.base_url)
        lines = task.context.splitlines()
        assert len(lines) == len(task.meta.page_paths)
        title, url = task.meta.page_titles[0], task.attachments[0].source
        handle = handle_for("page", f"pages/{task.meta.page_paths[0]}")
        assert lines[0] == f"Page: {handle} {title}" and url.startswith("http://127.0.0.1:")
        page = httpx.get(url, timeout=5.0)
        assert page.status_code == 200
        assert f"<h1>{title}</h1>" in page.text and "<p>" in page.text
        assert httpx.get(f"{server.base_url}/nope.html", timeout=5.0).status_code == 404
    with pytest.raises(httpx.ConnectError):
        httpx.get(url, timeout=5.0)


def test_page_html_escapes_and_joins_sentences() -> None:
    """Titles and text are HTML-escaped; sentences are joined with single spaces."""
    html = multihop.page_html(("A & <B>", ["First.", " Second <i>x</i>."]))
    assert "<title>A &amp; &lt;B&gt;</title>" in html and "<h1>A &amp; &lt;B&gt;</h1>" in html
    assert "<p>First. Second &lt;i&gt;x&lt;/i&gt;.</p>" in html


def test_unmappable_multihop_records_are_skipped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Records with a missing field, no answer or non-text sentences are skipped with a counted warning."""
    good = {"id": "g1", "question": "Q?", "answer": "A", "supporting_facts": {"title": ["T"], "sent_id": [0]}}
    good["context"] = {"title": ["T"], "sentences": [["S."]]}
    numbers = {"title": ["T"], "sentences": [[1, 2]]}
    rows = [good, {"id": "b1", "question": "Q?"}, {**good, "id": "b2", "answer": " "}]
    rows += [{**good, "id": "b3", "answer": None}, {**good, "id": "b4", "context": numbers}]
    (tmp_path / "multihop").mkdir()
    (tmp_path / "multihop" / "hotpotqa_dev.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    with caplog.at_level(logging.WARNING):
        tasks = T.load_family("multihop_pages", "dev", data_dir=tmp_path)
    assert [t.task_id for t in tasks] == ["hotpotqa-g1"]
    assert "skipped 4 records" in caplog.text


def test_missing_data_and_bad_names_fail_clearly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A missing data folder names its path and CONDUCTOR_DATA; unknown families and splits are refused."""
    monkeypatch.setenv("CONDUCTOR_DATA", str(tmp_path / "absent"))
    with pytest.raises(FileNotFoundError, match="absent.*CONDUCTOR_DATA"):
        T.load_family("plate_reading", "train")
    with pytest.raises(ValueError, match="unknown task family"):
        T.load_family("chess", "train", data_dir=tmp_path)
    with pytest.raises(ValueError, match="unknown split"):
        T.load_family("plate_reading", "validation", data_dir=tmp_path)


def ffmpeg_stderr(*args: str) -> str:
    argv = [imageio_ffmpeg.get_ffmpeg_exe(), "-nostdin", "-hide_banner", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False).stderr


def test_prepare_videos_muxes_the_sentence_as_subtitles(shared_data: Path, tmp_path: Path) -> None:
    """GRID tasks point at a new .mp4 whose subtitle track holds the spoken sentence over the whole clip;
    the Kinetics task is left as is; a second call reuses the files."""
    tasks = T.load_family("video_qa", "dev", data_dir=shared_data) + [
        t
        for t in T.load_family("video_qa", "train", data_dir=shared_data)
        if t.task_id.startswith("kinetics")
    ]
    prepared = video.prepare_videos(tasks, tmp_path)
    assert prepared[-1] == tasks[-1]
    grid = prepared[0]
    out = Path(grid.meta.video_path or "")
    assert out.parent == tmp_path.resolve() and out.suffix == ".mp4"
    assert grid.attachments == (Attachment("video", str(out), file_key(out)),)
    assert grid.context == f"Video: {grid.attachments[0].handle}" and str(tmp_path) not in grid.context
    probe = ffmpeg_stderr("-i", str(out))
    assert "Subtitle: mov_text" in probe and "Video: h264" in probe and "Duration: 00:00:03.00" in probe
    srt = tmp_path / "cue.srt"
    ffmpeg_stderr("-i", str(out), "-map", "0:s:0", str(srt))
    assert grid.reference in srt.read_text() and "00:00:00,000 --> 00:00:03,000" in srt.read_text()
    mtime = out.stat().st_mtime_ns
    assert video.prepare_videos(tasks, tmp_path) == prepared and out.stat().st_mtime_ns == mtime


def test_mux_failure_raises_with_ffmpeg_message(tmp_path: Path) -> None:
    """A clip ffmpeg cannot read raises instead of leaving a broken video behind."""
    bogus = tmp_path / "bogus.mpg"
    bogus.write_bytes(b"not a video")
    with pytest.raises(RuntimeError):
        video.mux_subtitles(bogus, "hello", tmp_path / "out.mp4")
    assert not (tmp_path / "out.mp4").exists()


def test_reward_and_success_per_family() -> None:
    """Plates score by plate match, text families by token F1 / exact match; no answer scores 0 and fails."""
    plate = Task("p", "plate_reading", "?", ("image_ops",), "YG9X2G", meta=TaskMeta(split="dev"))
    assert T.reward_for(plate, "yg9-x2g") == 1.0 and T.success(plate, "yg9-x2g")
    assert T.reward_for(plate, "YG9X26") == 0.0 and not T.success(plate, "YG9X26")
    for family in ("multihop_pages", "video_qa"):
        text = Task("t", family, "?", (), "set white with p two soon")
        assert T.reward_for(text, "Set white with P two soon.") == 1.0 and T.success(
            text, "set white with p two soon"
        )
        assert T.reward_for(text, "set white") == pytest.approx(2 * (1.0 * 2 / 6) / (1 + 2 / 6))
        assert not T.success(text, "set white")
    for task in (plate, text):
        assert T.reward_for(task, None) == 0.0 and not T.success(task, None)


def test_graded_reward_gives_partial_credit_where_the_reward_is_exact() -> None:
    """kind="graded": plates score 1 - normalised edit distance (success stays exact); the text families keep
    their own reward (token F1, graded already); no answer still scores 0."""
    plate = Task("p", "plate_reading", "?", ("image_ops",), "YG9X2G", meta=TaskMeta(split="dev"))
    assert T.reward_for(plate, "YG9X26", kind="graded") == pytest.approx(5 / 6)
    assert T.reward_for(plate, "YG9X26") == 0.0 and not T.success(plate, "YG9X26")
    assert T.reward_for(plate, "yg9x2g", kind="graded") == 1.0
    assert T.reward_for(plate, None, kind="graded") == 0.0
    text = Task("t", "multihop_pages", "?", (), "set white with p two soon")
    assert T.reward_for(text, "set white", kind="graded") == T.reward_for(text, "set white")


def test_musique_tasks_carry_their_decomposition(shared_data: Path, tmp_path: Path) -> None:
    """Every MuSiQue train question keeps its hops: a sub-question per hop (later hops name earlier answers as
    #k) and the page that answers it; HotpotQA questions have none. Hops survive the JSON round trip."""
    train = T.load_family("multihop_pages", "train", data_dir=shared_data)
    musique = [t for t in train if t.task_id.startswith("musique-")]
    assert len(musique) == 100 and all(2 <= len(t.meta.hops) <= 4 for t in musique)
    assert all(0 <= page < len(t.meta.page_paths) for t in musique for _, page in t.meta.hops)
    assert all(any("#" in question for question, _ in t.meta.hops[1:]) for t in musique)
    assert not any(t.meta.hops for t in train if t.task_id.startswith("hotpotqa-"))
    path = tmp_path / "musique.jsonl"
    T.save_tasks(path, musique)
    assert T.load_tasks(path) == musique


def test_item_tasks_bundle_one_split_deterministically(shared_data: Path) -> None:
    """A bundle's items come from its own split only, every item at most once per N, the same items for the same
    id on every load; its reference is its items' references, one per line."""
    for family in ("plate_audit", "multihop_batch"):
        for n in (1, 4, 8):
            tasks = T.load_family(family, "dev", data_dir=shared_data, items=n)
            assert all(len(t.items) == n and all(i.meta.split == "dev" for i in t.items) for t in tasks)
            items = [i.task_id for t in tasks for i in t.items]
            assert len(items) == len(set(items))
            again = T.load_family(family, "dev", data_dir=shared_data, items=n)
            assert [(t.task_id, t.items) for t in again] == [(t.task_id, t.items) for t in tasks]
            assert tasks[0].reference.splitlines() == [i.reference for i in tasks[0].items]
    audit = T.load_family("plate_audit", "dev", data_dir=shared_data, items=32)
    assert len(audit) == 1 and audit[0].task_id == "plate_audit-dev-n32-000"
    first = audit[0].items[0].attachments[0]
    assert audit[0].context.splitlines()[0] == f"Image 1: {first.handle}" and "/" not in audit[0].context
    assert audit[0].attachments == tuple(i.attachments[0] for i in audit[0].items)


def test_item_rewards_score_each_line_against_its_item(shared_data: Path) -> None:
    """Reward is the mean per-line score (missing lines 0); success needs every line; one recorded item is
    scored by its own reference."""
    [task] = T.load_family("plate_audit", "dev", data_dir=shared_data, items=4, limit=1)
    plates = [i.reference for i in task.items]
    assert T.reward_for(task, "\n".join(plates)) == 1.0 and T.success(task, "\n".join(plates))
    half = "\n".join([plates[0], "WRONG1", plates[2]])
    assert T.reward_for(task, half) == 0.5 and not T.success(task, half)
    assert T.item_reward(task, 2, plates[1].lower()) == 1.0 and T.item_reward(task, 2, plates[0]) == 0.0
    second = normalize_plate(plates[1])
    one_off = second[:-1] + ("0" if second[-1] != "0" else "1")  # the second plate, last character wrong
    graded = T.reward_for(task, "\n".join([plates[0], one_off]), kind="graded")
    assert graded == pytest.approx((1 + 1 - 1 / len(second)) / 4)  # graded: the mean plate_similarity
    [batch] = T.load_family("multihop_batch", "dev", data_dir=shared_data, items=2, limit=1)
    answers = [i.reference for i in batch.items]
    assert T.reward_for(batch, "\n".join(answers)) == 1.0
    assert T.reward_for(batch, answers[0]) == 0.5


def test_item_tasks_round_trip_through_jsonl(shared_data: Path, tmp_path: Path) -> None:
    """Bundles with their nested items survive save_tasks -> load_tasks unchanged."""
    tasks = T.load_family("plate_audit", "train", data_dir=shared_data, items=4, limit=3)
    tasks += T.load_family("multihop_batch", "train", data_dir=shared_data, items=2, limit=3)
    T.save_tasks(tmp_path / "t.jsonl", tasks)
    assert T.load_tasks(tmp_path / "t.jsonl") == tasks
