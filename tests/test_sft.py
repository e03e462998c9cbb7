"""The scripted expert, supervised fine-tuning on its tokens only, and (slow) the expert on real plates."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F

from main_agent.rollout import RolloutConfig, rollout
from main_agent.tokens import collate, to_sequences
from main_agent.types import Episode
from subagents.handles import Attachment
from tests.fakes import TOOLS, ByteChatTokenizer, fake_tool_server, ok_result
from tool_server.client import ToolClient
from tool_server.embedded import ToolAccess
from training import tasks as task_data
from training.experts import OraclePolicy, draw, play_experts, worth_imitating
from training.metrics import save_rollouts
from training.play import play as play_tasks
from training.play import rollout_task, tool_session
from training.sft import (
    SFTConfig,
    family_tasks,
    generate_expert_episodes,
    load_sft_config,
    masked_nll,
    recorded_demonstrations,
    sft,
)
from training.tasks import Task, TaskMeta, multihop, plates, video
from training.tasks.plates import GAVE_UP


def pages(task_id: str, titles: list[str]) -> tuple[Attachment, ...]:
    return tuple(
        Attachment("page", f"http://pages.test/{task_id}/{i}.html", f"pages/{task_id}/{i}.html", title)
        for i, title in enumerate(titles)
    )


def with_attached(task: Task, *attached: Attachment) -> Task:
    return dataclasses.replace(task, context="\n".join(a.line for a in attached), attachments=attached)


def photo(name: str) -> Attachment:
    """A photo attached by its key; the fake server's images are named after the key (img_good ...)."""
    return Attachment("image", f"/data/{name}.jpg", f"sha256:{name}")


HOTPOT_PAGES = pages("hotpot-1", ["Paris", "Berlin", "France"])
MUSIQUE_PAGES = pages("musique-1", ["P0", "P1", "P2"])
MULTIHOP = with_attached(
    Task(
        "hotpot-1",
        "multihop_pages",
        "Which country is Paris the capital of?",
        ("page_qa",),
        "France",
        "",
        TaskMeta(supporting_titles=("Paris", "France"), page_titles=("Paris", "Berlin", "France")),
    ),
    *HOTPOT_PAGES,
)
MUSIQUE = with_attached(
    Task(
        "musique-1",
        "multihop_pages",
        "Who was the first president of the association which published the journal?",
        ("page_qa",),
        "G. Stanley Hall",
        "",
        TaskMeta(
            page_titles=("P0", "P1", "P2"),
            hops=(("The Journal >> publisher", 2), ("Who was the first president of #1 ?", 0)),
        ),
    ),
    *MUSIQUE_PAGES,
)
PLATE = with_attached(
    Task(
        "plate-us-good",
        "plate_reading",
        plates.QUESTION,
        ("image_ops",),
        "7ABC123",
        "",
        TaskMeta(image_path="/data/good.jpg", plate_box=(400, 300, 70, 30)),
    ),
    photo("good"),
)
BLURRY = with_attached(dataclasses.replace(PLATE, task_id="plate-us-blurry"), photo("blurry"))
LATE = with_attached(dataclasses.replace(PLATE, task_id="plate-us-late"), photo("late"))
MISREAD = with_attached(dataclasses.replace(PLATE, task_id="plate-us-misread"), photo("misread"))
CLIP = Attachment("video", "/data/grid/bbaf2n.mp4", "sha256:bbaf2n")
VIDEO = with_attached(
    Task(
        "grid-bbaf2n",
        "video_qa",
        video.SPEECH_QUESTION,
        ("video_summary",),
        "bin blue at f two now",
        "",
        TaskMeta(video_path="/data/grid/bbaf2n.mp4"),
    ),
    CLIP,
)
PHOTO_NAMES = {
    photo(n).handle: n for n in ("good", "blurry", "late", "misread")
}  # the fake server's image names
# A byte tokenizer spends one token per character: budgets large enough for the oracle's longest turn.
CFG = RolloutConfig(max_turns=10, max_new_tokens=1024, max_context_tokens=32768)
SFT = SFTConfig(rollout=CFG)
# What find_text sees in every photo: a caption, the plate (the gold box is [400, 300, 470, 330]) and a sign.
REGIONS = [
    {"id": "r1", "box": [100, 50, 300, 90], "score": 0.95, "label": "line"},
    {"id": "r2", "box": [405, 302, 468, 328], "score": 0.80, "label": "plate-like"},
    {"id": "r3", "box": [600, 400, 660, 420], "score": 0.70, "label": "plate-like"},
]
ANSWERS = {
    "The Journal": "the American Psychological Association",
    "American Psychological": "G. Stanley Hall",
}


