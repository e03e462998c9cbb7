"""Group baselines and turn-level credit, checked against numbers computed by hand (see each docstring)."""

from __future__ import annotations

import math

import pytest

from training.advantages import (
    STD_EPS,
    BranchValues,
    CreditConfig,
    EpisodeCredit,
    TurnCredit,
    branch_advantages,
    group_advantages,
    returns_to_go,
)


def episode(final_reward: float, *turns: tuple[float, str | None]) -> EpisodeCredit:
    return EpisodeCredit(final_reward, tuple(TurnCredit(r, a) for r, a in turns))


def approx_rows(rows: list[list[float]]) -> list[object]:
    return [pytest.approx(row, abs=1e-9) for row in rows]


# The module docstring's worked example: unequal turn counts, shared anchor "s".
#   episode 0: R=1, r=[0.0, 0.1]       -> G (gamma=1) = [1.1, 1.1]
#   episode 1: R=0, r=[0.1, 0.0, 0.1]  -> G (gamma=1) = [0.2, 0.1, 0.1]
GROUP = [
    episode(1.0, (0.0, "s"), (0.1, "p")),
    episode(0.0, (0.1, "s"), (0.0, "s"), (0.1, "q")),
]
TURN = CreditConfig(mode="turn", gamma=1.0)


def test_outcome_two_episodes() -> None:
    """GRPO: R = [1, 0] -> mean 0.5 -> A = [+0.5, -0.5], copied to every turn; turn rewards do not count."""
    result = group_advantages(GROUP, CreditConfig(mode="outcome"))
    assert result == approx_rows([[0.5, 0.5], [-0.5, -0.5, -0.5]])


def test_outcome_std_normalised() -> None:
    """With normalize_std, A = (R - mean) / (pstd + eps) = +-0.5 / 0.500001."""
    result = group_advantages(GROUP, CreditConfig(mode="outcome", normalize_std=True))
    a = 0.5 / (0.5 + STD_EPS)
    assert result == approx_rows([[a, a], [-a, -a, -a]])


def test_outcome_counts_final_reward_of_an_episode_without_turns() -> None:
    """An episode that took no turn still enters the group mean; it just has no turn to credit."""
    group = [episode(1.0, (0.0, None)), episode(0.0), episode(0.5, (0.0, None))]
    result = group_advantages(group, CreditConfig(mode="outcome"))
    assert result == approx_rows([[0.5], [], [0.0]])


@pytest.mark.parametrize("normalize_std", [False, True])
@pytest.mark.parametrize("credit", ["outcome", "turn"])
def test_degenerate_group_gives_exact_zeros(credit: str, normalize_std: bool) -> None:
    """All episodes alike (values whose float mean is inexact, like 0.1) -> every advantage is exactly 0.0."""
    same = episode(0.1, (0.0, "a"), (0.0, "b"))  # R = every G = 0.1, and (0.1 + 0.1 + 0.1) / 3 != 0.1
    cfg = CreditConfig(mode=credit, normalize_std=normalize_std)  # type: ignore[arg-type]
    assert group_advantages([same, same, same], cfg) == [[0.0, 0.0]] * 3


@pytest.mark.parametrize("baseline", ["turn_index", "anchor"])
def test_contested_shaping_trains_nothing_where_every_answer_scored_alike(baseline: str) -> None:
    """shaping="contested": a group whose final rewards are equal gets 0.0 on every turn, though its episodes
    made different numbers of rewarded calls (with "every_group" the busier episode's turns get A > 0)."""
    alike = [episode(0.0, (0.05, "a"), (0.05, "b"), (0.1, "c")), episode(0.0, (0.05, "a"))]
    shaped = group_advantages(alike, CreditConfig(mode="turn", baseline=baseline))  # type: ignore[arg-type]
    assert shaped[0][0] > 0.0
    contested = CreditConfig(mode="turn", baseline=baseline, shaping="contested")  # type: ignore[arg-type]
    assert group_advantages(alike, contested) == [[0.0, 0.0, 0.0], [0.0]]


def test_contested_shaping_keeps_the_turn_rewards_where_answers_differ() -> None:
    """shaping="contested" changes nothing in a group whose final rewards differ: the worked example's numbers."""
    contested = CreditConfig(mode="turn", gamma=1.0, shaping="contested")
    assert group_advantages(GROUP, contested) == group_advantages(GROUP, TURN)
    assert group_advantages(GROUP, contested) == approx_rows([[0.45, 0.5], [-0.45, -0.5, 0.0]])


def test_group_of_one_episode_is_rejected_at_run_time() -> None:
    """A group shrunk to one episode (the others invalid) must be dropped by the caller, not scored 0."""
    with pytest.raises(ValueError, match="at least 2 episodes"):
        group_advantages(GROUP[:1], TURN)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"gamma": 0.0}, "gamma"),
        ({"gamma": 1.5}, "gamma"),
        ({"min_anchor_group": 1}, "min_anchor_group"),
        ({"mode": "token"}, "mode"),
        ({"baseline": "value"}, "baseline"),
        ({"shaping": "always"}, "shaping"),
    ],
)
def test_config_rejects_bad_values(kwargs: dict[str, object], message: str) -> None:
    """Settings outside their meaningful range fail when the config is built."""
    with pytest.raises(ValueError, match=message):
        CreditConfig(**kwargs)  # type: ignore[arg-type]


