"""Group baselines and turn-level credit assignment. Pure Python, no torch.

A group is the G episodes sampled for one task. Episode i has a final reward R_i, and turns t = 0 .. T_i - 1,
each with a turn reward r_{i,t} (see `rewards.turn_reward`) and an anchor key (a string such as the turn's
`rewards.call_key`, or None when the turn has none). The result is one advantage per turn; every sampled token of
a turn then carries that turn's advantage (`main_agent.tokens.to_sequences`).

Outcome credit (`mode="outcome"`, GRPO):
    A_i = R_i - mean_j R_j                  [/ (std_j R_j + eps) when normalize_std]
    and every turn of episode i gets A_i. Turn rewards are ignored (log them, they do not train).

Turn credit (`mode="turn"`):
    return-to-go  G_{i,t} = sum_{k=t}^{T_i-1} gamma^(k-t) r_{i,k} + gamma^(T_i-1-t) R_i
        i.e. the final reward is paid at the last turn together with that turn's reward, undiscounted there
        (with 1-based t this is gamma^(T_i-t) R_i). Recursively G_{i,T_i-1} = r_{i,T_i-1} + R_i and
        G_{i,t} = r_{i,t} + gamma G_{i,t+1}.
    baseline "turn_index": b_{i,t} = mean of G_{j,t} over all episodes j of the group that have a turn t,
        episode i included (not leave-one-out, as GRPO's mean; a turn index reached by one episode only gets A = 0).
    baseline "anchor": b_{i,t} = mean of G over all turns of the group, any episode and any index, whose anchor
        equals turn (i,t)'s anchor, itself included, when at least `min_anchor_group` such turns exist; otherwise
        (or when the anchor is None) the "turn_index" baseline.
    A_{i,t} = G_{i,t} - b_{i,t}          [/ (std of all A_{.,.} of the group + eps) when normalize_std]
    shaping "contested": a group whose final rewards R are all equal gets A = 0 on every turn, as outcome
        credit gives it; the turn rewards then only break ties between episodes whose answers scored differently.

Branch credit (`mode="branch"`, per-call Monte Carlo values from exact replays; VinePPO's estimate, made cheap
by frozen, cached tools):
    for chosen turns t of episode i, `branch_k` continuations are sampled from the state before turn t (the
    episode's first t turns replayed exactly, turn t sampled anew) and `branch_k` from the state after turn t's
    observation (t + 1 turns replayed). With b the final rewards of the first and a those of the second,
        A_{i,t} = mean(a ∪ {R_i}) - mean(b)
    (the episode itself is one continuation from after turn t, so it counts there). After the episode's last
    turn nothing follows, so mean({R_i}) = R_i; before turn 0 the group's other episodes are continuations from
    the same state and serve as b without extra sampling. Turns not chosen get the outcome advantage
    R_i - mean_j R_j, so every sampled token trains; with every turn chosen this is VinePPO's per-step advantage.
    Continuations are value probes only and do not train: training them would need their own branches (or a
    baseline from a group they do not form), and it would weight the states the trainer happened to branch from.
    [/ (std of all A of the group + eps) when normalize_std]

Degenerate sets: when all values in a baseline set are equal (all R_j, or all G in a turn-index / anchor set),
the advantages are exactly 0.0 for that set, not a rounding residue. Standard deviations are population ones.

Simplifications, on purpose: no learned value function (the group is the baseline); the baseline includes the
episode itself, which shrinks advantages by a factor (n-1)/n relative to leave-one-out; std normalisation is one
scale per group, not per baseline set; in turn credit an episode with no turns contributes nothing, while in
outcome credit its R still enters the mean.

Worked example (gamma = 1, turn_index baseline), two episodes:
    episode 0: R = 1, turn rewards [0.0, 0.1]       -> G = [1.1, 1.1]
    episode 1: R = 0, turn rewards [0.1, 0.0, 0.1]  -> G = [0.2, 0.1, 0.1]
    baselines: t=0 mean(1.1, 0.2) = 0.65; t=1 mean(1.1, 0.1) = 0.6; t=2 only episode 1 -> 0.1
    advantages: episode 0 [0.45, 0.5], episode 1 [-0.45, -0.5, 0.0]
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

# Added to the standard deviation before dividing: a group whose spread is tiny but non-zero
# should not turn rounding noise into advantages of size ~1e6. GRPO implementations use 1e-4 to 1e-8.
STD_EPS = 1e-6


@dataclass(frozen=True)
class CreditConfig:
    """How advantages are assigned within a group."""

    mode: Literal["outcome", "turn", "branch"] = "outcome"
    """"outcome": one group-relative advantage per episode (GRPO); "turn": return-to-go minus a group baseline;
    "branch": Monte Carlo values of chosen turns from continuations of exact replays (training/branching.py)."""
    gamma: float = 1.0
    """Discount per turn for turn credit, in (0, 1]; 1 spreads the final reward undiminished to every turn."""
    normalize_std: bool = False
    """Divide advantages by the group's standard deviation (+eps). Off by default: Dr. GRPO shows it biases
    learning towards groups that are nearly all right or all wrong."""
    baseline: Literal["turn_index", "anchor"] = "turn_index"
    """Turn credit only: compare a turn with the same turn index in the other episodes, or with turns that share
    its anchor key (same call / same observation) anywhere in the group."""
    min_anchor_group: int = 2
    """Fewest turns that must share an anchor for the anchor baseline to be used; smaller sets fall back to the
    turn-index baseline. At least 2, since a set of one would always give A = 0."""
    shaping: Literal["every_group", "contested"] = "every_group"
    """Turn credit only: which groups the turn rewards train in. "contested": only groups whose final rewards
    differ. In a group where every answer scored alike the turn rewards are the whole signal, and Adam moves the
    weights as far for their few hundredths as for a right answer: a turn run of the research recipe learned to
    read 6-10 pages a question and stop answering that way (docs/learning.md, "Turn credit farmed its shaping")."""

    branch_k: int = 2
    """Branch credit: continuations sampled from each state around a chosen turn (before it and after it)."""
    branch_turns: int = 2
    """Branch credit: turns chosen per episode, at random (seeded per step and episode); 0 chooses every turn.
    Each costs up to 2 x branch_k continuations, so on long episodes a few chosen turns are the affordable
    budget; the others take the outcome advantage."""

    def __post_init__(self) -> None:
        if self.mode not in ("outcome", "turn", "branch"):
            raise ValueError(f"credit mode must be 'outcome', 'turn' or 'branch', got {self.mode!r}")
        if self.branch_k < 1 or self.branch_turns < 0:
            raise ValueError(
                f"branch_k must be >= 1 and branch_turns >= 0, got {self.branch_k}, {self.branch_turns}"
            )
        if self.baseline not in ("turn_index", "anchor"):
            raise ValueError(f"baseline must be 'turn_index' or 'anchor', got {self.baseline!r}")
        if not 0.0 < self.gamma <= 1.0:
            raise ValueError(f"gamma must be in (0, 1], got {self.gamma}")
        if self.min_anchor_group < 2:
            raise ValueError(f"min_anchor_group must be >= 2, got {self.min_anchor_group}")
        if self.shaping not in ("every_group", "contested"):
            raise ValueError(f"shaping must be 'every_group' or 'contested', got {self.shaping!r}")


@dataclass(frozen=True)
class TurnCredit:
    """The two facts about a turn that credit assignment needs."""

    reward: float
    """The turn's shaping reward r_{i,t} (`rewards.TurnRewardParts.total`)."""
    anchor: str | None
    """Key shared by turns in the same situation (e.g. `rewards.call_key` of the turn's call); None for none."""


