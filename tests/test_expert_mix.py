"""Expert episodes mixed off-policy into the early updates (`[expert_mix]`, training/expert_mix.py).

The tasks are echo's (tests/echo_family.py), scored all-or-nothing here (`strict_echo`): only the word itself earns
1. Its scripted expert searches for the word and answers it, through the fake tool server; the scripted policy of
the unit tests answers a wrong word, so a group of its episodes all fail alike. The loop test trains a tiny random
policy, which never says the word either.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from main_agent.rollout import RolloutConfig
from main_agent.tokens import TrainSequence, collate
from main_agent.types import Episode
from tests import echo_family
from tests.fakes import ByteChatTokenizer, ScriptedPolicy, fake_tool_server
from tests.test_train import TINY_ROLLOUT, final_weights, tiny_config, tiny_llama
from tool_server.client import ToolClient
from training import tasks as task_data
from training.checkpoint import TrainState
from training.config import ConfigError, RunSettings, TrainConfig, load_train_config
from training.expert_mix import ExpertMix, ExpertMixConfig, demonstrate, mix_weight
from training.loop import start_collection, train
from training.loss import batch_logprobs
from training.metrics import MetricsLog, read_metrics
from training.play import play
from training.ray_session import check_supported
from training.run import Run
from training.step import score_groups
from training.tasks import Family, Task
from training.tasks.task import answer_text
from training.update import micro_batch_loss

ROLLOUT = RolloutConfig(max_turns=3, max_new_tokens=128, max_context_tokens=4096)
MIX = ExpertMixConfig(per_group=1, until_step=4, weight=0.8)


@pytest.fixture
def strict_echo(monkeypatch: pytest.MonkeyPatch) -> Family:
    """echo, its reward all-or-nothing: 1 for the word, 0 for anything else."""
    family = dataclasses.replace(
        echo_family.FAMILY, reward=lambda answer, word: float(echo_family.success(answer, word))
    )
    monkeypatch.setitem(task_data.FAMILIES, echo_family.NAME, family)
    return family


def echo_tasks(tmp_path: Path) -> list[Task]:
    return task_data.load_family("echo", "train", data_dir=tmp_path, limit=2)


def config(mix: ExpertMixConfig = MIX, rollout: RolloutConfig = ROLLOUT) -> TrainConfig:
    return TrainConfig(task="echo", group_size=2, rollout=rollout, max_concurrent_episodes=2, expert_mix=mix)


async def answering(words: list[str], tasks: list[Task], tools: ToolClient) -> list[list[Episode]]:
    """One group per task: an episode answering each of `words`, by a scripted policy (byte tokenizer)."""
    groups: list[list[Episode]] = [[] for _ in tasks]
    for word in words:
        policy = ScriptedPolicy(functools.partial(saying, word))
        played = await play(
            tasks, functools.partial(same, policy), tools=tools, tokenizer=policy.tokenizer, cfg=ROLLOUT,
            max_concurrent=2,
        )  # fmt: skip
        for group, [episode] in zip(groups, played, strict=True):
            group.append(episode)
    return groups


def saying(word: str, history: str, turn: int) -> str:
    """A scripted reply: the answer `word`, whatever came before."""
    return answer_text(word)


def same(policy: ScriptedPolicy, task: Task) -> ScriptedPolicy:
    return policy


async def policy_and_experts(
    tasks: list[Task], words: list[str], cfg: TrainConfig, *, step: int = 1
) -> tuple[list[list[Episode]], ExpertMix]:
    async with ToolClient("http://tools", transport=fake_tool_server()) as tools:
        groups = await answering(words, tasks, tools)
        mix = await experts_of(tasks, tools, cfg, step=step)
    return groups, mix


async def experts_of(tasks: list[Task], tools: ToolClient, cfg: TrainConfig, *, step: int) -> ExpertMix:
    """The step's expert episodes, as the run's collector asks for them (byte tokenizer)."""
    return await demonstrate(
        tasks, mix=cfg.expert_mix, step=step, tools=tools, tokenizer=ByteChatTokenizer(), rollout=cfg.rollout,
        max_concurrent=2,
    )  # fmt: skip


def trained(sequence: TrainSequence) -> set[float]:
    """The advantages on a sequence's trained tokens."""
    return {a for a, m in zip(sequence.advantages, sequence.loss_mask, strict=True) if m}


# ---------------------------------------------------------------- off: as today


class NoExperts:
    """A collector whose expert must never be asked for."""

    version = 0

    async def collect(self, tasks, step):
        return [[] for _ in tasks], None, None

    async def demonstrate(self, tasks, step):
        raise AssertionError("the expert played with expert_mix off")