def test_returns_to_go_gamma_one_and_below() -> None:
    """G_t = r_t + gamma G_{t+1}, G_{T-1} = r_{T-1} + R; gamma = 0.5 on episode 1: [0.125, 0.05, 0.1]."""
    assert returns_to_go(GROUP[0], 1.0) == pytest.approx([1.1, 1.1])
    assert returns_to_go(GROUP[1], 1.0) == pytest.approx([0.2, 0.1, 0.1])
    assert returns_to_go(GROUP[0], 0.5) == pytest.approx([0.55, 1.1])
    assert returns_to_go(GROUP[1], 0.5) == pytest.approx([0.125, 0.05, 0.1])
    assert returns_to_go(episode(1.0), 0.5) == []


def test_turn_index_baseline_gamma_one_unequal_turns() -> None:
    """Baselines t0: mean(1.1, 0.2)=0.65; t1: mean(1.1, 0.1)=0.6; t2 only episode 1 -> A=0 there."""
    assert group_advantages(GROUP, TURN) == approx_rows([[0.45, 0.5], [-0.45, -0.5, 0.0]])


def test_turn_index_baseline_gamma_half() -> None:
    """gamma=0.5: G = [0.55, 1.1] and [0.125, 0.05, 0.1]; baselines 0.3375, 0.575, 0.1."""
    cfg = CreditConfig(mode="turn", gamma=0.5)
    assert group_advantages(GROUP, cfg) == approx_rows([[0.2125, 0.525], [-0.2125, -0.525, 0.0]])


def test_turn_credit_equals_outcome_credit_without_turn_rewards() -> None:
    """gamma=1, zero turn rewards, equal turn counts: every G_{i,t} = R_i, so turn credit is GRPO."""
    group = [episode(r, (0.0, None), (0.0, None)) for r in (1.0, 0.0, 0.25)]
    turn = group_advantages(group, CreditConfig(mode="turn"))
    outcome = group_advantages(group, CreditConfig(mode="outcome"))
    assert turn == approx_rows(outcome)


def test_anchor_baseline_shared_anchor_and_fallback() -> None:
    """Anchor "s" is shared by 3 turns (G 1.1, 0.2, 0.1; mean 1.4/3); "p" and "q" occur once and fall back
    to the turn-index baselines 0.6 (t1) and 0.1 (t2)."""
    cfg = CreditConfig(mode="turn", baseline="anchor")
    b = 1.4 / 3
    expected = [[1.1 - b, 0.5], [0.2 - b, 0.1 - b, 0.0]]
    assert group_advantages(GROUP, cfg) == approx_rows(expected)


def test_anchor_baseline_falls_back_below_min_group_or_without_anchor() -> None:
    """min_anchor_group above every anchor set's size, or no anchors at all: the turn-index result."""
    index_result = group_advantages(GROUP, TURN)
    strict = CreditConfig(mode="turn", baseline="anchor", min_anchor_group=4)
    assert group_advantages(GROUP, strict) == approx_rows(index_result)
    anonymous = [
        EpisodeCredit(e.final_reward, tuple(TurnCredit(t.reward, None) for t in e.turns)) for e in GROUP
    ]
    anchor = CreditConfig(mode="turn", baseline="anchor")
    assert group_advantages(anonymous, anchor) == approx_rows(index_result)


def test_turn_credit_std_normalised() -> None:
    """Turn advantages [0.45, 0.5, -0.45, -0.5, 0] have pstd sqrt(0.905/5); each is divided by it (+eps)."""
    cfg = CreditConfig(mode="turn", normalize_std=True)
    s = math.sqrt(0.905 / 5) + STD_EPS
    assert group_advantages(GROUP, cfg) == approx_rows([[0.45 / s, 0.5 / s], [-0.45 / s, -0.5 / s, 0.0]])


# ---------------------------------------------------------------- branch credit


def test_branch_credit_by_hand() -> None:
    """Episode 0 (R = 1), turn 1 branched: before (0, 0) -> 0; after (1, 0) plus the episode's 1 -> 2/3; so
    A = 2/3. Its unbranched turn 0 gets the outcome advantage 1 - 0.5 = 0.5. Episode 1 (R = 0), turn 0 branched
    with the group's other episode (R = 1) as before and after (0, 0) plus its own 0: A = 0 - 1 = -1; turns 1
    and 2 get -0.5."""
    values = [[BranchValues(1, (0.0, 0.0), (1.0, 0.0))], [BranchValues(0, (1.0,), (0.0, 0.0))]]
    result = branch_advantages(GROUP, values, normalize_std=False)
    assert result == approx_rows([[0.5, 2 / 3], [-1.0, -0.5, -0.5]])


def test_branch_credit_after_the_last_turn_is_the_episodes_own_reward() -> None:
    """A branched last turn has no continuation after it: A = R - mean(before) = 0 - 0.25."""
    values = [[], [BranchValues(2, (0.5, 0.0), ())]]
    result = branch_advantages(GROUP, values, normalize_std=False)
    assert result[1][2] == pytest.approx(-0.25) and result[0] == approx_rows([[0.5, 0.5]])[0]


def test_branch_credit_without_branches_is_grpo() -> None:
    """No turn branched: exactly the outcome advantages (the estimator degrades to GRPO, not to zero)."""
    assert branch_advantages(GROUP, [[], []], normalize_std=False) == group_advantages(GROUP, CreditConfig())


def test_branch_credit_of_equal_values_is_exactly_zero() -> None:
    """Before and after all equal to the episode's reward: the advantage is 0.0, not a rounding residue."""
    values = [[BranchValues(0, (1.0, 1.0), (1.0,))], []]
    assert branch_advantages(GROUP, values, normalize_std=False)[0][0] == 0.0


def test_branch_credit_refuses_a_turn_with_nothing_before_it() -> None:
    """A branched turn needs at least one continuation from before it to compare with."""
    with pytest.raises(ValueError, match="no continuation"):
        branch_advantages(GROUP, [[BranchValues(0, (), (1.0,))], []], normalize_std=False)
