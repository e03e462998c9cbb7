"""What a study's episode files say, read back from disk (the learning study's records are made of it):
whether training moved the greedy policy, each photo's sampled scores, and how sure a sampler was.

    moved(warm_episodes, episodes, tasks) -> dict   greedy dev episodes changed in tokens, in acts, won, lost
    sampled_scores(episodes, tasks) -> dict  per task, the mean success and graded reward of its samples
    how_sure(episodes) -> dict               identical groups, tokens drawn with p > CONFIDENT, tokens per episode
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path

from main_agent.types import Episode
from training.metrics import load_episodes, mean
from training.tasks import Task, reward_for, success

CONFIDENT = 0.99
"""A sampled token drawn with at least this probability could hardly have been another: the share of such tokens
says how little a temperature explores (the warm start at 1.0: 98 %)."""


def moved(warm_episodes: Path, episodes: Path, tasks: Sequence[Task]) -> dict:
    """Whether training moved the greedy policy: of `tasks` (both evaluations played them), how many episodes
    differ from the warm start's in any sampled token, how many in what they did (`acted`: a call, a record or
    the answer; a policy that only learned to stop before `</answer>` changes every episode's tokens and none of
    its acts), how many turned a miss into a success or back (tasks.success of the answers), and the graded
    reward of both over all tasks (what a near miss gained) with the standard error of their paired difference."""
    warm, now = _by_task(warm_episodes), _by_task(episodes)
    changed = [t for t in tasks if _sampled(warm[t.task_id]) != _sampled(now[t.task_id])]
    acted = [t for t in changed if _acts(warm[t.task_id]) != _acts(now[t.task_id])]
    flips = [success(t, now[t.task_id].answer) - success(t, warm[t.task_id].answer) for t in changed]
    won, lost = flips.count(1), flips.count(-1)
    warm_graded, now_graded = ([_graded(t, played) for t in tasks] for played in (warm, now))
    diffs = [b - a for a, b in zip(warm_graded, now_graded, strict=True)]
    return {
        "tasks": len(tasks),
        "changed": len(changed),
        "acted": len(acted),
        "won": won,
        "lost": lost,
        "graded_warm": mean(warm_graded),
        "graded_now": mean(now_graded),
        "graded_gain_se": statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) >= 2 else math.nan,
    }


def _graded(task: Task, played: dict[str, Episode]) -> float:
    return reward_for(task, played[task.task_id].answer, kind="graded")


def _by_task(path: Path) -> dict[str, Episode]:
    return {e.task_id: e for e in load_episodes(path)}


def sampled_scores(episodes: Path, tasks: Sequence[Task]) -> dict:
    """Per task of `tasks`, in order, the mean exact success and graded reward of its episodes in `episodes`
    (an evaluation with samples > 1: several per task), and over them all the share that ended without an answer
    (out of turns or context) and `how_sure` the sampler was; episodes the tools failed are left out, not scored
    0."""
    kept = [e for e in load_episodes(episodes) if e.stop_reason != "infra_failed"]
    played: dict[str, list[Episode]] = {}
    for e in kept:
        played.setdefault(e.task_id, []).append(e)

    def graded(task: Task, answer: str | None) -> float:
        return reward_for(task, answer, kind="graded")

    def mean_of(score, task: Task) -> float:
        return mean([float(score(task, e.answer)) for e in played.get(task.task_id, [])])

    def spread(task: Task) -> float:
        rewards = [graded(task, e.answer) for e in played.get(task.task_id, [])]
        return max(rewards) - min(rewards) if rewards else math.nan

    return {
        "task_ids": [t.task_id for t in tasks],
        "samples": [len(played.get(t.task_id, [])) for t in tasks],
        "success": [mean_of(success, t) for t in tasks],
        "graded": [mean_of(graded, t) for t in tasks],
        # best minus worst graded reward: 0 is a group with nothing to learn
        "spread": [spread(t) for t in tasks],
        "unanswered": mean([float(e.answer is None) for e in kept]),
        **how_sure(kept),
    }


def _sampled(episode: Episode) -> list[list[int]]:
    return [turn.completion_ids for turn in episode.turns]


def _acts(episode: Episode) -> tuple[list, list, str | None]:
    """What an episode did, turn by turn: its calls (name and arguments), its records, then its answer."""
    calls = [[(c.name, c.arguments) for c in turn.calls] for turn in episode.turns]
    records = [[(r.item, r.text) for r in turn.records] for turn in episode.turns]
    return calls, records, episode.answer


def how_sure(episodes: Sequence[Episode]) -> dict:
    """How little a sampler explored: tasks whose episodes all came out token for token the same, the share of
    sampled tokens drawn with a probability above CONFIDENT, and sampled tokens per episode."""
    groups: dict[str, set] = {}
    for e in episodes:
        groups.setdefault(e.task_id, set()).add(tuple(map(tuple, _sampled(e))))
    logprobs = [lp for e in episodes for turn in e.turns for lp in turn.completion_logprobs]
    return {
        "groups_identical": sum(len(drawn) == 1 for drawn in groups.values()),
        "confident_share": sum(lp > math.log(CONFIDENT) for lp in logprobs) / len(logprobs),
        "tokens_per_episode": len(logprobs) / len(episodes),
    }
