"""HTML trace viewer (app.trace): content coverage, escaping, well-formed tree, JSONL round trip, long
episodes (segments, ledger, page size)."""

from __future__ import annotations

import dataclasses
import html
import json
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest

from app.trace import render_html, write_html
from main_agent.types import Episode, ParseError, Record, ToolCall, ToolResult, Turn
from training.metrics import load_episodes

XSS = "<script>alert(1)</script>"


def result(
    name: str,
    observation: str,
    payload: dict[str, object],
    *,
    ok: bool = True,
    kind: str | None = None,
    cached: bool = False,
) -> ToolResult:
    envelope = {
        "ok": ok,
        "error": None,
        "latency_ms": 42.0,
        "tokens_read": 300,
        "tokens_returned": 12,
        "cached": cached,
        "observation": observation,
    }
    return ToolResult(name, ok, observation, kind, 42.0, 300, 12, cached, {**envelope, **payload})


def turn(text: str, pairs: list[tuple[ToolCall, ToolResult]], errors: list[ParseError] | None = None) -> Turn:
    return Turn(
        completion_ids=[1, 2, 3],
        completion_logprobs=[-0.1, -0.2, -0.3],
        observation_ids=[7, 8],
        completion_text=text,
        observation_text="<tool_response>appended</tool_response>",
        calls=[c for c, _ in pairs],
        results=[r for _, r in pairs],
        parse_errors=errors or [],
        policy_version=3,
        policy_s=0.5,
        tools_s=1.25,
    )


def call(name: str, **arguments: object) -> ToolCall:
    return ToolCall(name, dict(arguments), f'<tool_call>{{"name": "{name}"}}</tool_call>')


def episodes() -> list[Episode]:
    page = result(
        "page_qa",
        "answer: 330 m | quote: the tower is 330 m",
        {
            "answer": "330 m",
            "quote": "the tower is 330 m",
            "url": "http://x.test/eiffel",
            "title": "Eiffel",
            "chunks": ["CHUNK-ONE about the tower", "CHUNK-TWO <b>bold</b> history"],
            "mystery_field": [1, 2],
        },
    )
    image = result(
        "image_ops",
        "image img-7 640x480; text: EXIT",
        {
            "image_id": "img-7",
            "width": 640,
            "height": 480,
            "thumbnail_url": "/v1/images/img-7",
            "text": "EXIT",
            "boxes": [{"x": 1, "y": 2, "w": 3, "h": 4, "text": "EXIT"}],
        },
    )
    video = result(
        "video_summary",
        "video 1m30s; 2 subtitle cues",
        {
            "answer": "a cat",
            "duration_s": 90.0,
            "subtitles": [{"start_s": 1.0, "end_s": 2.5, "text": "SUB-HELLO"}, "not-a-dict-cue"],
            "frame_texts": [{"t_s": 10.0, "text": "FRAME-TEXT-SALE"}],
        },
        cached=True,
    )
    search = result(
        "search",
        "1. Eiffel — http://x.test/eiffel — tall tower",
        {
            "query": "eiffel height",
            "hits": [
                {"title": "Eiffel", "url": "http://x.test/eiffel", "snippet": "SNIPPET-TALL", "score": 3.5}
            ],
        },
    )
    broken = result(
        "page_qa",
        "error (timeout): page took too long",
        {"error": {"kind": "timeout"}},
        ok=False,
        kind="timeout",
    )
    first = Episode(
        "task-A",
        "How tall is the tower?",
        [1, 2, 3, 4],
        [
            turn("<tool_call>search</tool_call>", [(call("search", query="eiffel height"), search)]),
            turn(
                XSS,
                [
                    (call("page_qa", url="http://x.test/eiffel", question="height?"), page),
                    (call("image_ops", op="ocr", image="http://x.test/sign.png"), image),
                ],
                [ParseError("unknown_tool", "unknown tool 'fly'", '<tool_call>{"name": "fly"}</tool_call>')],
            ),
            turn(
                "<tool_call>video</tool_call>",
                [
                    (call("video_summary", url="http://x.test/v.mp4"), video),
                    (call("page_qa", url="http://slow.test/"), broken),
                ],
            ),
            turn("<answer>330 m</answer>", []),
        ],
        "330 m",
        "answer",
        3,
        4.0,
        1.5,
        2.5,
        reward=0.75,
        turn_rewards=[0.1, 0.2, 0.3, 0.4],
    )
    second = Episode(
        "task-B",
        "What does the sign say?",
        [1, 2],
        [turn("thinking", [])],
        None,
        "infra_failed",
        3,
        0.5,
        0.4,
        0.0,
        infra_error="tool server unreachable: connection refused",
    )
    return [first, second]


