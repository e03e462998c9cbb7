"""The policy's side of the conversation: a short system prompt built from the tool schemas, and exact token ids.

The tool list comes from the tool server's `GET /v1/tools` (OpenAI function-calling schemas), the one source of
truth; each tool becomes one line with its argument names and types, followed by one example call. The call and
answer format itself is described in `main_agent.parse`.

SmolLM2-135M-Instruct's chat template is plain ChatML (`<|im_start|>{role}\\n{content}<|im_end|>\\n`) with no tools
section: `apply_chat_template(..., tools=...)` renders exactly the ids it renders without `tools`
(tests/test_prompts.py checks this on the real tokenizer). So the tool list lives in our system prompt and `tools=`
is never passed (a template that honoured it would describe every tool twice). Tool results go back as a `user`
message of `<tool_response>` blocks, as Qwen's template renders `tool` messages: SmolLM2 was tuned on the
system/user/assistant roles only.

Token exactness: `render_prompt` gives the first prompt's ids. After each completion the rollout appends
`observation_ids(...)`, found by rendering through the chat template and taking the difference, so that
prompt + completion + observation ids equal the template's rendering of the whole conversation when the completion
ends with the end-of-turn token (and the ids the template would put there when it does not). No text is
re-tokenised. Limit: the difference assumes the template renders earlier messages independently of later ones,
true of ChatML templates (not of templates that rewrite earlier turns, such as Qwen3's thinking stripper).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any, Protocol

from main_agent.parse import ANSWER_CLOSE, ANSWER_OPEN, CALL_CLOSE, CALL_OPEN, RECORD_CLOSE, RECORD_OPEN
from main_agent.types import ParseError, Record, ToolResult

# One tool as `GET /v1/tools` returns it: {"type": "function", "function": {"name", "description", "parameters"}}.
# Raw JSON from a process boundary, read only by the helpers below.
ToolSchema = dict[str, Any]
Message = dict[str, str]

RECORD_EXAMPLE = f'{RECORD_OPEN} item="1">answer{RECORD_CLOSE}'
_SHORT_TYPES = {"string": "str", "integer": "int", "number": "float", "boolean": "bool", "object": "dict"}
_PLACEHOLDERS: dict[str, object] = {"str": "...", "int": 1, "float": 1.0, "bool": True, "dict": {}}
# The stand-in conversation observation_ids renders around the observation; ChatML renders it the same anywhere.
_HEAD: list[Message] = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]


class ChatTokenizer(Protocol):
    """The part of a Hugging Face tokenizer used here."""

    def apply_chat_template(
        self, conversation: list[Message], *, add_generation_prompt: bool, tokenize: bool, return_dict: bool
    ) -> list[int]: ...


def system_prompt(tools: Sequence[ToolSchema], *, max_calls_per_turn: int, items: int = 0) -> str:
    """Tools one per line, one example call, the answer tag (and the record tag for a task with `items`).
    Short: the policy's context is small."""
    assert tools, "system_prompt needs at least one tool"
    lines = [f"- {_signature(tool)}" for tool in tools]
    how_many = "one call" if max_calls_per_turn == 1 else f"up to {max_calls_per_turn} calls"
    record = [f"Record each item's answer as soon as you know it: {RECORD_EXAMPLE}"] if items else []
    done = "When all items are recorded" if items else "When you know the answer"
    return "\n".join(
        [
            "Answer the user's question. You can use these tools:",
            *lines,
            f"Make {how_many} per turn, each written like this:",
            f"{CALL_OPEN}{_example_call(tools[0])}{CALL_CLOSE}",
            "Results come back in <tool_response> tags.",
            *record,
            f"{done}, write {ANSWER_OPEN}your answer{ANSWER_CLOSE}.",
        ]
    )


def _signature(tool: ToolSchema) -> str:
    """`search(query: str, k?: int): Search the corpus.` (`?` marks an optional argument)."""
    function = tool["function"]
    parameters = function.get("parameters", {})
    required = set(parameters.get("required", []))
    args = [
        f"{name}{'' if name in required else '?'}: {_type_name(schema)}"
        for name, schema in parameters.get("properties", {}).items()
    ]
    return f"{function['name']}({', '.join(args)}): {function.get('description', '').strip()}"