def image_result(op: str, image_id: str, **fields: object) -> dict[str, object]:
    """A result shaped like image_ops's Response (its observation and its structured payload)."""
    payload = {"op": op, "image_id": image_id, "width": 1000, "height": 600, "text": "", "boxes": []}
    payload.update(fields)
    return {**ok_result(f"{image_id} 1000x600 ({op})", tokens_read=0), **payload}


async def tools_handler(name: str, arguments: dict[str, object]) -> dict[str, object]:
    """Results shaped like the real sub-agents', payload fields included. Attached photo X is img_X here; an
    image's zoom is its id plus "z" and the region's id, an autocontrast its id plus "a"; reads of good's zooms
    and of late's zoom on the plate's region (r2) show the plate, misread's another plate, every other read
    only "CALIFORNIA"."""
    if name == "page_qa":
        question = str(arguments["question"])
        answer = next((a for k, a in ANSWERS.items() if k in question), "France")
        quote = f"{answer} is right." if answer != "France" else "Paris is the capital of France."
        return {**ok_result(f'answer: {answer} | quote: "{quote}"'), "answer": answer, "quote": quote}
    if name == "video_summary":
        answer = "The speaker says: bin blue at f two now [00:00.5]"
        return {**ok_result(f"{answer}\n(video 3 s, 360x288, 8 frames)"), "answer": answer}
    op, image = str(arguments["op"]), str(arguments["image"])
    image = "img_" + PHOTO_NAMES[image] if image in PHOTO_NAMES else image
    if op == "find_text":
        return image_result(op, image, boxes=REGIONS)
    if op == "zoom":
        return image_result(op, f"{image}z{arguments['region']}")
    if op == "autocontrast":
        return image_result(op, image + "a")
    shows = image.startswith("img_good") or image == "img_latezr2"  # late: the plate's region only
    if image.startswith("img_misread"):
        return image_result(op, image, text="7ABC 128\nCALIFORNIA")
    return image_result(op, image, text="7ABC 123\nCALIFORNIA" if shows else "CALIFORNIA")


def tools(handler=tools_handler) -> ToolClient:
    return ToolClient("http://tools", transport=fake_tool_server(handler), deadline_s=5.0)


async def play(
    task: Task, *, trust_reference: bool = False, mistakes: float = 0.0, handler=tools_handler
) -> Episode:
    tokenizer = ByteChatTokenizer()
    async with tools(handler) as client:
        policy = OraclePolicy(task, tokenizer, trust_reference=trust_reference, mistakes=mistakes)
        task_view = rollout_task(task, TOOLS)
        return await rollout(task_view, policy, client, tokenizer, CFG, on_turn=policy.observe)


def calls(episode: Episode) -> list[list[tuple[str, dict[str, object]]]]:
    return [[(c.name, c.arguments) for c in turn.calls] for turn in episode.turns]


def assert_clean(episode: Episode, task: Task) -> None:
    assert all(not t.parse_errors for t in episode.turns), [t.parse_errors for t in episode.turns]
    assert episode.stop_reason == "answer" and task_data.success(task, episode.answer), episode.answer


