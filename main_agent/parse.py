"""Completion text -> tool calls | final answer | parse errors. Pure. This docstring is THE description of the format.

In each turn the policy writes tool calls or a final answer:

    <tool_call>{"name": "search", "arguments": {"query": "eiffel tower height", "k": 3}}</tool_call>
    <answer>330 metres</answer>

Tasks with numbered items (several plates, several questions) also take records, each one finished item's answer,
kept in the episode's ledger (`main_agent.rollout`) and alongside calls in any turn:

    <record item="3">ABC123</record>

These are the tags of Qwen/Hermes-style tool calling. SmolLM2-135M-Instruct's chat template has no tools section
(it ignores `tools=`), so `prompts.system_prompt` teaches the format; results come back as `<tool_response>` blocks.

Rules, scanning left to right (each has a test in tests/test_parse.py):
- Several `<tool_call>` blocks per turn are allowed; they run in the order written. Text outside tags (reasoning
  before a call, chatter after it) is ignored.
- A call body is one JSON object with a string `name` naming an offered tool and an object `arguments`. A missing
  `arguments` means `{}` (the tool server reports missing required fields); a JSON string holding an object is
  decoded. Other keys are ignored.
- The body is read as strict JSON right after `<tool_call>`, so tags inside JSON strings are harmless. A complete
  JSON value ends the call: the `</tool_call>` after it is consumed, and a missing one is fine (samplers that stop
  on `</tool_call>` drop the stop string); text between the value and `</tool_call>` is ignored.
- If strict JSON fails, the body is the text up to `</tool_call>` (or, unclosed, up to the next opening tag or the
  end) and three common slips are repaired silently, not flagged: trailing commas, single-quoted strings, and double
  quotes left unescaped inside a string (a quote closes a string only where `,` `:` `}` `]` or the end follows). A closed
  body still not JSON is `bad_json`, as is JSON that is not an object; an unclosed one is `unclosed_tag`.
- `<answer>...</answer>` holds the final answer (stripped; it may be empty). An `<answer>` without `</answer>`
  takes the rest of the text, for the same sampler reason. Only the first answer counts. Everything inside the
  answer belongs to it: a `<tool_call>` there is answer text and never runs.
- Calls and an answer in one turn: the calls run and the answer is dropped with an `answer_ignored` error, so the
  policy is told. An answer ends the episode only in a turn without valid calls.
- `<record item="N">text</record>` records item N's answer (N a positive integer, quoted or not; the text is
  stripped). A record without `</record>` takes the text up to the next opening tag or the end. A record tag whose
  item is missing or not a positive integer is `bad_record`. Records never conflict with calls or an answer; a
  `<record>` inside an answer is answer text. Whether item N exists is the rollout's check, not the parser's.
- Whitespace-only text is `empty`; other text with no call, answer or record tag is `no_action`.

Tags are exact and case-sensitive. `parse_completion` never raises: every problem is a `ParseError` whose message
is written for the policy to read.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection

from main_agent.types import ParsedTurn, ParseError, Record, ToolCall

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
RECORD_OPEN, RECORD_CLOSE = "<record", "</record>"
_OPENING = re.compile(f"{re.escape(CALL_OPEN)}|{re.escape(ANSWER_OPEN)}|{re.escape(RECORD_OPEN)}\\b")
_RECORD_HEAD = re.compile(r"""<record\s+item\s*=\s*["']?(\d+)["']?\s*>""")
_CLOSING_AHEAD = re.compile(r"\s*[}\]]")
_AFTER_STRING = re.compile(r"\s*(?:[,:}\]]|$)")
_DECODER = json.JSONDecoder()
_INVALID = object()  # "not JSON", distinct from a JSON null


def parse_completion(text: str, *, tool_names: Collection[str]) -> ParsedTurn:
    """Split one completion into the calls to run, the final answer, and the mistakes to report."""
    calls: list[ToolCall] = []
    records: list[Record] = []
    errors: list[ParseError] = []
    answer: str | None = None
    answer_raw = ""
    pos = 0
    while (match := _OPENING.search(text, pos)) is not None:
        if match.group() == RECORD_OPEN:
            record, pos = _parse_record(text, match.start())
            (records if isinstance(record, Record) else errors).append(record)  # type: ignore[arg-type]
            continue
        if match.group() == ANSWER_OPEN:
            end = text.find(ANSWER_CLOSE, match.end())
            stop = len(text) if end < 0 else end
            if answer is None:
                answer, answer_raw = text[match.end() : stop].strip(), text[match.start() : stop]
            pos = stop if end < 0 else end + len(ANSWER_CLOSE)
            continue
        call, pos = _parse_call(text, match.start(), tool_names)
        if isinstance(call, ToolCall):
            calls.append(call)
        else:
            errors.append(call)
    if calls and answer is not None:
        msg = "answer ignored: a turn with tool calls cannot also answer; answer after reading the results"
        errors.append(ParseError("answer_ignored", msg, answer_raw))
        answer = None
    if not calls and answer is None and not records and not errors:
        errors.append(_no_action(text))
    return ParsedTurn(calls=calls, answer=answer, errors=errors, records=records)


def _parse_record(text: str, start: int) -> tuple[Record | ParseError, int]:
    """The record opening at `start` and where scanning resumes (after `</record>`, else at the next tag)."""
    head = _RECORD_HEAD.match(text, start)
    following = _OPENING.search(text, start + len(RECORD_OPEN))
    next_open = len(text) if following is None else following.start()
    close = text.find(RECORD_CLOSE, start)
    end = close + len(RECORD_CLOSE) if 0 <= close < next_open else next_open
    raw = text[start:end]
    if head is None or int(head.group(1)) < 1 or head.end() > end:
        message = 'a record needs a positive item number: <record item="1">answer</record>'
        return ParseError("bad_record", message, raw), end
    body_end = close if 0 <= close < next_open else next_open
    return Record(item=int(head.group(1)), text=text[head.end() : body_end].strip(), raw=raw), end


def _no_action(text: str) -> ParseError:
    if not text.strip():
        return ParseError("empty", "empty output: write a <tool_call> or an <answer>", text)
    return ParseError("no_action", "no <tool_call> or <answer> found", text)


def _parse_call(text: str, start: int, tool_names: Collection[str]) -> tuple[ToolCall | ParseError, int]:
    """Parse the call opening at `start`; returns it (or the error) and where scanning resumes."""
    body_start = start + len(CALL_OPEN)
    decoded = _decode_at(text, body_start)
    if decoded is not None:
        obj, end = decoded
        if text.startswith(CALL_CLOSE, end):
            end += len(CALL_CLOSE)
        return _check_call(obj, text[start:end], tool_names), end
    close = text.find(CALL_CLOSE, body_start)
    following = _OPENING.search(text, body_start)
    next_open = len(text) if following is None else following.start()
    if 0 <= close < next_open:
        end = close + len(CALL_CLOSE)
        return _check_call(_loads(text[body_start:close]), text[start:end], tool_names), end
    obj = _loads(text[body_start:next_open])
    if isinstance(obj, dict):
        return _check_call(obj, text[start:next_open], tool_names), next_open
    return ParseError("unclosed_tag", f"{CALL_OPEN} without {CALL_CLOSE}", text[start:next_open]), next_open


def _decode_at(text: str, pos: int) -> tuple[object, int] | None:
    """Strict JSON value starting at `pos` (after whitespace) and the index after it and its trailing whitespace."""
    try:
        obj, end = _DECODER.raw_decode(text, _skip_space(text, pos))
    except (ValueError, RecursionError):
        return None
    return obj, _skip_space(text, end)


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _check_call(obj: object, raw: str, tool_names: Collection[str]) -> ToolCall | ParseError:
    if obj is _INVALID:
        return ParseError("bad_json", "tool call is not valid JSON", raw)
    if not isinstance(obj, dict):
        return ParseError(
            "bad_json", 'tool call must be a JSON object {"name": ..., "arguments": {...}}', raw
        )
    name = obj.get("name")
    if not isinstance(name, str):
        return ParseError("missing_name", 'tool call needs a string "name"', raw)
    if name not in tool_names:
        known = ", ".join(sorted(tool_names))
        return ParseError("unknown_tool", f"unknown tool {name!r}; tools: {known}", raw)
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):
        arguments = _loads(arguments)
    if not isinstance(arguments, dict):
        return ParseError("bad_arguments", f'"arguments" of {name} must be a JSON object', raw)
    return ToolCall(name=name, arguments=arguments, raw=raw)


