"""Evaluate a policy on a task split: one greedy episode per task, one table, one JSON report.

    conductor eval --policy CKPT --task plate_reading --split dev --n 100 [--out report.json] [--set key=value]
    conductor eval ... --set samples=4 --set sampling.temperature=1.15     # the sampler's success, 4 per task

Every policy sees the same task instances: the first `limit` tasks of the split in the loader's fixed order (`--n`),
played with temperature 0 (greedy decoding) and torch seeded from `seed`, so two checkpoints are compared on
identical questions. Greedy decoding is deterministic given the weights; batched generation may still differ in
the last bits when episodes are batched differently (padding changes the matmul shapes). With `samples` > 1 and a
temperature, each task is played `samples` times and every measure is over all of them: what the policy does when
it samples as training does, on tasks training never saw (the episodes file holds them task by task).

What the report measures, over the episodes that did not fail for infrastructure reasons (those are counted in
`n_infra_failed` and excluded: an unreachable tool server says nothing about the policy):
    answer_rate       share of episodes that ended with an answer (not a budget or an infrastructure failure)
    success_rate      tasks.success (exact match; plate match for plates)
    mean_reward       tasks.reward_for (token F1; plate match for plates)
    format_validity   share of turns whose completion parsed without any parse error
    valid_call_rate   share of attempted calls (served or rejected by the parser) that parsed and came back ok
    evidence_read_rate  page tasks: share of episodes in which page_qa read a page holding the gold evidence
    calls_per_tool    mean calls of each tool per episode
    tool_error_rate   share of tool results that came back not ok (NaN without any call)
    main_tokens_*     an episode's peak main context (its longest segment; the whole stream when not folded)
    turn_tokens_mean  the main context a turn was sampled from, over all turns
    segments_mean, calls_mean   segments and calls per episode
    items_right       item tasks: the share of items recorded right (apart from mean_reward)
    subagent_tokens_read  mean tokens the sub-agents read on the policy's behalf per episode
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from conductor.models import default_device
from conductor.settings import ConfigError, load_settings, shared
from main_agent.backends import load_policy
from main_agent.policy import Policy, SamplingConfig
from main_agent.rollout import RolloutConfig
from main_agent.types import Episode
from tool_server.client import ToolClient
from tool_server.embedded import ToolAccess
from training import tasks as task_data
from training.config import RunSettings, device_sizes
from training.metrics import mean, save_rollouts
from training.play import play, tool_session
from training.tasks import Task

logger = logging.getLogger(__name__)


def greedy() -> SamplingConfig:
    """Evaluation's sampling default: greedy decoding in this process."""
    return SamplingConfig(temperature=0.0)


@dataclass(frozen=True)
class EvalConfig:
    """One evaluation: a policy, greedy, on the first `limit` tasks of a split (`conductor eval`)."""

    run: RunSettings = shared(lambda: RunSettings(split="dev", limit=100))
    """The policy evaluated, on the first `limit` tasks of the dev split by default (`conductor eval --n`), data
    folder and seed: keys of this table."""
    task: str = "plate_reading"
    """Task family (a key of `training.tasks.FAMILIES`)."""
    items: int | None = None
    """Item families (plate_audit, multihop_batch): items per task; None: the family's default (4)."""
    samples: int = 1
    """Episodes per task. Greedy episodes of one task are all the same, so more than 1 asks for a sampling
    temperature (`sampling.temperature`)."""
    max_concurrent_episodes: int | None = None
    """Episodes in flight at once; the in-process policy batches their turns into one generate. None (the
    default): by the device the policy loads on, as training sizes it (`in_flight`: 8 on a CPU, up to 256 on a
    GPU), said in the log."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Turn, token and time budgets (`[rollout]`): the training defaults, so evaluation measures what training
    optimises."""
    sampling: SamplingConfig = field(default_factory=greedy)
    """Who decodes and how (`[sampling]`): greedy in this process by default; backend "vllm" decodes through a
    vLLM engine (the `vllm` extra; dense checkpoints only)."""
    tools: ToolAccess = field(default_factory=ToolAccess)
    """The tool server (`[tools]`): a running one, or one in this process."""

    def __post_init__(self) -> None:
        checks = {
            "samples >= 1": self.samples >= 1,
            "max_concurrent_episodes >= 1 (or unset)": (
                self.max_concurrent_episodes is None or self.max_concurrent_episodes >= 1
            ),
            "sampling.temperature > 0 with samples > 1 (greedy samples of a task are one episode)": (
                self.samples == 1 or self.sampling.temperature > 0
            ),
        }
        failed = [rule for rule, ok in checks.items() if not ok]
        if failed:
            raise ConfigError(f"invalid evaluation settings, need: {', '.join(failed)}")