def assert_seen_before_written(episode: Episode) -> None:
    """Every handle the oracle writes occurs in what the policy had seen when it wrote it, and no path or URL
    is written at all."""
    tokenizer = ByteChatTokenizer()
    seen = tokenizer.decode(episode.prompt_ids)
    for turn in episode.turns:
        for call in turn.calls:
            for key in ("image", "url", "video"):
                if key in call.arguments:
                    assert str(call.arguments[key]) in seen, (key, call.arguments[key])
                    assert "/" not in str(call.arguments[key]), (key, call.arguments[key])
        seen += tokenizer.decode(turn.completion_ids + turn.observation_ids)


async def test_multihop_oracle_reads_the_supporting_pages_in_one_turn_then_answers():
    """Without a decomposition: turn 1 asks exactly the supporting pages the whole question, concurrently."""
    episode = await play(MULTIHOP)
    question = MULTIHOP.question
    assert calls(episode) == [
        [
            ("page_qa", {"url": HOTPOT_PAGES[0].handle, "question": question}),
            ("page_qa", {"url": HOTPOT_PAGES[2].handle, "question": question}),
        ],
        [],
    ]
    assert_clean(episode, MULTIHOP)
    assert_seen_before_written(episode)


async def test_multihop_oracle_asks_hop_by_hop_filling_in_what_it_observed():
    """With MuSiQue's decomposition: hop 1 ("X >> relation" written as a question) to its page, then hop 2 with
    #1 replaced by the answer page_qa gave for hop 1, to hop 2's page; then the answer."""
    episode = await play(MUSIQUE)
    assert calls(episode) == [
        [
            (
                "page_qa",
                {
                    "url": MUSIQUE_PAGES[2].handle,
                    "question": "What is the publisher of The Journal?",
                },
            )
        ],
        [
            (
                "page_qa",
                {
                    "url": MUSIQUE_PAGES[0].handle,
                    "question": "Who was the first president of the American Psychological Association ?",
                },
            )
        ],
        [],
    ]
    assert_clean(episode, MUSIQUE)


def test_independent_hops_go_out_together():
    """Hops whose placeholders are all answered are asked in the same turn; a hop needing #2 waits for it."""
    hops = (("A >> x", 0), ("B >> y", 1), ("#1 and #2 ?", 2))
    task = dataclasses.replace(MUSIQUE, meta=dataclasses.replace(MUSIQUE.meta, hops=hops))
    first = multihop.oracle_reply(task, [], trust_reference=False)
    assert (
        first.count("<tool_call>") == 2 and "What is the x of A?" in first and "What is the y of B?" in first
    )
    assert multihop.hop_question("#1 and #2 ?", {1: "Ada", 2: "Bob"}) == "Ada and Bob ?"


async def test_plate_oracle_finds_text_zooms_on_a_found_region_reads_then_answers():
    """find_text on the attached photo -> zoom on its first region, by its id -> read -> answer the plate."""
    episode = await play(PLATE)
    good = PLATE.attachments[0].handle
    assert calls(episode) == [
        [("image_ops", {"op": "find_text", "image": good})],
        [("image_ops", {"op": "zoom", "image": good, "region": "r1"})],
        [("image_ops", {"op": "read", "image": "img_goodzr1"})],
        [],
    ]
    assert episode.answer == "7ABC123"
    assert_clean(episode, PLATE)
    assert_seen_before_written(episode)


async def test_plate_oracle_retries_the_next_region_when_a_read_shows_no_plate():
    """A read without plate-shaped text: zoom on find_text's next region, read, answer the plate."""
    episode = await play(LATE)
    assert [c[0][1]["op"] for c in calls(episode)[:-1]] == ["find_text", "zoom", "read", "zoom", "read"]
    assert calls(episode)[3] == [
        ("image_ops", {"op": "zoom", "image": LATE.attachments[0].handle, "region": "r2"})
    ]
    assert_clean(episode, LATE)
    assert_seen_before_written(episode)


async def test_video_oracle_summarises_with_the_question_then_answers():
    """One video_summary call on the context's video with the question, then the spoken sentence."""
    episode = await play(VIDEO)
    assert calls(episode) == [
        [("video_summary", {"video": CLIP.handle, "question": VIDEO.question})],
        [],
    ]
    assert_clean(episode, VIDEO)


