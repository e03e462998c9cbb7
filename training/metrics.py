"""What a training step reports: one JSON line of namespaced metrics and one fixed-shape printed line.

Keys of a metrics row (`metrics.jsonl`, one row per step):

    step, policy_version
    reward/final, reward/turn, reward/turn/<component>, success       over the scored (valid) episodes
                                                                       (reward/turn/info_gain: the weighted
                                                                       information gain per turn, 0 when off)
    reward/evidence_recall                                             share of supporting pages read, over the
                                                                       scored episodes of tasks that have them
    loss/pg, loss/kl, clip_frac, ratio_mean, grad_norm, update/tokens, update/skipped   the optimizer step
    loss/lld                                                           the likelihood-displacement guard's term
                                                                       (training/loss.py), when lld_coef > 0
    update/tokens_skipped                                              tokens whose advantage is all 0: not run
    groups/total, groups/zero_variance, groups/zero_advantage          scored groups; those with all rewards
                                                                       equal; those with every advantage 0
    optim/lr                                                           the learning rate of that step
    tools/<name>/calls, tools/<name>/error_rate, tools/cache_hit_rate, tools/calls_per_episode
    episodes/collected, episodes/infra_failed, episodes/inexact (not trained on), episodes/stale_dropped
    context/main_tokens, context/peak_tokens                           mean and max of an episode's peak context
    context/turn_tokens, context/segments                              mean context a turn was sampled from;
                                                                       segments per episode (folded long ones)
    subagents/tokens_read                                              tokens sub-agents read per episode
    items/recorded, items/right                                        item tasks: share of items recorded, and
                                                                       recorded right (apart from reward/final)
    horizon/items                                                      item tasks: the curriculum's current N
    perf/episodes_per_s, perf/tokens_per_s, time/rollout, time/train   tokens = sampled completion tokens
    tokens/sampled                                                     sampled tokens of the step's episodes
    branch/continuations, branch/sampled_tokens, branch/cache_hit_rate,  branch credit: what its continuations
    branch/infra_failed, time/branch                                     cost (time/rollout includes them)
    expert_mix/weight, expert_mix/played, expert_mix/dropped,          [expert_mix] only: the step's weight w_s, the
    expert_mix/episodes, expert_mix/success, time/expert_mix           tasks the expert played, those not worth
                                                                       imitating, expert episodes that joined a
                                                                       group, its success rate, its time (included
                                                                       in time/rollout; training/expert_mix.py)
    near_miss/prefixes, near_miss/continuations, near_miss/joined,    [near_miss] only: groups whose near miss was
    near_miss/success, near_miss/infra_failed, time/near_miss          continued, continuations played through and
                                                                       those that joined a scored group, their
                                                                       success rate, those dropped for infra
                                                                       failures, their time (included in
                                                                       time/rollout; training/near_miss.py)
    time/weight_sync                                                   pushing the weights to the sampler
    perf/rss_gb, perf/peak_rss_gb                                      the training process's resident memory
                                                                       now and at its peak (sampler processes
                                                                       apart), to see growth before an OOM kill

A mean over nothing (no valid episode, no turn) is NaN, written as JSON's NaN extension: an empty step must not
look like a step that scored 0.
"""

from __future__ import annotations

import json
import math
import resource
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

from main_agent.types import Episode
from training.rewards import TurnRewardParts

Row = Mapping[str, float]


class MetricsLog:
    """Appends one JSON object per step to a file, flushed at once so a killed run keeps every finished step."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = path.open("a", encoding="utf-8")

    def write(self, row: Row) -> None:
        self._file.write(json.dumps(dict(row), sort_keys=True) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def read_metrics(path: Path) -> list[dict[str, float]]:
    """The rows of a metrics file, in order."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def reward_metrics(
    scored: Sequence[Episode],
    *,
    successes: Sequence[bool],
    turn_parts: Sequence[TurnRewardParts],
    ledgers: Sequence[tuple[float, float]] = (),
) -> dict[str, float]:
    """Final reward, success rate, every turn-reward component averaged over episodes and turns, and for item
    tasks the ledger's progress: the share of items recorded and recorded right, apart from the final reward."""
    row = {
        "reward/final": mean([e.reward for e in scored if e.reward is not None]),
        "success": mean([float(s) for s in successes]),
        "reward/turn": mean([p.total for p in turn_parts]),
    }
    parts = ("valid_call", "malformed_call", "repeated_call", "new_evidence", "recorded_item", "info_gain")
    for name in parts:
        row[f"reward/turn/{name}"] = mean([getattr(p, name) for p in turn_parts])
    if ledgers:
        row["items/recorded"] = mean([recorded for recorded, _ in ledgers])
        row["items/right"] = mean([right for _, right in ledgers])
    return row