class TagBalance(HTMLParser):
    """Checks that every emitted container element is closed in the order it was opened."""

    TRACKED = {"details", "summary", "table", "tr", "td", "th", "div", "pre", "span", "html", "head", "body"}

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.seen: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.seen.add(tag)
        if tag in self.TRACKED:
            self.stack.append(tag)

    def handle_endtag(self, tag: str) -> None:
        if tag in self.TRACKED:
            assert self.stack and self.stack[-1] == tag, f"</{tag}> closes {self.stack[-1:]}"
            self.stack.pop()


def test_every_call_argument_and_observation_shown() -> None:
    """Each call's name, each argument value and each observation the policy read appear in the page."""
    page = html.unescape(render_html(episodes()))
    for ep in episodes():
        for t in ep.turns:
            for c, r in zip(t.calls, t.results, strict=True):
                assert f"<b>{c.name}</b>" in page
                for value in c.arguments.values():
                    assert json.dumps(value) in page
                assert r.observation in page


def test_subagent_detail_shown() -> None:
    """page_qa chunks, video subtitles/frame texts, search hits and unknown payload fields reach the page."""
    page = render_html(episodes())
    for text in (
        "CHUNK-ONE about the tower",
        "CHUNK-TWO &lt;b&gt;bold&lt;/b&gt; history",
        "SUB-HELLO",
        "not-a-dict-cue",
        "FRAME-TEXT-SALE",
        "SNIPPET-TALL",
        "mystery_field",
        "boxes",
        "img-7",
    ):
        assert text in page, text
    assert "<b>bold</b>" not in page


def test_episode_facts_and_summary_table() -> None:
    """Episode facts (reward, stop, infra error, time split, tokens, calls per tool) and a summary row per episode."""
    eps = episodes()
    page = render_html(eps)
    assert page.count('<table class="summary">') == 1
    summary = page.split('<table class="summary">')[1].split("</table>")[0]
    assert summary.count("<tr>") == 1 + len(eps) and "task-A" in summary and "task-B" in summary
    assert "0.750" in summary and "infra_failed" in summary and f"{eps[0].context_tokens:,}" in summary
    assert "tool server unreachable: connection refused" in page
    assert "4.00 s (policy 1.50 s, tools 2.50 s)" in page
    assert "page_qa: 2, search: 1, video_summary: 1" in page.split("calls per tool")[1][:200].replace(
        "image_ops: 1, ", ""
    )
    assert "sub-agent tokens read" in page and f"{eps[0].subagent_tokens_read:,}" in page
    assert "unknown_tool" in page and "timeout" in page and "cached" in page


def test_single_episode_has_no_summary_table() -> None:
    """One episode renders without the summary table and opened."""
    page = render_html(episodes()[:1], title="one")
    assert 'class="summary"' not in page and '<details class="episode" open>' in page


def test_user_text_is_escaped() -> None:
    """A completion, question or title holding markup is shown as text, never as live markup."""
    eps = episodes()
    eps[1].question = XSS
    page = render_html(eps, title=XSS)
    assert "<script" not in page.lower()
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page


def test_images_only_with_base_url() -> None:
    """Thumbnails become <img> under image_base_url; without it only the image id is shown."""
    assert "<img" not in render_html(episodes())
    page = render_html(episodes(), image_base_url="http://127.0.0.1:8000")
    assert '<img src="http://127.0.0.1:8000/v1/images/img-7"' in page


