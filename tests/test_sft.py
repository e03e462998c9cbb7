"""The scripted expert, supervised fine-tuning on its tokens only, and (slow) the expert on real plates."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from main_agent.rollout import RolloutConfig, rollout
from main_agent.tokens import collate, to_sequence
from main_agent.types import Episode
from tests.fakes import TOOLS, ByteChatTokenizer, fake_tool_server, ok_result
from tool_server.client import ToolClient
from training import tasks as task_data
from training.sft import (
    OraclePolicy,
    SFTConfig,
    generate_expert_episodes,
    load_sft_config,
    masked_nll,
    padded_box,
    sft,
)
from training.tasks import Task, TaskMeta
from training.train import rollout_task

PAGES = "\n".join(
    f"Page: {title} http://pages.test/hotpot-1/{i}.html"
    for i, title in enumerate(["Paris", "Berlin", "France"])
)
MULTIHOP = Task(
    "hotpot-1",
    "multihop_pages",
    "Which country is Paris the capital of?",
    ("page_qa",),
    "France",
    PAGES,
    TaskMeta(supporting_titles=("Paris", "France"), page_titles=("Paris", "Berlin", "France")),
)
PLATE = Task(
    "plate-us-good",
    "plate_reading",
    task_data.PLATE_QUESTION,
    ("image_ops",),
    "7ABC123",
    "Image: /data/good.jpg",
    TaskMeta(image_path="/data/good.jpg", plate_box=(400, 300, 70, 30)),
)
BLURRY = dataclasses.replace(PLATE, task_id="plate-us-blurry", context="Image: /data/blurry.jpg")
VIDEO = Task(
    "grid-bbaf2n",
    "video_qa",
    task_data.SPEECH_QUESTION,
    ("video_summary",),
    "bin blue at f two now",
    "Video: /data/grid/bbaf2n.mp4",
    TaskMeta(video_path="/data/grid/bbaf2n.mp4"),
)
# A byte tokenizer spends one token per character: budgets large enough for the oracle's longest turn.
CFG = RolloutConfig(max_new_tokens=1024, max_context_tokens=16384)
SFT = SFTConfig(max_new_tokens=1024)


async def tools_handler(name: str, arguments: dict[str, object]) -> dict[str, object]:
    """Observations shaped like the real sub-agents'. Images: good.jpg loads as img_a1, blurry.jpg as img_b1."""
    if name == "page_qa":
        return ok_result(
            f'answer: France | quote: "Paris is the capital of France." | source: {arguments["url"]}'
        )
    if name == "video_summary":
        return ok_result("The speaker says: bin blue at f two now [00:00.5]\n(video 3 s, 360x288, 8 frames)")
    op, image = arguments["op"], str(arguments["image"])
    if op == "load":
        return ok_result(f"img_{'a1' if 'good' in image else 'b1'} 1000x600 (load)", tokens_read=0)
    if op == "zoom":
        return ok_result(f"{image}0 630x270 (zoom)", tokens_read=0)
    text = "7ABC 123 / CALIFORNIA" if image.startswith("img_a1") else "CALIFORNIA"
    return ok_result(f'{image} 384x165 read: "{text}"')


def tools() -> ToolClient:
    return ToolClient("http://tools", transport=fake_tool_server(tools_handler), deadline_s=5.0)


async def play(task: Task, *, trust_reference: bool = False) -> Episode:
    tokenizer = ByteChatTokenizer()
    async with tools() as client:
        policy = OraclePolicy(task, tokenizer, trust_reference=trust_reference)
        return await rollout(rollout_task(task, TOOLS), policy, client, tokenizer, CFG)


def calls(episode: Episode) -> list[list[tuple[str, dict[str, object]]]]:
    return [[(c.name, c.arguments) for c in turn.calls] for turn in episode.turns]


