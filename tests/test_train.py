"""The RL trainers: scoring, filtering, the optimizer step, and whole sync/async runs with exact resume.

Unit tests use the byte tokenizer and a tiny random Llama (vocab 258). Loop tests train a tiny random Llama with the
real SmolLM2 tokenizer against the fake tool server. A random policy never answers, so every real final reward is 0
and all advantages vanish; the loop tests that must see weights move swap `score` for `parity_score`, a stub
reward the random policy varies on (the share of even token ids it sampled).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from main_agent.rollout import RolloutConfig, RolloutTask, rollout
from main_agent.tokens import TrainSequence
from main_agent.types import Episode
from tests.fakes import TOOLS, ScriptedPolicy, call_text, fake_tool_server, ok_result
from tool_server.client import ToolClient
from training import step as step_module
from training import tasks as task_data
from training.advantages import CreditConfig
from training.checkpoint import CheckpointError, TrainState
from training.config import (
    ConfigError,
    RunSettings,
    TrainConfig,
    config_hash,
    config_to_dict,
    load_train_config,
)
from training.data_order import next_tasks
from training.loop import train
from training.metrics import read_metrics, rollout_metrics, step_line
from training.step import InfraFailure, drop_stale, filter_groups, group_to_sequences, score, score_groups
from training.tasks import Task
from training.update import masked_tokens, update

# Text-scored tasks with nothing to prepare: video_qa's reward (token F1) with the fake server's tools.
TASK = Task("t1", "video_qa", "Who wrote the first program?", ("search", "page_qa"), "Ada Lovelace")
STUB_TASKS = [
    Task(f"stub-{i}", "video_qa", f"What is {i} plus one?", ("search",), str(i + 1)) for i in range(5)
]


def tiny_llama(vocab: int, **config):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, **shape, num_key_value_heads=4, **config))


def params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------- score, credit, filter


async def play(replies: list[str], handler) -> Episode:
    policy = ScriptedPolicy(lambda history, turn: replies[turn])
    task = RolloutTask(TASK.task_id, TASK.question, TOOLS)
    async with ToolClient("http://tools", transport=fake_tool_server(handler)) as tools:
        return await rollout(task, policy, tools, policy.tokenizer, RolloutConfig())


async def page_knows_ada(name: str, arguments: dict[str, object]) -> dict[str, object]:
    return ok_result("The first program was written by Ada Lovelace." if name == "page_qa" else "no hits")


async def test_score_fills_final_reward_and_each_turn_component() -> None:
    """Turn 0: two new calls, the page holds the answer (valid + evidence); turn 1: a repeated call and bad JSON
    (repeated + malformed); turn 2: the right answer (final reward 1, no turn reward)."""
    replies = [
        call_text("search", query="first program") + call_text("page_qa", url="http://a", question="who?"),
        call_text("search", query=" First Program ") + "<tool_call>{'name': 'search',</tool_call>",
        "<answer>Ada Lovelace</answer>",
    ]
    episode = await play(replies, page_knows_ada)
    parts = score(episode, TASK, TrainConfig().turn_rewards, "task")
    assert episode.reward == 1.0
    expected = [
        {"valid_call": 0.05, "malformed_call": 0.0, "repeated_call": 0.0, "new_evidence": 0.1, "total": 0.15},
        {
            "valid_call": 0.0,
            "malformed_call": -0.05,
            "repeated_call": -0.05,
            "new_evidence": 0.0,
            "total": -0.1,
        },
        {"valid_call": 0.0, "malformed_call": 0.0, "repeated_call": 0.0, "new_evidence": 0.0, "total": 0.0},
    ]
    expected = [{**e, "recorded_item": 0.0, "info_gain": 0.0} for e in expected]
    assert [p.metrics(prefix="") for p in parts] == [pytest.approx(e) for e in expected]
    assert episode.turn_rewards == pytest.approx([0.15, -0.1, 0.0])


async def test_group_advantages_land_on_sampled_tokens_only() -> None:
    """Outcome credit: rewards 1 and 0 give +0.5 and -0.5 on every sampled token, 0 on prompt and observations."""
    right = await play([call_text("search", query="x"), "<answer>Ada Lovelace</answer>"], page_knows_ada)
    wrong = await play(["<answer>Charles Babbage</answer>"], page_knows_ada)
    for e in (right, wrong):
        score(e, TASK, TrainConfig().turn_rewards, "task")
    sequences = group_to_sequences([right, wrong], TrainConfig())
    for seq, advantage in zip(sequences, (0.5, -0.5), strict=True):
        assert {a for a, m in zip(seq.advantages, seq.loss_mask, strict=True) if m} == {advantage}
        assert {a for a, m in zip(seq.advantages, seq.loss_mask, strict=True) if not m} == {0.0}


def fake_episode(task_id: str, *, failed: bool = False) -> Episode:
    stop = "infra_failed" if failed else "max_turns"
    return Episode(task_id, "q", [1, 2], [], None, stop, 0, 0.0, 0.0, 0.0, "tools: down" if failed else None)


def test_filter_groups_drops_groups_with_infra_failures() -> None:
    """A group with one infra-failed episode goes entirely; clean groups stay, in order."""
    groups = [[fake_episode("a"), fake_episode("a")], [fake_episode("b"), fake_episode("b", failed=True)]]
    groups += [[fake_episode("c"), fake_episode("c")], [fake_episode("d"), fake_episode("d")]]
    kept = filter_groups(groups, TrainConfig(max_infra_failure_frac=0.25))
    assert [g[0].task_id for g in kept] == ["a", "c", "d"]


def test_filter_groups_fails_the_step_above_the_failure_limit() -> None:
    """2 of 4 failed episodes is above a 25% limit: the step raises, naming the count and the reason."""
    groups = [
        [fake_episode("a", failed=True), fake_episode("a")],
        [fake_episode("b", failed=True), fake_episode("b")],
    ]
    with pytest.raises(InfraFailure, match=r"2 of 4 episodes.*tools: down"):
        filter_groups(groups, TrainConfig(max_infra_failure_frac=0.25))


async def test_an_inexact_turn_keeps_the_episode_out_of_the_loss_but_in_the_baseline() -> None:
    """A sampler that re-tokenised one turn (exact=False) marks the turn and episode; the episode trains on nothing,
    yet its reward still sets the group's baseline (the exact episode's advantage is R - mean over both)."""
    right = await play([call_text("search", query="x"), "<answer>Ada Lovelace</answer>"], page_knows_ada)
    wrong = await play(["<answer>Charles Babbage</answer>"], page_knows_ada)
    inexact_turn = dataclasses.replace(wrong.turns[0], exact=False)
    wrong = dataclasses.replace(wrong, turns=[inexact_turn])
    assert right.exact and not wrong.exact
    for e in (right, wrong):
        score(e, TASK, TrainConfig().turn_rewards, "task")
    sequences = group_to_sequences([right, wrong], TrainConfig())
    assert len(sequences) == 1
    assert {a for a, m in zip(sequences[0].advantages, sequences[0].loss_mask, strict=True) if m} == {0.5}
    assert rollout_metrics([right, wrong], seconds=1.0)["episodes/inexact"] == 1


async def test_rollout_carries_the_samplers_exact_flag_into_each_turn() -> None:
    """`Sample.exact` reaches `Turn.exact` and survives the JSON round trip of rollout logs."""
    policy = ScriptedPolicy(lambda history, turn: "<answer>x</answer>")
    original = policy.sample

    async def inexact(prompt_ids: list[int], *, max_new_tokens: int):
        return dataclasses.replace(await original(prompt_ids, max_new_tokens=max_new_tokens), exact=False)

    policy.sample = inexact  # type: ignore[method-assign]
    task = RolloutTask(TASK.task_id, TASK.question, TOOLS)
    async with ToolClient("http://tools", transport=fake_tool_server(page_knows_ada)) as tools:
        episode = await rollout(task, policy, tools, policy.tokenizer, RolloutConfig())
    assert [t.exact for t in episode.turns] == [False] and not episode.exact
    assert not Episode.from_json(episode.to_json()).exact


def test_filter_groups_fails_the_step_when_too_many_episodes_are_inexact() -> None:
    """Inexact episodes count against the same limit as infra failures: a sampler that returns no ids must not
    train silently on nothing."""
    inexact = dataclasses.replace(fake_episode("a"), turns=[dataclasses.replace(_turn(), exact=False)])
    groups = [[inexact, fake_episode("a")], [fake_episode("b"), fake_episode("b")]]
    assert filter_groups(groups, TrainConfig(max_infra_failure_frac=0.25)) == groups
    with pytest.raises(InfraFailure, match=r"2 of 4 episodes.*2 inexact"):
        filter_groups([[inexact, inexact], groups[1]], TrainConfig(max_infra_failure_frac=0.25))


def _turn():
    from main_agent.types import Turn

    return Turn([1], [-0.1], [], "x", "", [], [], [], 0, 0.0, 0.0)


def test_drop_stale_counts_the_episodes_of_stale_groups() -> None:
    """At version 3 with max_staleness 1, a group sampled by version 1 is dropped and its 2 episodes counted."""
    old, new = [fake_episode("a"), fake_episode("a")], [fake_episode("b"), fake_episode("b")]
    for e in new:
        e.policy_version = 2
    fresh, dropped = drop_stale([old, new], version=3, max_staleness=1)
    assert fresh == [new] and dropped == 2


# ---------------------------------------------------------------- the optimizer step


def byte_sequences(model, n: int = 4, length: int = 24, temperature: float = 1.0) -> list[TrainSequence]:
    """Random byte sequences whose last 16 tokens are 'sampled', with the model's own log-probs (at `temperature`)
    as old ones."""
    from training.loss import token_logprobs

    torch.manual_seed(1)
    ids = torch.randint(0, 256, (n, length))
    with torch.no_grad():
        logprobs = token_logprobs(model, ids, torch.ones_like(ids), temperature=temperature)
    sequences = []
    for i in range(n):
        mask = [0] * (length - 16) + [1] * 16
        adv = [0.0] * (length - 16) + [1.0 if i % 2 else -1.0] * 16
        old = [lp if m else 0.0 for lp, m in zip(logprobs[i].tolist(), mask, strict=True)]
        sequences.append(TrainSequence(ids[i].tolist(), mask, old, adv))
    return sequences


def test_update_moves_the_weights_with_a_finite_loss() -> None:
    """One step over two micro-batches: finite loss and gradient norm, ratio 1 on-policy, weights changed."""
    model = tiny_llama(258)
    before = params(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    stats = update(model, optimizer, byte_sequences(model), TrainConfig(micro_batch_tokens=48))
    assert stats.skipped is None and stats.n_tokens == 64
    assert math.isfinite(stats.pg_loss) and math.isfinite(stats.grad_norm) and stats.grad_norm > 0
    assert stats.ratio_mean == pytest.approx(1.0, abs=1e-5)
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_the_update_trains_the_distribution_the_sampler_drew_from() -> None:
    """With `sampling.temperature` T the update's log-probs are the tempered ones the sampler reported, so the
    on-policy ratio is 1; read at temperature 1 the same sequences would start off-policy."""
    from main_agent.policy import SamplingConfig

    model = tiny_llama(258)
    sequences = byte_sequences(model, temperature=2.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0, weight_decay=0.0)
    tempered = TrainConfig(micro_batch_tokens=48, sampling=SamplingConfig(temperature=2.0))
    assert update(model, optimizer, sequences, tempered).ratio_mean == pytest.approx(1.0, abs=1e-5)
    plain = update(model, optimizer, sequences, TrainConfig(micro_batch_tokens=48))
    assert abs(plain.ratio_mean - 1.0) > 1e-2, plain.ratio_mean


def test_a_bf16_update_stays_close_to_the_float32_one() -> None:
    """precision = "bf16" runs the update's matmuls in bfloat16 and keeps everything else float32: the step is
    finite, the weights stay float32, and the on-policy ratio moves off 1 only by bf16 rounding."""
    model = tiny_llama(258)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    stats = update(
        model, optimizer, byte_sequences(model), TrainConfig(micro_batch_tokens=48, precision="bf16")
    )
    assert stats.skipped is None and math.isfinite(stats.grad_norm) and stats.grad_norm > 0
    assert stats.ratio_mean == pytest.approx(1.0, abs=5e-2)
    assert all(p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize("field", ["advantages", "old_logprobs"])
def test_a_non_finite_batch_skips_the_step(field: str) -> None:
    """A NaN advantage or sampler log-prob skips the whole step: weights and optimizer state untouched."""
    model = tiny_llama(258)
    sequences = byte_sequences(model)
    poisoned = getattr(sequences[0], field)
    poisoned[-1] = math.nan
    before = params(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    stats = update(model, optimizer, sequences, TrainConfig())
    assert stats.skipped is not None
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not optimizer.state and all(p.grad is None for p in model.parameters())


def test_sequences_with_no_advantage_are_skipped_without_changing_the_gradient() -> None:
    """Without a KL term, sequences whose every advantage is 0 (a flat group) run no forward or backward, yet the
    gradient is the whole step's: they still count in the normaliser. With a KL term every sequence runs."""
    from training.update import accumulate_gradients, with_signal

    model = tiny_llama(258)
    sequences = byte_sequences(model, n=6)
    for s in sequences[4:]:
        s.advantages[:] = [0.0] * len(s.advantages)
    cfg = TrainConfig(micro_batch_tokens=48)
    live = with_signal(sequences, cfg)
    assert live == sequences[:4] and with_signal(sequences, TrainConfig(kl_coef=0.1)) == sequences
    accumulate_gradients(model, sequences, cfg)
    whole = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    accumulate_gradients(model, live, cfg, normalizer=96)
    for k, p in model.named_parameters():
        assert torch.allclose(p.grad, whole[k], atol=1e-7), k
    stats = update(model, torch.optim.AdamW(model.parameters(), lr=1e-3), sequences, cfg)
    assert stats.skipped is None and (stats.n_tokens, stats.tokens_skipped) == (96, 32)