async def test_oracle_states_the_reference_only_when_an_observation_showed_it():
    """Reads that never show a plate-shaped text make the oracle say, in plain words, that it could not read the
    plate, after every region: kept, an honest demonstration though not a right one. A plate-shaped misread is
    answered as read and not kept. Told to trust the reference, the oracle answers it regardless."""
    blurry = await play(BLURRY)
    assert blurry.answer == GAVE_UP and [c[0][1]["op"] for c in calls(blurry)[:-1]].count("zoom") == 3
    assert (await play(MISREAD)).answer == "7ABC128"
    tokenizer = ByteChatTokenizer()
    async with tools() as client:
        kept = await generate_expert_episodes([PLATE, BLURRY, MISREAD], client, tokenizer, SFT)
        trusted_cfg = dataclasses.replace(SFT, trust_reference=True)
        trusted = await generate_expert_episodes([PLATE, BLURRY, MISREAD], client, tokenizer, trusted_cfg)
    assert [e.task_id for e in kept] == ["plate-us-good", "plate-us-blurry"]
    assert [e.task_id for e in trusted] == ["plate-us-good", "plate-us-blurry", "plate-us-misread"]


async def test_oracle_reply_is_cut_by_the_token_budget_like_any_policy():
    """A reply longer than max_new_tokens comes back cut, without its end-of-turn id, marked "length"."""
    tokenizer = ByteChatTokenizer()
    sample = await OraclePolicy(PLATE, tokenizer).sample([1, 2, 3], max_new_tokens=10)
    assert (len(sample.ids), sample.finish_reason, sample.text) == (10, "length", "<tool_call")
    full = await OraclePolicy(PLATE, tokenizer).sample([1, 2, 3], max_new_tokens=1000)
    assert full.finish_reason == "stop" and full.ids[-1] == tokenizer.eos_token_id


def test_sft_settings_read_overrides_as_toml():
    """`tasks=[...]` becomes a tuple and numbers keep their types; an unknown key is refused."""
    cfg = load_sft_config(['tasks=["video_qa"]', "limit=3", "lr=0.001", "rollout.max_turns=4"])
    assert (cfg.tasks, cfg.run.limit, cfg.lr, cfg.rollout.max_turns) == (("video_qa",), 3, 0.001, 4)
    with pytest.raises(ValueError, match="unknown key"):
        load_sft_config(["epoch=2"])
    with pytest.raises(ValueError, match="set rollout.max_new_tokens instead"):
        load_sft_config(["max_new_tokens=320"])


def test_sft_limits_give_each_family_its_own_number_of_tasks(shared_data):
    """`limits` takes the first n tasks of each family in `tasks`' order; without it `limit` holds for all;
    a list of another length than `tasks` is refused with both lengths named."""
    cfg = load_sft_config(
        [
            'tasks=["corpus_qa", "plate_reading"]',
            "limit=2",
            "limits=[3, 1]",
            f"data_dir={json.dumps(str(shared_data))}",
        ]
    )
    families = [t.family for t in family_tasks(cfg, "train", cfg.run.limit, cfg.limits)]
    assert families == ["corpus_qa"] * 3 + ["plate_reading"]
    assert len(family_tasks(cfg, "train", cfg.run.limit)) == 4
    with pytest.raises(ValueError, match="limits has 1 values for 2 tasks"):
        load_sft_config(['tasks=["corpus_qa", "plate_reading"]', "limits=[3]"])


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
    [seq] = to_sequences(episode, [0.0] * len(episode.turns))
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


def refusing_zoom_before_find_text():
    """A fake tool handler that refuses a zoom of an image find_text has not searched yet, as image_ops does."""
    searched: set[str] = set()

    async def refusing(name: str, arguments: dict[str, object]) -> dict[str, object]:
        if name == "image_ops" and arguments["op"] == "find_text":
            searched.add(str(arguments["image"]))
        if name == "image_ops" and arguments["op"] == "zoom" and arguments["image"] not in searched:
            error = {"kind": "invalid_args", "message": "no regions yet: call find_text on it first"}
            return {**ok_result(f"error (invalid_args): {error['message']}"), "ok": False, "error": error}
        return await tools_handler(name, arguments)

    return refusing


