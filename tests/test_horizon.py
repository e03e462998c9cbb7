"""Long horizons in the rollout: the ledger of recorded items, folding into segments, exact replay."""

from __future__ import annotations

import dataclasses
import re

import pytest

from main_agent.parse import parse_completion
from main_agent.rollout import ReplayDiverged, RolloutConfig, RolloutTask, ledger_answer, rollout
from main_agent.tokens import segment_ids, to_sequences
from main_agent.types import Episode
from tests.fakes import TOOLS, ScriptedPolicy, call_text, echo_tool, fake_tool_server, ok_result
from tool_server.client import ToolClient

IMAGE_TOOLS = [t for t in TOOLS if t["function"]["name"] == "image_ops"]  # type: ignore[index]


def audit_task(n: int) -> RolloutTask:
    context = "\n".join(f"Image {i}: /photos/{i}.jpg" for i in range(1, n + 1))
    return RolloutTask(f"audit-{n}", f"Read the plate in each of these {n} photos.", IMAGE_TOOLS, context, n)


def plate_of(photo: int) -> str:
    return f"P{photo:03d}X"


async def plate_tool(name: str, arguments: dict[str, object]) -> dict[str, object]:
    """load -> an id naming the photo; read -> the photo's plate; anything else -> a new id."""
    photo = re.search(r"(\d+)", str(arguments["image"])).group(1)  # type: ignore[union-attr]
    if arguments["op"] == "read":
        return ok_result(f"img_{photo} read: {plate_of(int(photo))}")
    return ok_result(f"img_{photo} 400x300 ({arguments['op']})")


def auditor(n: int, *, answer: bool = True):
    """A scripted policy over n photos: load, zoom, read each, recording a plate in the turn after its read
    (beside the next load); after the last, it records and answers (or only records)."""

    def reply(history: str, turn: int) -> str:
        photo, step = divmod(turn, 3)  # the 0-based photo being worked on
        record = f'<record item="{photo}">{plate_of(photo)}</record>' if step == 0 and photo else ""
        if photo == n:
            return record + ("<answer>done</answer>" if answer else "")
        op = ("load", "zoom", "read")[step]
        image = f"/photos/{photo + 1}.jpg" if op == "load" else f"img_{photo + 1}"
        return record + call_text("image_ops", op=op, image=image)

    return reply


async def play(
    task: RolloutTask, reply, cfg: RolloutConfig, handler=plate_tool, replay=()
) -> tuple[Episode, ScriptedPolicy]:
    policy = ScriptedPolicy(reply)
    async with ToolClient("http://tools", transport=fake_tool_server(handler), deadline_s=5.0) as tools:
        episode = await rollout(task, policy, tools, policy.tokenizer, cfg, replay=replay)
    return episode, policy


def test_record_tags_parse_beside_calls_and_answers() -> None:
    """A record is read with its item number and stripped text, beside calls; a bad item number is an error."""
    turn = parse_completion(
        '<record item="3"> AB12 </record>' + call_text("search", query="x") + "<record item=x>y</record>",
        tool_names={"search"},
    )
    assert [(r.item, r.text) for r in turn.records] == [(3, "AB12")]
    assert [c.name for c in turn.calls] == ["search"]
    assert [e.kind for e in turn.errors] == ["bad_record"]
    alone = parse_completion("<record item=2>CD34", tool_names=set())
    assert [(r.item, r.text) for r in alone.records] == [(2, "CD34")] and not alone.errors


def test_the_final_answer_of_an_item_task_is_the_ledger_filled_from_the_answer() -> None:
    """Recorded items win; the answer's line of the same number fills an item the ledger lacks."""
    assert ledger_answer(["A1", None, "C3"], "x\nB2\ny") == "A1\nB2\nC3"
    assert ledger_answer([None, None], None) == "\n"


