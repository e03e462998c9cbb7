"""Playing tasks: the one place training, evaluation and the SFT expert turn tasks into episodes.

    async with tool_session(tasks, work_dir=..., access=cfg.tools) as (tools, ready):   # server + prepared tasks
        groups = await play(ready, lambda task: policy, tools=tools, tokenizer=tok, cfg=rollout_cfg,
                            group_size=4, max_concurrent=8)                             # [task][episode]

`play` runs `group_size` episodes of every task, all in flight together up to `max_concurrent` (the in-process
policy batches their turns into one generate), and returns them grouped per task in task order, whatever finishes
first. `policy_for(task)` gives each episode its policy (one shared sampler while training and evaluating; one
scripted expert per episode for SFT, which also watches its turns through `on_turn_for`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path

import httpx

from conductor.cluster import RayConfig
from main_agent.policy import Policy
from main_agent.rollout import ProgressHook, RolloutConfig, RolloutTask, rollout
from main_agent.types import Episode
from tool_server.client import ToolClient
from tool_server.embedded import ToolAccess, open_tools
from training import tasks as task_data
from training.tasks import Task


def rollout_task(task: Task, schemas: Sequence[dict[str, object]]) -> RolloutTask:
    """The rollout's view of a task: only the tools it names, in the server's order."""
    mine = [s for s in schemas if s["function"]["name"] in task.tools]  # type: ignore[index]
    missing = set(task.tools) - {s["function"]["name"] for s in mine}  # type: ignore[index]
    if missing:
        raise ValueError(f"task {task.task_id} needs tools {sorted(missing)} the tool server does not offer")
    return RolloutTask(
        task.task_id, task.question, mine, context=task.context, items=len(task.items),
        attachments=task.attachments,
    )  # fmt: skip


async def play(
    tasks: Sequence[Task],
    policy_for: Callable[[Task], Policy],
    *,
    tools: ToolClient,
    tokenizer,
    cfg: RolloutConfig,
    group_size: int = 1,
    max_concurrent: int,
    on_turn_for: Callable[[Task], ProgressHook] | None = None,
) -> list[list[Episode]]:
    """`group_size` episodes of each task, at most `max_concurrent` in flight; one list per task, in order."""
    schemas = await tools.tools()
    slots = asyncio.Semaphore(max_concurrent)

    async def one(task: Task) -> Episode:
        async with slots:
            hook = on_turn_for(task) if on_turn_for is not None else None
            job = rollout_task(task, schemas)
            return await rollout(job, policy_for(task), tools, tokenizer, cfg, on_turn=hook)

    episodes = await asyncio.gather(*(one(t) for t in tasks for _ in range(group_size)))
    return [list(episodes[i * group_size : (i + 1) * group_size]) for i in range(len(tasks))]


def media_roots(tasks: Sequence[Task]) -> list[str]:
    """The folders the tool server may read the tasks' photos and clips from. An item task's `media_root` comes
    first: its items name their photos relative to it ("us/x.jpg", training/tasks/plate_audit.py), and the
    server resolves relative names in its first root."""
    first = {t.meta.media_root for t in tasks if t.meta.media_root}
    single = {str(Path(p).parent) for t in tasks if (p := t.meta.image_path or t.meta.video_path)}
    return sorted(first) + sorted(single - first)


def search_corpus(tasks: Sequence[Task]) -> Path | None:
    """The folder the tasks' search indexes (corpus_qa, research_corpus); None when no task searches one. The
    tool server indexes one corpus, so tasks naming two cannot share a session (a ValueError)."""
    folders = sorted({t.meta.corpus for t in tasks if t.meta.corpus})
    if len(folders) > 1:
        raise ValueError(
            f"tasks search different corpora ({', '.join(folders)}): play them in separate sessions"
        )
    return Path(folders[0]) if folders else None


def server_needs(tasks: Sequence[Task]) -> tuple[list[str], bool, Path | None]:
    """What a tool server needs to serve the prepared `tasks`: the folders it may read (`media_roots`), whether
    it may fetch loopback pages (the multihop page server), the corpus it searches (`search_corpus`)."""
    served = [t for t in tasks if not t.meta.corpus]  # corpus pages are files, not loopback pages
    loopback = any(t.meta.page_paths or any(i.meta.page_paths for i in t.items) for t in served)
    return media_roots(tasks), loopback, search_corpus(tasks)


@contextlib.asynccontextmanager
async def tool_session(
    tasks: Sequence[Task],
    *,
    work_dir: Path,
    access: ToolAccess,
    data_dir: Path | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
    replicas: RayConfig | None = None,
) -> AsyncIterator[tuple[ToolClient, list[Task]]]:
    """A tool client and the tasks ready to play (`tasks.prepared` under `work_dir`), whichever host serves the
    tools (`tool_server.embedded.open_tools`): the server at `access.url`; else one started for the tasks, allowed
    to read their media folders, fetch their loopback pages and search their corpus (`server_needs`), in this
    process (`transport`, in tests, replaces it) or, for a run on Ray, `replicas.tool_replicas` replicas on Ray
    Serve sharing their result cache in `work_dir/tool_cache/` (the client's `url` is theirs). The page server
    binds 127.0.0.1, so with `access.url` multihop tasks need that server on this machine.
    """
    with task_data.prepared(tasks, work_dir, data_dir=data_dir) as ready:
        roots, loopback, corpus = server_needs(ready)
        tools = open_tools(
            access, roots=roots, loopback=loopback, corpus=corpus, transport=transport, replicas=replicas,
            shared_cache=work_dir / "tool_cache",
        )  # fmt: skip
        async with tools as client:
            yield client, ready