def test_tags_balanced() -> None:
    """The tree's details/summary/table/div elements all close, in order, and the document is complete."""
    parser = TagBalance()
    parser.feed(render_html(episodes(), image_base_url="http://h"))
    parser.close()
    assert parser.stack == []
    assert {"details", "summary", "table", "div", "img"} <= parser.seen
    assert not parser.seen & {"script", "link", "iframe"}


def test_payload_missing_or_odd() -> None:
    """A result without payload, or with payload fields of unexpected types, still renders."""
    odd = ToolResult("page_qa", True, "obs", None, 1.0, 0, 0, False, {"chunks": "not a list", "hits": 5})
    none = ToolResult("search", True, "obs2", None, 1.0, 0, 0, False, None)
    ep = Episode(
        "t",
        "q",
        [],
        [turn("x", [(call("page_qa"), odd), (call("search"), none)])],
        None,
        "max_turns",
        0,
        0.0,
        0.0,
        0.0,
    )
    page = render_html([ep])
    assert "no payload" in page and "not a list" in page


def test_round_trip_via_jsonl(tmp_path: Path) -> None:
    """Episodes written as JSONL load back equal, and write_html produces the same page as render_html."""
    eps = episodes()
    log = tmp_path / "rollouts.jsonl"
    log.write_text("\n".join(ep.to_json() for ep in eps) + "\n\n", encoding="utf-8")
    loaded = load_episodes(log)
    assert loaded == eps
    out = tmp_path / "sub" / "trace.html"
    write_html(loaded, out, title="T")
    assert out.read_text(encoding="utf-8") == render_html(eps, title="T")


@pytest.mark.parametrize("bad", ["{not json", '{"task_id": "x"}', "[1, 2]"])
def test_bad_line_names_line_number(tmp_path: Path, bad: str) -> None:
    """A malformed JSONL line raises ValueError naming its line number."""
    log = tmp_path / "rollouts.jsonl"
    log.write_text(episodes()[0].to_json() + "\n" + bad + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"rollouts\.jsonl:2:"):
        load_episodes(log)


FOLDS = (25, 50, 75)  # turns of the long episode that open a segment
PLATE_COUNT, UNRECORDED = 32, (5, 12, 19, 30)