@dataclass(frozen=True)
class EvalReport:
    """What one policy did on one set of tasks (see the module docstring for each measure)."""

    policy: str
    tasks: str
    n: int
    n_infra_failed: int
    success_rate: float
    mean_reward: float
    format_validity: float
    calls_per_tool: dict[str, float]
    tool_error_rate: float
    main_tokens_mean: float
    main_tokens_median: float
    subagent_tokens_read: float
    mean_turns: float
    stop_reasons: dict[str, int]
    wall_s: float
    main_tokens_peak: float = math.nan
    turn_tokens_mean: float = math.nan
    segments_mean: float = math.nan
    calls_mean: float = math.nan
    items_right: float = math.nan
    answer_rate: float = math.nan
    valid_call_rate: float = math.nan
    evidence_read_rate: float = math.nan

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    def table(self) -> str:
        return format_table([self])


def summarise(
    tasks: Sequence[Task], episodes: Sequence[Episode], *, policy: str, wall_s: float
) -> EvalReport:
    """The report of `episodes[i]` played on `tasks[i]`."""
    assert len(tasks) == len(episodes), f"{len(tasks)} tasks but {len(episodes)} episodes"
    valid = [(t, e) for t, e in zip(tasks, episodes, strict=True) if e.stop_reason != "infra_failed"]
    played = [e for _, e in valid]
    turns = [turn for e in played for turn in e.turns]
    results = [r for turn in turns for r in turn.results]
    tools = sorted({name for t in tasks for name in t.tools} | {c.name for turn in turns for c in turn.calls})
    calls = Counter(c.name for turn in turns for c in turn.calls)
    lengths = [e.context_tokens for e in played]
    return EvalReport(
        policy=policy,
        tasks=",".join(sorted({t.family for t in tasks})),
        n=len(episodes),
        n_infra_failed=len(episodes) - len(valid),
        success_rate=mean([float(task_data.success(t, e.answer)) for t, e in valid]),
        mean_reward=mean([task_data.reward_for(t, e.answer) for t, e in valid]),
        format_validity=mean([float(not turn.parse_errors) for turn in turns]),
        calls_per_tool={name: calls[name] / len(played) if played else math.nan for name in tools},
        tool_error_rate=mean([float(not r.ok) for r in results]),
        main_tokens_mean=mean([float(n) for n in lengths]),
        main_tokens_median=float(statistics.median(lengths)) if lengths else math.nan,
        subagent_tokens_read=mean([float(e.subagent_tokens_read) for e in played]),
        mean_turns=mean([float(len(e.turns)) for e in played]),
        stop_reasons=dict(sorted(Counter(e.stop_reason for e in episodes).items())),
        wall_s=wall_s,
        main_tokens_peak=float(max(lengths, default=math.nan)),
        turn_tokens_mean=mean([float(n) for e in played for n in e.turn_context_tokens]),
        segments_mean=mean([float(len(e.segments)) for e in played]),
        calls_mean=mean([float(e.num_calls) for e in played]),
        items_right=mean([_items_right(t, e) for t, e in valid if t.items]),
        answer_rate=mean([float(e.answer is not None) for e in played]),
        valid_call_rate=_valid_call_rate(turns),
        evidence_read_rate=mean([float(read) for t, e in valid if (read := evidence_read(t, e)) is not None]),
    )


