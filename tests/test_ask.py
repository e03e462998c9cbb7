"""The research assistant's pure parts: validation, attachment lines, tool subsets, the first-turn opening."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from main_agent.ask import AskError, AskOptions, attachments, first_turn_prefix, offered, validate
from main_agent.parse import parse_completion
from tests.fakes import TOOLS

NAMES = [str(t["function"]["name"]) for t in TOOLS]  # type: ignore[index]


def test_an_attached_page_is_opened_first_and_the_policy_writes_the_question():
    """With --url, the required first call is page_qa on that URL; completing it yields a valid call."""
    opts = AskOptions("Who?", urls=('file:///a "quoted" b.html',))
    prefix = first_turn_prefix(opts, NAMES)
    parsed = parse_completion(prefix + 'Who wrote it?"}}</tool_call>', tool_names=NAMES)
    assert parsed.calls[0].name == "page_qa"
    assert parsed.calls[0].arguments == {"url": 'file:///a "quoted" b.html', "question": "Who wrote it?"}


def test_an_attached_image_is_loaded_first():
    """With --image, the first call loads it; the policy only has to close the call."""
    prefix = first_turn_prefix(AskOptions("Plate?", image=Path("/x/car.jpg")), NAMES)
    call = parse_completion(prefix + '"}}</tool_call>', tool_names=NAMES).calls[0]
    assert call.arguments == {"image": "/x/car.jpg", "op": "load"}


def test_no_attachment_leaves_the_tool_choice_to_the_policy_and_trained_policies_get_no_prefix():
    """Without attachments any call may follow; --no-require-call opens nothing."""
    assert first_turn_prefix(AskOptions("Q"), NAMES) == '<tool_call>{"name": "'
    assert first_turn_prefix(AskOptions("Q", urls=("http://a",), require_call=False), NAMES) == ""
    assert first_turn_prefix(AskOptions("Q", urls=("http://a",)), ["search"]) == '<tool_call>{"name": "'


def test_tool_subset_and_unknown_tools():
    """--tool keeps the named schemas in order; an unknown name is a clear error."""
    assert [s["function"]["name"] for s in offered(TOOLS, ("search",))] == ["search"]  # type: ignore[index]
    assert offered(TOOLS, ()) == TOOLS
    with pytest.raises(AskError, match="nope"):
        offered(TOOLS, ("nope",))


def test_validation_and_attachment_lines(tmp_path):
    """Empty questions and missing files are refused; attachments become absolute 'Image:' / 'Page:' lines."""
    with pytest.raises(AskError, match="empty"):
        validate(AskOptions("  "))
    with pytest.raises(AskError, match="no such file"):
        validate(AskOptions("q", image=tmp_path / "missing.jpg"))
    image = tmp_path / "car.jpg"
    image.write_bytes(b"x")
    opts = validate(AskOptions("q", image=image, urls=("http://a",)))
    assert attachments(opts).splitlines() == ["Page: http://a", f"Image: {image.resolve()}"]
    assert json.loads(json.dumps(str(opts.corpus)))  # the default corpus is an absolute folder
