"""The research assistant's pure parts: validation, attachment lines, tool subsets, the first-turn opening."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from main_agent.ask import AskError, AskOptions, attachments, first_turn_prefix, offered, validate
from main_agent.parse import parse_completion
from tests.fakes import TOOLS

NAMES = [str(t["function"]["name"]) for t in TOOLS]  # type: ignore[index]


def test_an_attached_page_is_asked_the_users_question_first():
    """With --url, the opening call is page_qa on that URL with the user's question, complete and valid JSON
    whatever the URL or question contains; what the policy writes after it is ignored."""
    opts = AskOptions('Who wrote "it"?', urls=('file:///a "quoted" b.html',))
    prefix = first_turn_prefix(opts, NAMES)
    parsed = parse_completion(prefix + " I will wait for the page.", tool_names=NAMES)
    assert parsed.errors == [] and len(parsed.calls) == 1
    assert parsed.calls[0].name == "page_qa"
    assert parsed.calls[0].arguments == {"url": 'file:///a "quoted" b.html', "question": 'Who wrote "it"?'}


def test_an_attached_image_is_loaded_and_a_video_asked_first():
    """With --image the opening call loads it; with --video it asks video_summary the question."""
    image = parse_completion(
        first_turn_prefix(AskOptions("Plate?", image=Path("/x/car.jpg")), NAMES), tool_names=NAMES
    )
    assert image.calls[0].arguments == {"op": "load", "image": "/x/car.jpg"}
    video = parse_completion(
        first_turn_prefix(AskOptions("What?", video=Path("/v.mp4")), NAMES), tool_names=NAMES
    )
    assert (video.calls[0].name, video.calls[0].arguments) == (
        "video_summary",
        {"video": "/v.mp4", "question": "What?"},
    )


def test_without_attachments_the_corpus_is_searched_and_trained_policies_get_no_prefix():
    """No attachment: search with the question; no search tool either: only the bare opening, the policy picks
    the tool; --no-require-call opens nothing."""
    search = parse_completion(first_turn_prefix(AskOptions("Q?"), NAMES), tool_names=NAMES)
    assert (search.calls[0].name, search.calls[0].arguments) == ("search", {"query": "Q?"})
    assert first_turn_prefix(AskOptions("Q", urls=("http://a",), require_call=False), NAMES) == ""
    assert first_turn_prefix(AskOptions("Q", urls=("http://a",)), ["image_ops"]) == '<tool_call>{"name": "'


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