def long_episode() -> Episode:
    """100 turns in 4 segments of a 32-plate task: 28 plates recorded (plate 3 twice), sizes like a real run."""
    prose = "I zoomed on the rear bumper; the plate reads clearly, moving on to the next photo. " * 4
    obs = "image img-{i} 1024x768; text: plate AB{i:03d}CD | region 412,300 180x60 | confidence high. " * 3
    turns = []
    to_record = [i for i in range(1, PLATE_COUNT + 1) if i not in UNRECORDED] + [3]
    for i in range(100):
        tag = f'<record item="{to_record[i // 3]}">AB{i:03d}CD</record>' if i % 3 == 0 and i < 87 else ""
        records = [Record(to_record[i // 3], f"AB{i:03d}CD", tag)] if tag else []
        payload = {"image_id": f"img-{i}", "text": f"AB{i:03d}CD", "chunks": [prose]}
        t = turn(
            prose + tag,
            [(call("image_ops", op="ocr", image=f"img-{i}"), result("image_ops", obs.format(i=i), payload))],
        )
        ids = list(range(150))
        t = dataclasses.replace(
            t,
            completion_ids=ids,
            completion_logprobs=[-0.5] * len(ids),
            observation_ids=[] if i + 1 in FOLDS else list(range(90)),
            observation_text=obs.format(i=i),
            records=records,
            prompt_ids=list(range(800 + i)) if i in FOLDS else [],
        )
        turns.append(t)
    ledger: list[str | None] = [None] * PLATE_COUNT
    for t in turns:
        for r in t.records:
            ledger[r.item - 1] = r.text
    return Episode(
        "plate_audit-7", "Read all 32 plates.", list(range(1200)), turns, None, "max_turns", 5, 300.0, 120.0,
        180.0, ledger=ledger,
    )  # fmt: skip


def test_long_episode_page_small_with_segments_and_ledger() -> None:
    """A 100-turn, 4-segment, 32-item episode renders well under 1 MB, with 3 dividers, the ledger and records."""
    ep = long_episode()
    page = render_html([ep])
    assert len(page.encode("utf-8")) < 1_000_000, len(page.encode("utf-8"))
    dividers = re.findall(r'<div class="segment">(.*?)</div>', page)
    assert [d.split(" — ")[0] for d in dividers] == ["segment 2", "segment 3", "segment 4"]
    assert dividers[0].startswith("segment 2 — new prompt: 825 tokens")
    assert page.index("turn 24 ·") < page.index('<div class="segment">segment 2') < page.index("turn 25 ·")
    tokens = ep.segment_tokens
    assert len(tokens) == 4
    assert f"4 ({' / '.join(f'{n:,}' for n in tokens)} tokens)" in page
    assert "peak main-context tokens" in page and f"{max(tokens):,}" in page
    assert "<td>items recorded</td><td>28 of 32</td>" in page
    assert page.count("went into the next segment's prompt") == len(FOLDS)


def test_ledger_table_rows() -> None:
    """The ledger is collapsed and lists every item: its text and last recording turn, or "—" for both."""
    ep = long_episode()
    page = render_html([ep])
    assert "<details><summary>ledger: 28 of 32 items recorded</summary>" in page
    table = page.split('<table class="ledger">')[1].split("</table>")[0]
    rows = re.findall(r"<tr><td>(\d+)</td><td>(.*?)</td><td>(.*?)</td></tr>", table)
    assert [int(r[0]) for r in rows] == list(range(1, PLATE_COUNT + 1))
    for item, text, where in rows:
        if int(item) in UNRECORDED:
            assert "—" in text and "—" in where
        else:
            assert text == ep.ledger[int(item) - 1]
    last = max(i for i, t in enumerate(ep.turns) for r in t.records if r.item == 3)
    assert rows[2][1:] == (ep.ledger[2], f'{last} <span class="muted">(2 records)</span>')
    assert f'<div class="record">recorded 3: {ep.ledger[2]}</div>' in page
    assert "reward per item" not in page  # the viewer does not know per-item rewards


def test_one_segment_no_ledger_unchanged() -> None:
    """A single-answer, never-folded episode gets no segment divider, no ledger table, no segment facts."""
    page = render_html(episodes()[:1])
    for absent in (
        'class="segment"',
        'class="ledger"',
        "ledger:",
        "items recorded",
        "peak main-context",
        'class="record"',
        "record(s)",
    ):
        assert absent not in page, absent
    assert "<td>main-context tokens</td>" in page


def test_summary_has_segments_column() -> None:
    """The summary table gives each episode's number of segments."""
    page = render_html([long_episode(), *episodes()])
    summary = page.split('<table class="summary">')[1].split("</table>")[0]
    header = re.findall(r"<th>(.*?)</th>", summary)
    col = header.index("segments")
    rows = [re.findall(r"<td>(.*?)</td>", row) for row in summary.split("<tr>")[2:]]
    assert [row[col] for row in rows] == ["4", "1", "1"]


def test_long_episode_escaped_balanced_and_round_trips(tmp_path: Path) -> None:
    """Record and ledger text with markup is escaped, the long page's tags balance, and JSONL keeps it intact."""
    ep = long_episode()
    first = ep.turns[0]
    ep.turns[0] = dataclasses.replace(first, records=[Record(1, XSS, f'<record item="1">{XSS}</record>')])
    ep.ledger[0] = XSS
    page = render_html([ep])
    assert "<script" not in page.lower() and page.count(html.escape(XSS)) >= 2
    parser = TagBalance()
    parser.feed(page)
    parser.close()
    assert parser.stack == []
    log = tmp_path / "long.jsonl"
    log.write_text(ep.to_json() + "\n", encoding="utf-8")
    assert render_html(load_episodes(log)) == page
