"""One training step's parts as plain functions; the loop (training/loop.py) calls them in order.

    collected = Collected(step, tasks, state, groups, rollout_s)    # what a collector played (training/loop.py)
    fresh, stale = drop_stale(collected.groups, version=..., max_staleness=cfg.max_staleness)
    gains = group_gains(model, tokenizer, fresh, collected.tasks, cfg)   # only with turn_rewards.info_gain
    branches = branches_of(collected.groups, collected.branches, fresh)
    scored = score_groups(fresh, collected.tasks, cfg, branches, gains)
    stats = update(model, optimizer, scored.sequences, cfg)        # training/update.py
    row = step_row(version, collected, scored, stats, seconds=(train_s, sync_s), stale_dropped=stale)

- collect: groups of episodes (training/play.py), then branch credit's continuations (training/branching.py,
  valued by `rewarded`), then under `[near_miss]` continuations of near-miss prefixes (training/near_miss.py),
  then under `[expert_mix]` the scripted expert's episodes (training/expert_mix.py)
- score: `filter_groups` drops groups with an infrastructure failure (and fails the step when too many failed);
  `score` fills the task's final reward (evidence recall mixed in at `evidence_weight`) and the turn rewards
  (each turn's information gain, computed by the learner's model beforehand, training/info_gain.py);
  `group_credit` gives the group's advantages (outcome, turn or branch credit) and `lay` puts them onto each
  episode's tokens; an expert episode that beats every policy episode of its group joins its credit and trains
  off-policy (`joining`); a near miss's continuations join their group's credit and train their own sampled
  turns (`resampled`); groups whose rewards are all equal, and those whose every advantage is 0 (trained on no
  token), are counted
- drop stale: an overlapped collection runs one step behind the weights; groups older than `max_staleness`
  versions are dropped (`drop_stale`)
- the metrics row of the step (`step_row`; keys in training/metrics.py)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from conductor.settings import ConfigError
from main_agent.tokens import TrainSequence, to_sequences
from main_agent.types import Episode, Turn
from training import tasks as task_data
from training.advantages import BranchValues, EpisodeCredit, TurnCredit, branch_advantages, group_advantages
from training.branching import BranchStats, learnable
from training.checkpoint import TrainState
from training.config import TrainConfig
from training.expert_mix import ExpertMix, expert_sequences, joins
from training.metrics import memory_metrics, reward_metrics, rollout_metrics
from training.near_miss import NearMiss
from training.rewards import (
    TurnFacts,
    TurnRewardParts,
    TurnRewardWeights,
    call_key,
    contains_evidence,
    evidence_recall,
    supporting_pages,
    turn_reward,
    with_evidence,
)
from training.tasks import Task
from training.update import UpdateStats

# Parse errors that are not a malformed call: an answer dropped beside valid calls, calls past the per-turn cap.
# Every other parse error (no action, bad JSON, unknown tool, ...) counts as one malformed call.
NOT_MALFORMED = frozenset({"answer_ignored", "too_many_calls"})


class InfraFailure(RuntimeError):
    """Too many episodes of a step failed for infrastructure reasons to train on the rest."""


# ---------------------------------------------------------------- scoring and credit


def score(
    episode: Episode,
    task: Task,
    weights: TurnRewardWeights,
    kind: str,
    *,
    evidence_weight: float = 0.0,
    gains: Sequence[float] | None = None,
) -> list[TurnRewardParts]:
    """Fill `episode.reward` (the task's final reward of `kind`, TrainConfig.reward_kind, mixed with evidence
    recall at `evidence_weight`: rewards.with_evidence) and `episode.turn_rewards`; return each turn's parts.
    `gains`: each turn's information gain (training/info_gain.py), None for none."""
    facts = turn_facts(episode, task)
    if gains is not None:
        facts = [dataclasses.replace(f, info_gain=g) for f, g in zip(facts, gains, strict=True)]
    parts = [turn_reward(f, weights) for f in facts]
    answer = task_data.reward_for(task, episode.answer, kind=kind)
    recall = evidence_recall(task, episode) if evidence_weight > 0.0 else None
    episode.reward = with_evidence(answer, recall, evidence_weight)
    episode.turn_rewards = [p.total for p in parts]
    return parts


