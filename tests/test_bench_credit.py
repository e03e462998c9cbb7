"""benchmarks/studies/credit/: its scores against hand-computed values, and the whole study on fake tools and a
scripted policy whose first call decides the outcome (so the true advantage of every turn is known)."""

from __future__ import annotations

import dataclasses
import json
import math
import random
import statistics
from pathlib import Path

import pytest
import torch

from benchmarks.studies.credit import scores as cs
from benchmarks.studies.credit.bench import tabled, whole
from benchmarks.studies.credit.folders import Options, recorded_lines, recorded_ns, seal
from benchmarks.studies.credit.pool import plot, pool, with_trends
from benchmarks.studies.credit.report import MODES, report
from benchmarks.studies.credit.stages import (
    Records,
    Session,
    ToolsChanged,
    matched_episodes,
    matched_rewards,
    run_stages,
    truth_plan,
    truth_states,
)
from main_agent.types import Episode
from tests.fakes import ScriptedPolicy, call_text, fake_tool_server, ok_result
from tool_server.client import ToolClient
from training.advantages import CreditConfig
from training.config import TrainConfig
from training.tasks import Task

# ---------------------------------------------------------------- scores


def test_ranks_share_the_average_rank_among_ties() -> None:
    """[3, 1, 2, 2]: 1 is first, the two 2s share ranks 2 and 3, 3 is fourth; a rounding residue is a tie."""
    assert cs.ranks([3, 1, 2, 2]) == [4, 1, 2.5, 2.5]
    assert cs.ranks([0.1 + 0.2, 0.3]) == [1.5, 1.5]


def test_spearman_pools_every_episode_and_is_undefined_for_a_constant_side() -> None:
    """Ranks 1 2 3 4 against 1 3 2 4: 1 - 6 x 2 / (4 x 15) = 0.8; a reversed order is -1; constant
    estimates (outcome credit within one episode) have no rank correlation: NaN."""
    assert cs.spearman([[(1, 1), (2, 3)], [(3, 2), (4, 4)]]) == pytest.approx(0.8)
    assert cs.spearman([[(1, 3), (2, 2), (3, 1)]]) == pytest.approx(-1.0)
    assert math.isnan(cs.spearman([[(0.5, 1), (0.5, 2), (0.5, 3)]]))


def test_sign_agreement_skips_zero_truths_and_counts_a_zero_estimate_half() -> None:
    """Truths 0.2, 0.3, -0.4 (and a 0 skipped): estimates right, wrong, 0 -> (1 + 0 + 1/2) / 3."""
    pairs = [(0.5, 0.2), (-0.1, 0.3), (0.0, -0.4), (0.7, 0.0)]
    assert cs.sign_agreement([pairs]) == pytest.approx(0.5)
    assert math.isnan(cs.sign_agreement([[(1.0, 0.0)]]))


def test_pairwise_accuracy_compares_turns_within_an_episode_only() -> None:
    """Episode 1: pairs (0,1) and (0,2) ordered right, (1,2) tied in the estimate (1/2); episode 2's truths are
    equal, so it has no pair; across episodes nothing is compared: 2.5 / 3. Equal estimates score exactly 1/2."""
    first = [(1.0, 0.1), (2.0, 0.3), (2.0, 0.2)]
    second = [(0.5, 0.4), (0.1, 0.4)]
    assert cs.pairwise_accuracy([first, second]) == pytest.approx(2.5 / 3)
    assert cs.pairwise_accuracy([[(0.3, 0.1), (0.3, 0.9), (0.3, -0.5)]]) == 0.5
    assert math.isnan(cs.pairwise_accuracy([second, [(1.0, 0.0)]]))