def _type_name(schema: dict[str, Any]) -> str:
    """A compact type for one JSON-schema property: str, int, list[int], "crop"|"ocr", str|int ..."""
    if "enum" in schema:
        return "|".join(json.dumps(value) for value in schema["enum"])
    if "const" in schema:
        return json.dumps(schema["const"])
    options = schema.get("anyOf") or schema.get("oneOf")
    if options:
        names = [_type_name(option) for option in options if option.get("type") != "null"]
        return "|".join(dict.fromkeys(names))
    if "$ref" in schema:  # a nested model
        return "dict"
    kind = schema.get("type", "any")
    if isinstance(kind, list):
        return "|".join(_SHORT_TYPES.get(str(k), str(k)) for k in kind if k != "null")
    if kind == "array":
        items = schema.get("items")
        return f"list[{_type_name(items)}]" if items else "list"
    return _SHORT_TYPES.get(str(kind), str(kind))


def _example_call(tool: ToolSchema) -> str:
    """A valid call of `tool` with its required arguments, valued from the schema's examples when it has them."""
    function = tool["function"]
    parameters = function.get("parameters", {})
    properties = parameters.get("properties", {})
    arguments = {name: _example_value(properties.get(name, {})) for name in parameters.get("required", [])}
    return json.dumps({"name": function["name"], "arguments": arguments}, ensure_ascii=False)


def _example_value(schema: dict[str, Any]) -> object:
    if schema.get("examples"):
        return schema["examples"][0]
    if "default" in schema:
        return schema["default"]
    if schema.get("enum"):
        return schema["enum"][0]
    first_type = _type_name(schema).split("|")[0]
    if first_type.startswith("list"):
        return []
    return _PLACEHOLDERS.get(first_type, "...")


def prompt_messages(
    question: str,
    tools: Sequence[ToolSchema],
    *,
    max_calls_per_turn: int,
    extra_context: str = "",
    items: int = 0,
) -> list[Message]:
    """The first two messages of every episode: system prompt and question (plus context, e.g. image ids)."""
    user = f"{question}\n\n{extra_context}" if extra_context else question
    system = system_prompt(tools, max_calls_per_turn=max_calls_per_turn, items=items)
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def render_prompt(
    tokenizer: ChatTokenizer,
    question: str,
    tools: Sequence[ToolSchema],
    *,
    max_calls_per_turn: int,
    extra_context: str = "",
    items: int = 0,
) -> list[int]:
    """The first prompt's ids, ending with the assistant header the policy continues from."""
    messages = prompt_messages(
        question, tools, max_calls_per_turn=max_calls_per_turn, extra_context=extra_context, items=items
    )
    return _render(tokenizer, messages, add_generation_prompt=True)


def render_segment_prompt(
    tokenizer: ChatTokenizer,
    question: str,
    tools: Sequence[ToolSchema],
    *,
    max_calls_per_turn: int,
    extra_context: str = "",
    items: int = 0,
    ledger: Sequence[str | None] = (),
    observation: str = "",
) -> list[int]:
    """The prompt of a folded episode's next segment: the first prompt's messages with the ledger and the last
    observation added to the user message (the turns before are gone from the context; the ledger keeps what
    they found)."""
    messages = prompt_messages(
        question, tools, max_calls_per_turn=max_calls_per_turn, extra_context=extra_context, items=items
    )
    messages[-1]["content"] += "\n\n" + ledger_text(ledger) + next_item(extra_context, ledger)
    messages[-1]["content"] += f"\n\nLast results:\n{observation}"
    return _render(tokenizer, messages, add_generation_prompt=True)


def next_item(context: str, ledger: Sequence[str | None]) -> str:
    """'\nNext: item 3 (Image 3: img_8bf8dd)': the first unrecorded item and its line of the context, so a folded
    segment never has to work out where it was; "" when every item is recorded."""
    pending = _first_pending(context, ledger)
    return f"\nNext: {pending}" if pending else ""


