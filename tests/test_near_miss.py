"""Continuations resampled from truncated near-miss prefixes (`[near_miss]`, training/near_miss.py).

The tasks are echo's (tests/echo_family.py) through the fake tool server, whose search echoes its query: a search
for the task's word shows the word (evidence), one for anything else does not. The scripted near miss searches
for the word, then answers a wrong one; its continuation is sampled by a scripted policy that answers what it
saw. Scored all-or-nothing here (`strict_echo`) where a test needs groups that fail alike; the loop test trains a
tiny random policy whose forced first call shows every word.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import httpx
import pytest

from main_agent.rollout import RolloutConfig
from main_agent.types import Episode
from tests import echo_family
from tests.fakes import ScriptedPolicy, call_text, fake_tool_server, ok_result
from tests.test_train import TINY_ROLLOUT, tiny_config
from tool_server.client import ToolClient
from training import tasks as task_data
from training.checkpoint import TrainState
from training.config import ConfigError, RunSettings, TrainConfig, load_train_config
from training.loop import start_collection, train
from training.metrics import MetricsLog, read_metrics
from training.near_miss import NearMiss, NearMissConfig, choose, cut_of, progress, resample
from training.play import play
from training.ray_session import check_supported
from training.run import Run
from training.step import score_groups
from training.tasks import Family, Task
from training.tasks.task import answer_text

ROLLOUT = RolloutConfig(max_turns=3, max_new_tokens=128, max_context_tokens=4096)
ON = NearMissConfig(per_group=1)


@pytest.fixture
def strict_echo(monkeypatch: pytest.MonkeyPatch) -> Family:
    """echo, its reward all-or-nothing: 1 for the word, 0 for anything else."""
    family = dataclasses.replace(
        echo_family.FAMILY, reward=lambda answer, word: float(echo_family.success(answer, word))
    )
    monkeypatch.setitem(task_data.FAMILIES, echo_family.NAME, family)
    return family


@pytest.fixture
def echo(monkeypatch: pytest.MonkeyPatch) -> Family:
    """echo as it is: a graded reward (the share of the word's letters an answer holds)."""
    monkeypatch.setitem(task_data.FAMILIES, echo_family.NAME, echo_family.FAMILY)
    return echo_family.FAMILY


def echo_tasks(tmp_path: Path, n: int = 2) -> list[Task]:
    return task_data.load_family("echo", "train", data_dir=tmp_path, limit=n)


def config(near: NearMissConfig = ON) -> TrainConfig:
    return TrainConfig(task="echo", group_size=2, rollout=ROLLOUT, max_concurrent_episodes=2, near_miss=near)


def word_of(history: str) -> str:
    return re.findall(r"Word: (\w+)", history)[0]


def seen(history: str) -> bool:
    """Whether the history holds a search's observation."""
    return "search saw" in history


def near_missing(history: str, turn: int) -> str:
    """Search for the word, then answer a wrong one: a near miss."""
    return answer_text("zzz") if seen(history) else call_text("search", query=word_of(history))


def answering_seen(history: str, turn: int) -> str:
    """Search for the word, then answer the word the search showed."""
    return answer_text(word_of(history)) if seen(history) else call_text("search", query=word_of(history))


def wrong_outright(history: str, turn: int) -> str:
    """Answer a wrong word at once: no evidence, no near miss."""
    return answer_text("zzz")


def answering_seen_as(answer: str):
    """Search for the word, then answer `answer`."""
    return lambda history, turn: answer_text(answer) if seen(history) else near_missing(history, turn)


def guessing(answer: str):
    """Search for something else (no evidence), then answer `answer`."""
    return lambda history, turn: (
        answer_text(answer) if seen(history) else call_text("search", query="nothing")
    )


async def groups_of(replies: list, tasks: list[Task], tools: ToolClient) -> list[list[Episode]]:
    """One group per task: an episode by each scripted policy of `replies`, in order."""
    groups: list[list[Episode]] = [[] for _ in tasks]
    for reply in replies:
        policy = ScriptedPolicy(reply)
        played = await play(
            tasks,
            lambda _, p=policy: p,
            tools=tools,
            tokenizer=policy.tokenizer,
            cfg=ROLLOUT,
            max_concurrent=2,
        )
        for group, [episode] in zip(groups, played, strict=True):
            group.append(episode)
    return groups


async def resampled(
    groups: list[list[Episode]],
    tasks: list[Task],
    tools: ToolClient,
    cfg: TrainConfig,
    *,
    policy=None,
    step=1,
) -> NearMiss:
    """The step's continuations as the run's collector asks for them, sampled by `policy` (answering what it saw
    unless given)."""
    policy = policy or ScriptedPolicy(answering_seen)
    return await resample(
        groups, tasks, cfg=cfg.near_miss, step=step, policy=policy, tools=tools, tokenizer=policy.tokenizer,
        rollout=cfg.rollout, reward_kind=cfg.reward_kind, max_concurrent=2,
    )  # fmt: skip


def trained(sequence) -> set[float]:
    """The advantages on a sequence's trained tokens."""
    return {a for a, m in zip(sequence.advantages, sequence.loss_mask, strict=True) if m}


# ---------------------------------------------------------------- off: as today


class NoResampling:
    """A collector that must never be asked to resample."""

    version = 0

    async def collect(self, tasks, step):
        return [[] for _ in tasks], None, None

    async def resample(self, tasks, groups, step):
        raise AssertionError("near misses resampled with near_miss off")


async def test_off_leaves_groups_and_advantages_exactly_as_today(strict_echo: Family, tmp_path: Path) -> None:
    """per_group 0 (the default): the loop never asks to resample (`Collected.near_miss` None), `resample` itself
    plays nothing at any step (no tool call), and scoring lays exactly today's sequences, with or without the
    empty result: a right and a near-miss episode get +0.5 and -0.5, the group unchanged."""
    off = TrainConfig().near_miss
    assert off.per_group == 0 and not any(off.active(s) for s in range(1, 40))
    tasks = echo_tasks(tmp_path)
    run = Run(config(off), tasks, TrainState(), MetricsLog(tmp_path / "metrics.jsonl"))
    collected = await start_collection(run, NoResampling(), run.state, 1)  # type: ignore[arg-type]
    assert collected.near_miss is None
    calls: list[str] = []
    server = fake_tool_server()

    async def counted(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        return await server.handle_async_request(request)

    async with ToolClient("http://tools", transport=httpx.MockTransport(counted)) as tools:
        groups = await groups_of([answering_seen, near_missing], tasks[:1], tools)
        calls.clear()
        empty = await resampled(groups, tasks[:1], tools, config(off))
    assert calls == [] and empty.continuations == [[]] and empty.prefixes == 0
    today = score_groups(groups, tasks, config(off))
    assert score_groups(groups, tasks, config(off), near_miss=empty) == today
    assert score_groups(groups, tasks, config(off), near_miss=None) == today
    assert [trained(s) for s in today.sequences] == [{0.5}, {-0.5}] and today.near_miss == 0
    assert [len(g) for g in today.groups] == [2]


# ---------------------------------------------------------------- which prefix, where cut


async def test_a_near_miss_is_cut_after_its_progress_turn_and_replayed_exactly(
    strict_echo: Family, tmp_path: Path
) -> None:
    """A near miss searched (turn 0: its observation holds the word, P = 1) and answered wrong (turn 1): it is cut
    right after turn 0. Each continuation starts from the near miss's very ids (prompt, turn 0's completion,
    log-probs and observation), replayed without asking the policy, its calls re-run; the policy is asked once,
    with exactly the near miss's context after turn 0, and samples on from there (here: the right word)."""
    [task] = echo_tasks(tmp_path, 1)
    cfg = config(NearMissConfig(per_group=2))
    policy = ScriptedPolicy(answering_seen)
    async with ToolClient("http://tools", transport=fake_tool_server()) as tools:
        groups = await groups_of([near_missing, near_missing], [task], tools)
        result = await resampled(groups, [task], tools, cfg, policy=policy)
    near = groups[0][0]
    assert progress(task, near) == [1.0, 1.0] and cut_of(task, near, reward=0.0, partial_answers=False) == 1
    assert result.prefixes == 1 and len(result.continuations[0]) == 2 and result.succeeded == 2
    context = near.prompt_ids + near.turns[0].completion_ids + near.turns[0].observation_ids
    assert policy.prompts == [context, context]
    for continuation in result.continuations[0]:
        replayed, sampled = continuation.turns
        assert continuation.prompt_ids == near.prompt_ids
        assert replayed.completion_ids == near.turns[0].completion_ids
        assert replayed.completion_logprobs == near.turns[0].completion_logprobs
        assert replayed.observation_ids == near.turns[0].observation_ids
        assert not replayed.trained and sampled.trained and continuation.answer == "apple"
        assert sampled.completion_ids == policy.samples[0].ids


async def test_which_groups_are_resampled_and_from_which_episode(echo: Family, tmp_path: Path) -> None:
    """No near miss without progress (an outright wrong answer, or a search that showed nothing); "all_fail"
    leaves a group with a success alone, "always" continues its near miss; of two near misses the one whose
    answer scored more is taken; with `partial_answers` an episode with no evidence whose answer scored > 0 is
    cut before its answer turn."""
    [task] = echo_tasks(tmp_path, 1)  # apple: "ape" holds 3 of its 4 letters, "zzz" none
    async with ToolClient("http://tools", transport=fake_tool_server()) as tools:
        [blind] = await groups_of([wrong_outright, guessing("ape")], [task], tools)
        [won] = await groups_of([answering_seen, near_missing], [task], tools)
        [two] = await groups_of([near_missing, answering_seen_as("pal")], [task], tools)
    assert choose(blind, task, cfg=ON, reward_kind="task") is None
    assert choose(won, task, cfg=ON, reward_kind="task") is None
    assert choose(won, task, cfg=dataclasses.replace(ON, when="always"), reward_kind="task") == (won[1], 1)
    assert choose(two, task, cfg=ON, reward_kind="task") == (two[1], 1)
    partial = dataclasses.replace(ON, partial_answers=True)
    assert choose(blind, task, cfg=partial, reward_kind="task") == (blind[1], 1)
    early = NearMissConfig(per_group=1, until_step=2)
    assert early.active(2) and not early.active(3) and NearMissConfig(per_group=1).active(99)


async def test_a_continuation_whose_replay_diverges_is_dropped_and_counted(
    strict_echo: Family, tmp_path: Path
) -> None:
    """Tools that are not frozen after all (the search answers otherwise the second time) make the replay
    diverge: the continuation is an infrastructure failure, dropped and counted, and never joins its group."""
    [task] = echo_tasks(tmp_path, 1)
    answered: list[str] = []

    async def drifting(name: str, arguments: dict[str, object]) -> dict[str, object]:
        answered.append(name)
        return ok_result(f"search saw {arguments['query']} ({len(answered)})")

    async with ToolClient("http://tools", transport=fake_tool_server(drifting)) as tools:
        groups = await groups_of([near_missing, near_missing], [task], tools)
        result = await resampled(groups, [task], tools, config())
    assert result.prefixes == 1 and result.continuations == [[]] and result.infra_failed == 1
    assert result.metrics(joined=0)["near_miss/infra_failed"] == 1
    assert math.isnan(result.metrics(joined=0)["near_miss/success"])


def test_the_setting_is_checked_and_refused_on_ray() -> None:
    """Settings out of range are a ConfigError naming the table; a Ray run refuses the setting (continuations
    replay near misses on the collector of the run in this process)."""
    with pytest.raises(ConfigError, match="near_miss"):
        load_train_config(None, ["near_miss.when=sometimes"])
    with pytest.raises(ConfigError, match="near_miss"):
        load_train_config(None, ["near_miss.per_group=-1"])
    with pytest.raises(ConfigError, match="near_miss"):
        check_supported(TrainConfig(near_miss=NearMissConfig(per_group=1)))
    check_supported(TrainConfig())


# ---------------------------------------------------------------- what trains


async def test_only_the_continuations_sampled_tokens_train(strict_echo: Family, tmp_path: Path) -> None:
    """A continuation's sequence holds the near miss's prompt and turn 0 as context (loss mask 0: those ids train
    once, in the near miss's own sequence) and trains exactly its own sampled turn's ids, on-policy (its
    sampler's log-probs, not off-policy)."""
    [task] = echo_tasks(tmp_path, 1)
    async with ToolClient("http://tools", transport=fake_tool_server()) as tools:
        groups = await groups_of([near_missing, near_missing], [task], tools)
        result = await resampled(groups, [task], tools, config())
    scored = score_groups(groups, [task], config(), near_miss=result)
    near, [continuation] = groups[0][0], result.continuations[0]
    own, mine = scored.sequences[0], scored.sequences[2]
    sampled = continuation.turns[1].completion_ids
    context = near.prompt_ids + near.turns[0].completion_ids + near.turns[0].observation_ids
    assert mine.input_ids == context + sampled and not mine.off_policy
    assert mine.loss_mask == [0] * len(context) + [1] * len(sampled)
    assert mine.old_logprobs[len(context) :] == continuation.turns[1].completion_logprobs
    prompt, first = len(near.prompt_ids), len(near.turns[0].completion_ids)
    assert own.loss_mask[prompt : prompt + first] == [1] * first  # the prefix trains in the near miss itself


async def test_an_all_fail_group_gets_signal_from_a_continuation_that_succeeds(
    strict_echo: Family, tmp_path: Path
) -> None:
    """Two near misses a group have no signal alone (advantages 0, zero variance). A continuation that answers
    right joins each group: rewards (0, 0, 1), so the policy's episodes get -1/3 and the continuation's sampled
    tokens +2/3. The logged success stays the policy's; the metrics count prefixes, continuations, success."""
    tasks = echo_tasks(tmp_path)
    async with ToolClient("http://tools", transport=fake_tool_server()) as tools:
        groups = await groups_of([near_missing, near_missing], tasks, tools)
        result = await resampled(groups, tasks, tools, config())
    alone = score_groups(groups, tasks, config())
    assert alone.zero_variance == 2 and all(trained(s) == {0.0} for s in alone.sequences)
    scored = score_groups(groups, tasks, config(), near_miss=result)
    assert scored.zero_variance == 0 and scored.zero_advantage == 0 and scored.near_miss == 2
    assert [list(trained(s)) for s in scored.sequences] == [
        [pytest.approx(-1 / 3)], [pytest.approx(-1 / 3)], [pytest.approx(2 / 3)],
    ] * 2  # fmt: skip
    assert scored.successes == [False] * 4 and [len(g) for g in scored.groups] == [2, 2]
    assert result.metrics(joined=scored.near_miss) | {"time/near_miss": 0.0} == {
        "near_miss/prefixes": 2, "near_miss/continuations": 2, "near_miss/joined": 2, "near_miss/success": 1.0,
        "near_miss/infra_failed": 0, "time/near_miss": 0.0,
    }  # fmt: skip


# ---------------------------------------------------------------- the loop


async def every_word(name: str, arguments: dict[str, object]) -> dict[str, object]:
    """A search that shows every echo word, whatever it was asked."""
    return ok_result("search saw " + " ".join(echo_family.WORDS))


@pytest.mark.slow
def test_a_run_resamples_near_misses_then_stops(
    strict_echo: Family, tiny_policy: Path, tmp_path: Path
) -> None:
    """Two steps of the one loop, resampling in step 1 only (until_step 1). A forced first call shows the word,
    so each of the tiny random policy's episodes is a near miss; at step 1 each all-fail group's is continued
    once by the real sampler and tokenizer (the replay exact: nothing infra-failed) and the continuations join
    their groups; at step 2 nothing is resampled. The policy's own episodes alone are counted and saved."""
    rollout = dataclasses.replace(
        TINY_ROLLOUT, max_new_tokens=48, untagged_is_answer=True,
        first_turn_prefix=call_text("search", query="word"),
    )  # fmt: skip
    cfg = tiny_config(
        tmp_path / "run", tiny_policy, run=RunSettings(policy=str(tiny_policy), data_dir=tmp_path), task="echo",
        rollout=rollout, near_miss=NearMissConfig(per_group=1, until_step=1),
    )  # fmt: skip
    run_dir = train(cfg, transport=fake_tool_server(every_word))
    first, second = read_metrics(run_dir / "metrics.jsonl")
    assert first["near_miss/prefixes"] == 2 and first["near_miss/continuations"] == 2
    assert first["near_miss/joined"] == 2 and first["near_miss/infra_failed"] == 0
    assert first["near_miss/success"] == 0.0 and first["time/near_miss"] > 0.0
    assert first["episodes/collected"] == 4 and first["groups/total"] == 2
    assert second["near_miss/prefixes"] == 0 and second["near_miss/continuations"] == 0
    assert math.isnan(second["near_miss/success"])
    assert len((run_dir / "rollouts" / "step_1.jsonl").read_text().splitlines()) == 4
