"""Should video_summary's text model be the 0.5B reader? video_qa's 12 clips through the real tool server.

    nice -n 5 python -m benchmarks.studies.reader.video_text     # -> results/reader/video_text/summary.json

For each built-in text model (SmolLM2-135M, video_summary's default today; Qwen2.5-Coder-0.5B, page_qa's reader),
set by a generated server TOML (`[video_summary.model] model = "..."`), every video_qa task of train, dev and test
gets the call the family's expert makes: video_summary with the task's question on the clip's handle, one call at
a time after one untimed warm-up call. Per clip: the answer's first line (what the expert answers when the
observation lacks the gold), its token F1 (the family's reward) and exact match (its success), whether the
observation holds the gold (`contains_evidence`: then the expert answers the gold itself), and the call's seconds.

Decides: the issue's "the best reader by default ... for any other sub-agent whose answers it measurably improves",
chosen on tune (train: 7 clips) and reported on report (dev + test: 5 clips); "all" is the 12 together.
Limits: 12 clips (11 GRID sentences given as a subtitle, 1 Kinetics action with no text) separate only large
differences; seconds are wall time beside whatever else runs on the machine, so compare the models by their ratio
within one run, not with other runs.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common.records import summary_path, write_summary
from conductor.models import DEFAULT_READER
from tool_server.client import ToolClient
from tool_server.embedded import ToolAccess
from training import tasks as task_data
from training.play import tool_session
from training.rewards import contains_evidence
from training.tasks import Task, video
from training.tasks.task import NO_ANSWER, context_lines

MODELS = ("smollm2-135m-instruct", DEFAULT_READER)
CAVEAT = "seconds: wall time a call, beside whatever else ran on these cores: compare models by ratio"
GROUPS = {"tune": ("train",), "report": ("dev", "test"), "all": ("train", "dev", "test")}


def first_line(answer: str) -> str:
    """The expert's guess: the answer's first line, or its "unknown" when the answer is empty."""
    return answer.strip().splitlines()[0] if answer.strip() else NO_ANSWER


def score_row(
    *, task_id: str, split: str, reference: str, answer: str, observation: str, seconds: float
) -> dict:
    """One clip's record: the first line scored by video_qa's reward (F1) and success (EM)."""
    line = first_line(answer)
    return {
        "task_id": task_id, "split": split, "reference": reference, "answer": answer, "first_line": line,
        "f1": video.reward(line, reference), "em": float(video.success(line, reference)),
        "evidence": contains_evidence(observation, reference), "seconds": round(seconds, 2),
    }  # fmt: skip


async def _call(tools: ToolClient, task: Task) -> dict:
    """The expert's one call on `task` in its own session, timed."""
    await tools.attach(task.attachments, session=task.task_id)
    args = {"video": context_lines(task, "Video")[0], "question": task.question}
    start = time.perf_counter()
    result = await tools.call("video_summary", args, session=task.task_id)
    seconds = time.perf_counter() - start
    assert not result.cached, f"{task.task_id}: a cached call times nothing"
    answer = str(result.payload.get("answer") or "") if result.ok else ""
    return score_row(
        task_id=task.task_id, split=task.meta.split or "", reference=task.reference, answer=answer,
        observation=result.observation if result.ok else "", seconds=seconds,
    )  # fmt: skip


async def _play(model: str, tasks: list[Task], work: Path) -> list[dict]:
    """Every task's call with `model` answering for video_summary; the clips are muxed once into `work`."""
    toml = work / f"{model}.toml"
    toml.write_text(f'[video_summary.model]\nmodel = "{model}"\n', encoding="utf-8")
    async with tool_session(tasks, work_dir=work, access=ToolAccess(config=toml)) as (tools, ready):
        await _warm_up(tools, ready[0])
        return [{"model": model, **await _call(tools, task)} for task in ready]


async def _warm_up(tools: ToolClient, task: Task) -> None:
    """One untimed call (a summary, not the question: no cache entry the timed calls could hit), so the first
    timed call does not pay for loading OCR and the first generation."""
    await tools.attach(task.attachments, session="warm-up")
    await tools.call("video_summary", {"video": context_lines(task, "Video")[0]}, session="warm-up")


def summarise(rows: list[dict]) -> dict[str, dict[str, dict]]:
    """Per model and group: clips, mean F1 and EM of the first line, share with the gold in the observation,
    median and mean seconds a call."""
    found: dict[str, dict[str, dict]] = {}
    for model in dict.fromkeys(r["model"] for r in rows):
        for group, splits in GROUPS.items():
            mine = [r for r in rows if r["model"] == model and r["split"] in splits]
            found.setdefault(model, {})[group] = _means(mine)
    return found


def _means(rows: list[dict]) -> dict:
    if not rows:
        return {"n": 0}
    means = {key: round(statistics.fmean(float(r[key]) for r in rows), 3) for key in ("f1", "em", "evidence")}
    seconds = [r["seconds"] for r in rows]
    return {"n": len(rows), **means, "p50_s": round(statistics.median(seconds), 2),
            "mean_s": round(statistics.fmean(seconds), 2)}  # fmt: skip


def table(summary: dict[str, dict[str, dict]]) -> str:
    """The summary as a Markdown table, then each model's median seconds as a ratio to the first model's."""
    lines = ["| model | group | clips | F1 | EM | gold in observation | p50 s | mean s |", "|---" * 8 + "|"]
    for model, groups in summary.items():
        for group, m in groups.items():
            if m["n"]:
                lines.append(f"| {model} | {group} | {m['n']} | {m['f1']:.3f} | {m['em']:.3f} | "
                             f"{m['evidence']:.3f} | {m['p50_s']:.1f} | {m['mean_s']:.1f} |")  # fmt: skip
    base = next(iter(summary.values()))["all"]["p50_s"]
    ratios = ", ".join(f"{model} {groups['all']['p50_s'] / base:.2f}x" for model, groups in summary.items())
    return "\n".join([*lines, f"p50 s a call (all clips) relative to the first model, this run: {ratios}"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), help="built-in names or checkpoints")
    parser.add_argument("--out", type=Path, default=summary_path("reader", "video_text"))
    args = parser.parse_args()
    tasks = [t for split in GROUPS["all"] for t in task_data.load_family("video_qa", split)]
    with tempfile.TemporaryDirectory(prefix="video-text-") as work:
        rows = [row for model in args.models for row in asyncio.run(_play(model, tasks, Path(work)))]
    summary = summarise(rows)
    print(table(summary))
    print(CAVEAT)
    write_summary(args.out, {"models": args.models, "groups": GROUPS, "summary": summary, "rows": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