def test_bootstrap_interval_brackets_the_value_and_is_a_point_without_spread() -> None:
    """One episode resampled is always itself: the interval is the value. Mixed episodes give an interval around
    the value, the same for the same seed; the quantile interpolates as numpy's default does."""
    one = [[(1.0, 0.1), (2.0, 0.3)]]
    assert cs.bootstrap(cs.pairwise_accuracy, one, draws=20) == (1.0, 1.0)
    episodes = [[(1.0, 0.1), (2.0, 0.3)], [(2.0, 0.1), (1.0, 0.3)], [(1.0, 0.1), (3.0, 0.2)]]
    low, high = cs.bootstrap(cs.pairwise_accuracy, episodes, draws=200, seed=1)
    assert 0.0 <= low <= cs.pairwise_accuracy(episodes) <= high <= 1.0 and low < high
    assert cs.bootstrap(cs.pairwise_accuracy, episodes, draws=200, seed=1) == (low, high)
    assert cs._quantile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert all(math.isnan(v) for v in cs.estimate(cs.spearman, []))


def test_truth_error_is_the_standard_error_of_a_difference_of_means() -> None:
    """[1, 0, 1, 0] and [1, 1, 0, 0]: each s² = 1/3 over n = 4, so se = sqrt(1/12 + 1/12); an exact value after
    adds nothing; a sampled set of one has no variance estimate. Noise share: mean se² / var(truth)."""
    assert cs.truth_error([1, 0, 1, 0], [1, 1, 0, 0]) == pytest.approx(math.sqrt(1 / 6))
    assert cs.truth_error([1.0], [1, 1, 0, 0], exact_after=True) == pytest.approx(math.sqrt(1 / 12))
    assert math.isnan(cs.truth_error([1.0], [1, 0]))
    assert cs.noise_share([(1.0, 0.5), (-1.0, 0.5)]) == pytest.approx(0.25)


# ---------------------------------------------------------------- the study on fakes

TASKS = [Task(f"stub-{i}", "video_qa", f"What is {i} plus one?", ("search",), str(i + 1)) for i in range(2)]


def decided_by_the_first_call(rng: random.Random, answer=None):
    """Turn 0 searches "good" or "bad" at random; turn 1 answers right after "good", wrong after "bad" (by default
    the question's number plus one, or 0; `answer(right)` for another). The true advantage of turn 0 is
    R - P(right), of turn 1 exactly 0."""

    def reply(history: str, turn: int) -> str:
        history = history.split("<|im_start|>user")[1]  # past the system prompt's example call
        if "<tool_call>" not in history:
            return call_text("search", query=rng.choice(["good", "bad"]))
        right = '"query": "good"' in history
        if answer is not None:
            return f"<answer>{answer(right)}</answer>"
        number = int(history.split("What is ")[1].split(" ")[0])
        return f"<answer>{number + 1 if right else 0}</answer>"

    return reply