async def test_records_fill_the_ledger_and_a_budget_out_still_scores_it() -> None:
    """Every recorded item lands in the ledger; an episode that runs out of turns answers with its ledger."""
    cfg = RolloutConfig(max_turns=3 * 4 + 1, max_context_tokens=100_000)
    episode, _ = await play(audit_task(4), auditor(4, answer=False), cfg)
    assert episode.stop_reason == "max_turns"
    assert episode.ledger == [plate_of(i) for i in range(1, 5)]
    assert episode.answer == "\n".join(plate_of(i) for i in range(1, 5))
    assert "recorded 1: P001X" in episode.turns[3].observation_text


async def test_a_record_of_an_item_the_task_lacks_is_an_observation() -> None:
    """Item 9 of a 2-item task is refused with an error the policy reads; the ledger is unchanged."""

    def reply(history: str, turn: int) -> str:
        return '<record item="9">X</record>' if turn == 0 else "<answer>a\nb</answer>"

    episode, _ = await play(audit_task(2), reply, RolloutConfig())
    assert "no item 9" in episode.turns[0].observation_text
    assert episode.ledger == [None, None] and episode.answer == "a\nb"


async def test_a_long_episode_folds_into_segments_that_stay_under_the_limit() -> None:
    """With fold_at_tokens each segment stays under it; each segment's stream is what the policy was given,
    and the new segment's prompt holds the ledger and the last observation."""
    cfg = RolloutConfig(max_turns=40, max_new_tokens=96, max_context_tokens=4096, fold_at_tokens=1400)
    episode, policy = await play(audit_task(8), auditor(8), cfg)
    assert episode.stop_reason == "answer" and episode.ledger == [plate_of(i) for i in range(1, 9)]
    segments = segment_ids(episode)
    assert len(segments) >= 3
    assert max(episode.segment_tokens) <= cfg.fold_at_tokens
    for ids, (_, turns) in zip(segments, episode.segments, strict=True):
        first = policy.samples.index(next(s for s in policy.samples if s.ids == turns[0].completion_ids))
        assert ids[: len(policy.prompts[first])] == policy.prompts[first]
    opened = policy.tokenizer.decode(episode.segments[1][0])
    assert "Recorded so far" in opened and "Last results:" in opened


async def test_the_forced_last_turn_opens_a_folded_segment_where_the_policy_saw_it() -> None:
    """When the last turn follows a fold, last_turn_prefix's ids end the new segment's prompt: each segment's
    stream is still exactly what the policy was given, and the audit ends with its ledger as the answer."""
    cfg = RolloutConfig(
        max_turns=9, max_new_tokens=96, max_context_tokens=4096, fold_at_tokens=700, turns_per_item=1,
        last_turn_prefix="<answer>",
    )  # fmt: skip
    episode, policy = await play(audit_task(8), auditor(8), cfg)
    assert episode.stop_reason == "last_turn_answer" and len(episode.turns) == 9
    assert len(episode.segments) >= 2 and len(episode.segments[-1][1]) == 1  # the last turn opened a segment
    assert segment_ids(episode)[-1] == policy.prompts[-1] + policy.samples[-1].ids
    assert policy.tokenizer.decode(episode.segments[-1][0]).endswith("<answer>")


async def test_segments_train_on_exactly_the_sampled_ids() -> None:
    """A folded episode lays out one sequence per segment; the masked-in ids over all of them are exactly the
    ids the policy sampled, with each turn's own advantage."""
    cfg = RolloutConfig(max_turns=40, max_new_tokens=96, max_context_tokens=4096, fold_at_tokens=1400)
    episode, policy = await play(audit_task(8), auditor(8), cfg)
    advantages = [float(i) for i in range(len(episode.turns))]
    sequences = to_sequences(episode, advantages)
    assert len(sequences) == len(episode.segments)
    sampled = [i for s in sequences for i, m in zip(s.input_ids, s.loss_mask, strict=True) if m]
    assert sampled == [i for s in policy.samples for i in s.ids]
    laid = [a for s in sequences for a, m in zip(s.advantages, s.loss_mask, strict=True) if m]
    assert laid == [a for t, a in zip(episode.turns, advantages, strict=True) for _ in t.completion_ids]