def test_a_step_whose_every_advantage_is_zero_skips_the_optimizer_step() -> None:
    """No sequence with a gradient: the optimizer does not step (no momentum-only move), the tokens are counted."""
    model = tiny_llama(258)
    sequences = byte_sequences(model)
    for s in sequences:
        s.advantages[:] = [0.0] * len(s.advantages)
    before = params(model)
    stats = update(model, torch.optim.AdamW(model.parameters(), lr=1e-3), sequences, TrainConfig())
    assert stats.skipped == "every advantage is 0: no gradient" and stats.tokens_skipped == 64
    assert stats.metrics()["update/tokens_skipped"] == 64
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_step_at_learning_rate_0_computes_nothing_and_moves_nothing() -> None:
    """lr = 0 (a study's control): the step is skipped before any forward pass, weights and optimizer state as
    they were, every token counted as skipped, so a control costs its rollouts only."""
    model = tiny_llama(258)
    sequences = byte_sequences(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
    before = params(model)
    model.forward = lambda *a, **k: pytest.fail("no forward pass at learning rate 0")  # type: ignore[method-assign]
    stats = update(model, optimizer, sequences, TrainConfig(lr=0.0))
    assert stats.skipped == "learning rate 0" and stats.tokens_skipped == masked_tokens(sequences)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()) and not optimizer.state


