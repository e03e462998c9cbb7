"""Branch credit's sampling (`[credit] mode = "branch"`): continuations from exact replays of episode prefixes.

    values, stats = await branch_values(groups, tasks, policy=..., tools=..., tokenizer=..., cfg=cfg, step=s)
    # values[g][i]: the BranchValues of episode i of group g, for training.advantages.branch_advantages

For every learnable episode (not infra-failed, exact, with turns) `branch_turns` turns are chosen at random
(seeded by the run's seed, the step, the task and the episode's place in its group, so a resumed run chooses the
same). Around a chosen turn t the states needed are "before t" (t turns replayed; none for t = 0, where the
group's other episodes are the continuations) and "after t" (t + 1 turns replayed; none after the last turn).
Each state is continued `branch_k` times by `main_agent.rollout.rollout(..., replay=prefix)`: the prefix's
sampled ids are taken as they were, its calls re-run in a fresh session (cache hits for page_qa, search and video;
image_ops re-runs its cheap ops and OCR), checked byte for byte against the first observations, and the policy
samples on from there under the same budgets. A state shared by two chosen turns (after t = before t + 1) is
continued once. A continuation that fails for infrastructure reasons (a replay that diverged included) is left
out of the values and counted; a chosen turn left with no continuation before it falls back to the outcome
advantage.

Cost is reported per step (`branch/*` in metrics.jsonl): continuations, the tokens they sampled (replayed ids are
not sampled, not counted), their tool calls' cache hit rate, their infrastructure failures, seconds.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from main_agent.policy import Policy
from main_agent.rollout import RolloutConfig, rollout
from main_agent.types import Episode
from tool_server.client import ToolClient
from training.advantages import BranchValues
from training.config import TrainConfig
from training.metrics import mean
from training.play import rollout_task
from training.tasks import Task

State = tuple[int, int, int]  # (group, episode in the group, turns replayed)


@dataclass(frozen=True)
class BranchStats:
    """What branching cost in one step."""

    continuations: int
    sampled_tokens: int
    cache_hit_rate: float
    infra_failed: int
    seconds: float

    def metrics(self) -> dict[str, float]:
        return {
            "branch/continuations": self.continuations,
            "branch/sampled_tokens": self.sampled_tokens,
            "branch/cache_hit_rate": self.cache_hit_rate,
            "branch/infra_failed": self.infra_failed,
            "time/branch": self.seconds,
        }


def chosen_turns(n_turns: int, how_many: int, rng: random.Random) -> list[int]:
    """`how_many` distinct turn indices in order (all of them when `how_many` is 0 or not smaller)."""
    if how_many == 0 or how_many >= n_turns:
        return list(range(n_turns))
    return sorted(rng.sample(range(n_turns), how_many))


def learnable(episode: Episode) -> bool:
    """Whether the update can learn from the episode: not infra-failed, exact (the sampler's own ids and
    log-probs), with turns. The update lays only these into the loss (training/step.py `lay`)."""
    return episode.stop_reason != "infra_failed" and episode.exact and bool(episode.turns)


def plan(
    groups: Sequence[list[Episode]], tasks: Sequence[Task], cfg: TrainConfig, step: int
) -> dict[tuple[int, int], list[int]]:
    """The chosen turns of every learnable episode, keyed by (group, episode in the group)."""
    chosen = {}
    for g, (task, group) in enumerate(zip(tasks, groups, strict=True)):
        for i, episode in enumerate(group):
            if learnable(episode):
                rng = random.Random(f"{cfg.run.seed}/{step}/{task.task_id}/{i}")
                chosen[(g, i)] = chosen_turns(len(episode.turns), cfg.credit.branch_turns, rng)
    return chosen


def states(groups: Sequence[list[Episode]], chosen: dict[tuple[int, int], list[int]]) -> list[State]:
    """The states to continue: before each chosen turn but the first, and after each but the episode's last."""
    needed = set()
    for (g, i), turns in chosen.items():
        needed |= {(g, i, t) for t in turns if t > 0}
        needed |= {(g, i, t + 1) for t in turns if t + 1 < len(groups[g][i].turns)}
    return sorted(needed)


