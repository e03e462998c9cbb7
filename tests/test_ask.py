"""The research assistant's pure parts: validation, attachment lines, tool subsets, the first-turn opening, and
the answer panel of its live view."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from app.ask import (
    AskError,
    AskOptions,
    attachments,
    default_tools,
    first_turn_prefix,
    index_corpus,
    offered,
    reader_settings,
    requires_call,
    validate,
)
from app.display import LiveView, shown_answer
from conductor.models import DEFAULT_MODEL, DEFAULT_POLICY
from main_agent.parse import parse_completion
from main_agent.types import Episode
from subagents.handles import file_key, handle_for
from tests.fake_openai_server import Script, create_openai_app, serve, unused_port
from tests.fakes import TOOLS
from tool_server.config import reader_overrides

NAMES = [str(t["function"]["name"]) for t in TOOLS]  # type: ignore[index]
UNTRAINED = DEFAULT_MODEL  # the built-in model: its first turn is forced to call


def test_an_attached_page_is_asked_the_users_question_first():
    """With --url, the opening call is page_qa on the page's handle with the user's question, complete and valid
    JSON whatever the question contains; what the policy writes after it is ignored."""
    url = 'file:///a "quoted" b.html'
    opts = AskOptions('Who wrote "it"?', urls=(url,), policy=UNTRAINED)
    prefix = first_turn_prefix(opts, NAMES)
    parsed = parse_completion(prefix + " I will wait for the page.", tool_names=NAMES)
    assert parsed.errors == [] and len(parsed.calls) == 1
    assert parsed.calls[0].name == "page_qa"
    assert parsed.calls[0].arguments == {"url": handle_for("page", url), "question": 'Who wrote "it"?'}


def test_an_attached_image_is_searched_for_text_and_a_video_asked_first(tmp_path):
    """With --image the opening call is find_text on the image's handle; with --video video_summary is asked
    the question on the clip's handle. Handles come from the files' bytes, so no path reaches the policy."""
    (car := tmp_path / "car.jpg").write_bytes(b"jpeg bytes")
    (clip := tmp_path / "v.mp4").write_bytes(b"mp4 bytes")
    image = parse_completion(
        first_turn_prefix(AskOptions("Plate?", image=car, policy=UNTRAINED), NAMES), tool_names=NAMES
    )
    assert image.calls[0].arguments == {"op": "find_text", "image": handle_for("image", file_key(car))}
    video = parse_completion(
        first_turn_prefix(AskOptions("What?", video=clip, policy=UNTRAINED), NAMES), tool_names=NAMES
    )
    assert (video.calls[0].name, video.calls[0].arguments) == (
        "video_summary",
        {"video": handle_for("video", file_key(clip)), "question": "What?"},
    )
    assert str(tmp_path) not in image.calls[0].arguments["image"] + video.calls[0].arguments["video"]


def test_without_attachments_the_corpus_is_searched_and_trained_policies_get_no_prefix():
    """No attachment: search with the question; no search tool either: only the bare opening, the policy picks
    the tool; --no-require-call opens nothing."""
    search = parse_completion(first_turn_prefix(AskOptions("Q?", policy=UNTRAINED), NAMES), tool_names=NAMES)
    assert (search.calls[0].name, search.calls[0].arguments) == ("search", {"query": "Q?"})
    assert first_turn_prefix(AskOptions("Q", urls=("http://a",), require_call=False), NAMES) == ""
    assert first_turn_prefix(AskOptions("Q", urls=("http://a",), policy=UNTRAINED), ["image_ops"]) == (
        '<tool_call>{"name": "'
    )


def test_the_shipped_policy_writes_its_own_first_call_with_the_tools_it_was_trained_with():
    """The default policy is trained on the call format: no forced opening unless asked for; the tools offered
    by default are the ones its training gave that kind of question (search and page_qa with no attachment)."""
    assert AskOptions("Q").policy == DEFAULT_POLICY and not requires_call(AskOptions("Q"))
    assert requires_call(AskOptions("Q", require_call=True)) and requires_call(
        AskOptions("Q", policy=UNTRAINED)
    )
    assert first_turn_prefix(AskOptions("Q"), NAMES) == ""
    assert default_tools(AskOptions("Q")) == ("search", "page_qa")
    assert default_tools(AskOptions("Q", urls=("http://a",))) == ("page_qa",)
    assert default_tools(AskOptions("Q", image=Path("/x.jpg"))) == ("image_ops",)
    assert default_tools(AskOptions("Q", video=Path("/v.mp4"))) == ("video_summary",)


def test_tool_subset_and_unknown_tools():
    """--tool keeps the named schemas in the server's order whatever order they are named in (training's
    prompts list them so); an unknown name is a clear error."""
    assert [s["function"]["name"] for s in offered(TOOLS, ("search",))] == ["search"]  # type: ignore[index]
    server_order = [str(s["function"]["name"]) for s in TOOLS]  # type: ignore[index]
    both = [s["function"]["name"] for s in offered(TOOLS, ("page_qa", "search"))]  # type: ignore[index]
    assert both == [n for n in server_order if n in ("search", "page_qa")] == ["search", "page_qa"]
    assert offered(TOOLS, ()) == TOOLS
    with pytest.raises(AskError, match="nope"):
        offered(TOOLS, ("nope",))


def test_validation_and_attachment_lines(tmp_path):
    """Empty questions and missing files are refused; attachments are shown as 'Page:' / 'Image:' lines with
    their handles (the same for the same bytes wherever the file lies), never a path."""
    with pytest.raises(AskError, match="empty"):
        validate(AskOptions("  "))
    with pytest.raises(AskError, match="no such file"):
        validate(AskOptions("q", image=tmp_path / "missing.jpg"))
    image = tmp_path / "car.jpg"
    image.write_bytes(b"x")
    opts = validate(AskOptions("q", image=image, urls=("http://a",)))
    elsewhere = tmp_path / "a" / "much" / "longer" / "folder" / "name" / "car.jpg"
    elsewhere.parent.mkdir(parents=True)
    elsewhere.write_bytes(b"x")
    lines = [a.line for a in attachments(opts)]
    assert lines == [
        f"Page: {handle_for('page', 'http://a')}",
        f"Image: {handle_for('image', file_key(image))}",
    ]
    assert attachments(validate(AskOptions("q", image=elsewhere)))[0].line == lines[1]
    assert [a.source for a in attachments(opts)] == ["http://a", str(image.resolve())]
    assert json.loads(json.dumps(str(opts.corpus)))  # the default corpus is an absolute folder


def test_a_local_file_given_as_url_is_a_page_named_by_its_bytes(tmp_path):
    """`--url notes.md` (a local file) becomes a file:// page the in-process tools may read, shown by a handle
    from its bytes and its file name, never its folder; a path that is no file is refused."""
    notes = tmp_path / "deep" / "folder" / "notes.md"
    notes.parent.mkdir(parents=True)
    notes.write_text("# Notes\n\nThe meeting is on Tuesday.\n")
    opts = validate(AskOptions("When is the meeting?", urls=(str(notes),)))
    assert opts.urls == (notes.resolve().as_uri(),)
    [page] = attachments(opts)
    assert (page.source, page.line) == (
        notes.resolve().as_uri(),
        f"Page: {handle_for('page', file_key(notes))} notes.md",
    )
    with pytest.raises(AskError, match="neither a URL nor a file"):
        validate(AskOptions("q", urls=(str(tmp_path / "missing.md"),)))
    assert validate(AskOptions("q", urls=("https://example.org/a",))).urls == ("https://example.org/a",)


def test_index_corpus_warms_the_index_the_in_process_server_loads(tmp_path, monkeypatch):
    """`conductor ask --corpus` indexes the folder before the tools start (with its progress bar); the embedded
    server's search then finds the persistent index and extracts nothing. A folder with nothing to search is a
    one-line AskError naming the file kinds."""
    from subagents import documents, search
    from tool_server.config import ServerConfig
    from tool_server.embedded import embedded_config

    monkeypatch.setenv("CONDUCTOR_HOME", str(tmp_path / "home"))
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "kiln.md").write_text("# Kilns\n\nA kiln fires clay at 1200 degrees.", encoding="utf-8")
    assert len(index_corpus(folder)) == 1
    cfg = embedded_config(ServerConfig(), corpus=folder, persist_index=True).tools["search"].config

    def no_extraction(path, *, url):
        raise AssertionError(f"the server extracted {path} again")

    monkeypatch.setattr(documents, "read_document", no_extraction)
    assert cfg.persist_index and len(search.start(cfg, (str(folder),))) == 1
    (tmp_path / "empty").mkdir()
    with pytest.raises(AskError, match=r"no readable documents \(.*\.pdf"):
        index_corpus(tmp_path / "empty")


def test_conductor_ask_names_the_files_search_skipped(tmp_path, monkeypatch, capsys):
    """A damaged PDF in --corpus costs that file only: `conductor ask` indexes the rest and says, even without
    -v, which file search skipped and why (on stderr, before the episode)."""
    from app.cli_ask import _index_corpus
    from tests.pdf import damaged_pdf

    monkeypatch.setenv("CONDUCTOR_HOME", str(tmp_path / "home"))
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "kiln.md").write_text("# Kilns\n\nA kiln fires clay at 1200 degrees.", encoding="utf-8")
    (folder / "bad.pdf").write_bytes(damaged_pdf())
    _index_corpus(AskOptions(question="What fires clay?", corpus=folder))
    assert capsys.readouterr().err == "search corpus: 1 document; 1 file skipped: bad.pdf (damaged PDF)\n"


def test_a_folder_that_cannot_be_read_is_refused_with_the_fix(tmp_path, monkeypatch):
    """An unreadable --corpus is one AskError naming the folder and what to check (the listing is made to fail:
    as root, chmod 000 does not stop reading)."""

    def denied(folder, **_):
        raise PermissionError(13, "Permission denied", str(folder))

    monkeypatch.setattr("subagents.search.Corpus.build", denied)
    with pytest.raises(AskError, match=r"cannot read it \(Permission denied\); check its permissions"):
        index_corpus(tmp_path)


def test_the_shown_answer_has_no_protocol_tags():
    """Echoed <tool_response> blocks are dropped and other protocol tags removed from what the reader sees; an
    answer that is nothing but an echo shows the echo's text rather than nothing."""
    echoed = "<tool_response>search: 1. GRPO — file:///g.html</tool_response>\nIt returns a quote.<|im_end|>"
    assert shown_answer(echoed) == "It returns a quote."
    assert shown_answer("<answer>LM298AI</answer>") == "LM298AI"
    assert shown_answer("<tool_response>search: 1. GRPO — file:///g.html — The advan") == (
        "search: 1. GRPO — file:///g.html — The advan"
    )
    assert shown_answer("a < b and c > d") == "a < b and c > d"