async def test_flat_groups_are_counted_and_lay_no_advantage() -> None:
    """Outcome credit: a group of equal rewards is counted (zero variance, zero advantage) and its tokens carry
    advantage 0; a mixed group is neither. Turn credit: equal final rewards with different turn rewards still
    give non-zero advantages, so that group is counted as zero variance but not as zero advantage."""
    replies = (
        [call_text("search", query="x"), "<answer>Ada Lovelace</answer>"],
        ["<answer>Ada Lovelace</answer>"],
    )
    slow, fast = [await play(r, page_knows_ada) for r in replies]
    wrong = await play(["<answer>Charles Babbage</answer>"], page_knows_ada)
    groups = [[slow, fast], [fast, wrong]]
    scored = score_groups(groups, [TASK], TrainConfig())
    assert scored.metrics() == {"groups/total": 2, "groups/zero_variance": 1, "groups/zero_advantage": 1}
    flat_group = scored.sequences[:2]
    assert all(a == 0.0 for s in flat_group for a in s.advantages) and any(scored.sequences[2].advantages)
    turn = score_groups(groups, [TASK], TrainConfig(credit=CreditConfig(mode="turn")))
    assert turn.metrics() == {"groups/total": 2, "groups/zero_variance": 1, "groups/zero_advantage": 0}