@dataclass(frozen=True)
class EpisodeCredit:
    """One episode of a group, reduced to its rewards."""

    final_reward: float
    """R_i, the final reward in [0, 1]."""
    turns: tuple[TurnCredit, ...]
    """The policy's turns in order."""


@dataclass(frozen=True)
class BranchValues:
    """The final rewards of the continuations sampled around one turn of an episode."""

    turn: int
    """t, the 0-based turn index."""
    before: tuple[float, ...]
    """Final rewards of continuations from the state before turn t (turn t sampled anew)."""
    after: tuple[float, ...]
    """Final rewards of continuations from the state after turn t's observation, the episode itself excluded
    (empty after the episode's last turn)."""


def branch_advantages(
    episodes: Sequence[EpisodeCredit], branches: Sequence[Sequence[BranchValues]], *, normalize_std: bool
) -> list[list[float]]:
    """A_{i,t} = mean(after ∪ {R_i}) - mean(before) for the turns in `branches[i]`, the outcome advantage
    R_i - mean(R) for the others (see the module docstring)."""
    if len(episodes) < 2:
        raise ValueError(f"a group needs at least 2 episodes to have a baseline, got {len(episodes)}")
    outcome = outcome_advantages(episodes, normalize_std=False)
    rows = []
    for episode, row, values in zip(episodes, outcome, branches, strict=True):
        row = list(row)
        for v in values:
            if not v.before:
                raise ValueError(f"turn {v.turn}: no continuation from before it to compare with")
            row[v.turn] = _mean([*v.after, episode.final_reward]) - _mean(v.before)
        rows.append(row)
    if normalize_std:
        rows = _unflatten(_scale([a for row in rows for a in row]), [len(row) for row in rows])
    return rows


