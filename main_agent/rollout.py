"""One episode of the orchestrator: generate → parse → run the turn's calls concurrently → append → repeat.

The token stream is built from ids only: the prompt's ids, then per turn the ids the policy sampled and the
ids of the rendered observation (tool results or the parser's complaint, plus the next assistant header).
Nothing is re-tokenised, so the trainer sees exactly what the policy saw.

Policy mistakes (malformed calls, unknown tools, bad arguments, tool errors) become observations and the
episode goes on. Infrastructure failures (the tool server or the policy endpoint failing) end the episode
with `stop_reason="infra_failed"` and the reason; the trainer excludes such episodes instead of scoring them.

Long horizons. A task with numbered items (`RolloutTask.items`, e.g. 32 plates) keeps a **ledger**: the policy
writes `<record item="3">ABC123</record>` (main_agent.parse) when an item is done, and the observation
confirms it and names what comes next: the next unrecorded item and its handle, or that every item is recorded
(prompts.record_progress). A record tag is a built-in action, not a tool: it costs no HTTP round trip and can share
a turn with calls. The final answer of such a task is always the ledger, one line per item in order, whether the
policy ends with `<answer>` (whose lines fill only items the ledger lacks) or a budget runs out first: recorded
work counts either way. With `fold_at_tokens` set, when the next turn could pass it the episode continues in a
new segment whose prompt is the task, the ledger and the last observation (prompts.render_segment_prompt), so
the main context stays bounded however many calls the episode makes. Each segment is trained as its own
sequence on exactly the ids the policy saw (types.Episode.segments).

Attachments. What the task hands the policy (a photo, a clip, pages) is registered in the episode's session
before the first turn (`ToolClient.attach`), and the context names it by handle (subagents/handles.py), so
no prompt holds a path and the policy never copies one.

Exact replay. `rollout(..., replay=turns)` first replays the given turns of an earlier episode of the same task
(their sampled ids as they were, their calls re-run in a fresh session, its attachments registered again) and
then samples on: the state before any
turn of an episode can be restored and continued, which branch credit (training/branching.py) builds on. Sub-agents
are frozen and image ids are derived from their history, so a replayed call must return the very observation it
returned before; if not, the replay raises `ReplayDiverged` (an infrastructure failure).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from main_agent.parse import parse_completion
from main_agent.policy import Policy, PolicyError, Sample
from main_agent.prompts import (
    observation_ids,
    record_progress,
    render_observation,
    render_prompt,
    render_segment_prompt,
)
from main_agent.types import Episode, ParseError, Record, ToolCall, ToolResult, Turn
from subagents.handles import Attachment
from tool_server.client import CallResult, ToolClient, ToolServerError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RolloutConfig:
    """The budgets of one episode (`[rollout]` of the training, evaluation and SFT settings)."""

    max_turns: int = 10
    """Policy turns per episode; each may issue several calls. A plate needs five (load, find_text, zoom,
    read, answer) and up to four more when a read is retried; a four-hop question asked hop by hop, five."""
    max_calls_per_turn: int = 4
    """Calls beyond this in one turn are dropped with a note to the policy (they would run concurrently)."""
    max_new_tokens: int = 320
    """Tokens per policy turn, an upper bound (sampling stops at the end-of-turn token): an expert's turn of
    page_qa calls on loopback URLs measures ~200 SmolLM2 tokens (max ~300), an image_ops call ~60."""
    max_context_tokens: int = 2048
    """The main context budget: prompt with tool schemas (~500 tokens) plus the turns and observations; the
    episode stops when the next turn would not fit."""
    observation_tokens: int = 192
    """Each tool result is cut to this many tokens with a visible marker."""
    wall_clock_s: float = 600.0
    """Whole-episode budget: sub-agent calls take 10-20 s each on a loaded 2-core CPU."""
    untagged_is_answer: bool = False
    """Take a turn with no call and no tag as the final answer, as OpenAI-style chat agents do (a message
    without tool calls ends the run). Off while training: the answer tag is part of what is learned."""
    first_turn_prefix: str = ""
    """Text that opens the first assistant turn, e.g. '<tool_call>{"name": "' to require a call first (the
    analogue of tool_choice="required"). Its ids join the prompt (never trained on); it is parsed with the
    first completion. Empty while training: the policy must learn the format itself."""
    last_turn_prefix: str = ""
    """Text that opens the last turn the budget allows (from the second turn on), e.g. '<answer>' so that an
    episode about to run out of turns ends with an answer from what the policy saw (tool_choice="none" on the
    last step; LangChain's early_stopping_method="generate"). Its ids follow the previous turn's observation
    (never trained on) and the episode stops with "last_turn_answer". Empty while training and evaluating:
    running out of turns is what the policy must learn not to do, and it scores 0."""
    turns_per_item: int = 6
    """Item tasks get at least this many turns per item (plus one to answer) whatever `max_turns` says: a
    plate takes 4 calls and up to 2 retries, so a horizon that grows keeps its room."""
    fold_at_tokens: int = 0
    """0: never fold (an episode stops when its context is full). > 0: when the context after a turn's
    observation plus `max_new_tokens` would pass this, the episode goes on in a new segment whose prompt is the
    task, the ledger and that observation (see the module docstring). For long item tasks, e.g. plate_audit."""

    def __post_init__(self) -> None:
        limits = (self.max_turns, self.max_calls_per_turn, self.max_new_tokens, self.observation_tokens)
        if min(limits) < 1 or self.max_context_tokens < 16 or self.wall_clock_s <= 0:
            raise ValueError(f"rollout budgets must be positive (max_context_tokens >= 16), got {self}")
        if self.fold_at_tokens and not self.max_new_tokens < self.fold_at_tokens <= self.max_context_tokens:
            raise ValueError(
                f"fold_at_tokens must be 0 or in (max_new_tokens, max_context_tokens], got {self.fold_at_tokens}"
            )


@dataclass(frozen=True)
class RolloutTask:
    """What a rollout needs from a task: the question, the tools it may use, the context lines shown with the
    question (which name attachments by their handles, never by path) and the attachments to register."""

    task_id: str
    question: str
    tools: Sequence[dict[str, object]]
    context: str = ""
    items: int = 0  # numbered items the policy records answers for (0: a single-answer task, no ledger)
    attachments: Sequence[Attachment] = ()  # registered in the episode's session before the first turn


ProgressHook = Callable[[Turn], None]


class ReplayDiverged(ToolServerError):
    """A replayed call did not return what it returned the first time: the tools are not frozen after all."""


async def rollout(
    task: RolloutTask,
    policy: Policy,
    tools: ToolClient,
    tokenizer,
    cfg: RolloutConfig = RolloutConfig(),
    *,
    on_turn: ProgressHook | None = None,
    replay: Sequence[Turn] = (),
) -> Episode:
    """Play one episode to an answer or a budget, top to bottom; `replay`: turns of an earlier episode of this
    task to replay exactly before sampling on."""
    start = time.monotonic()
    session = f"{task.task_id}-{uuid.uuid4().hex[:8]}"  # this episode's images and handles on the server
    prompt_ids = _first_prompt(task, tokenizer, cfg)
    episode = _new_episode(task, prompt_ids, policy.version)
    ids, opened = list(prompt_ids), []  # the current segment's stream; the prompt of a segment just opened
    turns = max_turns(task, cfg)
    try:  # what the task's context names by handle exists in this session before the policy acts
        if task.attachments:
            await tools.attach(task.attachments, session=session)
    except ToolServerError as exc:
        logger.warning("episode %s infra failure: %s", task.task_id, exc)
        episode.stop_reason, episode.infra_error, turns = "infra_failed", f"{type(exc).__name__}: {exc}", 0
    for index in range(turns):
        room = cfg.max_context_tokens - len(ids)
        if room < 16:  # not even a short answer fits
            episode.stop_reason = "max_context"
            break
        if time.monotonic() - start > cfg.wall_clock_s:
            episode.stop_reason = "deadline"
            break
        last = 0 < index == turns - 1 and cfg.last_turn_prefix != ""
        prefix = cfg.last_turn_prefix if last else cfg.first_turn_prefix if index == 0 else ""
        if last:
            ids, opened = _open_last_turn(tokenizer, prefix, ids, opened, episode)
        redo = replay[index] if index < len(replay) else None
        try:
            turn, answer = await play_turn(
                ids, policy, tools, tokenizer, cfg, task=task, session=session, prefix=prefix,
                ledger=episode.ledger, replay=redo,
            )  # fmt: skip
        except (PolicyError, ToolServerError) as exc:  # infrastructure, not the policy's fault
            logger.warning("episode %s infra failure: %s", task.task_id, exc)
            episode.stop_reason, episode.infra_error = "infra_failed", f"{type(exc).__name__}: {exc}"
            break
        turn = dataclasses.replace(turn, prompt_ids=opened)
        opened = _fold(task, tokenizer, cfg, ids, turn, episode.ledger) if answer is None else []
        if opened:
            turn = dataclasses.replace(turn, observation_ids=[])
        episode.turns.append(turn)
        ids = opened or ids + turn.completion_ids + turn.observation_ids
        if on_turn is not None:
            on_turn(turn)
        if answer is not None:
            episode.answer, episode.stop_reason = answer, "last_turn_answer" if last else "answer"
            break
    _finish(episode, start)
    return episode


def _open_last_turn(
    tokenizer, prefix: str, ids: list[int], opened: list[int], episode: Episode
) -> tuple[list[int], list[int]]:
    """The stream and segment prompt with `prefix`'s ids appended, recorded where the episode keeps what the
    policy did not sample: the prompt of a segment just opened, else the previous turn's observation."""
    forced = tokenizer.encode(prefix, add_special_tokens=False)
    if opened:
        return ids + forced, opened + forced
    last = episode.turns[-1]
    episode.turns[-1] = dataclasses.replace(last, observation_ids=[*last.observation_ids, *forced])
    return ids + forced, opened


def max_turns(task: RolloutTask, cfg: RolloutConfig) -> int:
    """`max_turns`, raised for an item task to `turns_per_item` per item plus one to answer."""
    return max(cfg.max_turns, cfg.turns_per_item * task.items + 1) if task.items else cfg.max_turns


def _first_prompt(task: RolloutTask, tokenizer, cfg: RolloutConfig) -> list[int]:
    prompt = render_prompt(
        tokenizer,
        task.question,
        task.tools,
        max_calls_per_turn=cfg.max_calls_per_turn,
        extra_context=task.context,
        items=task.items,
    )
    return prompt + tokenizer.encode(cfg.first_turn_prefix, add_special_tokens=False)


def _fold(
    task: RolloutTask, tokenizer, cfg: RolloutConfig, ids: list[int], turn: Turn, ledger: list[str | None]
) -> list[int]:
    """The next segment's prompt when the next turn could pass `fold_at_tokens`, else [] (no fold)."""
    after = len(ids) + len(turn.completion_ids) + len(turn.observation_ids)
    if not cfg.fold_at_tokens or after + cfg.max_new_tokens <= cfg.fold_at_tokens:
        return []
    return render_segment_prompt(
        tokenizer,
        task.question,
        task.tools,
        max_calls_per_turn=cfg.max_calls_per_turn,
        extra_context=task.context,
        items=task.items,
        ledger=ledger,
        observation=turn.observation_text,
    )


async def play_turn(
    ids: list[int],
    policy: Policy,
    tools: ToolClient,
    tokenizer,
    cfg: RolloutConfig,
    *,
    task: RolloutTask,
    session: str,
    prefix: str,
    ledger: list[str | None],
    replay: Turn | None = None,
) -> tuple[Turn, str | None]:
    """Sample (or take `replay`'s sample), parse, record, run the calls concurrently, render the observation.
    Returns the turn and the episode's answer (None unless the turn answered without calling); `ledger` takes
    the turn's records. Raises PolicyError / ToolServerError on infra failure, ReplayDiverged when a replayed
    turn observes something else than it did."""
    t0 = time.monotonic()
    sample = await _sample(ids, policy, cfg, replay)
    t1 = time.monotonic()
    names = [str(t["function"]["name"]) for t in task.tools]  # type: ignore[index]
    parsed = parse_completion(prefix + sample.text, tool_names=names)
    calls = parsed.calls[: cfg.max_calls_per_turn]
    records, bad_items = _record(parsed.records, ledger)
    results = await run_calls(
        tools, calls, session=session, tokenizer=tokenizer, budget=cfg.observation_tokens
    )
    t2 = time.monotonic()
    errors = list(parsed.errors) + bad_items + _dropped_note(len(parsed.calls) - len(calls))
    answer, errors = _answer(parsed.answer if not calls else None, sample.text, errors, cfg, task, ledger)
    progress = record_progress(task.context, ledger) if records else ""
    text, obs_ids = "", []
    if answer is None:  # the episode goes on: the observation follows the completion
        text = render_observation(results, parse_errors=errors, records=records, progress=progress)
        obs_ids = observation_ids(tokenizer, text, completion_ids=sample.ids)
    turn = Turn(
        completion_ids=list(sample.ids),
        completion_logprobs=list(sample.logprobs),
        observation_ids=obs_ids,
        completion_text=sample.text,
        observation_text=text,
        calls=calls,
        results=results,
        parse_errors=errors,
        policy_version=policy.version if replay is None else replay.policy_version,
        policy_s=t1 - t0,
        tools_s=t2 - t1,
        exact=sample.exact if replay is None else replay.exact,
        trained=sample.trained if replay is None else replay.trained,
        records=records,
    )
    if replay is not None and text != replay.observation_text:
        raise ReplayDiverged(
            f"replayed turn observed {text[:200]!r}, first time {replay.observation_text[:200]!r}"
        )
    return turn, answer


async def _sample(ids: list[int], policy: Policy, cfg: RolloutConfig, replay: Turn | None) -> Sample:
    """The policy's completion within the context left, or the replayed turn's own sample."""
    if replay is not None:
        return Sample(replay.completion_ids, replay.completion_logprobs, replay.completion_text, "stop")
    room = cfg.max_context_tokens - len(ids)
    return await policy.sample(ids, max_new_tokens=min(cfg.max_new_tokens, room))


def _answer(
    answer: str | None,
    text: str,
    errors: list[ParseError],
    cfg: RolloutConfig,
    task: RolloutTask,
    ledger: list[str | None],
) -> tuple[str | None, list[ParseError]]:
    """The turn's answer (None: the episode goes on) and the errors left for the policy to read: untagged text
    is the answer where `untagged_is_answer` allows it, and an item task's answer is its ledger."""
    if cfg.untagged_is_answer and answer is None and [e.kind for e in errors] == ["no_action"]:
        answer, errors = text.strip(), []
    if answer is not None and task.items:
        answer = ledger_answer(ledger, answer)
    return answer, errors


def _record(records: Sequence[Record], ledger: list[str | None]) -> tuple[list[Record], list[ParseError]]:
    """Write the records of items the task has into `ledger` (a later record of an item replaces an earlier
    one); the others become errors for the policy to read."""
    kept, errors = [], []
    for record in records:
        if 1 <= record.item <= len(ledger):
            ledger[record.item - 1] = record.text
            kept.append(record)
        elif ledger:
            errors.append(
                ParseError("bad_item", f"no item {record.item}: items are 1 to {len(ledger)}", record.raw)
            )
        else:
            errors.append(
                ParseError("bad_item", "this task has no items to record: answer instead", record.raw)
            )
    return kept, errors


def ledger_answer(ledger: Sequence[str | None], answer: str | None) -> str:
    """The final answer of an item task: one line per item, the recorded answer where there is one, else the
    answer's line of the same number (when the policy answered), else an empty line."""
    lines = (answer or "").splitlines()
    return "\n".join(
        text if text is not None else (lines[i].strip() if i < len(lines) else "")
        for i, text in enumerate(ledger)
    )


async def run_calls(
    tools: ToolClient, calls: list[ToolCall], *, session: str, tokenizer, budget: int
) -> list[ToolResult]:
    """All calls of a turn at once; tool errors come back as results, infra failures raise."""
    done = await asyncio.gather(*(tools.call(c.name, c.arguments, session=session) for c in calls))
    return [to_tool_result(r, cap_tokens(tokenizer, r.observation, budget)) for r in done]


def cap_tokens(tokenizer, text: str, budget: int) -> str:
    """Cut `text` to `budget` tokens with a visible marker saying how many were dropped."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) <= budget:
        return text
    return tokenizer.decode(ids[:budget]) + f" …[truncated {len(ids) - budget} tokens]"


def _dropped_note(n: int) -> list[ParseError]:
    if n <= 0:
        return []
    return [ParseError("too_many_calls", f"only the first calls ran; {n} more were dropped", "")]


def to_tool_result(r: CallResult, observation: str) -> ToolResult:
    return ToolResult(
        name=r.name,
        ok=r.ok,
        observation=observation,
        error_kind=r.error.kind if r.error else None,
        latency_ms=r.latency_ms,
        tokens_read=r.tokens_read,
        tokens_returned=r.tokens_returned,
        cached=r.cached,
        payload=dict(r.payload),
    )


def _new_episode(task: RolloutTask, prompt_ids: list[int], version: int) -> Episode:
    return Episode(
        ledger=[None] * task.items,
        task_id=task.task_id,
        question=task.question,
        prompt_ids=prompt_ids,
        turns=[],
        answer=None,
        stop_reason="max_turns",
        policy_version=version,
        wall_s=0.0,
        policy_s=0.0,
        tools_s=0.0,
    )


def _finish(episode: Episode, start: float) -> None:
    if episode.answer is None and any(text is not None for text in episode.ledger):
        if episode.stop_reason != "infra_failed":  # a budget ran out: the recorded items are the answer
            episode.answer = ledger_answer(episode.ledger, None)
    episode.wall_s = time.monotonic() - start
    episode.policy_s = sum(t.policy_s for t in episode.turns)
    episode.tools_s = sum(t.tools_s for t in episode.turns)