# ---------------------------------------------------------------- config, data order, step line


def test_config_reads_toml_and_overrides_and_names_unknown_keys(tmp_path: Path) -> None:
    """TOML then key=value overrides (TOML values, bare words as strings, dotted keys into tables); a typo is an
    error naming the key; a group of one is refused before anything is loaded."""
    path = tmp_path / "train.toml"
    path.write_text(
        'group_size = 8\ntask = "plate_reading"\n[turn_rewards]\nvalid_call = 0.0\n'
        '[rollout]\nmax_turns = 6\n[credit]\nmode = "turn"\nmin_anchor_group = 3\n'
    )
    overrides = ["lr=3e-5", "run_dir=runs/x", "turn_rewards.new_evidence=0.2", "sampling.temperature=0.9"]
    cfg = load_train_config(path, overrides)
    assert (cfg.group_size, cfg.task, cfg.lr, cfg.run_dir) == (8, "plate_reading", 3e-5, Path("runs/x"))
    assert (cfg.turn_rewards.valid_call, cfg.turn_rewards.new_evidence) == (0.0, 0.2)
    assert (cfg.rollout.max_turns, cfg.credit.mode, cfg.credit.min_anchor_group) == (6, "turn", 3)
    assert cfg.sampling.temperature == 0.9 and cfg.rollout.max_new_tokens == RolloutConfig().max_new_tokens
    assert config_hash(cfg) != config_hash(TrainConfig())
    with pytest.raises(ConfigError, match="grop_size"):
        load_train_config(None, ["grop_size=2"])
    with pytest.raises(ConfigError, match="group_size"):
        load_train_config(None, ["group_size=1"])


@pytest.mark.parametrize(
    ("override", "new_place"),
    [
        ("max_turns=4", "rollout.max_turns"),
        ("max_new_tokens=128", "rollout.max_new_tokens"),
        ('credit="turn"', "credit.mode"),
        ("gamma=0.9", "credit.gamma"),
        ('sampler="vllm"', "sampling.backend"),
        ('sampler_url="http://x"', "sampling.url"),
        ("temperature=1.0", "sampling.temperature"),
        ('tools_url="http://x"', "tools.url"),
        ("max_inflight_tool_calls=4", "tools.max_inflight_calls"),
    ],
)
def test_old_flat_keys_name_their_new_table(override: str, new_place: str) -> None:
    """A key of the earlier flat layout is a one-line error that says where the setting lives now."""
    with pytest.raises(ConfigError, match=f"set {new_place.replace('.', '[.]')} instead"):
        load_train_config(None, [override])


def test_settings_round_trip_through_their_json_form() -> None:
    """What a checkpoint stores (`config_to_dict`) builds the same settings back, tables included."""
    from conductor.settings import build

    cfg = load_train_config(None, ["rollout.max_turns=3", "credit.mode=turn", "lora_rank=4", "limit=7"])
    assert build(TrainConfig, config_to_dict(cfg), "the settings") == cfg