def group_advantages(episodes: Sequence[EpisodeCredit], cfg: CreditConfig) -> list[list[float]]:
    """One advantage per turn of every episode of a group: result[i][t] is A_{i,t} (see the module docstring).

    A group may hold fewer episodes than were sampled (invalid ones dropped) but never fewer than 2.
    """
    if len(episodes) < 2:
        raise ValueError(f"a group needs at least 2 episodes to have a baseline, got {len(episodes)}")
    if cfg.mode == "branch":
        raise ValueError("branch credit needs the continuations' rewards: call branch_advantages")
    if cfg.mode == "outcome":
        return outcome_advantages(episodes, normalize_std=cfg.normalize_std)
    return turn_advantages(episodes, cfg)


def outcome_advantages(episodes: Sequence[EpisodeCredit], *, normalize_std: bool) -> list[list[float]]:
    """GRPO: A_i = R_i - mean(R) (optionally / (std(R) + eps)), copied to every turn of episode i."""
    rewards = [episode.final_reward for episode in episodes]
    centred = [r - _mean(rewards) for r in rewards]
    if normalize_std:
        centred = _scale(centred)
    return [[a] * len(episode.turns) for a, episode in zip(centred, episodes, strict=True)]


def returns_to_go(episode: EpisodeCredit, gamma: float) -> list[float]:
    """G_t = r_t + gamma G_{t+1}, with G_{T-1} = r_{T-1} + R: the final reward is paid at the last turn."""
    returns = [0.0] * len(episode.turns)
    future = episode.final_reward
    for t in reversed(range(len(episode.turns))):
        returns[t] = episode.turns[t].reward + future
        future = gamma * returns[t]
    return returns


def turn_advantages(episodes: Sequence[EpisodeCredit], cfg: CreditConfig) -> list[list[float]]:
    """A_{i,t} = G_{i,t} - b_{i,t} with the turn-index or anchor baseline (see the module docstring)."""
    if cfg.shaping == "contested" and len({episode.final_reward for episode in episodes}) == 1:
        return [[0.0] * len(episode.turns) for episode in episodes]
    returns = [returns_to_go(episode, cfg.gamma) for episode in episodes]
    by_index: defaultdict[int, list[float]] = defaultdict(list)
    by_anchor: defaultdict[str, list[float]] = defaultdict(list)
    for episode, episode_returns in zip(episodes, returns, strict=True):
        for t, (turn, g) in enumerate(zip(episode.turns, episode_returns, strict=True)):
            by_index[t].append(g)
            if turn.anchor is not None:
                by_anchor[turn.anchor].append(g)

    def baseline(t: int, anchor: str | None) -> float:
        if cfg.baseline == "anchor" and anchor is not None and len(by_anchor[anchor]) >= cfg.min_anchor_group:
            return _mean(by_anchor[anchor])
        return _mean(by_index[t])

    advantages = [
        [g - baseline(t, turn.anchor) for t, (turn, g) in enumerate(zip(episode.turns, rets, strict=True))]
        for episode, rets in zip(episodes, returns, strict=True)
    ]
    if cfg.normalize_std:
        flat = _scale([a for row in advantages for a in row])
        sizes = [len(row) for row in advantages]
        advantages = _unflatten(flat, sizes)
    return advantages


def _mean(values: Sequence[float]) -> float:
    """Arithmetic mean, exactly the common value when all values are equal (so degenerate sets give A = 0.0)."""
    if not values:
        raise ValueError("mean of an empty set")
    if all(v == values[0] for v in values):
        return values[0]
    return sum(values) / len(values)


def _scale(values: list[float]) -> list[float]:
    """Divide by (population std + STD_EPS); values with no spread are returned unchanged."""
    std = statistics.pstdev(values) if values else 0.0
    if std == 0.0:
        return list(values)
    return [v / (std + STD_EPS) for v in values]


def _unflatten(flat: list[float], sizes: list[int]) -> list[list[float]]:
    """Cut a flat list back into rows of the given sizes."""
    rows, start = [], 0
    for size in sizes:
        rows.append(flat[start : start + size])
        start += size
    return rows