async def test_a_deliberate_mistake_is_refused_recovered_from_and_left_out_of_the_loss():
    """With `mistakes` = 1 the plate expert makes both of its mistakes: a zoom before find_text (the audits' most
    frequent refused call), which the tool refuses, then find_text, then a zoom on r2 rather than r1, whose read
    shows the plate here. Both mistakes' turns are marked untrained and none of their tokens is in the loss;
    every other reply is. At 0 the expert makes no mistake."""
    episode = await play(PLATE, mistakes=1.0, handler=refusing_zoom_before_find_text())
    made = [c[0][1] for c in calls(episode)[:-1]]
    assert [a["op"] for a in made] == ["zoom", "find_text", "zoom", "read"] and episode.tool_errors == 1
    assert made[2]["region"] == "r2"
    assert [t.trained for t in episode.turns] == [False, True, False, True, True]
    assert_clean(episode, PLATE)
    [seq] = to_sequences(episode, [0.0] * len(episode.turns))
    masked = [i for i, m in zip(seq.input_ids, seq.loss_mask, strict=True) if m]
    assert masked == [i for t in episode.turns if t.trained for i in t.completion_ids]
    assert all(t.trained for t in (await play(PLATE, mistakes=0.0)).turns)


async def test_an_audit_keeps_a_demonstration_whose_only_refusal_was_the_deliberate_mistake():
    """An item task's demonstration is kept when its one refused call is the expert's deliberate mistake (an
    untrained turn) and dropped when a trained call was refused: with `mistakes` > 0 every long audit holds a
    refusal, and the rule that dropped them all kept none of the recoveries."""
    episode = await play(PLATE, mistakes=1.0, handler=refusing_zoom_before_find_text())
    audit = dataclasses.replace(PLATE, family="plate_audit", items=(PLATE,))
    recorded = dataclasses.replace(episode, ledger=[PLATE.reference])
    assert episode.tool_errors == 1 and worth_imitating(audit, recorded)
    turns = [dataclasses.replace(t, trained=True) for t in recorded.turns]
    assert not worth_imitating(audit, dataclasses.replace(recorded, turns=turns))


def test_mistakes_are_drawn_the_same_way_every_time():
    """The draw that decides a mistake is fixed by seed, task and turn, spread over [0, 1): a rerun of the
    recipe makes the same demonstrations."""
    draws = [draw(0, f"plate-us-{i}", 0) for i in range(400)]
    assert draws == [draw(0, f"plate-us-{i}", 0) for i in range(400)]
    assert all(0.0 <= d < 1.0 for d in draws) and 0.4 < sum(d < 0.5 for d in draws) / 400 < 0.6
    assert draw(1, "plate-us-0", 0) != draws[0]


async def test_sft_reduces_the_loss_on_expert_episodes():
    """Ten steps on three episodes bring a random model's loss on the expert's tokens well down."""
    episodes = await expert_episodes()
    model = tiny_llama()
    losses = sft(model, ByteChatTokenizer(), episodes, epochs=10, lr=5e-3, micro_batch_tokens=4096)
    assert len(losses) == 10  # all three episodes fit one micro-batch: one step per epoch
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < 0.8 * losses[0], losses


async def test_recorded_demonstrations_are_reused_except_for_tasks_played_again(tmp_path):
    """An earlier run's kept episodes come back whole and in order, from every file named, but a task played
    again now is not imitated twice (its recorded episode is dropped); the setting reads as TOML paths."""
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    multihop_ep, plate_ep, video_ep = await expert_episodes()
    save_rollouts(first, [multihop_ep, plate_ep])
    save_rollouts(second, [video_ep])
    reused = recorded_demonstrations([first, second], replaced=[PLATE])
    assert [e.task_id for e in reused] == [MULTIHOP.task_id, VIDEO.task_id]
    assert reused[0].turns == multihop_ep.turns and reused[0].prompt_ids == multihop_ep.prompt_ids
    cfg = load_sft_config([f'demonstrations=["{first}"]'])
    assert [str(p) for p in cfg.demonstrations] == [str(first)]