def _first_pending(context: str, ledger: Sequence[str | None]) -> str:
    """'item 3 (Image 3: img_8bf8dd)': the first unrecorded item and its line of the context (item tasks list
    item i as "<Noun> i: ..."); "" when every item is recorded."""
    pending = [i for i, text in enumerate(ledger, start=1) if text is None]
    if not pending:
        return ""
    line = next((x for x in context.splitlines() if re.match(rf"^\w+ {pending[0]}: ", x)), "")
    return f"item {pending[0]}" + (f" ({line})" if line else "")


def ledger_text(ledger: Sequence[str | None]) -> str:
    """'Recorded so far: ...' with one `item: answer` line per recorded item, or a line saying none is."""
    lines = [f"{i}: {text}" for i, text in enumerate(ledger, start=1) if text is not None]
    if not lines:
        return "Recorded so far: nothing. Earlier turns are hidden."
    return "Recorded so far (earlier turns are hidden):\n" + "\n".join(lines)


def render_observation(
    results: Sequence[ToolResult],
    *,
    parse_errors: Sequence[ParseError] = (),
    records: Sequence[Record] = (),
    progress: str = "",
) -> str:
    """One `<tool_response>` line per call result (in call order), then one per record and, after a record, the
    `progress` line (`record_progress`), then one per parse error."""
    lines = [f"<tool_response>{r.name}: {r.observation}</tool_response>" for r in results]
    lines += [f"<tool_response>recorded {r.item}: {r.text}</tool_response>" for r in records]
    lines += [f"<tool_response>{progress}</tool_response>"] if records and progress else []
    lines += [f"<tool_response>error ({e.kind}): {e.message}</tool_response>" for e in parse_errors]
    return "\n".join(lines)


def record_progress(context: str, ledger: Sequence[str | None]) -> str:
    """What a record's acknowledgement adds: 'next: item 3 (Image 3: img_8bf8dd), 30 of 32 left' or 'all 32
    recorded: answer to finish'. The policy reads where it is and the next handle from the last observation
    instead of counting lines of a long prompt (a 135M policy stopped after the first of 32 photos)."""
    left = sum(text is None for text in ledger)
    if not left:
        return f"all {len(ledger)} recorded: answer to finish"
    return f"next: {_first_pending(context, ledger)}, {left} of {len(ledger)} left"


def end_of_turn_id(tokenizer: ChatTokenizer) -> int:
    """The id the template closes an assistant message with (`<|im_end|>` for SmolLM2): the policy's stop id."""
    return _closing_ids(tokenizer)[0]


def observation_ids(
    tokenizer: ChatTokenizer, observation: str, *, completion_ids: Sequence[int]
) -> list[int]:
    """The exact ids to append after `completion_ids`: the rest of the assistant message's closing (all of it if
    the completion stopped before the end-of-turn id), the user message holding `observation` (as
    `render_observation` wrote it), and the next assistant header."""
    closing = _closing_ids(tokenizer)
    if completion_ids and completion_ids[-1] == closing[0]:
        closing = closing[1:]
    answered = [*_HEAD, {"role": "assistant", "content": ""}]
    before = _render(tokenizer, answered, add_generation_prompt=False)
    after = _render(
        tokenizer, [*answered, {"role": "user", "content": observation}], add_generation_prompt=True
    )
    return closing + _suffix(before, after)


def _closing_ids(tokenizer: ChatTokenizer) -> list[int]:
    """What the template writes after an (empty) assistant message's content: end-of-turn id first."""
    opened = _render(tokenizer, _HEAD, add_generation_prompt=True)
    closed = _render(tokenizer, [*_HEAD, {"role": "assistant", "content": ""}], add_generation_prompt=False)
    closing = _suffix(opened, closed)
    assert closing, f"the chat template closes an assistant message with no tokens: {closed}"
    return closing


def _suffix(prefix: list[int], full: list[int]) -> list[int]:
    assert full[: len(prefix)] == prefix, (
        f"chat template is not append-only: {prefix} is not a prefix of {full}"
    )
    return full[len(prefix) :]


def _render(tokenizer: ChatTokenizer, messages: list[Message], *, add_generation_prompt: bool) -> list[int]:
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
    )
    return list(ids)
