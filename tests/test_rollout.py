"""The rollout loop with a scripted policy and a fake tool server (no weights, no network)."""

from __future__ import annotations

import httpx

from main_agent.rollout import RolloutConfig, RolloutTask, rollout
from main_agent.tokens import segment_ids, to_sequences
from main_agent.types import Episode
from tests.fakes import TOOLS, ByteChatTokenizer, ScriptedPolicy, call_text, fake_tool_server, ok_result
from tool_server.client import ToolClient

TASK = RolloutTask("t1", "Who wrote the page?", TOOLS)


def client(transport: httpx.AsyncBaseTransport) -> ToolClient:
    return ToolClient("http://tools", transport=transport, deadline_s=5.0)


def two_calls_then_answer(history: str, turn: int) -> str:
    if turn == 0:
        return call_text("search", query="author") + call_text("page_qa", url="http://a", question="who?")
    return "<answer>Ada</answer>"


DEFAULT_CFG = RolloutConfig()


async def play(reply, transport=None, cfg=DEFAULT_CFG, task=TASK) -> tuple[Episode, ScriptedPolicy]:
    policy = ScriptedPolicy(reply)
    async with client(transport or fake_tool_server()) as tools:
        episode = await rollout(task, policy, tools, policy.tokenizer, cfg)
    return episode, policy


async def test_calls_then_answer_ends_with_the_answer():
    """A turn's calls run, their results come back, and an answer-only turn ends the episode."""
    episode, _ = await play(two_calls_then_answer)
    assert episode.stop_reason == "answer" and episode.answer == "Ada"
    assert [c.name for c in episode.turns[0].calls] == ["search", "page_qa"]
    assert all(r.ok for r in episode.turns[0].results)
    assert "search saw" in episode.turns[0].observation_text
    assert episode.calls_per_tool == {"search": 1, "page_qa": 1}


async def test_calls_of_a_turn_run_concurrently():
    """Two calls that each take 0.3 s finish together in well under 0.6 s."""
    episode, _ = await play(two_calls_then_answer, fake_tool_server(delay_s=0.3))
    assert episode.turns[0].tools_s < 0.5


async def test_token_stream_is_exactly_what_the_policy_saw():
    """The training sequence is the concatenation of ids: the last prompt plus the last completion."""
    episode, policy = await play(two_calls_then_answer)
    assert segment_ids(episode) == [policy.prompts[-1] + policy.samples[-1].ids]
    [seq] = to_sequences(episode, [1.0] * len(episode.turns))
    sampled = [i for i, m in zip(seq.input_ids, seq.loss_mask, strict=True) if m]
    assert sampled == [i for s in policy.samples for i in s.ids]
    assert sum(seq.loss_mask) == sum(len(t.completion_ids) for t in episode.turns)


async def test_policy_mistakes_become_observations_and_the_episode_goes_on():
    """Bad JSON and an unknown tool are shown to the policy; the next turn still runs."""
    replies = [
        "<tool_call>{'name': 'search', 'arguments': {'query': 1,}</tool_call>x",
        call_text("browse", url="x"),
        "<answer>done</answer>",
    ]
    episode, policy = await play(lambda h, t: replies[t])
    assert episode.stop_reason == "answer" and len(episode.turns) == 3
    assert episode.turns[1].parse_errors[0].kind == "unknown_tool"
    assert "unknown_tool" in policy.tokenizer.decode(policy.prompts[2])


async def test_tool_errors_are_counted_and_shown():
    """A tool's structured error (ok=False) is an observation, not an infrastructure failure."""

    async def failing(name, arguments):
        return {
            **ok_result("error (blocked_url): private address"),
            "ok": False,
            "error": {"kind": "blocked_url", "message": "private address", "retryable": False},
        }

    episode, _ = await play(two_calls_then_answer, fake_tool_server(failing))
    assert episode.stop_reason == "answer" and episode.tool_errors == 2
    assert episode.turns[0].results[0].error_kind == "blocked_url"
    assert "blocked_url" in episode.turns[0].observation_text