def check_evidence(tasks: Sequence[Task], evidence_weight: float) -> None:
    """ConfigError, before any episode is played, when evidence recall is trained on (`evidence_weight` > 0) and
    a task has no supporting page to read (a family without pages): the setting would otherwise do nothing."""
    bare = [t for t in tasks if not supporting_pages(t)] if evidence_weight > 0.0 else []
    if bare:
        raise ConfigError(
            f"evidence_weight={evidence_weight} needs tasks with supporting pages; {len(bare)} of {len(tasks)} "
            f"have none (first: {bare[0].task_id} of {bare[0].family})"
        )


def turn_facts(episode: Episode, task: Task) -> list[TurnFacts]:
    """Per turn: new valid calls, malformed ones (parse errors, rejected arguments), repeats, first evidence,
    the score of items recorded for the first time."""
    seen: set[str] = set()
    recorded: set[int] = set()
    found = False
    facts = []
    for turn in episode.turns:
        first = [r for r in turn.records if r.item not in recorded and not recorded.add(r.item)]  # type: ignore[func-returns-value]
        progress = sum(task_data.item_reward(task, r.item, r.text) for r in first) / max(len(task.items), 1)
        valid = repeated = 0
        malformed = sum(e.kind not in NOT_MALFORMED for e in turn.parse_errors)
        for call, result in zip(turn.calls, turn.results, strict=True):
            key = call_key(call.name, call.arguments)
            if result.error_kind == "invalid_args":
                malformed += 1
            elif key in seen:
                repeated += 1
            else:
                valid += 1
            seen.add(key)
        evidence = not found and any(
            r.ok and contains_evidence(r.observation, task.reference) for r in turn.results
        )
        found = found or evidence
        facts.append(TurnFacts(valid, malformed, repeated, evidence, progress))
    return facts


def anchor(turn: Turn) -> str | None:
    """Turn credit's anchor: the key of the turn's first call (turns asking the same thing share a baseline)."""
    return call_key(turn.calls[0].name, turn.calls[0].arguments) if turn.calls else None


def episode_credits(episodes: Sequence[Episode]) -> list[EpisodeCredit]:
    """Scored episodes reduced to what credit assignment reads (training/advantages.py): the final reward, each
    turn's reward and anchor."""
    credits = []
    for e in episodes:
        assert e.reward is not None, f"episode of {e.task_id} is not scored"
        turns = tuple(TurnCredit(r, anchor(t)) for r, t in zip(e.turn_rewards, e.turns, strict=True))
        credits.append(EpisodeCredit(e.reward, turns))
    return credits


def group_credit(
    episodes: Sequence[Episode], cfg: TrainConfig, branches: Sequence[Sequence[BranchValues]] | None = None
) -> list[list[float]]:
    """One group's advantage per turn of each episode (outcome, turn or branch credit); branch credit reads each
    episode's continuation values (`branches`, training/branching.py)."""
    credits = episode_credits(episodes)
    if cfg.credit.mode == "branch":
        assert branches is not None, "branch credit needs the continuations' values"
        return branch_advantages(credits, branches, normalize_std=cfg.credit.normalize_std)
    return group_advantages(credits, cfg.credit)


def lay(episodes: Sequence[Episode], advantages: Sequence[list[float]]) -> list[TrainSequence]:
    """The advantages laid onto the tokens of the learnable episodes (training/branching.py `learnable`): one
    without turns, inexact or infra-failed has nothing to learn from."""
    pairs = zip(episodes, advantages, strict=True)
    return [s for e, a in pairs if learnable(e) for s in to_sequences(e, a)]