def test_sft_refuses_to_train_on_nothing():
    """No episodes is a mistake upstream (every expert episode failed), not a silent no-op."""
    with pytest.raises(ValueError, match="no expert episodes"):
        sft(tiny_llama(), ByteChatTokenizer(), [], epochs=1, lr=1e-3, micro_batch_tokens=256)


# ---------------------------------------------------------------- the real thing


def real_tokenizer():
    """The built-in model's tokenizer; the test is skipped where the model is not installed."""
    from transformers import AutoTokenizer

    from conductor.models import ModelNotFound, resolve_model

    try:
        return AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct"), local_files_only=True)
    except ModelNotFound as exc:
        pytest.skip(str(exc))


CFG_REAL = RolloutConfig(
    max_turns=10, max_new_tokens=320, max_context_tokens=4096
)  # budgets for the real tokenizer


@pytest.mark.slow
async def test_oracle_reads_real_plates_through_the_real_tool_server(shared_data, tmp_path):
    """Two real plate photos, attached and named by handle, the in-process tool server with real OCR: every
    oracle call runs without error, zooms name a found region, and each episode ends with an answer (right or
    not: the print says how many were right)."""
    tokenizer = real_tokenizer()
    photos = task_data.load_family("plate_reading", "train", data_dir=shared_data, limit=2)
    session = tool_session(photos, work_dir=tmp_path, access=ToolAccess(), data_dir=shared_data)
    async with session as (client, ready):
        experts = {t.task_id: OraclePolicy(t, tokenizer) for t in ready}
        groups = await play_tasks(
            ready,
            lambda task: experts[task.task_id],
            tools=client,
            tokenizer=tokenizer,
            cfg=RolloutConfig(max_turns=10, max_new_tokens=320, max_context_tokens=4096),
            max_concurrent=2,
            on_turn_for=lambda task: experts[task.task_id].observe,
        )
    played = [group[0] for group in groups]
    for episode in played:
        ops = [c.arguments["op"] for t in episode.turns for c in t.calls]
        assert ops[:3] == ["find_text", "zoom", "read"], ops
        assert episode.turns[1].calls[0].arguments["region"] in (
            "r1",
            "r2",
            "r3",
            "r4",
            "r5",
            "r6",
            "r7",
            "r8",
        )
        assert episode.tool_errors == 0 and episode.num_parse_errors == 0 and episode.stop_reason == "answer"
        reads = [r for t in episode.turns for r in t.results if (r.payload or {}).get("op") == "read"]
        shown = [str(r.payload["plate"]) for r in reads if r.payload["plate"]]  # type: ignore[index]
        assert all(f"plate-shaped: {plate}" in str([r.observation for r in reads]) for plate in shown)
        assert episode.answer == (shown[-1] if shown else GAVE_UP)  # what a read named, never the label
    right = sum(task_data.success(t, e.answer) for t, e in zip(ready, played, strict=True))
    print(f"oracle on 2 real plates: {right} right; calls:", [len(e.turns) for e in played])


@pytest.mark.slow
async def test_real_image_ops_refuses_the_deliberate_mistake_and_the_expert_recovers(shared_data, tmp_path):
    """The real tool server refuses a zoom before find_text and names find_text; the expert's next call is
    find_text on the same photo, and the episode goes on to an answer with that refusal its only error."""
    tokenizer = real_tokenizer()
    photos = task_data.load_family("plate_reading", "train", data_dir=shared_data, limit=1)
    session = tool_session(photos, work_dir=tmp_path, access=ToolAccess(), data_dir=shared_data)
    async with session as (client, ready):
        [episode] = await play_experts(
            ready, client, tokenizer, rollout=CFG_REAL, max_concurrent=1, mistakes=1.0
        )
    first, second = episode.turns[0], episode.turns[1]
    assert not first.trained and not first.results[0].ok and "find_text" in first.observation_text
    assert second.trained and second.calls[0].arguments == {
        "op": "find_text",
        "image": ready[0].attachments[0].handle,
    }
    assert episode.tool_errors == 1 and episode.stop_reason == "answer"