async def test_unreachable_tool_server_marks_the_episode_infra_failed():
    """A dead tool server ends the episode as infra_failed with the reason, never as a wrong answer."""

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    episode, _ = await play(two_calls_then_answer, httpx.MockTransport(refuse))
    assert episode.stop_reason == "infra_failed"
    assert "unreachable" in (episode.infra_error or "")
    assert episode.answer is None


async def test_server_errors_after_retries_are_infra_failures():
    """HTTP 503 on every attempt is retried, then reported as an infrastructure failure."""
    attempts = []

    def unavailable(request: httpx.Request) -> httpx.Response:
        attempts.append(1)
        return httpx.Response(503, headers={"Retry-After": "0"})

    episode, _ = await play(two_calls_then_answer, httpx.MockTransport(unavailable))
    assert episode.stop_reason == "infra_failed" and "503" in (episode.infra_error or "")
    assert len(attempts) == 2 * 3  # two calls, three attempts each


async def test_long_observations_are_cut_with_a_visible_marker():
    """A huge tool result is truncated to the observation budget and says so."""

    async def huge(name, arguments):
        return ok_result("x" * 5000)

    cfg = RolloutConfig(observation_tokens=64)
    episode, _ = await play(two_calls_then_answer, fake_tool_server(huge), cfg)
    observation = episode.turns[0].results[0].observation
    assert "truncated" in observation and len(observation) < 200


async def test_hundred_calls_stay_within_the_context_budget():
    """100 calls over 25 turns fit the main context because each observation is compact."""

    def four_calls(history: str, turn: int) -> str:
        if turn == 25:
            return "<answer>42</answer>"
        return "".join(call_text("search", query=f"q{turn}-{i}") for i in range(4))

    cfg = RolloutConfig(max_turns=30, max_context_tokens=32_000, observation_tokens=48)
    episode, _ = await play(four_calls, cfg=cfg)
    assert episode.num_calls == 100 and episode.stop_reason == "answer"
    assert episode.context_tokens <= cfg.max_context_tokens
    assert episode.subagent_tokens_read == 100 * 100  # sub-agents read far more than the policy saw


async def test_context_budget_stops_the_episode():
    """When the next turn cannot fit, the episode stops with max_context instead of overflowing."""

    def chatty(history: str, turn: int) -> str:
        return call_text("search", query="more")

    cfg = RolloutConfig(max_turns=50, max_context_tokens=1500)
    episode, _ = await play(chatty, cfg=cfg)
    assert episode.stop_reason == "max_context"
    assert episode.context_tokens <= cfg.max_context_tokens


async def test_too_many_calls_in_one_turn_are_dropped_with_a_note():
    """Calls past the per-turn cap do not run and the policy is told."""

    def six_calls(history: str, turn: int) -> str:
        return "<answer>a</answer>" if turn else "".join(call_text("search", query=str(i)) for i in range(6))

    episode, _ = await play(six_calls, cfg=RolloutConfig(max_calls_per_turn=4))
    assert len(episode.turns[0].calls) == 4
    assert episode.turns[0].parse_errors[-1].kind == "too_many_calls"


async def test_episode_round_trips_through_jsonl():
    """A rollout's episode serialises to one JSON line and loads back equal."""
    episode, _ = await play(two_calls_then_answer)
    line = episode.to_json()
    assert "\n" not in line
    assert Episode.from_json(line) == episode


def test_fake_tokenizer_matches_chatml_layout():
    """The byte tokenizer renders ChatML with single-id specials (the rollout tests rely on it)."""
    tok = ByteChatTokenizer()
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert ids[0] == 256 and ids.count(257) == 1
    assert tok.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