def assert_clean(episode: Episode, task: Task) -> None:
    assert all(not t.parse_errors for t in episode.turns), [t.parse_errors for t in episode.turns]
    assert episode.stop_reason == "answer" and task_data.success(task, episode.answer), episode.answer


async def test_multihop_oracle_reads_the_supporting_pages_in_one_turn_then_answers():
    """Turn 1 calls page_qa on exactly the supporting pages (concurrently); turn 2 answers the reference."""
    episode = await play(MULTIHOP)
    question = MULTIHOP.question
    assert calls(episode) == [
        [
            ("page_qa", {"url": "http://pages.test/hotpot-1/0.html", "question": question}),
            ("page_qa", {"url": "http://pages.test/hotpot-1/2.html", "question": question}),
        ],
        [],
    ]
    assert_clean(episode, MULTIHOP)


async def test_plate_oracle_loads_zooms_on_the_padded_box_reads_then_answers():
    """load -> zoom on the id load returned, box 3x the plate -> read the zoomed id -> the plate."""
    episode = await play(PLATE)
    assert calls(episode) == [
        [("image_ops", {"op": "load", "image": "/data/good.jpg"})],
        [("image_ops", {"op": "zoom", "image": "img_a1", "box": [330, 270, 540, 360]})],
        [("image_ops", {"op": "read", "image": "img_a10"})],
        [],
    ]
    assert episode.answer == "7ABC123"
    assert_clean(episode, PLATE)


async def test_video_oracle_summarises_with_the_question_then_answers():
    """One video_summary call on the context's video with the question, then the spoken sentence."""
    episode = await play(VIDEO)
    assert calls(episode) == [
        [("video_summary", {"video": "/data/grid/bbaf2n.mp4", "question": VIDEO.question})],
        [],
    ]
    assert_clean(episode, VIDEO)


async def test_oracle_states_the_reference_only_when_an_observation_showed_it():
    """A read that misses the plate makes the oracle answer what it read; such episodes are not kept,
    unless the oracle is told to trust the reference."""
    blurry = await play(BLURRY)
    assert blurry.answer == "CALIFORNIA"
    tokenizer = ByteChatTokenizer()
    async with tools() as client:
        kept = await generate_expert_episodes([PLATE, BLURRY], client, tokenizer, SFT)
        trusted_cfg = dataclasses.replace(SFT, trust_reference=True)
        trusted = await generate_expert_episodes([PLATE, BLURRY], client, tokenizer, trusted_cfg)
    assert [e.task_id for e in kept] == ["plate-us-good"]
    assert [e.task_id for e in trusted] == ["plate-us-good", "plate-us-blurry"]


async def test_oracle_reply_is_cut_by_the_token_budget_like_any_policy():
    """A reply longer than max_new_tokens comes back cut, without its end-of-turn id, marked "length"."""
    tokenizer = ByteChatTokenizer()
    sample = await OraclePolicy(PLATE, tokenizer).sample([1, 2, 3], max_new_tokens=10)
    assert (len(sample.ids), sample.finish_reason, sample.text) == (10, "length", "<tool_call")
    full = await OraclePolicy(PLATE, tokenizer).sample([1, 2, 3], max_new_tokens=1000)
    assert full.finish_reason == "stop" and full.ids[-1] == tokenizer.eos_token_id


def test_padded_box_stays_inside_the_image():
    """The 3x box is clamped to the image, and stays non-empty for a plate on the edge."""
    assert padded_box((400, 300, 70, 30), width=1000, height=600) == [330, 270, 540, 360]
    assert padded_box((10, 5, 70, 30), width=100, height=50) == [0, 0, 100, 50]
    assert padded_box((999, 599, 70, 30), width=1000, height=600) == [929, 569, 1000, 600]


