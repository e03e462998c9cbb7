"""Tasks (a question, the tools that may answer it, a gold answer) and loaders over the shared real data.

`TASK_FAMILIES` maps a family to `loader(data_dir, split, *, limit=None) -> list[Task]`; adding a family is one
loader and one entry. `reward_for` / `success` score plates with `plate_match`, every other family as text.

- multihop_pages (page_qa): HotpotQA; train adds HippoRAG's HotpotQA and MuSiQue train subsets. Each paragraph
  becomes one HTML page read over loopback (the tool server needs `allow_private_cidrs=("127.0.0.0/8",)`):

      tasks = load_family("multihop_pages", "train")
      write_pages(tasks, pages_root)        # <pages_root>/<task_id>/<n>.html, as in meta.page_paths
      with PageServer(pages_root) as server:
          tasks = [with_base_url(t, server.base_url) for t in tasks]   # context: "Page: <title> <url>" lines
- plate_reading (image_ops): car photos with plate text and box; context "Image: <abs path>".
- video_qa (video_summary): GRID clips, whose sentence reaches the sub-agent only once `prepare_videos` muxes it
  in as a subtitle track (until then `context` names the raw clip), and a Kinetics clip with its action label.

Splits: multihop keeps the files' splits (RPT's 300/300/500, all official HotpotQA dev questions; train adds 200
HippoRAG train questions). Plates and videos split by a fixed hash of the file name (`hash_split`: sha1, first 8
bytes / 2**64 in [0, 1); < 0.7 train, < 0.85 dev, else test): stable across machines, file orders and additions.
The video set is tiny: train 7, dev 2, test 3.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import html
import json
import logging
import os
import subprocess
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from training.rewards import exact_match, plate_match, token_f1

logger = logging.getLogger(__name__)

SPLITS = ("train", "dev", "test")
REPO = Path(__file__).resolve().parent.parent
PLATE_QUESTION = "What is the licence plate number?"
SPEECH_QUESTION = "What sentence is spoken in this video?"
ACTION_QUESTION = "What action is shown in this video?"
# One 3-second GRID clip re-encodes in about 0.5 s on one core; 120 s leaves room on a loaded CI machine.
FFMPEG_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class TaskMeta:
    """What oracles and rewards need beyond the question; a field is empty where a family has no use for it."""

    supporting_titles: tuple[str, ...] = ()  # multihop: titles of the paragraphs holding the supporting facts
    page_titles: tuple[str, ...] = ()  # multihop: each page's title, in page order
    page_paths: tuple[str, ...] = ()  # multihop: each page's path under the pages root, "<task_id>/<n>.html"
    image_path: str | None = None  # plates: absolute path of the photo
    plate_box: tuple[int, int, int, int] | None = None  # plates: (x, y, w, h) of the plate, in pixels
    video_path: str | None = None  # video: absolute path of the clip the policy is pointed at
    subtitle: str | None = None  # video: the sentence `prepare_videos` muxes in; None: the clip is used as is
    split: str = ""  # train, dev or test


@dataclass(frozen=True)
class Task:
    """One task instance, serialisable to a JSON line (`save_tasks` / `load_tasks`)."""

    task_id: str  # unique across families; letters, digits, '-' and '_' (it names page folders and videos)
    family: str  # a key of TASK_FAMILIES
    question: str
    tools: tuple[str, ...]  # the sub-agents the policy may call
    reference: str  # the gold answer
    context: str = ""  # lines appended to the question, e.g. "Image: /abs/x.jpg" or "Page: <title> <url>"
    meta: TaskMeta = TaskMeta()


def save_tasks(path: Path, tasks: Iterable[Task]) -> None:
    """Write one JSON object per task; written to a temporary file and renamed, so readers never see half a file."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for task in tasks:
            f.write(json.dumps(dataclasses.asdict(task), ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def load_tasks(path: Path) -> list[Task]:
    """Read what `save_tasks` wrote. Every JSON list is a tuple in the dataclasses, so the round trip is exact."""
    tasks = []
    for line in path.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        meta_fields: dict = {k: tuple(v) if isinstance(v, list) else v for k, v in row.pop("meta").items()}
        meta = TaskMeta(**meta_fields)
        tasks.append(Task(**{**row, "tools": tuple(row["tools"]), "meta": meta}))
    return tasks


def reward_for(task: Task, answer: str | None) -> float:
    """Final reward in [0, 1]: `plate_match` for plates, else `token_f1`; no answer (a budget ran out) scores 0."""
    score = plate_match if task.family == "plate_reading" else token_f1
    return 0.0 if answer is None else score(answer, task.reference)


def success(task: Task, answer: str | None) -> bool:
    """Whether the answer is right: plate match for plates, normalised exact match otherwise; None is wrong."""
    match = plate_match if task.family == "plate_reading" else exact_match
    return answer is not None and match(answer, task.reference) == 1.0


def data_root(data_dir: Path | None = None) -> Path:
    """The shared data folder: `data_dir`, else $CONDUCTOR_DATA, else ../shared/data beside the repository."""
    path = data_dir or Path(os.environ.get("CONDUCTOR_DATA", REPO.parent / "shared" / "data"))
    if not path.is_dir():
        raise FileNotFoundError(f"task data folder not found: {path} (set CONDUCTOR_DATA to the shared data)")
    return path


def load_family(
    name: str, split: str, *, data_dir: Path | None = None, limit: int | None = None
) -> list[Task]:
    """The tasks of one family and split, in a fixed order; `limit` keeps the first ones."""
    if name not in TASK_FAMILIES:
        raise ValueError(f"unknown task family {name!r}; known: {sorted(TASK_FAMILIES)}")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; known: {SPLITS}")
    return TASK_FAMILIES[name](data_root(data_dir), split, limit=limit)


def hash_split(name: str) -> str:
    """train / dev / test from sha1(name) read as a number in [0, 1): < 0.7, < 0.85, else."""
    x = int.from_bytes(hashlib.sha1(name.encode()).digest()[:8], "big") / 2**64
    return "train" if x < 0.7 else "dev" if x < 0.85 else "test"


# ---------------------------------------------------------------- multihop_pages
# (title, sentences) -> one page; a record of any file -> (task id, question, answer, paragraphs, support)
Paragraph = tuple[str, Sequence[str]]
_Parsed = tuple[str, str, str, Sequence[Paragraph], Iterable[str]]
_WithPages = tuple[Task, Sequence[Paragraph]]


def _from_hf(row: dict) -> _Parsed:
    """RPT's HotpotQA rows (Hugging Face layout: parallel lists under context and supporting_facts)."""
    paragraphs = list(zip(row["context"]["title"], row["context"]["sentences"], strict=True))
    support = row["supporting_facts"]["title"]
    return f"hotpotqa-{row['id']}", row["question"], row["answer"], paragraphs, support


def _from_hipporag_hotpot(row: dict) -> _Parsed:
    """HippoRAG's HotpotQA rows (original layout: context [[title, sentences]], supporting_facts [[title, i]])."""
    support = (title for title, _ in row["supporting_facts"])
    return f"hotpotqa-{row['_id']}", row["question"], row["answer"], row["context"], support


def _from_musique(row: dict) -> _Parsed:
    """MuSiQue rows: paragraphs with one text each and an is_supporting flag. Answer aliases are not kept."""
    paragraphs = [(p["title"], [p["paragraph_text"]]) for p in row["paragraphs"]]
    support = (p["title"] for p in row["paragraphs"] if p["is_supporting"])
    return f"musique-{row['id']}", row["question"], row["answer"], paragraphs, support


_MULTIHOP_FILES: dict[str, tuple[tuple[str, Callable[[dict], _Parsed]], ...]] = {
    "train": (
        ("hotpotqa_train.jsonl", _from_hf),
        ("hipporag_hotpotqa_train.json", _from_hipporag_hotpot),
        ("hipporag_musique_train.json", _from_musique),
    ),
    "dev": (("hotpotqa_dev.jsonl", _from_hf),),
    "test": (("hotpotqa_test.jsonl", _from_hf),),
}


def _parse(parse: Callable[[dict], _Parsed], row: dict, split: str) -> _WithPages | None:
    """The task and paragraphs of a record; None if it does not map (bad fields, no paragraphs or answer)."""
    try:
        task_id, question, answer, paragraphs, support = parse(row)
        titles, support = tuple(str(t) for t, _ in paragraphs), tuple(dict.fromkeys(support))
        "".join(s for _, sentences in paragraphs for s in sentences)  # TypeError unless all are strings
    except (KeyError, TypeError, ValueError):
        return None
    if not titles or not isinstance(answer, str) or not answer.strip():
        return None
    paths = tuple(f"{task_id}/{n}.html" for n in range(len(titles)))
    meta = TaskMeta(support, titles, paths, split=split)
    return Task(task_id, "multihop_pages", question, ("page_qa",), answer, "", meta), paragraphs


def _multihop(data_dir: Path, split: str) -> Iterator[_WithPages]:
    """A split's records as tasks with paragraphs, in file order; unmappable ones are skipped with a warning."""
    for name, parse in _MULTIHOP_FILES[split]:
        text = (data_dir / "multihop" / name).read_text(encoding="utf-8")
        rows = [json.loads(x) for x in text.splitlines()] if name.endswith(".jsonl") else json.loads(text)
        parsed = [_parse(parse, row, split) for row in rows]
        if None in parsed:
            logger.warning("%s: skipped %d records that do not map to a task", name, parsed.count(None))
        yield from (p for p in parsed if p is not None)


def load_multihop(data_dir: Path, split: str, *, limit: int | None = None) -> list[Task]:
    """Multihop questions of a split (pages are described in meta, written by `write_pages`)."""
    return [task for task, _ in _multihop(data_dir, split)][:limit]


def page_html(paragraph: Paragraph) -> str:
    """One paragraph as a small HTML page: the title in <title> and <h1>, the text in one <p>."""
    title = html.escape(paragraph[0])
    text = html.escape(" ".join(s.strip() for s in paragraph[1] if s.strip()))
    head = f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8"><title>{title}</title></head>'
    return f"{head}\n<body><article><h1>{title}</h1>\n<p>{text}</p></article></body></html>\n"


def write_pages(tasks: Sequence[Task], pages_root: Path, *, data_dir: Path | None = None) -> int:
    """Write the pages of the multihop tasks (re-read from the data) under `pages_root`; return how many."""
    wanted = {t.task_id: t for t in tasks if t.family == "multihop_pages"}
    splits = sorted({t.meta.split for t in wanted.values()})
    found = {
        t.task_id: ps for s in splits for t, ps in _multihop(data_root(data_dir), s) if t.task_id in wanted
    }
    if missing := wanted.keys() - found.keys():
        raise ValueError(f"{len(missing)} tasks are not in the data, e.g. {sorted(missing)[:3]}")
    for task_id, paragraphs in found.items():
        for rel, paragraph in zip(wanted[task_id].meta.page_paths, paragraphs, strict=True):
            (pages_root / rel).parent.mkdir(parents=True, exist_ok=True)
            (pages_root / rel).write_text(page_html(paragraph), encoding="utf-8")
    return sum(len(wanted[task_id].meta.page_paths) for task_id in found)


def with_base_url(task: Task, base_url: str) -> Task:
    """The task with its context listing each page as "Page: <title> <url>"."""
    pages = zip(task.meta.page_titles, task.meta.page_paths, strict=True)
    lines = [f"Page: {title} {base_url.rstrip('/')}/{path}" for title, path in pages]
    return dataclasses.replace(task, context="\n".join(lines))


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # the base class's signature
        logger.debug("page server: " + format, *args)


class PageServer(ThreadingHTTPServer):
    """Serves a folder on 127.0.0.1 (a free port) from a daemon thread; a context manager, or call `close()`."""

    daemon_threads = True

    def __init__(self, root: Path) -> None:
        if not root.is_dir():
            raise FileNotFoundError(f"pages folder not found: {root}")
        super().__init__(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(root)))
        self._thread = threading.Thread(target=self.serve_forever, name="page-server", daemon=True)
        self._thread.start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def close(self) -> None:
        self.shutdown()
        self.server_close()
        self._thread.join()

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------- plate_reading
def _plate_task(txt: Path) -> Task:
    """One photo from its label file: `file<TAB>x<TAB>y<TAB>w<TAB>h<TAB>PLATE` (US and EU alike)."""
    fields = txt.read_text(encoding="utf-8").strip().split("\t")
    if len(fields) != 6:
        raise ValueError(f"{txt}: expected 6 tab-separated fields, got {fields}")
    image = (txt.parent / fields[0]).resolve()
    x, y, w, h = map(int, fields[1:5])
    meta = TaskMeta(image_path=str(image), plate_box=(x, y, w, h), split=hash_split(image.name))
    task_id = f"plate-{txt.parent.name}-{image.stem}"
    return Task(task_id, "plate_reading", PLATE_QUESTION, ("image_ops",), fields[5], f"Image: {image}", meta)


def load_plates(data_dir: Path, split: str, *, limit: int | None = None) -> list[Task]:
    """Licence plate photos (US, then EU, by file name) whose hashed file name falls in `split`."""
    labels = sorted((data_dir / "images" / "plates" / "endtoend").glob("*/*.txt"))
    return [t for t in map(_plate_task, labels) if t.meta.split == split][:limit]


# ---------------------------------------------------------------- video_qa
def _video_task(task_id: str, question: str, answer: str, clip: Path, subtitle: str | None) -> Task:
    clip = clip.resolve()
    meta = TaskMeta(video_path=str(clip), subtitle=subtitle, split=hash_split(clip.name))
    return Task(task_id, "video_qa", question, ("video_summary",), answer, f"Video: {clip}", meta)


def load_video_qa(data_dir: Path, split: str, *, limit: int | None = None) -> list[Task]:
    """GRID clips (transcripts.tsv: header, then `file<TAB>sentence`) and the Kinetics clip, split by file name."""
    grid, kinetics = data_dir / "video" / "grid", data_dir / "video" / "kinetics"
    tsv = (grid / "transcripts.tsv").read_text(encoding="utf-8")
    rows = [line.split("\t") for line in tsv.splitlines()[1:]]
    tasks = [_video_task(f"grid-{Path(n).stem}", SPEECH_QUESTION, text, grid / n, text) for n, text in rows]
    label = json.loads((kinetics / "label.json").read_text(encoding="utf-8"))
    clip, action = kinetics / label["video"], label["expected_top1_label"]
    tasks.append(_video_task(f"kinetics-{clip.stem}", ACTION_QUESTION, action, clip, None))
    return [t for t in tasks if t.meta.split == split][:limit]


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
    meta = dataclasses.replace(task.meta, video_path=str(out))
    return dataclasses.replace(task, context=f"Video: {out}", meta=meta)


# Each: loader(data_dir: Path, split: str, *, limit: int | None = None) -> list[Task], in a fixed order.
TASK_FAMILIES: dict[str, Callable[..., list[Task]]] = {
    "multihop_pages": load_multihop,
    "plate_reading": load_plates,
    "video_qa": load_video_qa,
}