async def test_first_turn_prefix_joins_the_prompt_and_the_first_parse():
    """A required-call prefix is part of the prompt ids (not trained on) and completes the first call."""
    prefix = '<tool_call>{"name": "'

    def continue_call(history: str, turn: int) -> str:
        return 'search", "arguments": {"query": "x"}}</tool_call>' if turn == 0 else "<answer>y</answer>"

    episode, policy = await play(continue_call, cfg=RolloutConfig(first_turn_prefix=prefix))
    assert policy.tokenizer.decode(episode.prompt_ids).endswith(prefix)
    assert [c.name for c in episode.turns[0].calls] == ["search"] and episode.answer == "y"
    assert segment_ids(episode) == [policy.prompts[-1] + policy.samples[-1].ids]


async def test_last_turn_prefix_makes_a_policy_that_would_run_out_of_turns_answer():
    """A policy that only calls runs out of turns with no answer; with last_turn_prefix the last turn the budget
    allows opens with it, the policy's completion is the answer ("last_turn_answer"), and the forced ids are in
    the episode's stream where the policy saw them (after the previous observation), never among sampled ids."""

    def calls_until_forced(history: str, turn: int) -> str:
        return "Ada</answer>" if history.endswith("<answer>") else call_text("search", query=f"x{turn}")

    looping, _ = await play(calls_until_forced, cfg=RolloutConfig(max_turns=3))
    assert (looping.answer, looping.stop_reason, len(looping.turns)) == (None, "max_turns", 3)
    cfg = RolloutConfig(max_turns=3, last_turn_prefix="<answer>")
    episode, policy = await play(calls_until_forced, cfg=cfg)
    assert (episode.answer, episode.stop_reason, len(episode.turns)) == ("Ada", "last_turn_answer", 3)
    assert segment_ids(episode) == [policy.prompts[-1] + policy.samples[-1].ids]
    assert policy.tokenizer.decode(episode.turns[1].observation_ids).endswith("<answer>")
    early, _ = await play(two_calls_then_answer, cfg=cfg)
    assert early.stop_reason == "answer" and early.answer == "Ada"


async def test_untagged_text_ends_the_episode_only_when_asked():
    """With untagged_is_answer, a turn of plain text is the answer; by default it is a format error."""

    def prose(history: str, turn: int) -> str:
        return call_text("search", query="x") if turn == 0 else "It is Ada."

    strict, _ = await play(prose, cfg=RolloutConfig(max_turns=3))
    assert strict.answer is None and strict.turns[1].parse_errors[0].kind == "no_action"
    lenient, _ = await play(prose, cfg=RolloutConfig(max_turns=3, untagged_is_answer=True))
    assert lenient.answer == "It is Ada." and lenient.stop_reason == "answer" and len(lenient.turns) == 2


class _FailingModel:
    """Stands in for an HF model whose `generate` fails the way torch does (out of memory, device fault)."""

    device = "cpu"
    training = False

    def eval(self):
        return self

    def train(self, mode: bool = True):
        return self

    def generate(self, **kwargs):
        raise RuntimeError("CUDA error: device-side assert triggered")


async def test_a_failing_in_process_policy_marks_the_episode_infra_failed():
    """A generation failure inside `TransformersPolicy` (raised through the shared micro-batcher) ends only its
    episode as infra_failed with the reason, exactly as the vLLM samplers' PolicyError does; the step goes on."""
    from main_agent.policy import SamplingConfig
    from main_agent.transformers_policy import TransformersPolicy

    tokenizer = ByteChatTokenizer()
    cfg = SamplingConfig(batch_wait_ms=1.0, decoder="generate")  # the decoder the stand-in fails in
    policy = TransformersPolicy(_FailingModel(), tokenizer, cfg=cfg)
    async with client(fake_tool_server()) as tools:
        episode = await rollout(TASK, policy, tools, tokenizer, DEFAULT_CFG)
    await policy.aclose()
    assert episode.stop_reason == "infra_failed" and episode.turns == []
    assert episode.infra_error is not None and "PolicyError" in episode.infra_error
    assert "device-side assert" in episode.infra_error
