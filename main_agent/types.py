"""The records a rollout produces and the trainer consumes: calls, results, turns, episodes.

Trainability is data carried per token: a `Turn` keeps the exact ids the policy sampled (with the sampler's
log-probs and the policy version that sampled them) and the exact ids appended after them (tool results and the
next assistant header, never trained on). Nothing here re-tokenises text. An episode's token stream is

    prompt_ids + turns[0].completion_ids + turns[0].observation_ids + turns[1].completion_ids + ...

unless it was folded: a long episode continues in a new **segment** when its context would pass the rollout's
`fold_at_tokens`. The turn that opens a segment carries that segment's prompt in `Turn.prompt_ids` (the task, the
ledger of recorded items and the last observation, rendered fresh), and the turn before it appends no
observation ids (its observation went into the new prompt). `Episode.segments` cuts the turns at those points;
each segment is one sequence exactly as the policy saw it, and the trainer trains each on its own.

`Episode.to_json()` / `Episode.from_json()` round-trip losslessly (one JSON line per episode in rollout logs).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Literal

ParseErrorKind = Literal[
    "empty",  # the completion is empty or whitespace only
    "no_action",  # text without any <tool_call> or <answer> tag
    "unclosed_tag",  # <tool_call> without </tool_call> whose body is not one complete JSON object
    "bad_json",  # the call body is not JSON (after repairing trailing commas and single quotes) or not an object
    "missing_name",  # the call object has no string "name"
    "unknown_tool",  # "name" is not a tool the server offers
    "bad_arguments",  # "arguments" is neither an object nor a JSON string holding one
    "answer_ignored",  # an <answer> in a turn that also made valid calls: the calls run, the answer is dropped
    "too_many_calls",  # calls past the per-turn cap: they were not run
    "bad_record",  # a <record> tag without a positive item number
    "bad_item",  # a record of an item the task does not have (or a task without items)
]

StopReason = Literal["answer", "last_turn_answer", "max_turns", "max_context", "deadline", "infra_failed"]
"""last_turn_answer: the answer of a last turn that `RolloutConfig.last_turn_prefix` opened for it."""


@dataclass(frozen=True)
class ToolCall:
    """One well-formed call the policy asked for."""

    name: str
    arguments: dict[str, object]
    raw: str  # the `<tool_call>...</tool_call>` text as written, for traces


@dataclass(frozen=True)
class Record:
    """One finished item's answer, written `<record item="3">ABC123</record>`; it goes into the ledger."""

    item: int  # 1-based, as the task numbers its items
    text: str
    raw: str


@dataclass(frozen=True)
class ParseError:
    """A policy mistake in one turn's text; the rollout shows it to the policy as an observation."""

    kind: ParseErrorKind
    message: str  # short, written for the policy to read
    raw: str  # the offending text


@dataclass(frozen=True)
class ParsedTurn:
    """What one completion asked for. At least one of the three is non-empty; `answer` is None when calls exist."""

    calls: list[ToolCall]
    answer: str | None
    errors: list[ParseError]
    records: list[Record] = field(default_factory=list)


@dataclass(frozen=True)
class ToolResult:
    """The outcome of one call as the tool server reported it."""

    name: str
    ok: bool
    observation: str  # the compact text the policy reads (the server's `observation()`)
    error_kind: str | None  # the server's ToolError.kind, or a client-side kind such as "timeout"
    latency_ms: float
    tokens_read: int  # tokens the sub-agent consumed on the policy's behalf
    tokens_returned: int  # tokens of `observation`
    cached: bool
    payload: dict[str, object] | None  # the raw JSON response, for the trace viewer


@dataclass(frozen=True)
class Turn:
    """One policy turn: what it sampled, what was appended after it, and what ran in between."""

    completion_ids: list[int]  # exactly the ids the policy sampled (trained on)
    completion_logprobs: list[float]  # the sampler's log-prob of each completion id
    observation_ids: list[int]  # exactly the ids appended after the completion (masked out of the loss)
    completion_text: str
    observation_text: str
    calls: list[ToolCall]
    results: list[ToolResult]  # one per call, same order
    parse_errors: list[ParseError]
    policy_version: int  # weights version that sampled this turn (async training may change it mid-episode)
    policy_s: float  # seconds spent generating this turn
    tools_s: float  # seconds spent waiting for this turn's tool calls
    exact: bool = True  # False: the sampler returned re-tokenised ids or lacked log-probs; never trained on
    # False: in the context, never a target: a demonstration's deliberate mistake (training/sft.py), a near
    # miss's replayed prefix (training/near_miss.py)
    trained: bool = True
    records: list[Record] = field(default_factory=list)  # items this turn recorded, in the order written
    prompt_ids: list[int] = field(
        default_factory=list
    )  # non-empty: this turn opens a segment with this prompt

    def __post_init__(self) -> None:
        n_ids, n_lp = len(self.completion_ids), len(self.completion_logprobs)
        assert n_ids == n_lp, f"completion has {n_ids} ids but {n_lp} log-probs"
        assert len(self.results) == len(self.calls), f"{len(self.calls)} calls, {len(self.results)} results"


