"""A study's episodes, played in chunks that resume: one folder a policy (or the scripted expert), its settings
claimed, each finished chunk one file of episodes (the research and plates benchmarks).

    folder = work / folder_name("runs/x/model")             # runs_x_model
    claim(folder, policy, sets)                              # exits if the folder was played with other sets
    play_chunks(chunks, folder, cfg=load_eval_config(None, [f"policy={policy}", "task=corpus_qa", *sets]))
    episodes = recorded(folder)                              # task id -> episode, of every finished chunk

`chunks` are (name, tasks) pairs: a chunk's episodes are written to <name>.partial as it plays and renamed to
<name>.episodes.jsonl once all of them are on disk, so an interrupted run loses at most the chunk in flight and
the caller plays only the tasks `recorded` lacks. The policy EXPERT plays the families' scripted experts (as
`conductor sft` does) instead of a model, through the same tools and budgets.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.common.stages import weights_sha
from conductor.models import DEFAULT_MODEL, resolve_model
from main_agent.types import Episode
from tool_server.client import ToolClient
from training import tasks as task_data
from training.evaluate import EvalConfig, evaluate
from training.experts import play_experts
from training.metrics import load_episodes, mean, save_rollouts
from training.play import tool_session
from training.tasks import Task
from training.tasks.family import OracleReply

EXPERT = "expert"
"""The policy name that plays the scripted expert of each task's family: what its demonstrations reach on tasks
they never saw, the ceiling of imitation."""
EXPERT_CONCURRENCY = 4  # episodes in flight: the expert samples nothing, its calls share the tool server


def folder_name(policy: str) -> str:
    """A policy's folder under the work folder: its name or path with every run of other characters as "_"."""
    return re.sub(r"[^A-Za-z0-9.-]+", "_", policy).strip("_")


def recorded(folder: Path) -> dict[str, Episode]:
    """The episodes of every finished chunk in a policy's folder, by task id."""
    return {e.task_id: e for path in sorted(folder.glob("*.episodes.jsonl")) for e in load_episodes(path)}


def claim(folder: Path, policy: str, sets: Sequence[str]) -> None:
    """Record the settings and the weights (`weights_sha`) a policy's folder is played with; exit when it was
    played with others. A name keeps its folder when its weights change (conductor-default after a new adapter
    ships): the weights' hash is what keeps one policy's episodes from being counted as another's."""
    folder.mkdir(parents=True, exist_ok=True)
    settings = {"policy": policy, "weights_sha256": weights_sha(policy), "sets": list(sets)}
    path = folder / "settings.json"
    if path.is_file() and (then := json.loads(path.read_text(encoding="utf-8"))) != settings:
        if then.get("weights_sha256") != settings["weights_sha256"]:
            was = str(then.get("weights_sha256") or "not recorded")[:12]
            sys.exit(
                f"{folder} was played by other weights of {policy} ({was}): move it away, or --work elsewhere"
            )
        sys.exit(f"{folder} was played with {then}, not {settings}: move it away or pass the same --set")
    path.write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")


def play_chunks(
    chunks: Sequence[tuple[str, list[Task]]],
    folder: Path,
    *,
    cfg: EvalConfig,
    plan: OracleReply | None = None,
) -> None:
    """Play every chunk in one tool session (`cfg.tools`), writing each as it finishes (the module docstring);
    `plan`: the plan the EXPERT plays instead of each family's own (`training.experts.OraclePolicy`)."""
    if chunks:
        asyncio.run(_play(chunks, folder, cfg=cfg, plan=plan))


async def _play(
    chunks: Sequence[tuple[str, list[Task]]], folder: Path, *, cfg: EvalConfig, plan: OracleReply | None
) -> None:
    pending = [t for _, c in chunks for t in c]
    with tempfile.TemporaryDirectory(prefix="bench-chunks-") as work:
        session = tool_session(pending, work_dir=Path(work), access=cfg.tools, data_dir=cfg.run.data_dir)
        async with session as (tools, ready):
            by_id = {t.task_id: t for t in ready}
            for name, tasks in chunks:
                start, partial = time.monotonic(), folder / f"{name}.partial"
                played = [by_id[t.task_id] for t in tasks]
                success, reward = await play_chunk(played, tools, cfg, partial, plan=plan)
                partial.replace(folder / f"{name}.episodes.jsonl")  # a chunk counts once all of it is on disk
                took = time.monotonic() - start
                print(
                    f"{cfg.run.policy} {name}: success {success:.3f} reward {reward:.3f} {took:.0f} s",
                    flush=True,
                )


async def play_chunk(
    tasks: list[Task], tools: ToolClient, cfg: EvalConfig, out: Path, *, plan: OracleReply | None = None
) -> tuple[float, float]:
    """Play `tasks` (the policy `cfg.run.policy`, or the scripted experts for EXPERT, playing `plan` where given)
    into `out`; their success rate and mean reward by each family's own scoring."""
    if cfg.run.policy != EXPERT:
        report = await evaluate(tasks, tools=tools, cfg=cfg, episodes_out=out)
        return report.success_rate, report.mean_reward
    episodes = await play_experts(
        tasks, tools, _tokenizer(), rollout=cfg.rollout, max_concurrent=EXPERT_CONCURRENCY, reply=plan
    )
    save_rollouts(out, episodes)
    played = list(zip(tasks, episodes, strict=True))
    success = mean([float(task_data.success(t, e.answer)) for t, e in played])
    return success, mean([task_data.reward_for(t, e.answer) for t, e in played])


@functools.cache
def _tokenizer():
    """The built-in model's tokenizer, which the experts' replies are tokenised with: loaded once a process."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model(DEFAULT_MODEL), local_files_only=True)