async def test_the_study_scores_known_advantages_and_resumes_without_sampling(tmp_path: Path) -> None:
    """2 tasks x 2 episodes x 2 turns, 6 replays a state: every stage recorded, every continuation after turn 0
    ends as the episode did (so turn 1's truth is exactly 0); outcome credit cannot order two turns of an
    episode (pairwise exactly 1/2), branch_all can; outcome and turn credit spend the episodes' tokens, branch
    more. A second run samples nothing: every stage resumes from its records. Without its truth stage the
    records score nothing (no row of undefined scores)."""
    policy = ScriptedPolicy(decided_by_the_first_call(random.Random(0)))
    cfg = TrainConfig(task="video_qa", group_size=2, credit=CreditConfig(branch_k=2, branch_turns=1))
    async with ToolClient("http://tools", transport=fake_tool_server()) as tools:
        session = Session(cfg, policy, policy.tokenizer, tools, await tools.tools())
        await run_stages(TASKS, session, tmp_path, replays=6, truth_turns=0)
        sampled = len(policy.samples)
        await run_stages(TASKS, session, tmp_path, replays=6, truth_turns=0)
    assert len(policy.samples) == sampled
    assert {p.name for p in tmp_path.iterdir()} == {
        f"{s}.jsonl" for s in ("episodes", "branch", "branch_all", "matched", "truth")
    }
    truth = {tuple(r["state"]): r["rewards"] for r in Records(tmp_path / "truth.jsonl").read()}
    assert set(truth) == {(g, 0, 0) for g in (0, 1)} | {(g, i, 1) for g in (0, 1) for i in (0, 1)}
    assert all(len(r) == 6 for r in truth.values())
    episodes = [
        r["episodes"] for r in sorted(Records(tmp_path / "episodes.jsonl").read(), key=lambda r: r["group"])
    ]
    for g, group in enumerate(episodes):  # after the first call the outcome is decided: V(after turn 0) = R
        for i, e in enumerate(group):
            assert len(e["turns"]) == 2 and set(truth[(g, i, 1)]) == {
                float(e["answer"] == TASKS[g].reference)
            }
    row = report(1, TASKS, tmp_path, cfg, truth_turns=0, draws=50)
    assert (
        row is not None
        and row["episodes"] == 4
        and row["turns_scored"] == 8
        and set(row["modes"]) == set(MODES)
    )
    modes = row["modes"]
    assert modes["outcome"]["pairwise"] == [0.5, 0.5, 0.5]
    assert modes["branch_all"]["pairwise"][0] > 0.5 and modes["branch_all"]["spearman"][0] > 0
    spent = {m: v["sampled_tokens_per_episode"] for m, v in modes.items()}
    assert spent["outcome"] == spent["turn"] == spent["anchor"] < spent["branch"] <= spent["branch_all"]
    assert spent["outcome"] < spent["outcome_matched"]
    assert row["truth"]["replays_per_state"] == 6 and row["truth"]["sampled_tokens_per_episode"] > 0
    assert row["truth"]["states"] == [6, 6] and tabled([row], [1], partial=False) == [row]
    (tmp_path / "truth.jsonl").unlink()
    assert report(1, TASKS, tmp_path, cfg, truth_turns=0, draws=50) is None


async def test_a_truth_cut_short_is_counted_and_left_out_of_the_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each state recorded says how many of those the truth needs are whole. A study stopped in its truth stage
    scores the turns recorded so far, but its row says how many of the states it needs are recorded, and the
    table leaves it out unless asked for a partial look; an N without any truth is left out either way."""
    policy = ScriptedPolicy(decided_by_the_first_call(random.Random(0)))
    cfg = TrainConfig(task="video_qa", group_size=2, credit=CreditConfig(branch_k=2, branch_turns=1))
    async with ToolClient("http://tools", transport=fake_tool_server()) as tools:
        session = Session(cfg, policy, policy.tokenizer, tools, await tools.tools())
        await run_stages(TASKS, session, tmp_path, replays=6, truth_turns=0)
    progress = [line for line in capsys.readouterr().out.splitlines() if "truth state" in line]
    assert len(progress) == 6 and "(6 of 6 whole)" in progress[-1]
    truth = tmp_path / "truth.jsonl"
    first = [line for line in truth.read_text(encoding="utf-8").splitlines() if line][:4]
    truth.write_text("\n".join(first) + "\n", encoding="utf-8")  # the study stopped after 4 of its 6 states
    row = report(1, TASKS, tmp_path, cfg, truth_turns=0, draws=20)
    assert row is not None and row["truth"]["states"] == [4, 6] and 0 < row["turns_scored"] < 8
    assert not whole(row)
    assert tabled([row], [1, 2], partial=False) == []
    assert tabled([row], [1, 2], partial=True) == [row]


async def test_with_a_sample_of_turns_branch_all_branches_around_exactly_the_scored_turns(
    tmp_path: Path,
) -> None:
    """--truth-turns 1: one turn scored per episode, chosen by the truth plan; branch_all's values are around
    that turn and no other, while branch keeps training's own choice."""
    policy = ScriptedPolicy(decided_by_the_first_call(random.Random(1)))
    cfg = TrainConfig(task="video_qa", group_size=2, credit=CreditConfig(branch_k=1, branch_turns=2))
    async with ToolClient("http://tools", transport=fake_tool_server()) as tools:
        session = Session(cfg, policy, policy.tokenizer, tools, await tools.tools())
        await run_stages(TASKS, session, tmp_path, replays=2, truth_turns=1)
    groups = {r["group"]: r["episodes"] for r in Records(tmp_path / "episodes.jsonl").read()}
    every = [[Episode.from_json(json.dumps(e)) for e in groups[g]] for g in range(len(TASKS))]
    scored = truth_plan(every, TASKS, turns=1, seed=cfg.run.seed)
    for line in Records(tmp_path / "branch_all.jsonl").read():
        assert [[v["turn"] for v in vs] for vs in line["values"]] == [
            scored[(line["group"], i)] for i in (0, 1)
        ]
    for line in Records(tmp_path / "branch.jsonl").read():
        assert [[v["turn"] for v in vs] for vs in line["values"]] == [[0, 1], [0, 1]]