async def test_off_leaves_groups_and_advantages_exactly_as_today(strict_echo: Family, tmp_path: Path) -> None:
    """per_group 0 (the default): the weight is 0 at every step, the loop never asks for the expert
    (`Collected.experts` None), and scoring lays exactly today's sequences: a right and a wrong episode get
    +0.5 and -0.5, nothing is off-policy."""
    off = TrainConfig().expert_mix
    assert off.per_group == 0 and all(mix_weight(off, s) == 0.0 for s in range(1, 40))
    tasks = echo_tasks(tmp_path)
    run = Run(config(off), tasks, TrainState(), MetricsLog(tmp_path / "metrics.jsonl"))
    collected = await start_collection(run, NoExperts(), run.state, 1)  # type: ignore[arg-type]
    assert collected.experts is None and len(collected.groups) == 2
    async with ToolClient("http://tools", transport=fake_tool_server()) as tools:
        groups = await answering(["apple", "zzz"], tasks[:1], tools)
    today = score_groups(groups, tasks, config(off))
    mixed = score_groups(groups, tasks, config(off), experts=None)
    assert mixed == today and today.experts == 0
    assert [trained(s) for s in today.sequences] == [{0.5}, {-0.5}]
    assert not any(s.off_policy for s in today.sequences)


# ---------------------------------------------------------------- credit


async def test_an_all_fail_group_gets_signal_from_the_expert(strict_echo: Family, tmp_path: Path) -> None:
    """Two wrong episodes a group have no signal alone (advantages 0, zero variance). The expert's right episode
    joins each group: rewards (0, 0, 1), so the policy's episodes get -1/3 and the expert's w x 2/3 (w = 0.8 at
    step 1), its sequence marked off-policy."""
    tasks = echo_tasks(tmp_path)
    groups, mix = await policy_and_experts(tasks, ["zzz", "zzz"], config())
    alone = score_groups(groups, tasks, config())
    assert alone.zero_variance == 2 and all(trained(s) == {0.0} for s in alone.sequences)
    scored = score_groups(groups, tasks, config(), experts=mix)
    assert scored.zero_variance == 0 and scored.experts == 2
    policy = [s for s in scored.sequences if not s.off_policy]
    experts = [s for s in scored.sequences if s.off_policy]
    assert len(policy) == 4 and all(list(trained(s)) == [pytest.approx(-1 / 3)] for s in policy)
    assert len(experts) == 2 and all(list(trained(s)) == [pytest.approx(0.8 * 2 / 3)] for s in experts)
    assert scored.successes == [False] * 4  # the logged success stays the policy's


async def test_an_expert_that_does_not_beat_the_group_stays_out(strict_echo: Family, tmp_path: Path) -> None:
    """A group with a right policy episode already scores what the expert scores: the expert does not join
    (David-GRPO's rule), so the group trains exactly as without it and no expert token is pushed down."""
    tasks = echo_tasks(tmp_path)
    groups, mix = await policy_and_experts(tasks, ["apple", "zzz"], config())
    scored = score_groups(groups, tasks, config(), experts=mix)
    assert scored.experts == 1 and [len(g) for g in scored.groups] == [2, 2]  # only river's group takes it in
    apple = scored.sequences[:2]
    assert [trained(s) for s in apple] == [{0.5}, {-0.5}] and not any(s.off_policy for s in apple)


async def test_an_expert_episode_not_worth_imitating_is_dropped(strict_echo: Family, tmp_path: Path) -> None:
    """Under an 8-token budget the expert's call and answer are cut off: it ends without an answer, is not worth
    imitating, and is dropped and counted (`expert_mix/dropped`), never joining a group."""
    tasks = echo_tasks(tmp_path)
    cut = dataclasses.replace(ROLLOUT, max_new_tokens=8)
    groups, mix = await policy_and_experts(tasks, ["zzz", "zzz"], config(rollout=cut))
    assert mix.episodes == {}
    assert mix.metrics(joined=0) | {"time/expert_mix": 0.0} == {
        "expert_mix/weight": 0.8, "expert_mix/played": 2, "expert_mix/dropped": 2, "expert_mix/episodes": 0,
        "expert_mix/success": 0.0, "time/expert_mix": 0.0,
    }  # fmt: skip
    assert score_groups(groups, tasks, config(), experts=mix).experts == 0


# ---------------------------------------------------------------- schedule