def test_sft_settings_read_overrides_as_toml():
    """`tasks=[...]` becomes a tuple and numbers keep their types; an unknown key is refused."""
    cfg = load_sft_config(['tasks=["video_qa"]', "limit=3", "lr=0.001"])
    assert (cfg.tasks, cfg.limit, cfg.lr) == (("video_qa",), 3, 0.001)
    with pytest.raises(ValueError, match="unknown key"):
        load_sft_config(["epoch=2"])


# ---------------------------------------------------------------- fine-tuning a tiny model


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=258,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=257,
    )
    return LlamaForCausalLM(config)


async def expert_episodes() -> list[Episode]:
    return [await play(task) for task in (MULTIHOP, PLATE, VIDEO)]


async def test_only_the_experts_tokens_are_in_the_loss():
    """The loss mask is 1 on exactly the oracle's replies (no prompt, no tool response), and the SFT loss is the
    mean cross-entropy of those tokens alone."""
    episode = await play(PLATE)
    seq = to_sequence(episode, [0.0] * len(episode.turns))
    masked = [i for i, m in zip(seq.input_ids, seq.loss_mask, strict=True) if m]
    assert masked == [i for t in episode.turns for i in t.completion_ids]
    text = ByteChatTokenizer().decode(masked)
    assert "<tool_call>" in text and "<tool_response>" not in text and "licence plate" not in text
    model = tiny_llama()
    batch = collate([seq], pad_id=257)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[0, :-1]
    targets = torch.tensor(seq.input_ids[1:])
    keep = torch.tensor(seq.loss_mask[1:], dtype=torch.bool)
    expected = F.cross_entropy(logits[keep], targets[keep])
    assert torch.allclose(masked_nll(model, batch), expected, atol=1e-5)


async def test_sft_reduces_the_loss_on_expert_episodes():
    """Ten steps on three episodes bring a random model's loss on the expert's tokens well down."""
    episodes = await expert_episodes()
    model = tiny_llama()
    losses = sft(model, ByteChatTokenizer(), episodes, epochs=10, lr=5e-3, micro_batch_tokens=4096)
    assert len(losses) == 10  # all three episodes fit one micro-batch: one step per epoch
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < 0.8 * losses[0], losses


def test_sft_refuses_to_train_on_nothing():
    """No episodes is a mistake upstream (every expert episode failed), not a silent no-op."""
    with pytest.raises(ValueError, match="no expert episodes"):
        sft(tiny_llama(), ByteChatTokenizer(), [], epochs=1, lr=1e-3, micro_batch_tokens=256)


# ---------------------------------------------------------------- the real thing


@pytest.mark.slow
async def test_oracle_reads_real_plates_through_the_real_tool_server(shared_data, tmp_path):
    """Two real plate photos, the in-process tool server with real OCR: every oracle call runs without error
    and each episode ends with an answer (right or not: the print says how many were right)."""
    from transformers import AutoTokenizer

    from subagents.models import ModelNotFound, resolve_model
    from training.evaluate import play_all, task_tool_client

    try:
        tokenizer = AutoTokenizer.from_pretrained(
            resolve_model("smollm2-135m-instruct"), local_files_only=True
        )
    except ModelNotFound as exc:
        pytest.skip(str(exc))
    plates = task_data.load_family("plate_reading", "train", data_dir=shared_data, limit=2)
    async with task_tool_client(plates, work_dir=tmp_path, data_dir=shared_data) as (client, ready):
        played = await play_all(
            lambda task: OraclePolicy(task, tokenizer),
            tokenizer,
            ready,
            tools=client,
            cfg=RolloutConfig(max_new_tokens=320),
            max_concurrent=2,
        )
    for episode in played:
        assert [len(t.calls) for t in episode.turns] == [1, 1, 1, 0]
        assert episode.tool_errors == 0 and episode.num_parse_errors == 0 and episode.stop_reason == "answer"
    right = sum(task_data.success(t, e.answer) for t, e in zip(ready, played, strict=True))
    print(f"oracle on 2 real plates: {right} right; reads:", [e.turns[2].observation_text for e in played])
