"""The completion format (main_agent.parse): every rule in the module docstring, plus parse never raising."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from main_agent.parse import parse_completion
from main_agent.types import ParsedTurn, ToolCall

TOOLS = {"search", "page_qa", "image_ops", "video_summary"}


def parse(text: str) -> ParsedTurn:
    return parse_completion(text, tool_names=TOOLS)


def kinds(turn: ParsedTurn) -> list[str]:
    return [e.kind for e in turn.errors]


def test_well_formed_call() -> None:
    """A single well-formed call becomes one ToolCall with its raw text, no answer, no errors."""
    text = (
        'Let me search.\n<tool_call>{"name": "search", "arguments": {"query": "eiffel", "k": 3}}</tool_call>'
    )
    turn = parse(text)
    assert turn.calls == [
        ToolCall("search", {"query": "eiffel", "k": 3}, text[text.index("<tool_call>") :]),
    ]
    assert turn.answer is None and turn.errors == []


def test_several_calls_keep_order() -> None:
    """Several calls in one turn are all returned, in the order written."""
    text = (
        '<tool_call>{"name": "search", "arguments": {"query": "a"}}</tool_call>\n'
        '<tool_call>{"name": "page_qa", "arguments": {"url": "https://x.org", "question": "b"}}</tool_call>'
        '<tool_call>{"name": "search", "arguments": {"query": "c"}}</tool_call>'
    )
    turn = parse(text)
    assert [(c.name, c.arguments.get("query")) for c in turn.calls] == [
        ("search", "a"),
        ("page_qa", None),
        ("search", "c"),
    ]
    assert turn.errors == []


def test_answer() -> None:
    """<answer> gives the stripped final answer; text before it is ignored."""
    turn = parse("I found it.\n<answer>  330 metres \n</answer>")
    assert turn == ParsedTurn(calls=[], answer="330 metres", errors=[])


def test_empty_answer_is_an_answer() -> None:
    """An empty answer still ends the episode (it is scored, not re-asked)."""
    assert parse("<answer></answer>").answer == ""


def test_unknown_tool() -> None:
    """A call to a tool the server does not offer is unknown_tool, and the message lists the real tools."""
    turn = parse('<tool_call>{"name": "browse", "arguments": {}}</tool_call>')
    assert turn.calls == [] and kinds(turn) == ["unknown_tool"]
    assert "search" in turn.errors[0].message and "browse" in turn.errors[0].message


def test_trailing_comma_is_repaired() -> None:
    """Trailing commas in objects and arrays are accepted silently."""
    turn = parse(
        '<tool_call>{"name": "image_ops", "arguments": {"op": "crop", "box": [1, 2, 3, 4,],},}</tool_call>'
    )
    assert turn.errors == []
    assert turn.calls[0].arguments == {"op": "crop", "box": [1, 2, 3, 4]}


def test_single_quotes_are_repaired() -> None:
    """Single-quoted strings are accepted, including escaped quotes and double quotes inside them."""
    text = """<tool_call>{'name': 'search', 'arguments': {'query': 'it\\'s "big"', 'k': 2}}</tool_call>"""
    turn = parse(text)
    assert turn.errors == []
    assert turn.calls[0].arguments == {"query": 'it\'s "big"', "k": 2}


def test_repair_keeps_commas_and_apostrophes_inside_json_strings() -> None:
    """The repair step leaves the content of double-quoted strings alone (",}" and apostrophes inside text)."""
    text = '<tool_call>{"name": "search", "arguments": {"query": "what\'s ,} here",},}</tool_call>'
    assert parse(text).calls[0].arguments == {"query": "what's ,} here"}


def test_unescaped_quotes_inside_a_string_are_repaired() -> None:
    """A question copied with its own double quotes unescaped stays one string, closed or unclosed; a quote that
    JSON could end a string at (`,` `:` `}` `]` after it) still ends it."""
    body = '{"name": "search", "arguments": {"query": "who sang "Yesterday" in 1965?", "k": 2}}'
    for text in (f"<tool_call>{body}</tool_call>", f"<tool_call>{body}"):
        turn = parse(text)
        assert turn.errors == [], text
        assert turn.calls[0].arguments == {"query": 'who sang "Yesterday" in 1965?', "k": 2}
    ambiguous = '<tool_call>{"name": "search", "arguments": {"query": "is "A", or B?"}}</tool_call>'
    assert kinds(parse(ambiguous)) == ["bad_json"]


def test_other_bad_json() -> None:
    """Anything beyond the three repairs is bad_json, and nothing runs."""
    for body in [
        '{"name": "search", "arguments": {query: "x"}}',
        '{"name": "search"',
        "search(query='x')",
        "",
    ]:
        turn = parse(f"<tool_call>{body}</tool_call>")
        assert turn.calls == [] and kinds(turn) == ["bad_json"], body


def test_call_that_is_not_an_object() -> None:
    """JSON that is not an object (a list, a string) is bad_json."""
    for body in ['["search", {"query": "x"}]', '"search"', "null"]:
        assert kinds(parse(f"<tool_call>{body}</tool_call>")) == ["bad_json"], body


def test_arguments_as_json_string_are_decoded() -> None:
    """OpenAI-style `arguments` given as a JSON string holding an object are decoded."""
    args = json.dumps({"video": "v1.mp4", "question": "who?"})
    turn = parse(
        json.dumps({"name": "video_summary", "arguments": args}).join(["<tool_call>", "</tool_call>"])
    )
    assert turn.errors == [] and turn.calls[0].arguments == {"video": "v1.mp4", "question": "who?"}


def test_missing_arguments_means_empty() -> None:
    """A call without `arguments` is a call with no arguments (the server reports missing required fields)."""
    assert parse('<tool_call>{"name": "search"}</tool_call>').calls[0].arguments == {}


def test_missing_name() -> None:
    """A call without a string name is missing_name."""
    for body in ['{"arguments": {"query": "x"}}', '{"name": 3, "arguments": {}}', '{"name": null}']:
        assert kinds(parse(f"<tool_call>{body}</tool_call>")) == ["missing_name"], body


def test_arguments_not_an_object() -> None:
    """Arguments that are a list, a number, or a string that is not an object are bad_arguments."""
    for args in ["[1, 2]", "5", '"query=x"', '"[1]"']:
        text = f'<tool_call>{{"name": "search", "arguments": {args}}}</tool_call>'
        assert kinds(parse(text)) == ["bad_arguments"], args


def test_unclosed_call_with_complete_json_is_accepted() -> None:
    """A call cut at `</tool_call>` by a sampler stop string still runs when its body is one complete object."""
    turn = parse('<tool_call>{"name": "search", "arguments": {"query": "x"}}\n')
    assert turn.errors == [] and turn.calls[0].arguments == {"query": "x"}


def test_unclosed_call_with_repairable_json_is_accepted() -> None:
    """The repair step also applies to a call whose closing tag the sampler dropped."""
    turn = parse("<tool_call>{'name': 'search', 'arguments': {'query': 'x',},}")
    assert turn.errors == [] and turn.calls[0].arguments == {"query": "x"}


def test_tags_inside_json_strings() -> None:
    """Tag text inside a JSON string is data: it neither closes the call nor opens a new one."""
    args = {"query": "what is </tool_call> or <answer>?"}
    turn = parse(f'<tool_call>{{"name": "search", "arguments": {json.dumps(args)}}}</tool_call>')
    assert turn.errors == [] and turn.answer is None and turn.calls[0].arguments == args


def test_unclosed_call_with_incomplete_json() -> None:
    """A truncated call body without a closing tag is unclosed_tag and does not run."""
    turn = parse('<tool_call>{"name": "search", "arguments": {"query": "x"')
    assert turn.calls == [] and kinds(turn) == ["unclosed_tag"]


def test_unclosed_call_before_another_call() -> None:
    """An unclosed call ends at the next <tool_call>; the next call still parses."""
    turn = parse(
        '<tool_call>{"name": "search", "arguments": {"q'
        '<tool_call>{"name": "search", "arguments": {"query": "y"}}</tool_call>'
    )
    assert kinds(turn) == ["unclosed_tag"] and [c.arguments for c in turn.calls] == [{"query": "y"}]


def test_text_after_call_is_ignored() -> None:
    """Chatter after a call (outside or before its closing tag) is ignored, not an error."""
    for text in [
        '<tool_call>{"name": "search", "arguments": {"query": "x"}}</tool_call> I will wait. </tool_call>',
        '<tool_call>{"name": "search", "arguments": {"query": "x"}} then wait</tool_call>',
    ]:
        turn = parse(text)
        assert [c.arguments for c in turn.calls] == [{"query": "x"}] and turn.errors == [], text


def test_empty_output() -> None:
    """Empty or whitespace-only output is the `empty` error."""
    for text in ["", "  \n\t"]:
        turn = parse(text)
        assert turn.calls == [] and turn.answer is None and kinds(turn) == ["empty"]


def test_text_without_tags() -> None:
    """Prose without any tag is no_action (a turn always yields calls, an answer, or an error)."""
    turn = parse("The answer is probably 42.")
    assert turn.calls == [] and turn.answer is None and kinds(turn) == ["no_action"]


def test_tool_call_inside_answer_is_not_executed() -> None:
    """Inside <answer>, a <tool_call> is answer text: the answer wins and nothing runs."""
    text = '<answer>use <tool_call>{"name": "search", "arguments": {}}</tool_call> next time</answer>'
    turn = parse(text)
    assert turn.calls == [] and turn.errors == []
    assert turn.answer == 'use <tool_call>{"name": "search", "arguments": {}}</tool_call> next time'


def test_calls_and_answer_in_one_turn() -> None:
    """With valid calls in the turn, the calls run and the answer is dropped with answer_ignored."""
    for text in [
        '<tool_call>{"name": "search", "arguments": {"query": "x"}}</tool_call><answer>42</answer>',
        '<answer>42</answer><tool_call>{"name": "search", "arguments": {"query": "x"}}</tool_call>',
    ]:
        turn = parse(text)
        assert len(turn.calls) == 1 and turn.answer is None and kinds(turn) == ["answer_ignored"], text


def test_answer_with_only_invalid_calls_stands() -> None:
    """An answer ends the episode when the turn's calls are all invalid; the call errors are still reported."""
    turn = parse('<tool_call>{"name": "nope"}</tool_call><answer>42</answer>')
    assert turn.answer == "42" and turn.calls == [] and kinds(turn) == ["unknown_tool"]


def test_unclosed_answer_takes_rest_of_text() -> None:
    """An answer cut at `</answer>` by a sampler stop string is the rest of the text."""
    assert parse("Done. <answer>Paris, France\n").answer == "Paris, France"


def test_only_first_answer_counts() -> None:
    """A second <answer> block is ignored."""
    assert parse("<answer>a</answer> <answer>b</answer>").answer == "a"


def test_deep_nesting_is_bad_json_not_a_crash() -> None:
    """Pathologically nested JSON is reported as bad_json instead of raising RecursionError."""
    turn = parse("<tool_call>" + "[" * 200_000 + "</tool_call>")
    assert kinds(turn) == ["bad_json"]


@st.composite
def json_values(draw: st.DrawFn) -> object:
    leaves = st.none() | st.booleans() | st.integers() | st.text(max_size=12)
    return draw(
        st.recursive(
            leaves,
            lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids, max_size=3),
            max_leaves=8,
        )
    )


@settings(max_examples=150, deadline=None)
@given(
    name=st.sampled_from(sorted(TOOLS)),
    arguments=st.dictionaries(st.text(max_size=8), json_values(), max_size=4),
)
def test_written_calls_round_trip(name: str, arguments: dict[str, object]) -> None:
    """Any call serialised with json.dumps inside the tags parses back to the same name and arguments."""
    turn = parse("<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>")
    assert turn.errors == [] and [(c.name, c.arguments) for c in turn.calls] == [(name, arguments)]


FRAGMENTS = [
    "<tool_call>",
    "</tool_call>",
    "<answer>",
    "</answer>",
    "{",
    "}",
    "[",
    "]",
    '"name"',
    '"search"',
    ":",
    ",",
    "'",
    '"',
    "\\",
    " ",
    '"arguments"',
    "null",
]


@settings(max_examples=400, deadline=None)
@given(text=st.text() | st.lists(st.sampled_from(FRAGMENTS) | st.text(max_size=3), max_size=40).map("".join))
def test_parse_never_raises(text: str) -> None:
    """parse_completion never raises and always yields calls, an answer, or at least one error."""
    turn = parse(text)
    assert turn.calls or turn.answer is not None or turn.errors
    assert all(c.name in TOOLS and isinstance(c.arguments, dict) for c in turn.calls)
    assert not (turn.calls and turn.answer is not None)