def memory_metrics() -> dict[str, float]:
    """The process's resident set now (Linux /proc; NaN elsewhere) and its peak so far, in GB."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        rss = pages * resource.getpagesize() / 1e9
    except (OSError, IndexError, ValueError):
        rss = math.nan
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {"perf/rss_gb": rss, "perf/peak_rss_gb": peak_kib * 1024 / 1e9}


def rollout_metrics(collected: Sequence[Episode], *, seconds: float) -> dict[str, float]:
    """Tool use, context size, infrastructure failures and throughput of every episode collected in a step."""
    results = [r for e in collected for t in e.turns for r in t.results]
    row: dict[str, float] = {
        "episodes/collected": len(collected),
        "episodes/infra_failed": sum(e.stop_reason == "infra_failed" for e in collected),
        "episodes/inexact": sum(e.stop_reason != "infra_failed" and not e.exact for e in collected),
        "context/main_tokens": mean([e.context_tokens for e in collected]),
        "context/peak_tokens": max((e.context_tokens for e in collected), default=math.nan),
        "context/turn_tokens": mean([n for e in collected for n in e.turn_context_tokens]),
        "context/segments": mean([len(e.segments) for e in collected]),
        "subagents/tokens_read": mean([e.subagent_tokens_read for e in collected]),
        "tools/calls_per_episode": mean([e.num_calls for e in collected]),
        "tools/cache_hit_rate": mean([float(r.cached) for r in results]),
        "time/rollout": seconds,
        "tokens/sampled": sampled_tokens(collected),
        "perf/episodes_per_s": len(collected) / seconds if seconds > 0 else math.nan,
        "perf/tokens_per_s": sampled_tokens(collected) / seconds if seconds > 0 else math.nan,
    }
    for name in sorted({r.name for r in results}):
        mine = [r for r in results if r.name == name]
        row[f"tools/{name}/calls"] = len(mine)
        row[f"tools/{name}/error_rate"] = mean([float(not r.ok) for r in mine])
    return row


def sampled_tokens(episodes: Sequence[Episode]) -> int:
    return sum(len(t.completion_ids) for e in episodes for t in e.turns)


def step_line(row: Row) -> str:
    """One fixed-shape line per step, for the console; the JSON row has everything else."""
    get = row.get
    return (
        f"step {int(row['step']):4d} | reward {get('reward/final', math.nan):5.3f} | "
        f"success {get('success', math.nan):4.2f} | pg {get('loss/pg', math.nan):+8.4f} | "
        f"clip {get('clip_frac', math.nan):4.2f} | calls {get('tools/calls_per_episode', math.nan):4.1f} | "
        f"ctx {get('context/main_tokens', math.nan):5.0f} | infra {int(get('episodes/infra_failed', 0))} | "
        f"stale {int(get('episodes/stale_dropped', 0))} | roll {get('time/rollout', math.nan):6.1f}s | "
        f"train {get('time/train', math.nan):5.1f}s"
    )


def save_rollouts(path: Path, episodes: Sequence[Episode]) -> None:
    """One `Episode.to_json` line per episode (the trace viewer and evaluation read these)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(e.to_json() + "\n" for e in episodes), encoding="utf-8")


def load_episodes(path: Path) -> list[Episode]:
    """The episodes `save_rollouts` wrote (blank lines skipped); a line that is not an episode is an error naming
    the file and line, not a skipped episode."""
    episodes = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            episodes.append(Episode.from_json(line))
        except (ValueError, TypeError, KeyError, AssertionError) as err:  # bad JSON or not an episode's shape
            raise ValueError(f"{path}:{lineno}: not an episode: {type(err).__name__}: {err}") from err
    return episodes


def trim_metrics(path: Path, *, after_step: int) -> None:
    """Drop rows past `after_step`: a run killed after logging a step but before its checkpoint redoes the step
    on resume, and the file must hold each step once."""
    if not path.is_file():
        return
    keep = [row for row in read_metrics(path) if row["step"] <= after_step]
    path.write_text("".join(json.dumps(row, sort_keys=True) + "\n" for row in keep), encoding="utf-8")