async def branch_values(
    groups: Sequence[list[Episode]],
    tasks: Sequence[Task],
    *,
    policy: Policy,
    tools: ToolClient,
    tokenizer,
    cfg: TrainConfig,
    step: int,
    reward_of: Callable[[Task, Episode], float],
    chosen: dict[tuple[int, int], list[int]] | None = None,
) -> tuple[list[list[list[BranchValues]]], BranchStats]:
    """Sample the continuations every chosen turn needs and return each episode's BranchValues; `reward_of`
    scores a continuation (or an episode of the group) exactly as the trainer scores its episodes. `chosen`
    (keyed as `plan`'s, learnable episodes only) replaces the run's random choice: the credit study
    (benchmarks/studies/credit/bench.py) branches around the turns it scores."""
    start = time.monotonic()
    chosen = plan(groups, tasks, cfg, step) if chosen is None else chosen
    continued = states(groups, chosen)
    schemas = await tools.tools()
    slots = asyncio.Semaphore(cfg.max_concurrent_episodes)

    async def one(state: State) -> Episode:
        g, i, replayed = state
        async with slots:
            return await continue_from(
                groups[g][i], replayed, tasks[g], schemas, policy=policy, tools=tools, tokenizer=tokenizer,
                cfg=cfg.rollout,
            )  # fmt: skip

    jobs = [s for s in continued for _ in range(cfg.credit.branch_k)]
    played = await asyncio.gather(*(one(s) for s in jobs))
    rewards: dict[State, list[float]] = {s: [] for s in continued}
    for state, episode in zip(jobs, played, strict=True):
        if episode.stop_reason != "infra_failed":
            rewards[state].append(reward_of(tasks[state[0]], episode))
    values = _values(groups, tasks, chosen, rewards, reward_of)
    return values, _stats(jobs, played, time.monotonic() - start)


async def continue_from(
    episode: Episode,
    replayed: int,
    task: Task,
    schemas: Sequence[dict[str, object]],
    *,
    policy: Policy,
    tools: ToolClient,
    tokenizer,
    cfg: RolloutConfig,
) -> Episode:
    """One continuation of `episode`'s state after `replayed` turns: those turns replayed exactly (their calls
    re-run in a fresh session and checked), then sampled on under `cfg`'s budgets. `replayed = 0` is a fresh
    episode of the task."""
    job = rollout_task(task, schemas)
    return await rollout(job, policy, tools, tokenizer, cfg, replay=episode.turns[:replayed])


def sampled_tokens(continuation: Episode, replayed: int) -> int:
    """The tokens a continuation sampled: its turns past the `replayed` ones (replayed ids are not sampled)."""
    return sum(len(t.completion_ids) for t in continuation.turns[replayed:])


def _values(
    groups: Sequence[list[Episode]],
    tasks: Sequence[Task],
    chosen: dict[tuple[int, int], list[int]],
    rewards: dict[State, list[float]],
    reward_of: Callable[[Task, Episode], float],
) -> list[list[list[BranchValues]]]:
    """Each episode's BranchValues from the continuations' rewards (before turn 0: the group's other episodes)."""
    out: list[list[list[BranchValues]]] = [[[] for _ in group] for group in groups]
    for (g, i), turns in chosen.items():
        others = [e for j, e in enumerate(groups[g]) if j != i and e.stop_reason != "infra_failed"]
        for t in turns:
            before = [reward_of(tasks[g], e) for e in others] if t == 0 else rewards[(g, i, t)]
            after = rewards.get((g, i, t + 1), [])
            if before:
                out[g][i].append(BranchValues(t, tuple(before), tuple(after)))
    return out


def _stats(jobs: Sequence[State], played: Sequence[Episode], seconds: float) -> BranchStats:
    results = [r for e in played for t in e.turns for r in t.results]
    return BranchStats(
        continuations=len(played),
        sampled_tokens=sum(sampled_tokens(e, state[2]) for state, e in zip(jobs, played, strict=True)),
        cache_hit_rate=mean([float(r.cached) for r in results]),
        infra_failed=sum(e.stop_reason == "infra_failed" for e in played),
        seconds=seconds,
    )