def test_truth_states_are_the_start_and_the_states_between_turns() -> None:
    """Episode 0 scores turns 0-2: the group's start (shared), after turn 0, after turn 1, and none after its last
    turn (the episode's own reward is the value there); episode 1 scores turns 0 and 2: the start, after turn 0,
    before turn 2."""

    class Three:
        turns = [None, None, None]

    states = truth_states([[Three(), Three()]], {(0, 0): [0, 1, 2], (0, 1): [0, 2]})
    assert states == [(0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 1, 1), (0, 1, 2)]


async def test_the_study_grades_with_the_reward_training_uses(tmp_path: Path) -> None:
    """With `reward_kind = "graded"` every stage scores as the trainer does: a plate read one character off is
    worth 0.75 in the truth's continuations, in branch credit's and in the scored episodes, not exact match's 0."""
    plates = [
        Task(f"plate-{i}", "plate_reading", "What is the plate?", ("search",), "AB12") for i in range(2)
    ]
    # the plate AB12 read right after "good", one character off after "bad" (AB13: graded 0.75, exact 0)
    policy = ScriptedPolicy(
        decided_by_the_first_call(random.Random(2), lambda right: "AB12" if right else "AB13")
    )
    cfg = TrainConfig(
        task="plate_reading",
        group_size=2,
        reward_kind="graded",
        credit=CreditConfig(branch_k=2, branch_turns=1),
    )
    async with ToolClient("http://tools", transport=fake_tool_server()) as tools:
        session = Session(cfg, policy, policy.tokenizer, tools, await tools.tools())
        await run_stages(plates, session, tmp_path, replays=4, truth_turns=0)
    truth = {x for r in Records(tmp_path / "truth.jsonl").read() for x in r["rewards"]}
    assert truth == {1.0, 0.75}
    branch = {
        x
        for r in Records(tmp_path / "branch.jsonl").read()
        for per_episode in r["values"]
        for v in per_episode
        for x in (*v["before"], *v["after"])
    }
    assert branch and branch <= {1.0, 0.75}
    row = report(1, plates, tmp_path, cfg, truth_turns=0, draws=20)
    assert row is not None and row["turns_nonzero"] > 0


async def test_records_made_on_other_tools_are_refused_before_anything_is_added(tmp_path: Path) -> None:
    """A study resumed on tools whose observations changed since its records stops at once (ToolsChanged,
    naming the task and the diverged observation), adds no line to any stage and samples nothing."""
    policy = ScriptedPolicy(decided_by_the_first_call(random.Random(5)))
    cfg = TrainConfig(task="video_qa", group_size=2, credit=CreditConfig(branch_k=1, branch_turns=1))

    async def changed(name: str, arguments: dict[str, object]) -> dict[str, object]:
        return ok_result(f"{name} now says {json.dumps(arguments, sort_keys=True)}")

    async with ToolClient("http://tools", transport=fake_tool_server()) as tools:
        session = Session(cfg, policy, policy.tokenizer, tools, await tools.tools())
        await run_stages(TASKS, session, tmp_path, replays=2, truth_turns=0)
    before = {p.name: p.read_text() for p in tmp_path.iterdir()}
    sampled = len(policy.samples)
    async with ToolClient("http://tools", transport=fake_tool_server(changed)) as tools:
        session = Session(cfg, policy, policy.tokenizer, tools, await tools.tools())
        with pytest.raises(ToolsChanged, match="stub-0.*now says"):
            await run_stages(TASKS, session, tmp_path, replays=4, truth_turns=0)
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == before
    assert len(policy.samples) == sampled