def group_to_sequences(
    episodes: Sequence[Episode], cfg: TrainConfig, branches: Sequence[Sequence[BranchValues]] | None = None
) -> list[TrainSequence]:
    """One group's advantages laid onto its episodes' tokens."""
    return lay(episodes, group_credit(episodes, cfg, branches))


def flat(advantages: Sequence[Sequence[float]]) -> bool:
    """Whether every advantage of a group is 0: it has no gradient (without a KL term, training/update.py)."""
    return all(a == 0.0 for row in advantages for a in row)


def filter_groups(groups: Sequence[list[Episode]], cfg: TrainConfig) -> list[list[Episode]]:
    """Groups without infrastructure failures; raise InfraFailure when the episodes that cannot be trained on
    (infra-failed, or inexact: a sampler that re-tokenised or lost log-probs) exceed the limit.

    An inexact episode keeps its group: its reward is a real outcome of the policy and serves the baseline, but
    `group_to_sequences` lays none of its tokens into the loss (its log-probs are stand-ins)."""
    episodes = [e for g in groups for e in g]
    failed = [e for e in episodes if e.stop_reason == "infra_failed"]
    inexact = [e for e in episodes if e.stop_reason != "infra_failed" and not e.exact]
    if episodes and (len(failed) + len(inexact)) / len(episodes) > cfg.max_infra_failure_frac:
        reasons = sorted({str(e.infra_error) for e in failed})[:3]
        if inexact:
            reasons.append(f"{len(inexact)} inexact (re-tokenised ids or missing log-probs)")
        raise InfraFailure(
            f"{len(failed) + len(inexact)} of {len(episodes)} episodes cannot be trained on "
            f"(limit {cfg.max_infra_failure_frac:.0%}): {'; '.join(reasons)}"
        )
    return [g for g in groups if not any(e.stop_reason == "infra_failed" for e in g)]


@dataclass(frozen=True)
class Scored:
    """A step's valid groups after scoring, and what they train on."""

    groups: list[list[Episode]]
    sequences: list[TrainSequence]
    successes: list[bool]
    turn_parts: list[TurnRewardParts]
    ledgers: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    """Item tasks, per episode: the share of items recorded, and the share recorded right (`ledger_scores`)."""
    zero_variance: int = 0
    """Groups whose final rewards are all equal (no outcome signal)."""
    zero_advantage: int = 0
    """Groups whose every advantage is 0 (the update runs none of their tokens, training/update.py); under
    outcome credit the same as `zero_variance`, under turn credit turn rewards may still tell turns apart."""
    recalls: list[float] = dataclasses.field(default_factory=list)
    """Per episode whose task has supporting pages: the share of them it read (`rewards.evidence_recall`)."""
    experts: int = 0
    """Expert episodes that joined the groups (`[expert_mix]`, training/expert_mix.py); `zero_variance` and
    `zero_advantage` count the groups with them in."""
    near_miss: int = 0
    """Near-miss continuations that joined the groups (`[near_miss]`, training/near_miss.py); `zero_variance`
    and `zero_advantage` count the groups with them in."""

    def metrics(self) -> dict[str, float]:
        recall = {"reward/evidence_recall": sum(self.recalls) / len(self.recalls)} if self.recalls else {}
        return {
            "groups/total": len(self.groups),
            "groups/zero_variance": self.zero_variance,
            "groups/zero_advantage": self.zero_advantage,
            **recall,
        }


def ledger_scores(episode: Episode, task: Task) -> tuple[float, float]:
    """The share of the task's items the episode recorded, and the share it recorded right (item scores)."""
    entries = [(i, text) for i, text in enumerate(episode.ledger, start=1) if text is not None]
    right = sum(task_data.item_reward(task, i, text) for i, text in entries)
    return len(entries) / len(task.items), right / len(task.items)