def _loads(body: str) -> object:
    """JSON, else JSON after `_repair`, else `_INVALID`. Deep nesting is invalid, not a crash."""
    for candidate in (body, _repair(body)):
        try:
            return json.loads(candidate)
        except (ValueError, RecursionError):
            continue
    return _INVALID


def _repair(text: str) -> str:
    """Rewrite single-quoted strings as JSON strings and drop commas before `}` or `]`; JSON strings are kept."""
    out: list[str] = []
    i = 0
    while i < len(text):
        char = text[i]
        if char in "\"'":
            end = _string_end(text, i, loose=char == '"')
            literal = text[i:end]
            quoted = end - i >= 2 and literal[-1] == char
            out.append(_requote(literal) if quoted else literal)
            i = end
            continue
        if not (char == "," and _CLOSING_AHEAD.match(text, i + 1)):
            out.append(char)
        i += 1
    return "".join(out)


def _string_end(text: str, start: int, *, loose: bool = False) -> int:
    """Index just past the string literal opening at `start` (or the end of the text if it never closes).

    `loose`: a quote closes the string only where JSON can go on after a string (`,` `:` `}` `]` or the end, past
    whitespace), so a question copied with its own quotes unescaped (`"question": "Who sang "Yesterday"?"`) stays
    one string. The shipped 135M policy did this in 5 of 24 multihop dev episodes, copying questions that quote a
    title."""
    quote, i = text[start], start + 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
        elif text[i] == quote and (not loose or _AFTER_STRING.match(text, i + 1)):
            return i + 1
        else:
            i += 1
    return len(text)


def _requote(literal: str) -> str:
    """'it\\'s "x"' -> "it's \\"x\\"", and "who sang "x"?" -> "who sang \\"x\\"?" (other escapes are JSON's)."""
    inner = literal[1:-1].replace("\\'", "'") if literal[0] == "'" else literal[1:-1]
    return '"' + re.sub(r'(?<!\\)"', r"\"", inner) + '"'