def one_branch_study(*, seed: int) -> tuple[ScriptedPolicy, TrainConfig]:
    """The scripted policy of `decided_by_the_first_call` and a study branching once around one turn."""
    policy = ScriptedPolicy(decided_by_the_first_call(random.Random(seed)))
    return policy, TrainConfig(task="video_qa", group_size=2, credit=CreditConfig(branch_k=1, branch_turns=1))


async def first_run(policy, cfg: TrainConfig, tools: ToolClient, folder: Path, *, replays: int) -> list:
    """Every stage of the study recorded into `folder` by a first process; the tools' schemas."""
    schemas = await tools.tools()
    session = Session(cfg, policy, policy.tokenizer, tools, schemas)
    await run_stages(TASKS, session, folder, replays=replays, truth_turns=0)
    return schemas


async def test_outcome_matched_plays_what_branch_credits_tokens_buy_and_baselines_on_them(
    tmp_path: Path,
) -> None:
    """Token for token: each group gets as many more episodes as branch credit's continuations' tokens buy at its
    tokens per episode, so outcome_matched spends within an episode's tokens of branch credit; its advantage is
    R_i minus the mean over the group and those episodes; records made before the stage existed score every
    other mode without it, and pool without it."""
    policy = ScriptedPolicy(decided_by_the_first_call(random.Random(7)))
    cfg = TrainConfig(task="video_qa", group_size=2, credit=CreditConfig(branch_k=4, branch_turns=2))
    async with ToolClient("http://tools", transport=fake_tool_server()) as tools:
        session = Session(cfg, policy, policy.tokenizer, tools, await tools.tools())
        await run_stages(TASKS, session, tmp_path, replays=2, truth_turns=0)
    groups = {
        r["group"]: [Episode.from_json(json.dumps(e)) for e in r["episodes"]]
        for r in Records(tmp_path / "episodes.jsonl").read()
    }
    branch = {r["group"]: r["stats"]["sampled_tokens"] for r in Records(tmp_path / "branch.jsonl").read()}
    more = matched_rewards(Records(tmp_path / "matched.jsonl").read())
    assert set(more) == set(branch) == {0, 1}
    for g, rewards in more.items():
        assert len(rewards) == matched_episodes(groups[g], branch[g]) >= 2
    row = report(1, TASKS, tmp_path, cfg, truth_turns=0, draws=20)
    assert row is not None
    spent = {m: v["sampled_tokens_per_episode"] for m, v in row["modes"].items()}
    per_episode = spent["outcome"]
    assert abs(spent["outcome_matched"] - spent["branch"]) <= per_episode
    estimates = [a for ep in row["pairs"]["outcome_matched"] for a, _ in ep]
    expected = []
    for g in (0, 1):
        group = [float(e.answer == TASKS[g].reference) for e in groups[g]]
        baseline = statistics.fmean([*group, *more[g]])
        expected += [r - baseline for r in group for _ in range(2)]  # two turns scored per episode
    assert estimates == pytest.approx(expected)
    (tmp_path / "matched.jsonl").unlink()
    older = report(1, TASKS, tmp_path, cfg, truth_turns=0, draws=20)
    assert older is not None and set(older["modes"]) == set(MODES) - {"outcome_matched"}
    both = pool([older, row], draws=20)
    assert "outcome_matched" not in both["modes"] and both["spearman_over_matched"] == {}
    assert set(pool([row], draws=20)["spearman_over_matched"]) == {"branch", "branch_all"}