def score_groups(
    groups: Sequence[list[Episode]],
    tasks: Sequence[Task],
    cfg: TrainConfig,
    branches: Sequence[list[list[BranchValues]] | None] | None = None,
    gains: Sequence[list[list[float]]] | None = None,
    experts: ExpertMix | None = None,
    near_miss: NearMiss | None = None,
) -> Scored:
    """filter_groups, then score every episode and build the training sequences (`branches[g]`: group g's
    continuation values under branch credit; `gains[g][i]`: the information gain of each turn of group g's
    episode i, training/info_gain.py, needed when `turn_rewards.info_gain` is not 0; `experts`: the step's expert
    episodes, which join their groups' credit and train off-policy, training/expert_mix.py; `near_miss`: the step's
    continuations of near-miss prefixes, which join their groups' credit and train their sampled turns,
    training/near_miss.py)."""
    assert gains is not None or not cfg.turn_rewards.info_gain, (
        "turn_rewards.info_gain needs the turns' gains"
    )
    by_id = {t.task_id: t for t in tasks}
    kept = filter_groups(groups, cfg)
    gains_of = dict(zip(map(id, groups), gains, strict=True)) if gains is not None else {}
    parts: list[TurnRewardParts] = []
    for g in kept:
        for e, ge in zip(g, gains_of.get(id(g), [None] * len(g)), strict=True):
            parts += score(
                e, by_id[e.task_id], cfg.turn_rewards, cfg.reward_kind, evidence_weight=cfg.evidence_weight,
                gains=ge,
            )  # fmt: skip
    successes = [task_data.success(by_id[e.task_id], e.answer) for g in kept for e in g]
    joined = [joining(g, by_id[g[0].task_id], experts=experts, cfg=cfg) for g in kept]  # [] without experts
    more = resampled(kept, by_id, near_miss=near_miss, cfg=cfg)  # [] without near misses
    mixed = [g + x + c for g, x, c in zip(kept, joined, more, strict=True)]
    # an expert episode or a near miss's continuation has no branch values: the outcome advantage on every turn
    values = branches_of(groups, branches, kept)
    values = [
        b if b is None else b + [[] for _ in x + c] for b, x, c in zip(values, joined, more, strict=True)
    ]
    credit = [group_credit(m, cfg, b) for m, b in zip(mixed, values, strict=True)]
    weight = experts.weight if experts is not None else 0.0
    sequences = [
        s
        for g, x, c, a in zip(kept, joined, more, credit, strict=True)
        for s in lay(g, a[: len(g)])
        + expert_sequences(x, a[len(g) : len(g) + len(x)], weight=weight)
        + lay(c, a[len(g) + len(x) :])
    ]
    ledgers = [ledger_scores(e, by_id[e.task_id]) for g in kept for e in g if by_id[e.task_id].items]
    recalls = [r for g in kept for e in g if (r := evidence_recall(by_id[e.task_id], e)) is not None]
    equal = sum(len({e.reward for e in m}) == 1 for m in mixed)
    return Scored(
        kept, sequences, successes, parts, ledgers, equal, sum(map(flat, credit)), recalls=recalls,
        experts=sum(map(len, joined)), near_miss=sum(map(len, more)),
    )  # fmt: skip


def joining(
    group: Sequence[Episode], task: Task, *, experts: ExpertMix | None, cfg: TrainConfig
) -> list[Episode]:
    """The expert episodes of `task` that join the scored `group` (training/expert_mix.py): scored as the step
    scores (`rewarded`; no information gain), kept where they beat every policy episode (`joins`)."""
    mine = experts.episodes.get(task.task_id, []) if experts is not None else []
    reward_of = rewarded(cfg)
    for e in mine:
        reward_of(task, e)
    return [e for e in mine if joins(e, group)]


def resampled(
    kept: Sequence[list[Episode]], by_id: dict[str, Task], *, near_miss: NearMiss | None, cfg: TrainConfig
) -> list[list[Episode]]:
    """Each scored group's near-miss continuations (training/near_miss.py), scored as the step scores
    (`rewarded`; no information gain); none per group without them. Their replayed turns are untrained, so `lay`
    puts only their sampled turns into the loss."""
    if near_miss is None:
        return [[] for _ in kept]
    more, reward_of = near_miss.of(kept), rewarded(cfg)
    for e in (e for c in more for e in c):
        reward_of(by_id[e.task_id], e)
    return more