def evidence_read(task: Task, episode: Episode) -> bool | None:
    """Whether page_qa read (without error) a page holding the gold evidence: one of the supporting pages
    (multihop, corpus_qa; every listed page when none is marked, as research_corpus's one source), matched by
    its file at the end of the URL page_qa opened; None for a task with no pages (photos, clips)."""
    support = set(task.meta.supporting_titles)
    pages = zip(task.meta.page_titles, task.meta.page_paths, strict=False)
    files = tuple("/" + path for title, path in pages if not support or title in support)
    if not files:
        return None
    reads = (r for turn in episode.turns for r in turn.results if r.name == "page_qa" and r.ok)
    return any(str((r.payload or {}).get("url", "")).endswith(files) for r in reads)


CALL_ERRORS = frozenset({"unclosed_tag", "bad_json", "missing_name", "unknown_tool", "bad_arguments"})
"""Parse errors that are a call the policy tried to make."""


def _valid_call_rate(turns: Sequence) -> float:
    """The share of attempted calls that parsed and were served: ok results over results plus call-shaped
    parse errors (a malformed call, an unknown tool, bad arguments)."""
    served = sum(r.ok for turn in turns for r in turn.results)
    attempted = sum(len(turn.results) for turn in turns) + sum(
        e.kind in CALL_ERRORS for turn in turns for e in turn.parse_errors
    )
    return served / attempted if attempted else math.nan


def _items_right(task: Task, episode: Episode) -> float:
    """The share of an item task's items whose recorded answer is right."""
    entries = [(i, text) for i, text in enumerate(episode.ledger, start=1) if text is not None]
    return sum(task_data.item_reward(task, i, text) for i, text in entries) / len(task.items)


def format_table(reports: Sequence[EvalReport]) -> str:
    """One row per measure, one column per report (e.g. before and after fine-tuning)."""
    tools = sorted({name for r in reports for name in r.calls_per_tool})
    rows: list[tuple[str, list[str]]] = [
        ("policy", [r.policy for r in reports]),
        ("tasks", [r.tasks for r in reports]),
        ("episodes (infra failed)", [f"{r.n} ({r.n_infra_failed})" for r in reports]),
        ("answer rate", [f"{r.answer_rate:.3f}" for r in reports]),
        ("success rate", [f"{r.success_rate:.3f}" for r in reports]),
        ("mean reward", [f"{r.mean_reward:.3f}" for r in reports]),
        ("format validity", [f"{r.format_validity:.3f}" for r in reports]),
        ("valid call rate", [f"{r.valid_call_rate:.3f}" for r in reports]),
        ("evidence page read", [f"{r.evidence_read_rate:.3f}" for r in reports]),
        *[(f"calls/episode {t}", [f"{r.calls_per_tool.get(t, 0.0):.2f}" for r in reports]) for t in tools],
        ("tool error rate", [f"{r.tool_error_rate:.3f}" for r in reports]),
        (
            "main tokens mean/median",
            [f"{r.main_tokens_mean:.0f}/{r.main_tokens_median:.0f}" for r in reports],
        ),
        (
            "main tokens peak / per turn",
            [f"{r.main_tokens_peak:.0f}/{r.turn_tokens_mean:.0f}" for r in reports],
        ),
        ("segments/episode", [f"{r.segments_mean:.2f}" for r in reports]),
        ("calls/episode", [f"{r.calls_mean:.1f}" for r in reports]),
        ("items right", [f"{r.items_right:.3f}" for r in reports]),
        ("sub-agent tokens read", [f"{r.subagent_tokens_read:.0f}" for r in reports]),
        ("turns/episode", [f"{r.mean_turns:.2f}" for r in reports]),
        ("wall time s", [f"{r.wall_s:.1f}" for r in reports]),
    ]
    head = max(len(name) for name, _ in rows)
    widths = [max(len(cells[i]) for _, cells in rows) for i in range(len(reports))]
    return "\n".join(
        f"{name:<{head}} | " + " | ".join(f"{c:>{w}}" for c, w in zip(cells, widths, strict=True))
        for name, cells in rows
    )