@dataclass
class Episode:
    """One rollout of one task. Mutable only so the reward step can fill `reward` and `turn_rewards`."""

    task_id: str
    question: str
    prompt_ids: list[int]  # the rendered first prompt, ending with the assistant header
    turns: list[Turn]
    answer: str | None
    stop_reason: StopReason
    policy_version: int  # the version that sampled the first turn
    wall_s: float
    policy_s: float
    tools_s: float
    infra_error: str | None = None  # set iff stop_reason == "infra_failed": the episode is invalid, not wrong
    reward: float | None = None
    turn_rewards: list[float] = field(default_factory=list)
    ledger: list[str | None] = field(default_factory=list)  # item i+1's recorded answer (None: not recorded)

    @property
    def segments(self) -> list[tuple[list[int], list[Turn]]]:
        """(prompt ids, turns) of each segment in order: one for an episode that never folded."""
        segments: list[tuple[list[int], list[Turn]]] = [(self.prompt_ids, [])]
        for turn in self.turns:
            if turn.prompt_ids:
                segments.append((turn.prompt_ids, []))
            segments[-1][1].append(turn)
        return segments

    @property
    def segment_tokens(self) -> list[int]:
        """Length of each segment's token stream: what the main context held at the end of that segment."""
        return [
            len(prompt) + sum(len(t.completion_ids) + len(t.observation_ids) for t in turns)
            for prompt, turns in self.segments
        ]

    @property
    def exact(self) -> bool:
        """Every turn carries the ids and log-probs the sampler really produced, so the episode can be trained on."""
        return all(t.exact for t in self.turns)

    @property
    def num_calls(self) -> int:
        return sum(len(t.calls) for t in self.turns)

    @property
    def calls_per_tool(self) -> dict[str, int]:
        return dict(Counter(c.name for t in self.turns for c in t.calls))

    @property
    def tool_errors(self) -> int:
        """Calls that reached the tool server and came back not ok."""
        return sum(not r.ok for t in self.turns for r in t.results)

    @property
    def num_parse_errors(self) -> int:
        return sum(len(t.parse_errors) for t in self.turns)

    @property
    def context_tokens(self) -> int:
        """The peak main context: the longest segment's token stream (the whole stream when never folded)."""
        return max(self.segment_tokens)

    @property
    def turn_context_tokens(self) -> list[int]:
        """The main context each turn was sampled from (its segment's prompt and the turns before it there)."""
        sizes = []
        for prompt, turns in self.segments:
            size = len(prompt)
            for turn in turns:
                sizes.append(size)
                size += len(turn.completion_ids) + len(turn.observation_ids)
        return sizes

    @property
    def subagent_tokens_read(self) -> int:
        return sum(r.tokens_read for t in self.turns for r in t.results)

    def to_json(self) -> str:
        """One line of JSON; floats keep full precision (non-finite ones as JSON's NaN/Infinity extension)."""
        return json.dumps(asdict(self), separators=(",", ":"), ensure_ascii=False)

    @classmethod
    def from_json(cls, line: str) -> Episode:
        data = json.loads(line)
        return cls(**{**data, "turns": [_turn_from_dict(t) for t in data["turns"]]})


def _turn_from_dict(data: dict[str, object]) -> Turn:
    calls = [ToolCall(**c) for c in data["calls"]]  # type: ignore[attr-defined]
    results = [ToolResult(**r) for r in data["results"]]  # type: ignore[attr-defined]
    errors = [ParseError(**e) for e in data["parse_errors"]]  # type: ignore[attr-defined]
    records = [Record(**r) for r in data.get("records", [])]  # type: ignore[attr-defined]
    parts = {"calls": calls, "results": results, "parse_errors": errors, "records": records}
    return Turn(**{**data, **parts})  # type: ignore[arg-type]
