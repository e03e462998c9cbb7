"""Information-gain turn rewards (training/info_gain.py, IGPO): what they score, that they telescope, that weight 0
changes nothing, that the scored ids are exactly the ones the policy saw, and that the one training loop asks the
learner for them only when they are weighted.

Episodes are played by a scripted policy with the byte tokenizer against the fake tool server. `CopyModel` is a
fake causal LM whose log-probs we control: it predicts the token that followed the last earlier occurrence of the
current 3 tokens (an induction head), so the gold answer becomes likely exactly when the context holds it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from main_agent.rollout import RolloutConfig, RolloutTask, rollout
from main_agent.types import Episode, Turn
from tests.fakes import TOOLS, ByteChatTokenizer, ScriptedPolicy, call_text, fake_tool_server
from tests.test_train import TASK, page_knows_ada, tiny_llama
from tool_server.client import ToolClient
from training.advantages import CreditConfig
from training.config import ConfigError, TrainConfig
from training.info_gain import answer_probs, boundary_contexts, gold_ids, group_gains, information_gains
from training.loop import train_loop
from training.metrics import MetricsLog, read_metrics
from training.rewards import TurnRewardWeights
from training.run import Run, first_state
from training.step import score_groups
from training.update import UpdateStats

TOKENIZER = ByteChatTokenizer()
GOLD = "<answer>Ada Lovelace</answer>"
SEARCH_THEN_READ = [
    call_text("search", query="first program"),
    call_text("page_qa", url="http://a", question="who wrote it?"),
    "<answer>Ada Lovelace</answer>",
]


class CopyModel(nn.Module):
    """An induction head: at position j, logit 8 for the token that followed the last earlier occurrence of
    tokens j-2..j (uniform when there is none). Records every row it is run on."""

    def __init__(self, vocab: int = 258, window: int = 3) -> None:
        super().__init__()
        self.vocab, self.window = vocab, window
        self.anchor = nn.Parameter(torch.zeros(1))  # where callers look for the device
        self.rows: list[list[int]] = []

    def forward(self, input_ids, attention_mask, logits_to_keep=None, **_) -> SimpleNamespace:
        rows, width = input_ids.shape
        keep = torch.arange(width) if logits_to_keep is None else logits_to_keep
        logits = torch.zeros(rows, len(keep), self.vocab)
        for b in range(rows):
            ids = input_ids[b]
            self.rows.append(ids[attention_mask[b].bool()].tolist())
            windows = ids.unfold(
                0, self.window, 1
            )  # [width - window + 1, window]: windows[s] = ids[s : s + window]
            for k, j in enumerate(keep.tolist()):
                start = j - self.window + 1
                if start <= 0:
                    continue
                match = (windows[:start] == windows[start]).all(dim=-1).nonzero()
                if len(match):
                    logits[b, k, ids[int(match[-1]) + self.window]] = 8.0
        return SimpleNamespace(logits=logits)


async def play(replies: list[str], cfg: RolloutConfig | None = None) -> tuple[Episode, ScriptedPolicy]:
    cfg = cfg or RolloutConfig()
    policy = ScriptedPolicy(lambda history, turn: replies[turn])
    task = RolloutTask(TASK.task_id, TASK.question, TOOLS)
    async with ToolClient("http://tools", transport=fake_tool_server(page_knows_ada)) as tools:
        return await rollout(task, policy, tools, policy.tokenizer, cfg), policy


def whole_rows(**settings) -> TrainConfig:
    """Every row scored alone and whole (the fake model takes no cache)."""
    return TrainConfig(share_prefix=False, micro_batch_tokens=1, **settings)


async def test_an_observation_holding_the_gold_answer_earns_a_positive_gain() -> None:
    """Turn 0 searches ("no hits"), turn 1 reads a page that names Ada Lovelace, turn 2 answers: the read raises
    the gold's teacher-forced probability (the per-token geometric mean: 0.03 -> 0.16 with this fake), so turn
    1's gain is positive and far above the search's, and the answering turn (no context after it) gets 0."""
    episode, _ = await play(SEARCH_THEN_READ)
    assert "Ada Lovelace" in episode.turns[1].observation_text
    [gains] = information_gains(CopyModel(), TOKENIZER, [episode], [TASK.reference], whole_rows())
    assert gains[1] > 0.1 and gains[1] > 10 * abs(gains[0]) and gains[2] == 0.0


async def test_gains_telescope_to_the_change_over_the_episode() -> None:
    """sum_t r_t = P(gold | after the last turn's observation) - P(gold | the prompt), with a real (tiny random)
    Llama; with the gold's prompt shared in one batch it scores as each row run whole and alone. An answered
    episode's sum stops at the context its answer was sampled from."""
    cut, _ = await play(SEARCH_THEN_READ[:2], RolloutConfig(max_turns=2))  # stops with an observation
    answered, _ = await play(SEARCH_THEN_READ)
    model, gold = tiny_llama(258), gold_ids(TOKENIZER, TASK.reference)
    shared = TrainConfig(micro_batch_tokens=100_000)
    gains = information_gains(model, TOKENIZER, [cut, answered], [TASK.reference] * 2, shared)
    alone = information_gains(model, TOKENIZER, [cut, answered], [TASK.reference] * 2, whole_rows())
    assert gains == [pytest.approx(g, abs=1e-6) for g in alone]
    for episode, episode_gains in zip((cut, answered), gains, strict=True):
        contexts = [c for c in boundary_contexts(episode) if c is not None]
        first, last = answer_probs(model, [(contexts[0], gold), (contexts[-1], gold)], shared)
        assert sum(episode_gains) == pytest.approx(last - first, abs=1e-6)
    assert gains[1][-1] == 0.0 and len(boundary_contexts(answered)) == 4


async def test_weight_0_leaves_advantages_bit_identical() -> None:
    """Turn credit with info_gain 0 lays exactly today's advantages whatever gains it is handed (the loop asks
    the learner for none then); a weight of 1 adds each gain to its turn's reward."""
    read, _ = await play(SEARCH_THEN_READ)
    quick, _ = await play(["<answer>Babbage</answer>"])
    groups = [[read, quick]]
    gains = [[[0.01, 0.7, 0.0], [0.0]]]
    today = score_groups(groups, [TASK], TrainConfig(credit=CreditConfig(mode="turn")))
    before = [list(s.advantages) for s in today.sequences]
    off = TrainConfig(credit=CreditConfig(mode="turn"), turn_rewards=TurnRewardWeights(info_gain=0.0))
    assert [list(s.advantages) for s in score_groups(groups, [TASK], off, gains=gains).sequences] == before
    on = dataclasses.replace(off, turn_rewards=TurnRewardWeights(info_gain=1.0))
    rewards = read.turn_rewards
    scored = score_groups(groups, [TASK], on, gains=gains)
    assert read.turn_rewards == pytest.approx([r + g for r, g in zip(rewards, gains[0][0], strict=True)])
    assert [list(s.advantages) for s in scored.sequences] != before
    assert scored.turn_parts[1].info_gain == pytest.approx(0.7)


async def test_the_scored_ids_are_the_policys_own_contexts_and_the_gold_answer() -> None:
    """Every row the model scores is a context the policy was given, id for id (its prompts as the sampler
    received them), followed by the gold answer's ids: the only text tokenised."""
    episode, policy = await play(SEARCH_THEN_READ)
    model = CopyModel()
    group_gains(model, TOKENIZER, [[episode]], [TASK], whole_rows())
    gold = TOKENIZER.encode(GOLD)
    assert gold_ids(TOKENIZER, TASK.reference) == gold
    assert sorted(model.rows) == sorted(prompt + gold for prompt in policy.prompts)


@dataclass
class FakeCollector:
    """Hands over the same recorded groups every step."""

    groups: list[list[Episode]]
    version: int = 0

    async def collect(self, tasks, step):
        return self.groups, None, None


@dataclass
class FakeLearner:
    """Records what the loop asks of it; its gains are given."""

    gains: list[list[list[float]]]
    asked: list[int] = field(default_factory=list)

    async def info_gains(self, groups, tasks):
        self.asked.append(len(groups))
        return self.gains

    async def update(self, sequences):
        return UpdateStats(), 0.0

    async def sync(self) -> float:
        return 0.0

    def save(self, step, run) -> None:
        return None


@pytest.mark.parametrize("weight", [0.0, 1.0])
async def test_the_loop_asks_the_learner_for_gains_only_when_they_are_weighted(
    tmp_path, weight: float
) -> None:
    """A step of the one training loop: with info_gain > 0 the learner scores the gains before the update, they
    join the turn rewards, and the step row logs their weighted mean per turn (reward/turn/info_gain); at 0 the
    learner is never asked and the row logs 0."""
    read, _ = await play(SEARCH_THEN_READ)
    quick, _ = await play(["<answer>Babbage</answer>"])
    learner = FakeLearner([[[0.01, 0.7, 0.0], [0.0]]])
    cfg = TrainConfig(
        steps=1, batch_tasks=1, group_size=2, run_dir=tmp_path, credit=CreditConfig(mode="turn"),
        turn_rewards=TurnRewardWeights(info_gain=weight),
    )  # fmt: skip
    with MetricsLog(tmp_path / "metrics.jsonl") as log:
        run = Run(cfg, [TASK], first_state(cfg, [TASK]), log)
        await train_loop(run, FakeCollector([[read, quick]]), learner)
    [row] = read_metrics(tmp_path / "metrics.jsonl")
    assert learner.asked == ([1] if weight else [])
    assert row["reward/turn/info_gain"] == pytest.approx(weight * 0.71 / 4)
    assert read.turn_rewards[1] == pytest.approx(0.05 + 0.1 + weight * 0.7)  # valid call, evidence, gain


def turn(completion: list[int], observation: list[int], prompt: list[int] | None = None) -> Turn:
    return Turn(completion, [0.0] * len(completion), observation, "", "", [], [], [], 0, 0.0, 0.0,
                prompt_ids=prompt or [])  # fmt: skip


def test_a_folded_episode_is_scored_from_each_segments_own_prompt() -> None:
    """The turn that opens a segment was sampled from that segment's prompt, which is also the context after
    the turn before it (whose observation went into that prompt); after a final answer there is no context."""
    turns = [turn([1], [2]), turn([3], []), turn([4], [5], prompt=[9, 9]), turn([6], [])]
    episode = Episode("t", "q", [7], turns, "x", "answer", 0, 0.0, 0.0, 0.0)
    assert boundary_contexts(episode) == [[7], [7, 1, 2], [9, 9], [9, 9, 4, 5], None]


def test_info_gain_refuses_a_forced_turn_prefix() -> None:
    """The gold answer is appended after an assistant header: a forced first or last turn prefix would sit
    between them, so the setting refuses it (and a negative weight)."""
    weights = TurnRewardWeights(info_gain=1.0)
    with pytest.raises(ConfigError, match="info_gain"):
        TrainConfig(turn_rewards=weights, rollout=RolloutConfig(last_turn_prefix="<answer>"))
    with pytest.raises(ConfigError, match="info_gain"):
        TrainConfig(turn_rewards=TurnRewardWeights(info_gain=-1.0))
    assert TrainConfig(turn_rewards=weights).turn_rewards.info_gain == 1.0  # no prefix: accepted