# A US train photo whose largest text region (r1) is the camera's time stamp, the plate r2.
STAMPED = "plate-us-a03ced3f-5a97-4e75-8106-fabfd2b8b76e"


@pytest.mark.slow
async def test_real_reads_of_a_time_stamp_name_no_plate_and_the_expert_retries_the_region_named(
    shared_data, tmp_path
):
    """Through the real tool server: the read of a time stamp ("2014-06-17 ...") holds no plate and names the
    regions not zoomed yet; the expert zooms on the first of them, reads the plate and answers it."""
    tokenizer = real_tokenizer()
    photos = [
        t
        for t in task_data.load_family("plate_reading", "train", data_dir=shared_data)
        if t.task_id == STAMPED
    ]
    session = tool_session(photos, work_dir=tmp_path, access=ToolAccess(), data_dir=shared_data)
    async with session as (client, ready):
        [episode] = await play_experts(ready, client, tokenizer, rollout=CFG_REAL, max_concurrent=1)
    done = [(c, r) for t in episode.turns for c, r in zip(t.calls, t.results, strict=True)]
    assert [c.arguments["op"] for c, _ in done] == ["find_text", "zoom", "read", "zoom", "read"]
    stamp = done[2][1]
    assert "2014-" in stamp.observation and "plate-shaped: none; not zoomed yet: r2" in stamp.observation
    assert done[3][0].arguments["region"] == "r2"
    assert episode.answer == ready[0].reference and episode.tool_errors == 0


@pytest.mark.slow
async def test_oracle_audits_real_plates_item_by_item(shared_data, tmp_path):
    """plate_audit with 3 real photos through the real tool server: the expert reads photo after photo,
    records each reading in the ledger (photos named by handle) in a turn of its own, whose acknowledgement names
    the next photo's handle or says all are recorded, and ends with the ledger as its answer."""
    tokenizer = real_tokenizer()
    audits = task_data.load_family("plate_audit", "train", data_dir=shared_data, items=3, limit=1)
    session = tool_session(audits, work_dir=tmp_path, access=ToolAccess(), data_dir=shared_data)
    async with session as (client, ready):
        expert = OraclePolicy(ready[0], tokenizer)
        [[episode]] = await play_tasks(
            ready,
            lambda task: expert,
            tools=client,
            tokenizer=tokenizer,
            cfg=RolloutConfig(max_turns=30, max_new_tokens=320, max_context_tokens=8192),
            max_concurrent=1,
            on_turn_for=lambda task: expert.observe,
        )
    assert episode.tool_errors == 0 and episode.num_parse_errors == 0 and episode.stop_reason == "answer"
    found = [c.arguments["image"] for t in episode.turns for c in t.calls if c.arguments["op"] == "find_text"]
    assert found == [line.split(": ", 1)[1] for line in ready[0].context.splitlines()]
    assert all(text is not None for text in episode.ledger)
    assert episode.answer == "\n".join(episode.ledger)
    recording = [t for t in episode.turns if t.records]
    assert [len(t.records) for t in recording] == [1, 1, 1] and not any(t.calls for t in recording)
    assert [t.observation_text.splitlines()[-1] for t in recording] == [
        f"<tool_response>next: item 2 ({ready[0].context.splitlines()[1]}), 2 of 3 left</tool_response>",
        f"<tool_response>next: item 3 ({ready[0].context.splitlines()[2]}), 1 of 3 left</tool_response>",
        "<tool_response>all 3 recorded: answer to finish</tool_response>",
    ]  # the policy opens each photo by the handle the last observation named
    right = sum(task_data.item_reward(ready[0], i + 1, t) for i, t in enumerate(episode.ledger))
    print(f"oracle audit of 3 real plates: {right:.0f} right in {episode.num_calls} calls")