def test_task_order_visits_every_task_once_per_epoch_and_repeats() -> None:
    """Batches of 2 from 5 tasks: each epoch is a permutation; the same seed and cursor give the same tasks."""
    cfg, state, seen = TrainConfig(batch_tasks=2), TrainState(), []
    for _ in range(5):
        batch, state = next_tasks(STUB_TASKS, state, cfg)
        seen += [t.task_id for t in batch]
    assert sorted(seen[:5]) == sorted(seen[5:]) == sorted(t.task_id for t in STUB_TASKS)
    assert (state.epoch, state.position) == (2, 0)
    again, _ = next_tasks(STUB_TASKS, TrainState(epoch=1, position=1), cfg)
    assert [t.task_id for t in again] == seen[6:8]


def test_task_ids_train_on_those_tasks_only_and_name_the_unknown(shared_data: Path) -> None:
    """`--set task_ids=[...]` (as a study writes it) keeps those tasks of the split, in the loader's order, and
    the task order draws from them alone; an id the split lacks is an error naming it, not a smaller run."""
    from training.data_order import load_tasks

    every = load_tasks(load_train_config(None, ["task=corpus_qa", "limit=40", f"data_dir={shared_data}"]))
    ids = [every[31].task_id, every[3].task_id, every[17].task_id]
    cfg = load_train_config(
        None, ["task=corpus_qa", f"data_dir={shared_data}", f"task_ids={json.dumps(ids)}", "batch_tasks=2"]
    )
    tasks = load_tasks(cfg)
    assert [t.task_id for t in tasks] == [every[i].task_id for i in (3, 17, 31)]
    state, seen = TrainState(), set()
    for _ in range(3):
        batch, state = next_tasks(tasks, state, cfg)
        seen |= {t.task_id for t in batch}
    assert seen == set(ids)
    wrong = load_train_config(
        None, ["task=corpus_qa", f"data_dir={shared_data}", 'task_ids=["corpus_qa-nope"]']
    )
    with pytest.raises(ValueError, match="corpus_qa-nope"):
        load_tasks(wrong)


def test_step_line_has_a_fixed_shape() -> None:
    """Two very different rows print lines of the same length with the fields in the same place."""
    small = {"step": 1, "reward/final": 0.0, "loss/pg": 0.0, "time/rollout": 1.0, "time/train": 1.0}
    large = {
        "step": 120,
        "reward/final": 0.75,
        "loss/pg": -0.01234,
        "episodes/infra_failed": 3,
        "context/main_tokens": 1812.0,
        "time/rollout": 412.5,
        "time/train": 88.1,
    }
    lines = [step_line(small), step_line(large)]
    assert len(lines[0]) == len(lines[1]) and lines[0].index("| pg") == lines[1].index("| pg")


# ---------------------------------------------------------------- whole runs


def parity_score(episode: Episode, task: Task, weights, kind: str = "task", **_: object) -> list:
    """Stub reward: the share of even ids among the sampled tokens (the random policy varies on it); the keyword
    settings of `score` (evidence_weight, ...) are ignored."""
    ids = [i for t in episode.turns for i in t.completion_ids]
    episode.reward = sum(i % 2 == 0 for i in ids) / max(len(ids), 1)
    episode.turn_rewards = [0.0] * len(episode.turns)
    return []


TINY_ROLLOUT = RolloutConfig(max_turns=2, max_new_tokens=8, max_context_tokens=1024, observation_tokens=32)


def tiny_config(run_dir: Path, policy: Path, **changes) -> TrainConfig:
    cfg = TrainConfig(
        run=RunSettings(policy=str(policy)),
        task="video_qa",
        steps=2,
        batch_tasks=2,
        group_size=2,
        lr=1e-3,
        rollout=TINY_ROLLOUT,
        max_concurrent_episodes=1,
        run_dir=run_dir,
        save_every=1,
        keep_last=1,
    )
    return dataclasses.replace(cfg, **changes)


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / (run_dir / "latest").read_text().strip() / "model" / "model.safetensors")