def test_the_answer_panel_numbers_its_sources():
    """The answer panel shows the cleaned answer and the sources as [1], [2], …; the episode keeps the raw text."""
    raw = "<tool_response>search: …</tool_response> See [1]."
    episode = Episode("ask", "q", [1], [], raw, "answer", 0, 1.0, 1.0, 0.0)
    console = Console(file=io.StringIO(), width=200)
    view = LiveView("q", console=console)
    view.final(episode, ["GRPO <file:///g.html>", "SmolLM2 <file:///s.html>"])
    shown = console.file.getvalue()  # type: ignore[attr-defined]
    assert "See [1]." in shown and "tool_response" not in shown and episode.answer == raw
    assert "[1] GRPO <file:///g.html>" in shown and "[2] SmolLM2 <file:///s.html>" in shown


def test_an_answer_asked_for_on_the_last_turn_says_so():
    """An answer the turn budget forced (stop reason last_turn_answer) is shown with a note that says so; an
    answer the policy chose to give is shown without it."""
    for reason, noted in (("last_turn_answer", True), ("answer", False)):
        episode = Episode("ask", "q", [1], [], "Hugging Face", reason, 0, 1.0, 1.0, 0.0)
        console = Console(file=io.StringIO(), width=200)
        LiveView("q", console=console).final(episode, [])
        shown = console.file.getvalue()  # type: ignore[attr-defined]
        assert "Hugging Face" in shown and ("turn budget ran out" in shown) is noted