# ---------------------------------------------------------------- collect


@dataclass(frozen=True)
class Collected:
    """One step's rollouts as a collector hands them over."""

    step: int
    tasks: list[Task]
    state: TrainState
    """The data cursor after these tasks."""
    groups: list[list[Episode]]
    rollout_s: float
    branches: list[list[list[BranchValues]]] | None = None
    """Branch credit's continuation values of each group, sampled with the groups (None for other modes)."""
    branching: BranchStats | None = None
    experts: ExpertMix | None = None
    """The scripted expert's episodes of the step's tasks (`[expert_mix]`, training/expert_mix.py); None when off."""
    near_miss: NearMiss | None = None
    """Continuations of the groups' near-miss prefixes (`[near_miss]`, training/near_miss.py); None when off."""


def rewarded(cfg: TrainConfig) -> Callable[[Task, Episode], float]:
    """An episode's final reward, scored as the step scores it under `cfg` (turn rewards, reward kind, evidence
    weight): what branch credit's continuations are worth (training/branching.py)."""

    def reward_of(task: Task, episode: Episode) -> float:
        score(episode, task, cfg.turn_rewards, cfg.reward_kind, evidence_weight=cfg.evidence_weight)
        assert episode.reward is not None
        return episode.reward

    return reward_of


# ---------------------------------------------------------------- drop stale, record


def drop_stale(
    groups: Sequence[list[Episode]], *, version: int, max_staleness: int
) -> tuple[list[list[Episode]], int]:
    """Groups whose every episode was sampled by version >= `version - max_staleness`, and how many episodes the
    dropped groups held. (A group is collected under one version, so this drops exactly the stale episodes.)"""
    fresh = [g for g in groups if all(e.policy_version >= version - max_staleness for e in g)]
    return fresh, sum(map(len, groups)) - sum(map(len, fresh))


def branches_of(
    groups: Sequence[list[Episode]],
    branches: Sequence[list[list[BranchValues]] | None] | None,
    kept: Sequence[list[Episode]],
) -> list[list[list[BranchValues]] | None]:
    """The branch values (`branches[g]`: group g's) of the groups in `kept`, a selection of `groups` in their
    order (by `drop_stale` or `filter_groups`); Nones without branch credit."""
    if branches is None:
        return [None] * len(kept)
    chosen = {id(g) for g in kept}
    return [b for g, b in zip(groups, branches, strict=True) if id(g) in chosen]


def step_row(
    version: int,
    batch: Collected,
    scored: Scored,
    stats: UpdateStats,
    *,
    seconds: tuple[float, float],
    stale_dropped: int = 0,
) -> dict[str, float]:
    """The metrics row of step `batch.step` (keys listed in training/metrics.py): `version` is the sampler's
    policy version after the step, `seconds` the update's and the weight push's."""
    return {
        "step": batch.step,
        "policy_version": version,
        **reward_metrics(
            [e for g in scored.groups for e in g],
            successes=scored.successes,
            turn_parts=scored.turn_parts,
            ledgers=scored.ledgers,
        ),
        **rollout_metrics([e for g in batch.groups for e in g], seconds=batch.rollout_s),
        **stats.metrics(),
        **scored.metrics(),
        "episodes/stale_dropped": stale_dropped,
        "time/train": seconds[0],
        "time/weight_sync": seconds[1],
        **(batch.branching.metrics() if batch.branching is not None else {}),
        **(batch.experts.metrics(joined=scored.experts) if batch.experts is not None else {}),
        **(batch.near_miss.metrics(joined=scored.near_miss) if batch.near_miss is not None else {}),
        **memory_metrics(),
    }