def sampled_task_ids(run_dir: Path, step: int) -> list[str]:
    lines = (run_dir / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()
    return [json.loads(line)["task_id"] for line in lines]


def check_run_trained(run_dir: Path, policy: Path, steps: int) -> list[dict[str, float]]:
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert all(math.isfinite(r["loss/pg"]) and r["update/skipped"] == 0.0 for r in rows)
    assert all(r["episodes/collected"] == 4 for r in rows)
    assert all(0 < r["perf/rss_gb"] <= r["perf/peak_rss_gb"] * 1.01 for r in rows)  # memory, to see growth
    before = load_file(policy / "model.safetensors")
    after = final_weights(run_dir)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    return rows


@pytest.mark.slow
def test_two_sync_steps_train(tiny_policy: Path, tmp_path: Path, stub_tasks, monkeypatch) -> None:
    """Two steps of the sync loop with a KL reference: finite losses, weights moved (so the second step's KL is
    positive), rollouts and a checkpoint written."""
    monkeypatch.setattr(step_module, "score", parity_score)
    run_dir = train(tiny_config(tmp_path / "run", tiny_policy, kl_coef=0.1), transport=fake_tool_server())
    rows = check_run_trained(run_dir, tiny_policy, 2)
    assert [r["policy_version"] for r in rows] == [1, 2]
    assert rows[0]["loss/kl"] == 0.0 and rows[1]["loss/kl"] > 0.0
    assert len(sampled_task_ids(run_dir, 2)) == 4 and (run_dir / "step_2" / "MANIFEST.json").is_file()


@pytest.mark.slow
def test_two_branch_credit_steps_train(tiny_policy: Path, tmp_path: Path, stub_tasks, monkeypatch) -> None:
    """credit = "branch": every episode's chosen turn is continued from exact replays (the continuations are
    counted and their sampled tokens logged), the advantages train, the weights move, in the sync and the async
    loop alike."""
    monkeypatch.setattr(step_module, "score", parity_score)
    credit = CreditConfig(mode="branch", branch_k=2, branch_turns=1)
    for overlap, name in ((False, "sync"), (True, "async")):
        cfg = tiny_config(tmp_path / name, tiny_policy, credit=credit)
        run_dir = train(cfg, overlap=overlap, transport=fake_tool_server())
        rows = check_run_trained(run_dir, tiny_policy, 2)
        assert all(r["branch/continuations"] >= 2 and r["branch/infra_failed"] == 0 for r in rows)
        assert all(r["branch/sampled_tokens"] > 0 and r["tokens/sampled"] > 0 for r in rows)


def test_branching_plans_states_around_chosen_turns() -> None:
    """A chosen turn needs the state before it (not for turn 0: the group serves) and after it (not after the
    last turn); the choice is the same for the same seed, step, task and episode."""
    from training.branching import plan, states

    episodes = [fake_episode("t1"), fake_episode("t1")]
    for e in episodes:
        e.turns = [_turn(), _turn(), _turn()]
    cfg = TrainConfig(run=RunSettings(seed=3), credit=CreditConfig(mode="branch", branch_turns=0))
    chosen = plan([episodes], [TASK], cfg, step=1)
    assert chosen == {(0, 0): [0, 1, 2], (0, 1): [0, 1, 2]}
    assert states([episodes], chosen) == [(0, i, s) for i in (0, 1) for s in (1, 2)]
    one = dataclasses.replace(cfg, credit=CreditConfig(mode="branch", branch_turns=1))
    assert plan([episodes], [TASK], one, step=1) == plan([episodes], [TASK], one, step=1)
    assert all(len(turns) == 1 for turns in plan([episodes], [TASK], one, step=1).values())


@pytest.mark.slow
def test_two_async_steps_train(tiny_policy: Path, tmp_path: Path, stub_tasks, monkeypatch) -> None:
    """Two steps of the async loop: the prefetched batch (one version behind) trains, losses finite; the
    checkpoint counts the episodes of both steps (the prefetching collection's copy of the counters is stale)."""
    monkeypatch.setattr(step_module, "score", parity_score)
    run_dir = train(tiny_config(tmp_path / "run", tiny_policy), overlap=True, transport=fake_tool_server())
    rows = check_run_trained(run_dir, tiny_policy, 2)
    assert json.loads((run_dir / "step_2" / "state.json").read_text())["episodes"] == 8
    assert [r["episodes/stale_dropped"] for r in rows] == [0, 0]
    second = [
        Episode.from_json(line) for line in (run_dir / "rollouts" / "step_2.jsonl").read_text().splitlines()
    ]
    assert {e.policy_version for e in second} == {0}  # sampled while step 1 trained


@pytest.mark.slow
def test_async_drops_stale_episodes(tiny_policy: Path, tmp_path: Path, stub_tasks, monkeypatch) -> None:
    """With max_staleness 0 the batch prefetched during step 1 is one version old: all 4 episodes dropped.
    (Rewards that vary, so step 1 updates the weights: a step with no gradient skips its update and the
    prefetched batch is then the current version's.)"""
    monkeypatch.setattr(step_module, "score", parity_score)
    cfg = tiny_config(tmp_path / "run", tiny_policy, max_staleness=0)
    run_dir = train(cfg, overlap=True, transport=fake_tool_server())
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["episodes/stale_dropped"] for r in rows] == [0, 4]
    assert rows[1]["update/skipped"] == 1.0 and math.isnan(rows[1]["reward/final"])