def test_sources_are_the_pages_read_and_search_hits_only_when_nothing_was_read():
    """A hit never opened is not a source: after page_qa read one hit, only that page is listed; an episode that
    only searched lists its hits; failed calls list nothing."""
    from app.ask import sources
    from main_agent.types import ToolCall, ToolResult, Turn

    def result(name: str, ok: bool, payload: dict) -> ToolResult:
        return ToolResult(name, ok, "obs", None, 1.0, 0, 0, False, payload)

    def turn(*results: ToolResult) -> Turn:
        calls = [ToolCall(r.name, {}, "") for r in results]
        return Turn([1], [0.0], [], "", "", calls, list(results), [], 0, 0.0, 0.0)

    hits = {"hits": [{"title": "BM25", "url": "file:///b.html"}, {"title": "GRPO", "url": "file:///g.html"}]}
    searched = turn(result("search", True, hits))
    read = turn(result("page_qa", True, {"title": "BM25", "url": "file:///b.html"}))
    failed = turn(result("page_qa", False, {"title": "GRPO", "url": "file:///g.html"}))
    episode = Episode("ask", "q", [1], [searched, read, failed], "0.75", "answer", 0, 1.0, 1.0, 0.0)
    assert sources(episode) == ["BM25 <file:///b.html>"]
    only_search = Episode("ask", "q", [1], [searched], "?", "answer", 0, 1.0, 1.0, 0.0)
    assert sources(only_search) == ["BM25 <file:///b.html>", "GRPO <file:///g.html>"]