async def evaluate_policy(
    policy: Policy, tokenizer, tasks: Sequence[Task], *, tools: ToolClient, cfg: EvalConfig, label: str
) -> tuple[EvalReport, list[Episode]]:
    """Play every task `cfg.samples` times with `policy` (set to decode as `cfg.sampling` says) and summarise;
    the episodes come back task by task, each task's samples together, each with the reward the report gave it
    (None where the tools failed: not scored)."""
    torch.manual_seed(cfg.run.seed)
    start = time.monotonic()
    groups = await play(
        tasks,
        lambda _: policy,
        tools=tools,
        tokenizer=tokenizer,
        cfg=cfg.rollout,
        group_size=cfg.samples,
        max_concurrent=cfg.max_concurrent_episodes,
    )
    played = [t for t in tasks for _ in range(cfg.samples)]
    episodes = [e for group in groups for e in group]
    for task, episode in zip(
        played, episodes, strict=True
    ):  # the episodes file carries what the report scored
        if episode.stop_reason != "infra_failed":
            episode.reward = task_data.reward_for(task, episode.answer)
    return summarise(played, episodes, policy=label, wall_s=time.monotonic() - start), episodes


def in_flight(cfg: EvalConfig) -> EvalConfig:
    """`cfg` with `max_concurrent_episodes`, where unset, chosen for the device the policy loads on ("auto": cuda
    when visible) by training's rule (`training.config.device_sizes`)."""
    if cfg.max_concurrent_episodes is not None:
        return cfg
    device = default_device()
    n = device_sizes(device).max_concurrent_episodes
    logger.info("sized for %s: max_concurrent_episodes %d", device, n)
    return dataclasses.replace(cfg, max_concurrent_episodes=n)


async def evaluate(
    tasks: Sequence[Task], *, tools: ToolClient, cfg: EvalConfig, episodes_out: Path | None = None
) -> EvalReport:
    """Load `cfg.run.policy` (`main_agent.backends.load_policy`) and evaluate it on `tasks`; the episodes go to
    `episodes_out` as JSON lines when given (`conductor trace` renders them)."""
    context = cfg.rollout.max_context_tokens + cfg.rollout.max_new_tokens
    cfg = in_flight(cfg)
    policy, tokenizer = load_policy(
        cfg.run.policy,
        cfg.sampling,
        max_batch=cfg.max_concurrent_episodes,
        seed=cfg.run.seed,
        max_model_len=context,
    )
    try:
        report, episodes = await evaluate_policy(
            policy, tokenizer, tasks, tools=tools, cfg=cfg, label=cfg.run.policy
        )
    finally:
        await policy.aclose()
    if episodes_out is not None:
        save_rollouts(episodes_out, episodes)
    return report


async def _run_eval(tasks: list[Task], *, cfg: EvalConfig, episodes_out: Path | None) -> EvalReport:
    with tempfile.TemporaryDirectory(prefix="conductor-eval-") as work:
        session = tool_session(tasks, work_dir=Path(work), access=cfg.tools, data_dir=cfg.run.data_dir)
        async with session as (tools, ready):
            return await evaluate(ready, tools=tools, cfg=cfg, episodes_out=episodes_out)


def run_eval(cfg: EvalConfig, out_json: Path | None = None) -> EvalReport:
    """The `conductor eval` entry point: the first `limit` tasks of `task`/`split`; with `out_json` the report
    there and the episodes beside it (`<name>.episodes.jsonl`)."""
    tasks = task_data.load_family(
        cfg.task, cfg.run.split, data_dir=cfg.run.data_dir, limit=cfg.run.limit, items=cfg.items
    )
    if not tasks:
        raise ValueError(f"no tasks in {cfg.task}/{cfg.run.split}")
    episodes_out = out_json.with_suffix(".episodes.jsonl") if out_json is not None else None
    report = asyncio.run(_run_eval(tasks, cfg=cfg, episodes_out=episodes_out))
    if out_json is not None:
        out_json.parent.mkdir(parents=True, exist_ok=True)
        out_json.write_text(report.to_json() + "\n", encoding="utf-8")
    return report


MOVED = {"sampler": "sampling.backend", "n": "limit"}
"""The keys of earlier versions and where each went (`conductor eval --n` still sets `limit`)."""


def load_eval_config(path: Path | None, overrides: Sequence[str] = ()) -> EvalConfig:
    """Defaults, then the TOML file at `path` (if any), then `key=value` overrides (`rollout.max_turns=6`)."""
    return load_settings(EvalConfig, path, overrides, moved=MOVED)