@pytest.mark.slow
def test_resume_continues_exactly(tiny_policy: Path, tmp_path: Path, stub_tasks, monkeypatch) -> None:
    """4 steps straight == 2 steps, a fresh process-like resume, 2 more: same tasks, losses and final weights.
    A changed group_size is refused on resume unless forced."""
    monkeypatch.setattr(step_module, "score", parity_score)
    cfg = tiny_config(tmp_path / "a", tiny_policy, steps=4, warmup_steps=4)  # the schedule must resume too
    straight = train(cfg, transport=fake_tool_server())
    split = train(dataclasses.replace(cfg, run_dir=tmp_path / "b", steps=2), transport=fake_tool_server())
    with pytest.raises(CheckpointError, match="group_size: 2 -> 3"):
        train(dataclasses.replace(cfg, group_size=3), resume=split)
    train(cfg, resume=split, transport=fake_tool_server())
    a, b = read_metrics(straight / "metrics.jsonl"), read_metrics(split / "metrics.jsonl")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for key in ("loss/pg", "reward/final", "grad_norm", "context/main_tokens"):
        assert [r[key] for r in a] == [r[key] for r in b], key
    assert all(sampled_task_ids(straight, s) == sampled_task_ids(split, s) for s in range(1, 5))
    wa, wb = final_weights(straight), final_weights(split)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    forced = train(
        dataclasses.replace(cfg, group_size=3), resume=split, force=True, transport=fake_tool_server()
    )
    assert (
        len(read_metrics(forced / "metrics.jsonl")) == 4
    )  # nothing left to run, but the resume was accepted


@pytest.mark.slow
def test_resume_takes_a_changed_learning_rate(
    tiny_policy: Path, tmp_path: Path, stub_tasks, monkeypatch
) -> None:
    """lr is not part of the data order: a resume with a new lr trains at it (the checkpoint's lr used to win
    silently), and every step logs the rate it used."""
    monkeypatch.setattr(step_module, "score", parity_score)
    cfg = tiny_config(tmp_path / "run", tiny_policy, steps=1, lr=1e-3)
    run_dir = train(cfg, transport=fake_tool_server())
    train(dataclasses.replace(cfg, steps=2, lr=5e-4), resume=run_dir, transport=fake_tool_server())
    assert [r["optim/lr"] for r in read_metrics(run_dir / "metrics.jsonl")] == [1e-3, 5e-4]


@pytest.mark.slow
def test_lora_run_trains_and_resumes_the_adapter(
    tiny_policy: Path, tmp_path: Path, stub_tasks, monkeypatch
) -> None:
    """lora_rank 4: the checkpoint is an adapter whose B matrices moved off their zero start; resuming loads it."""
    monkeypatch.setattr(step_module, "score", parity_score)
    cfg = tiny_config(tmp_path / "run", tiny_policy, steps=1, lora_rank=4)
    run_dir = train(cfg, transport=fake_tool_server())
    adapter = load_file(run_dir / "step_1" / "model" / "adapter_model.safetensors")
    assert any(k.endswith("lora_B.weight") and v.abs().sum() > 0 for k, v in adapter.items())
    train(dataclasses.replace(cfg, steps=2), resume=run_dir, transport=fake_tool_server())
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [1, 2]


@pytest.mark.parametrize("name", ["train_plates.toml", "train_multihop.toml"])
def test_example_configs_load(name: str) -> None:
    """The example RL configs are valid settings (their tables and keys exist) and keep their documented budgets."""
    cfg = load_train_config(Path(__file__).resolve().parent.parent / "examples" / name)
    assert cfg.task in task_data.FAMILIES and cfg.credit.mode == "outcome" and cfg.rollout.max_turns >= 6


