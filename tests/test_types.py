"""Episode records (main_agent.types): lossless JSON round trip, derived counts, and token bookkeeping checks."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from main_agent.types import Episode, ParseError, Record, ToolCall, ToolResult, Turn


def make_turn(*, n_ids: int = 3, ok: bool = True, name: str = "search", tokens_read: int = 100) -> Turn:
    call = ToolCall(name, {"query": "x", "k": 2}, '<tool_call>{"name": "search"}</tool_call>')
    res = ToolResult(
        name, ok, "3 passages", None if ok else "timeout", 12.5, tokens_read, 7, False, {"ok": ok}
    )
    return Turn(
        completion_ids=list(range(n_ids)),
        completion_logprobs=[-0.5] * n_ids,
        observation_ids=[9, 9],
        completion_text="<tool_call>...",
        observation_text="<tool_response>...",
        calls=[call],
        results=[res],
        parse_errors=[ParseError("unknown_tool", "unknown tool 'x'", "<tool_call>{}")],
        policy_version=1,
        policy_s=0.25,
        tools_s=0.5,
    )


def make_episode(turns: list[Turn]) -> Episode:
    return Episode("t1", "How tall?", [1, 2, 3, 4], turns, "330 m", "answer", 1, 2.0, 0.5, 1.0)


def test_derived_counts() -> None:
    """num_calls, calls_per_tool, tool_errors, context_tokens and subagent_tokens_read add up over turns."""
    episode = make_episode([make_turn(n_ids=3), make_turn(n_ids=5, ok=False, name="page_qa", tokens_read=40)])
    assert episode.num_calls == 2
    assert episode.calls_per_tool == {"search": 1, "page_qa": 1}
    assert episode.tool_errors == 1 and episode.num_parse_errors == 2
    assert episode.context_tokens == 4 + (3 + 2) + (5 + 2)
    assert episode.subagent_tokens_read == 140


def test_round_trip_hand_built() -> None:
    """to_json is one line and from_json rebuilds an equal episode, including non-finite log-probs and rewards."""
    turn = make_turn()
    turn = Turn(**{**turn.__dict__, "completion_logprobs": [-math.inf, -1e-300, 0.1 + 0.2]})
    episode = make_episode([turn, make_turn(ok=False)])
    episode.reward, episode.turn_rewards = 0.75, [0.1, -0.2]
    line = episode.to_json()
    assert "\n" not in line
    assert Episode.from_json(line) == episode


def test_a_folded_episode_round_trips_and_counts_per_segment() -> None:
    """Records, a segment's prompt ids and the ledger survive the JSON round trip; segments cut the turns where a
    prompt opens, the peak context is the longest segment, and each turn's context is its segment's so far."""
    opened = Turn(
        **{**make_turn(n_ids=2).__dict__, "prompt_ids": [7] * 6, "records": [Record(1, "AB12", "<r>")]}
    )
    folded = Turn(**{**make_turn(n_ids=3).__dict__, "observation_ids": []})
    episode = make_episode([make_turn(n_ids=3), folded, opened, make_turn(n_ids=1)])
    episode.ledger = ["AB12", None]
    assert Episode.from_json(episode.to_json()) == episode
    assert [len(turns) for _, turns in episode.segments] == [2, 2]
    assert episode.segment_tokens == [4 + 5 + 3, 6 + 4 + 3] and episode.context_tokens == 13
    assert episode.turn_context_tokens == [4, 9, 6, 10]


def test_turn_rejects_mismatched_logprobs() -> None:
    """A turn whose log-probs do not match its sampled ids one-to-one is a bug, caught at construction."""
    with pytest.raises(AssertionError, match="2 ids but 1 log-probs"):
        Turn(**{**make_turn().__dict__, "completion_ids": [1, 2], "completion_logprobs": [-0.1]})


json_leaf = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8)
json_value = st.recursive(
    json_leaf,
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=5), kids, max_size=3),
    max_leaves=6,
)
results = st.builds(
    ToolResult,
    name=st.text(max_size=8),
    ok=st.booleans(),
    observation=st.text(max_size=30),
    error_kind=st.none() | st.text(max_size=8),
    latency_ms=st.floats(allow_nan=False),
    tokens_read=st.integers(0, 10**6),
    tokens_returned=st.integers(0, 10**6),
    cached=st.booleans(),
    payload=st.none() | st.dictionaries(st.text(max_size=5), json_value, max_size=3),
)


@st.composite
def turns(draw: st.DrawFn) -> Turn:
    ids = draw(st.lists(st.integers(0, 50_000), max_size=8))
    n_calls = draw(st.integers(0, 3))
    return Turn(
        completion_ids=ids,
        completion_logprobs=draw(
            st.lists(st.floats(max_value=0.0, allow_nan=False), min_size=len(ids), max_size=len(ids))
        ),
        observation_ids=draw(st.lists(st.integers(0, 50_000), max_size=8)),
        completion_text=draw(st.text(max_size=30)),
        observation_text=draw(st.text(max_size=30)),
        calls=[
            ToolCall(
                draw(st.text(max_size=6)),
                draw(st.dictionaries(st.text(max_size=5), json_value, max_size=3)),
                draw(st.text(max_size=10)),
            )
            for _ in range(n_calls)
        ],
        results=[draw(results) for _ in range(n_calls)],
        parse_errors=draw(
            st.lists(
                st.builds(
                    ParseError,
                    kind=st.sampled_from(["bad_json", "empty"]),
                    message=st.text(max_size=10),
                    raw=st.text(max_size=10),
                ),
                max_size=2,
            )
        ),
        policy_version=draw(st.integers(0, 1000)),
        policy_s=draw(st.floats(0, 1e4)),
        tools_s=draw(st.floats(0, 1e4)),
    )


@settings(max_examples=60, deadline=None)
@given(
    turn_list=st.lists(turns(), max_size=3),
    reward=st.none() | st.floats(allow_nan=False),
    stop=st.sampled_from(["answer", "max_turns", "max_context", "deadline", "infra_failed"]),
    answer=st.none() | st.text(max_size=20),
)
def test_round_trip_property(
    turn_list: list[Turn], reward: float | None, stop: str, answer: str | None
) -> None:
    """Any episode survives to_json/from_json unchanged (unicode text, big and non-finite floats, nested payloads)."""
    episode = make_episode(turn_list)
    episode.reward, episode.stop_reason, episode.answer = reward, stop, answer  # type: ignore[assignment]
    episode.turn_rewards = [0.5] * len(turn_list)
    assert Episode.from_json(episode.to_json()) == episode