async def test_the_weight_decays_linearly_and_no_expert_plays_after_until_step(
    strict_echo: Family, tmp_path: Path
) -> None:
    """w_s = 0.8 x (1 - (s - 1) / 4): 0.8, 0.6, 0.4, 0.2 over steps 1-4, then 0; at step 4 the expert plays
    both tasks, at step 5 it is not played at all (no tool call reaches the server)."""
    assert [mix_weight(MIX, s) for s in range(1, 8)] == pytest.approx([0.8, 0.6, 0.4, 0.2, 0.0, 0.0, 0.0])
    calls: list[str] = []
    server = fake_tool_server()

    async def counted(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        return await server.handle_async_request(request)

    tasks = echo_tasks(tmp_path)
    async with ToolClient("http://tools", transport=httpx.MockTransport(counted)) as tools:
        last = await experts_of(tasks, tools, config(), step=4)
        assert last.weight == pytest.approx(0.2) and last.played == 2 and len(last.episodes) == 2
        calls.clear()
        after = await experts_of(tasks, tools, config(), step=5)
    assert after == ExpertMix(0.0) and calls == []
    assert math.isnan(after.metrics(joined=0)["expert_mix/success"])


def test_the_setting_is_checked_and_refused_on_ray() -> None:
    """Settings out of range are a ConfigError naming the table; a Ray run refuses the mix (the expert plays on
    the collector of the run in this process)."""
    with pytest.raises(ConfigError, match="expert_mix"):
        load_train_config(None, ["expert_mix.until_step=0"])
    with pytest.raises(ConfigError, match="expert_mix"):
        check_supported(TrainConfig(expert_mix=ExpertMixConfig(per_group=1)))
    check_supported(TrainConfig())


# ---------------------------------------------------------------- loss


def test_expert_tokens_train_at_ratio_one_whatever_their_stand_in_log_probs() -> None:
    """An off-policy sequence's old log-probs (the expert's stand-in 0.0) never reach the loss: its loss and
    gradient equal those of the same tokens with the policy's own log-probs as old (ratio 1, nothing clipped),
    where taken as sampler log-probs the stand-ins would give a ratio of p < 1."""
    model = tiny_llama(258)
    cfg = TrainConfig(precision="fp32")
    ids = list(range(10, 40))
    mask = [0] * 10 + [1] * 20
    adv = [0.0] * 10 + [0.7] * 20
    own = batch_logprobs(model, collate([TrainSequence(ids, mask, [0.0] * 30, adv)], pad_id=0))[0].tolist()

    def loss_and_grads(sequence: TrainSequence):
        model.zero_grad()
        out = micro_batch_loss(model, collate([sequence], pad_id=0), cfg, n_tokens=20, ref_model=None)
        out.loss.backward()
        return out, [p.grad.clone() for p in model.parameters()]

    expert, expert_grads = loss_and_grads(TrainSequence(ids, mask, [0.0] * 30, adv, off_policy=True))
    sampled, sampled_grads = loss_and_grads(TrainSequence(ids, mask, own, adv))
    assert expert.ratio_mean.item() == pytest.approx(1.0) and expert.clip_frac.item() == 0.0
    assert expert.loss.item() == pytest.approx(sampled.loss.item(), rel=1e-6)
    assert all(torch.allclose(a, b, atol=1e-7) for a, b in zip(expert_grads, sampled_grads, strict=True))
    stand_in, _ = loss_and_grads(TrainSequence(ids, mask, [0.0] * 30, adv))
    assert stand_in.ratio_mean.item() < 0.5


# ---------------------------------------------------------------- the loop


@pytest.mark.slow
def test_a_run_mixes_the_expert_in_then_stops(strict_echo: Family, tiny_policy: Path, tmp_path: Path) -> None:
    """Two overlapped steps of the one loop, the mix fading out after step 1 (until_step 1): at step 1 the
    expert plays both tasks and joins both all-fail groups, which then have signal and train (the weights move);
    at step 2 no expert plays, the groups have none and the step is skipped. Both rows log the mix; the saved
    rollouts and the success are the policy's."""
    rollout = dataclasses.replace(TINY_ROLLOUT, max_new_tokens=48, untagged_is_answer=True)
    cfg = tiny_config(
        tmp_path / "run", tiny_policy, run=RunSettings(policy=str(tiny_policy), data_dir=tmp_path), task="echo",
        rollout=rollout, expert_mix=ExpertMixConfig(per_group=1, until_step=1),
    )  # fmt: skip
    run_dir = train(cfg, overlap=True, transport=fake_tool_server())
    first, second = read_metrics(run_dir / "metrics.jsonl")
    assert first["expert_mix/weight"] == 1.0 and first["expert_mix/played"] == 2
    assert first["expert_mix/episodes"] == 2 and first["expert_mix/success"] == 1.0
    assert first["groups/zero_variance"] == 0 and first["update/skipped"] == 0.0 and first["success"] == 0.0
    assert second["expert_mix/weight"] == 0.0 and second["expert_mix/played"] == 0
    assert second["expert_mix/episodes"] == 0 and second["groups/zero_variance"] == 2
    assert second["update/skipped"] == 1.0
    saved = (run_dir / "rollouts" / "step_1.jsonl").read_text().splitlines()
    assert len(saved) == 4 and all(Episode.from_json(line).reward == 0.0 for line in saved)
    before, after = load_file(tiny_policy / "model.safetensors"), final_weights(run_dir)
    assert any(not torch.equal(before[k], after[k]) for k in before)