async def test_raising_the_replays_adds_only_the_missing_continuations_with_new_draws(tmp_path: Path) -> None:
    """A study recorded at 2 replays a state, rerun at 5: every state gets a second line of 3 continuations and
    nothing else is sampled again (episodes, branches); the report pools both lines (5 a state); the second
    process reseeds torch apart from the first (Session.draws), so its continuations are new draws."""
    policy, cfg = one_branch_study(seed=3)
    async with ToolClient("http://tools", transport=fake_tool_server()) as tools:
        schemas = await first_run(policy, cfg, tools, tmp_path, replays=2)
        first_seed = torch.initial_seed()
        before = {p.name: p.read_text() for p in tmp_path.iterdir() if p.name != "truth.jsonl"}
        more = Session(cfg, policy, policy.tokenizer, tools, schemas, draws=recorded_lines([tmp_path]))
        await run_stages(TASKS, more, tmp_path, replays=5, truth_turns=0)
    assert torch.initial_seed() != first_seed
    assert {p.name: p.read_text() for p in tmp_path.iterdir() if p.name != "truth.jsonl"} == before
    lines = Records(tmp_path / "truth.jsonl").read()
    per_state: dict[tuple, list[int]] = {}
    for r in lines:
        per_state.setdefault(tuple(r["state"]), []).append(len(r["rewards"]))
    assert per_state and all(counts == [2, 3] for counts in per_state.values())
    row = report(1, TASKS, tmp_path, cfg, truth_turns=0, draws=20)
    assert row is not None and row["truth"]["replays_per_state"] == 5