async def test_a_scripted_policy_makes_over_100_calls_with_a_bounded_context() -> None:
    """32 photos x 3 calls: 96 image calls plus records and an answer, in segments of at most 2,048 tokens."""
    cfg = RolloutConfig(max_turns=110, max_new_tokens=96, max_context_tokens=2048, fold_at_tokens=2048)
    episode, _ = await play(audit_task(32), auditor(32), cfg)
    assert episode.num_calls == 96 and len(episode.turns) >= 97
    assert episode.stop_reason == "answer" and episode.answer == "\n".join(plate_of(i) for i in range(1, 33))
    assert episode.context_tokens <= 2048 < sum(episode.segment_tokens)


async def test_the_trainer_consumes_100_call_episodes_segment_by_segment() -> None:
    """Two scripted 32-photo episodes (one right, one cut short) become one sequence per segment, none longer than
    the fold limit; the masked-in ids of each episode's sequences are exactly its sampled ids, carrying its
    outcome advantage; one optimizer step over all of them trains on exactly those tokens."""
    import torch

    from tests.test_train import tiny_llama
    from training.config import TrainConfig
    from training.step import group_to_sequences
    from training.update import update

    cfg = RolloutConfig(max_turns=110, max_new_tokens=96, max_context_tokens=2048, fold_at_tokens=2048)
    right, right_policy = await play(audit_task(32), auditor(32), cfg)
    short, short_policy = await play(
        audit_task(32), auditor(32), dataclasses.replace(cfg, turns_per_item=2, max_turns=60)
    )
    right.reward, short.reward = 1.0, 0.0
    for e in (right, short):
        e.turn_rewards = [0.0] * len(e.turns)
    sequences = group_to_sequences([right, short], TrainConfig())
    assert len(sequences) == len(right.segments) + len(short.segments) and right.num_calls == 96
    assert max(len(s.input_ids) for s in sequences) <= cfg.fold_at_tokens
    for policy, advantage, seqs in (
        (right_policy, 0.5, sequences[: len(right.segments)]),
        (short_policy, -0.5, sequences[len(right.segments) :]),
    ):
        sampled = [i for s in seqs for i, m in zip(s.input_ids, s.loss_mask, strict=True) if m]
        assert sampled == [i for s in policy.samples for i in s.ids]
        assert {a for s in seqs for a, m in zip(s.advantages, s.loss_mask, strict=True) if m} == {advantage}
    model = tiny_llama(258)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    stats = update(model, optimizer, sequences, TrainConfig(micro_batch_tokens=8192))
    assert stats.skipped is None and stats.n_tokens == sum(sum(s.loss_mask) for s in sequences)


async def test_a_replayed_prefix_observes_the_same_and_continues() -> None:
    """Replaying the first turns of an episode reproduces their observations and segments byte for byte; the
    policy is asked only for the turns after them."""
    cfg = RolloutConfig(max_turns=40, max_new_tokens=96, max_context_tokens=4096, fold_at_tokens=1400)
    original, _ = await play(audit_task(8), auditor(8), cfg)
    cut = 14
    calls = []

    def continuation(history: str, turn: int) -> str:
        calls.append(turn)
        return auditor(8)(history, turn + cut)

    branch, policy = await play(audit_task(8), continuation, cfg, replay=original.turns[:cut])
    assert len(policy.samples) == len(original.turns) - cut
    assert [t.observation_text for t in branch.turns] == [t.observation_text for t in original.turns]
    assert segment_ids(branch) == segment_ids(original)
    assert branch.ledger == original.ledger