def test_the_trained_weights_load_in_process_whatever_samples(
    tiny_policy: Path, tmp_path: Path, stub_tasks: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sampling "auto" picks vLLM where it is installed, but the weights the trainer updates always load in
    this process: a run starts with vLLM present (here pretended) and an in-process sampler asked for."""
    import asyncio
    import importlib.util

    from main_agent.policy import SamplingConfig
    from main_agent.transformers_policy import TransformersPolicy
    from training.local_session import local_session

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real(name, *a)
    )
    cfg = tiny_config(tmp_path / "run", tiny_policy, sampling=SamplingConfig(backend="transformers"))

    async def started():
        session = local_session(cfg, resume=None, force=False, transport=fake_tool_server())
        async with session as (_, collector, learner):
            return collector.sampler.policy, learner.learner.model

    policy, model = asyncio.run(started())
    assert isinstance(policy, TransformersPolicy) and model is not policy.model


@pytest.mark.parametrize(
    ("native", "setting", "expected"),
    [(True, "auto", "bf16"), (False, "auto", "fp32"), (True, "fp32", "fp32"), (False, "bf16", "bf16")],
)
def test_precision_auto_is_bf16_exactly_where_the_hardware_has_it(
    monkeypatch: pytest.MonkeyPatch, native: bool, setting: str, expected: str
) -> None:
    """ "auto" becomes bf16 on hardware with bf16 matmuls and fp32 elsewhere; an explicit setting is kept."""
    from training import learner

    monkeypatch.setattr(learner, "native_bf16", lambda device: native)
    assert learner.with_precision(TrainConfig(precision=setting), "cpu").precision == expected


@pytest.mark.parametrize(
    ("device", "memory_gib", "expected"),
    [
        ("cpu", 0.0, (2048, 8)),  # today's values, whatever the machine
        ("cpu", 512.0, (2048, 8)),
        ("cuda", 139.8, (65_536, 256)),  # an H200: the measured sizes
        ("cuda:1", 79.2, (32_768, 128)),  # an 80 GB H100 / A100
        ("cuda", 22.0, (8_192, 32)),  # an L4
        ("cuda", 2.0, (2048, 8)),  # never below the CPU's
    ],
)
def test_device_sizes_follow_the_device_and_its_memory(
    device: str, memory_gib: float, expected: tuple[int, int]
) -> None:
    """A CPU keeps the sizes every earlier run had; a GPU gets 512 tokens and 2 episodes per GiB, as powers of
    two between the CPU's sizes and the H200's."""
    from training.config import device_sizes

    sizes = device_sizes(device, memory_gib)
    assert (sizes.micro_batch_tokens, sizes.max_concurrent_episodes) == expected


def test_an_explicit_size_wins_over_the_device() -> None:
    """Unset sizes are chosen for the device; a size set in the settings stays, on a CPU and on a GPU; the
    defaults on a CPU resolve to exactly the old fixed values."""
    from training.config import with_device_sizes

    cpu = with_device_sizes(TrainConfig(), "cpu", memory_gib=0.0)
    assert (cpu.micro_batch_tokens, cpu.max_concurrent_episodes) == (2048, 8)
    gpu = with_device_sizes(TrainConfig(), "cuda", memory_gib=139.8)
    assert (gpu.micro_batch_tokens, gpu.max_concurrent_episodes) == (65_536, 256)
    mine = load_train_config(None, ["micro_batch_tokens=4096"])
    on_gpu = with_device_sizes(mine, "cuda", memory_gib=139.8)
    assert (on_gpu.micro_batch_tokens, on_gpu.max_concurrent_episodes) == (4096, 256)
    assert (
        with_device_sizes(
            TrainConfig(max_concurrent_episodes=3), "cuda", memory_gib=80.0
        ).max_concurrent_episodes
        == 3
    )


def test_a_run_plays_trains_and_saves_the_sizes_its_learner_chose(
    tiny_policy: Path, tmp_path: Path, stub_tasks: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sizes left unset are chosen once, where the learner knows its device, and that choice is what the run
    uses everywhere (the sampler's batch, the collector, the update) and what its checkpoint records, so a rerun
    from the saved settings is the same run. (The device's rule is replaced to see the value travel.)"""
    import asyncio

    from training import config as config_module
    from training.checkpoint import saved_config
    from training.config import DeviceSizes
    from training.local_session import local_session

    monkeypatch.setattr(config_module, "device_sizes", lambda device, memory: DeviceSizes(96, 3))
    cfg = tiny_config(tmp_path / "run", tiny_policy, max_concurrent_episodes=None)
    assert cfg.micro_batch_tokens is None and cfg.max_concurrent_episodes is None

    async def started():
        session = local_session(cfg, resume=None, force=False, transport=fake_tool_server())
        async with session as (run, collector, learner):
            learner.save(1, run)
            return run.cfg, collector, learner.learner.cfg

    run_cfg, collector, learned = asyncio.run(started())
    for used in (run_cfg, collector.cfg, learned):
        assert (used.micro_batch_tokens, used.max_concurrent_episodes) == (96, 3)
    assert collector.sampler.settings.max_batch == 3
    saved = saved_config(tmp_path / "run" / "step_1")
    assert (saved["micro_batch_tokens"], saved["max_concurrent_episodes"]) == (96, 3)


@pytest.mark.parametrize("setting", ["micro_batch_tokens=0", "max_concurrent_episodes=0"])
def test_a_size_set_to_zero_is_refused_not_taken_for_unset(setting: str) -> None:
    with pytest.raises(ConfigError, match=setting.split("=")[0]):
        load_train_config(None, [setting])


def test_sft_micro_batch_is_chosen_by_device_unless_set() -> None:
    from training.sft import SFTConfig, micro_batch_tokens

    assert micro_batch_tokens(SFTConfig(), "cpu", memory_gib=0.0) == 2048
    assert micro_batch_tokens(SFTConfig(), "cuda", memory_gib=139.8) == 65_536
    assert micro_batch_tokens(SFTConfig(micro_batch_tokens=512), "cuda", memory_gib=139.8) == 512


def test_native_bf16_follows_the_cpu_flags() -> None:
    """On Linux the CPU answer is the AVX512-BF16 / AMX flag in /proc/cpuinfo; a device that is neither a
    GPU nor the CPU is never assumed to have bf16."""
    from conductor.models import native_bf16

    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file():
        pytest.skip("no /proc/cpuinfo on this platform")
    flags = set(cpuinfo.read_text().split())
    assert native_bf16("cpu") == bool(flags & {"avx512_bf16", "amx_bf16"})
    assert native_bf16("mps") is False