async def test_a_resume_draws_again_the_continuations_that_failed_as_infrastructure(tmp_path: Path) -> None:
    """A state whose continuations failed as infrastructure (recorded, not scored) gets them drawn again on the
    next run, in a line of its own; every other state samples nothing; the report counts the state's scored
    continuations only."""
    policy, cfg = one_branch_study(seed=5)
    async with ToolClient("http://tools", transport=fake_tool_server()) as tools:
        schemas = await first_run(policy, cfg, tools, tmp_path, replays=3)
        lines = Records(tmp_path / "truth.jsonl").read()
        lines[0] = {**lines[0], "rewards": lines[0]["rewards"][:1], "infra_failed": 2}  # 2 of 3 failed
        (tmp_path / "truth.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
        more = Session(cfg, policy, policy.tokenizer, tools, schemas, draws=recorded_lines([tmp_path]))
        await run_stages(TASKS, more, tmp_path, replays=3, truth_turns=0)
    after = Records(tmp_path / "truth.jsonl").read()
    assert len(after) == len(lines) + 1
    assert after[-1]["state"] == lines[0]["state"] and len(after[-1]["rewards"]) == 2
    assert after[-1]["infra_failed"] == 0
    row = report(1, TASKS, tmp_path, cfg, truth_turns=0, draws=20)
    assert row is not None and row["truth"]["replays_per_state"] == 3


async def test_pooled_studies_are_scored_as_one_set_of_episodes(tmp_path: Path) -> None:
    """Two studies of the same N pool into one row: counts add up, the pairs are both studies' episodes in
    order, every score is the metric of those pooled pairs, a study pooled alone keeps its own scores, and the
    pooled rows plot (scores undefined on these episodes plot nothing)."""
    cfg = TrainConfig(task="video_qa", group_size=2, credit=CreditConfig(branch_k=1, branch_turns=1))
    rows = []
    for k in (0, 1):
        policy = ScriptedPolicy(decided_by_the_first_call(random.Random(10 + k)))
        async with ToolClient("http://tools", transport=fake_tool_server()) as tools:
            session = Session(cfg, policy, policy.tokenizer, tools, await tools.tools())
            await run_stages(TASKS, session, tmp_path / str(k), replays=3, truth_turns=0)
        rows.append(report(1, TASKS, tmp_path / str(k), cfg, truth_turns=0, draws=20))
    both = pool(rows, draws=20)
    assert both["episodes"] == 8 and both["turns_scored"] == rows[0]["turns_scored"] + rows[1]["turns_scored"]
    for mode in MODES:
        assert both["pairs"][mode] == [[tuple(p) for p in ep] for r in rows for ep in r["pairs"][mode]]
        assert both["modes"][mode]["sign"][0] == cs.sign_agreement(both["pairs"][mode])
    alone = pool([rows[0]], draws=20)
    for mode in MODES:
        for name in ("spearman", "sign", "pairwise"):
            a, b = alone["modes"][mode][name], rows[0]["modes"][mode][name]
            assert a == b or (math.isnan(a[0]) and math.isnan(b[0]))
    assert plot([both], tmp_path / "pooled.png").stat().st_size > 0  # undefined (NaN) scores plot nothing


def test_a_paired_difference_resamples_both_estimators_on_the_same_episodes() -> None:
    """An estimator against itself differs by exactly 0 on every draw; one that orders every turn as the truth
    does is ahead of one that reverses them by 2 in Spearman, with the interval a point where every draw keeps
    that order; estimators scored on different episodes are refused."""
    truth = [[(0.0, 0.1), (0.0, 0.5)], [(0.0, -0.2), (0.0, 0.3)], [(0.0, 0.0), (0.0, 0.4)]]
    right = [[(t, t) for _, t in ep] for ep in truth]
    wrong = [[(-t, t) for _, t in ep] for ep in truth]
    assert cs.paired_difference(cs.spearman, right, right, draws=50) == [0.0, 0.0, 0.0]
    value, low, high = cs.paired_difference(cs.spearman, right, wrong, draws=50)
    assert value == pytest.approx(2.0) and low == pytest.approx(2.0) and high == pytest.approx(2.0)
    with pytest.raises(ValueError):
        cs.paired_difference(cs.spearman, right, wrong[:2])


def test_a_trend_is_how_much_a_lead_grows_from_shorter_to_longer_chains() -> None:
    """Two estimators alike on the shorter chains and one ordering every turn right against one reversing them
    on the longer: the lead grows by 2 on every draw (a point interval). The same lead on both: 0. Each set is
    resampled on its own, so sets of different sizes are fine, but estimators on different episodes within a set
    are refused. `with_trends` gives every N past the shortest each mode's trend over outcome credit."""
    truth = [[(0.0, 0.1), (0.0, 0.5)], [(0.0, -0.2), (0.0, 0.3)], [(0.0, 0.0), (0.0, 0.4)]]
    right = [[(t, t) for _, t in ep] for ep in truth]
    wrong = [[(-t, t) for _, t in ep] for ep in truth]
    assert cs.trend(cs.spearman, (right, right), (right, wrong), draws=50) == pytest.approx([2.0, 2.0, 2.0])
    assert cs.trend(cs.spearman, (right, wrong), (right[:2], wrong[:2]), draws=50) == pytest.approx([0, 0, 0])
    with pytest.raises(ValueError):
        cs.trend(cs.spearman, (right, wrong[:2]), (right, wrong))
    rows = [
        {"n": 1, "pairs": {"outcome": right, "turn": right}, "spearman_over_outcome": {"turn": [0.0] * 3}},
        {"n": 2, "pairs": {"outcome": wrong, "turn": right}, "spearman_over_outcome": {"turn": [2.0] * 3}},
    ]
    trended = with_trends(rows, draws=20)
    assert "trend_over_outcome" not in trended[0]
    assert trended[1]["trend_over_outcome"]["turn"] == pytest.approx([2.0, 2.0, 2.0])


def test_a_run_of_one_n_still_tables_the_other_n_recorded_with_its_settings(tmp_path: Path) -> None:
    """`--n-items 2` alone must not drop N = 1's row from the results file: every N whose folder was recorded
    with the same settings is scored; a folder of other settings, or one with no episodes yet, is not."""
    cfg = TrainConfig()
    opts = Options("plate_audit", [2], 12, 64, 2, 10, tmp_path, work=tmp_path / "work")
    for n in (1, 2, 4):
        opts.folder(n, cfg)[0].mkdir(parents=True)
    for n in (1, 2):
        (opts.folder(n, cfg)[0] / "episodes.jsonl").write_text("", encoding="utf-8")
    (tmp_path / "plate_audit-n8-0123456789").mkdir()  # N = 8 under other settings
    (tmp_path / "plate_audit-n8-0123456789" / "episodes.jsonl").write_text("", encoding="utf-8")
    assert recorded_ns(opts, cfg) == {1, 2}
    other = Options("plate_audit", [2], 24, 64, 2, 10, tmp_path, work=tmp_path / "work")
    assert recorded_ns(other, cfg) == set()


def test_a_folder_recorded_before_a_config_field_existed_is_still_found(tmp_path: Path) -> None:
    """Records sampled before a config field was added keep their older digest: the same settings still find
    them when the field they lack holds its default now, and do not when it was set to anything else, when
    another setting differs, or when the folder holds a field the config no longer has."""
    cfg = TrainConfig()
    opts = Options("plate_audit", [1], 12, 64, 2, 10, tmp_path, work=tmp_path / "work")
    path, settings = opts.folder(1, cfg)
    older = json.loads(json.dumps(settings, default=str))
    del older["config"]["credit"]["shaping"], older["config"]["task_ids"]
    folder = tmp_path / "plate_audit-n1-0123456789"
    folder.mkdir()
    (folder / "settings.json").write_text(json.dumps({**older, "policy_sha256": "ab"}), encoding="utf-8")
    (folder / "episodes.jsonl").write_text("", encoding="utf-8")
    assert opts.folder(1, cfg)[0] == folder and recorded_ns(opts, cfg) == {1}
    assert opts.folder(1, dataclasses.replace(cfg, task_ids=("x",)))[0] != folder
    assert opts.folder(1, dataclasses.replace(cfg, lr=2e-5))[0] != folder
    (folder / "settings.json").write_text(json.dumps({**older, "gone": 1}), encoding="utf-8")
    assert opts.folder(1, cfg)[0] == path != folder


def test_a_whole_stage_is_gzipped_once_and_read_in_either_form(tmp_path: Path) -> None:
    """A running stage appends to <stage>.jsonl; sealing gzips every line into <stage>.jsonl.gz (the committed
    form) and removes the open file; lines appended after (raised replays) are read after the sealed ones and
    folded in by the next seal; a seal cut short between its two steps does not count a line twice. The
    folder's sealed stages still count as recorded (resume, recorded_lines, recorded_ns)."""
    records = Records(tmp_path / "truth.jsonl")
    for state in range(3):
        records.append({"state": state})
    records.seal()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["truth.jsonl.gz"]
    records.append({"state": 3})
    assert [r["state"] for r in records.read()] == [0, 1, 2, 3] and records.exists()
    open_lines = records.path.read_text(encoding="utf-8")
    seal(tmp_path)
    assert [r["state"] for r in Records(tmp_path / "truth.jsonl").read()] == [0, 1, 2, 3]
    records.path.write_text(open_lines, encoding="utf-8")  # as if cut short after the gzip, before the unlink
    assert [r["state"] for r in records.read()] == [0, 1, 2, 3] and recorded_lines([tmp_path]) == 4
    cfg = TrainConfig()
    opts = Options("plate_audit", [1], 12, 64, 2, 10, tmp_path, work=tmp_path / "work")
    folder = opts.folder(1, cfg)[0]
    Records(folder / "episodes.jsonl").append({"group": 0})
    seal(folder)
    assert recorded_ns(opts, cfg) == {1} and not (folder / "episodes.jsonl").exists()