def test_reader_url_names_the_model_page_qa_asks_there():
    """--reader-url is checked when the options are: the endpoint's first model unless --reader-model names one,
    handed to the in-process server as [page_qa.model] overrides; refused with --tools-url (whose own TOML says
    who reads) or with nobody answering. --reader-model alone names a built-in model, and only those."""
    with serve(create_openai_app(Script())) as url:
        opts = validate(AskOptions("q", reader_url=url))
        assert opts.reader_model == "fake" and reader_settings(opts) == reader_overrides(url, "fake")
        named = validate(AskOptions("q", reader_url=url, reader_model="big"))
        assert reader_settings(named) == reader_overrides(url, "big")
        with pytest.raises(AskError, match="--reader-url is for the in-process tools"):
            validate(AskOptions("q", reader_url=url, tools_url="http://127.0.0.1:8700"))
    assert reader_settings(validate(AskOptions("q"))) == ()
    with pytest.raises(AskError, match="without --reader-url, one of the built-in models"):
        validate(AskOptions("q", reader_model="big"))
    builtin = validate(AskOptions("q", reader_model="gemma3-270m"))
    assert reader_settings(builtin) == tuple(
        f'{tool}.model.model="gemma3-270m"' for tool in ("page_qa", "video_summary", "image_ops", "search")
    )  # the whole server on the named model: one model in memory
    nobody = f"http://127.0.0.1:{unused_port()}/v1"
    with pytest.raises(AskError, match=f"--reader-url: no OpenAI-compatible endpoint answers at {nobody}"):
        validate(AskOptions("q", reader_url=nobody))


async def test_a_tools_url_that_does_not_answer_fails_before_the_policy_loads(monkeypatch) -> None:
    """--tools-url is checked first: nothing answering there is an AskError naming the URL, and the policy (seconds
    to load) is never loaded for a run that cannot start."""
    from app import ask as ask_module

    def must_not_load(*args, **kwargs):
        raise AssertionError("the policy loaded before the tools were reached")

    monkeypatch.setattr(ask_module, "load_policy", must_not_load)
    url = f"http://127.0.0.1:{unused_port()}"
    with pytest.raises(AskError, match=f"--tools-url {url}"):
        await ask_module.ask(AskOptions("Who founded FFmpeg?", tools_url=url))