async def test_a_replay_that_observes_something_else_is_an_infra_failure() -> None:
    """A tool that answers differently the second time makes the replay fail loudly, not train on a lie."""
    cfg = RolloutConfig(max_turns=6)
    original, _ = await play(audit_task(2), auditor(2), cfg, handler=echo_tool)

    async def changed(name: str, arguments: dict[str, object]) -> dict[str, object]:
        return ok_result("something else")

    branch, _ = await play(audit_task(2), auditor(2), cfg, handler=changed, replay=original.turns[:2])
    assert branch.stop_reason == "infra_failed" and ReplayDiverged.__name__ in str(branch.infra_error)


def test_fold_at_tokens_must_leave_room_for_a_turn() -> None:
    """A fold threshold under one turn's tokens or over the context is refused."""
    with pytest.raises(ValueError, match="fold_at_tokens"):
        RolloutConfig(max_new_tokens=320, fold_at_tokens=300)
    with pytest.raises(ValueError, match="fold_at_tokens"):
        RolloutConfig(max_context_tokens=2048, fold_at_tokens=4096)


# ---------------------------------------------------------------- exact replay on the real tool server


class NeverSample:
    """A policy for a replay that covers the whole episode: asking it for a turn is a test failure."""

    version = 0
    eos_token_id = 0

    async def sample(self, prompt_ids: list[int], *, max_new_tokens: int):
        raise AssertionError("a full replay must not sample")

    async def aclose(self) -> None:
        return None


@pytest.mark.slow
@pytest.mark.parametrize("cache", [True, False])
async def test_replays_on_the_real_tool_server_observe_byte_identical_results(shared_data, tmp_path, cache):
    """An expert episode of real plates (image_ops with OCR) and of a real two-page question (page_qa with the
    built-in model), replayed whole in fresh sessions: every observation byte-identical, with the result cache
    on (page_qa answers from it) and off (everything recomputed)."""
    from transformers import AutoTokenizer

    from conductor.models import ModelNotFound, resolve_model
    from tool_server.embedded import ToolAccess
    from training import tasks as task_data
    from training.experts import OraclePolicy
    from training.play import play, rollout_task, tool_session

    try:
        tokenizer = AutoTokenizer.from_pretrained(
            resolve_model("smollm2-135m-instruct"), local_files_only=True
        )
    except ModelNotFound as exc:
        pytest.skip(str(exc))
    config = tmp_path / "server.toml"
    config.write_text(f"[cache]\nenabled = {str(cache).lower()}\n", encoding="utf-8")
    chosen = [
        *task_data.load_family("plate_audit", "train", data_dir=shared_data, items=2, limit=1),
        *task_data.load_family("multihop_pages", "dev", data_dir=shared_data, limit=1),
    ]
    access = ToolAccess(config=config)
    cfg = RolloutConfig(max_turns=20, max_context_tokens=8192)
    async with tool_session(chosen, work_dir=tmp_path, access=access, data_dir=shared_data) as (tools, ready):
        experts = {t.task_id: OraclePolicy(t, tokenizer) for t in ready}
        groups = await play(
            ready, lambda t: experts[t.task_id], tools=tools, tokenizer=tokenizer, cfg=cfg, max_concurrent=2,
            on_turn_for=lambda t: experts[t.task_id].observe,
        )  # fmt: skip
        schemas = await tools.tools()
        for task, [original] in zip(ready, groups, strict=True):
            job = rollout_task(task, schemas)
            replayed = await rollout(job, NeverSample(), tools, tokenizer, cfg, replay=original.turns)
            assert original.num_calls >= 2 and replayed.stop_reason == original.stop_reason == "answer"
            assert [t.observation_text for t in replayed.turns] == [
                t.observation_text for t in original.turns
            ]
            assert replayed.answer == original.answer and replayed.ledger == original.ledger
            page_hits = [r.cached for t in replayed.turns for r in t.results if r.name == "page_qa"]
            assert all(page_hits) if cache else not any(page_hits)
