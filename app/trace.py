"""Episodes -> one self-contained HTML trace: episode > turn > tool call > sub-agent detail, as a collapsible tree.

The page has inline CSS and no script: the tree is nested `<details>`, so it opens in any browser, offline, and can
be attached to a bug report as one file. Every string that came from a task, the policy or a tool server is passed
through `html.escape`, so a completion that writes markup shows as text. Payloads are the tool server's raw JSON and
are read defensively: fields the viewer knows get their own view, everything else is shown as collapsed JSON.
Images appear only when `image_base_url` is given (thumbnails are served by the tool server, not embedded).

Long episodes: a folded episode's turns are cut by a divider where each later segment starts (its prompt's length;
the viewer has no tokenizer, so prompt ids are never decoded), the facts give each segment's tokens, and an item
task's ledger is a collapsed table (item, recorded text, the turn that recorded it last). One-segment episodes
without a ledger render as before, apart from the summary's "segments" column.

    from app.trace import write_html
    from training.metrics import load_episodes
    write_html(load_episodes(Path("rollouts.jsonl")), Path("trace.html"))
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from html import escape
from pathlib import Path

from main_agent.types import Episode, ParseError, Record, ToolCall, ToolResult, Turn

_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222}
details{margin:.25em 0 .25em 1.2em}summary{cursor:pointer}
details.episode{margin-left:0;border-top:1px solid #ccc;padding-top:.4em}
pre{background:#f6f6f6;padding:.5em;white-space:pre-wrap;word-break:break-word;margin:.3em 0}
table{border-collapse:collapse;margin:.4em 0}td,th{border:1px solid #ddd;padding:2px 8px;text-align:left;
vertical-align:top}
.segment{margin:.6em 0 .3em;padding:.2em .4em;border-top:2px dashed #8a8fb0;color:#3a3f66;font-weight:600}
.record{color:#1b5e7f}
.bad{color:#b00020;font-weight:600}.ok{color:#1b7f2a}.muted{color:#777}.facts td:first-child{color:#555}
"""

# Envelope fields the call line already shows (from ToolResult) and fields with a dedicated view below.
_ENVELOPE = {"ok", "error", "latency_ms", "tokens_read", "tokens_returned", "cached", "observation"}
_SCALARS = (
    "answer",
    "quote",
    "title",
    "url",
    "query",
    "image_id",
    "width",
    "height",
    "text",
    "duration_s",
    "covered_s",
    "resolution",
)
_LISTS = {  # payload list field -> the columns shown for each item (dict items; anything else becomes JSON)
    "hits": ("score", "title", "url", "snippet"),
    "frame_texts": ("t_s", "text"),
    "subtitles": ("start_s", "end_s", "text"),
}
_HANDLED = _ENVELOPE | set(_SCALARS) | set(_LISTS) | {"chunks", "thumbnail_url"}


def render_html(
    episodes: Sequence[Episode], *, title: str = "Conductor trace", image_base_url: str | None = None
) -> str:
    """One HTML document for `episodes`; a summary table leads when there are several."""
    head = f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
    parts = [head, f"<style>{_CSS}</style></head><body>", f"<h1>{escape(title)}</h1>"]
    if len(episodes) > 1:
        parts.append(_summary_table(episodes))
    open_one = len(episodes) == 1
    parts += [_episode(ep, i, open_=open_one, image_base_url=image_base_url) for i, ep in enumerate(episodes)]
    parts.append("</body></html>\n")
    return "\n".join(parts)


def write_html(
    episodes: Sequence[Episode],
    path: Path,
    *,
    title: str = "Conductor trace",
    image_base_url: str | None = None,
) -> None:
    """Render `episodes` and write the page to `path` (UTF-8), creating its folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_html(episodes, title=title, image_base_url=image_base_url), encoding="utf-8")


# ---- episode level ----------------------------------------------------------------------------------------------


def _summary_table(episodes: Sequence[Episode]) -> str:
    head = (
        "<tr><th>#</th><th>task</th><th>reward</th><th>stop</th><th>calls</th><th>segments</th>"
        "<th>context tokens</th></tr>"
    )
    rows = [
        f"<tr><td>{i}</td><td>{escape(ep.task_id)}</td><td>{_reward(ep.reward)}</td><td>{_stop(ep)}</td>"
        f"<td>{ep.num_calls}</td><td>{len(ep.segments)}</td><td>{ep.context_tokens:,}</td></tr>"
        for i, ep in enumerate(episodes)
    ]
    return f'<table class="summary">{head}{"".join(rows)}</table>'


def _episode(ep: Episode, index: int, *, open_: bool, image_base_url: str | None) -> str:
    label = (
        f"<b>#{index} {escape(ep.task_id)}</b> · {_stop(ep)} · reward {_reward(ep.reward)} · "
        f"{ep.num_calls} calls · {len(ep.turns)} turns"
    )
    segments, seg_tokens = ep.segments, ep.segment_tokens
    parts = [_facts(_episode_facts(ep, seg_tokens)), _ledger(ep)]
    at = 0  # the next turn's index in the episode
    for number, (prompt, turns) in enumerate(segments, 1):
        if number > 1:  # a segment after the first always starts at a turn (the one carrying its prompt)
            parts.append(
                f'<div class="segment">segment {number} — new prompt: {len(prompt):,} tokens · '
                f"{seg_tokens[number - 1]:,} tokens in this segment</div>"
            )
        for turn in turns:
            folds = at + 1 < len(ep.turns) and bool(ep.turns[at + 1].prompt_ids)
            parts.append(_turn(turn, at, ep.turn_rewards, folds=folds, image_base_url=image_base_url))
            at += 1
    body = "".join(parts)
    return f'<details class="episode"{" open" if open_ else ""}><summary>{label}</summary>{body}</details>'


def _episode_facts(ep: Episode, seg_tokens: list[int]) -> list[tuple[str, str]]:
    per_tool = ", ".join(f"{escape(name)}: {n}" for name, n in sorted(ep.calls_per_tool.items())) or "none"
    facts = [
        ("question", _pre(ep.question)),
        ("answer", _pre(ep.answer) if ep.answer is not None else '<span class="muted">none</span>'),
    ]
    if ep.ledger:
        facts.append(("items recorded", f"{sum(t is not None for t in ep.ledger)} of {len(ep.ledger)}"))
    facts.append(("stop reason", _stop(ep)))
    if ep.infra_error is not None:
        facts.append(("infra error", f'<span class="bad">{escape(ep.infra_error)}</span>'))
    facts += [
        ("reward", _reward(ep.reward)),
        ("wall time", f"{_sec(ep.wall_s)} (policy {_sec(ep.policy_s)}, tools {_sec(ep.tools_s)})"),
    ]
    if len(seg_tokens) > 1:
        per_segment = " / ".join(f"{n:,}" for n in seg_tokens)
        facts.append(("segments", f"{len(seg_tokens)} ({per_segment} tokens)"))
        peak = f"{ep.context_tokens:,} (first prompt {len(ep.prompt_ids):,})"
        facts.append(("peak main-context tokens", peak))
    else:
        facts.append(("main-context tokens", f"{ep.context_tokens:,} (prompt {len(ep.prompt_ids):,})"))
    facts += [
        ("sub-agent tokens read", f"{ep.subagent_tokens_read:,}"),
        ("calls per tool", per_tool),
        ("errors", f"{ep.tool_errors} tool, {ep.num_parse_errors} parse"),
        ("policy version", str(ep.policy_version)),
    ]
    return facts


def _ledger(ep: Episode) -> str:
    """The final ledger of an item task as a collapsed table; "" for a single-answer task."""
    if not ep.ledger:
        return ""
    last: dict[int, int] = {}  # item -> index of the last turn that recorded it
    times: dict[int, int] = {}
    for index, turn in enumerate(ep.turns):
        for record in turn.records:
            last[record.item] = index
            times[record.item] = times.get(record.item, 0) + 1
    dash = '<span class="muted">—</span>'
    rows = []
    for item, text in enumerate(ep.ledger, 1):
        shown = dash if text is None else escape(text)
        where = dash if item not in last else str(last[item])
        if times.get(item, 0) > 1:
            where += f' <span class="muted">({times[item]} records)</span>'
        rows.append(f"<tr><td>{item}</td><td>{shown}</td><td>{where}</td></tr>")
    recorded = sum(text is not None for text in ep.ledger)
    table = (
        '<table class="ledger"><tr><th>item</th><th>recorded</th><th>last recorded in turn</th></tr>'
        + "".join(rows)
        + "</table>"
    )
    return _collapsed(f"ledger: {recorded} of {len(ep.ledger)} items recorded", table)


# ---- turn and call level ----------------------------------------------------------------------------------------


def _turn(
    turn: Turn, index: int, turn_rewards: list[float], *, folds: bool = False, image_base_url: str | None
) -> str:
    """One turn; `folds`: the next turn opens a segment, so this turn's observation went into that prompt."""
    names = ", ".join(escape(c.name) for c in turn.calls) or "no calls"
    label = (
        f"turn {index} · v{turn.policy_version} · {names} · policy {_sec(turn.policy_s)} · "
        f"tools {_sec(turn.tools_s)} · {len(turn.completion_ids)} tokens"
    )
    if index < len(turn_rewards):
        label += f" · turn reward {turn_rewards[index]:.3f}"
    if turn.records:
        label += f" · {len(turn.records)} record(s)"
    if turn.parse_errors:
        label += f' · <span class="bad">{len(turn.parse_errors)} parse error(s)</span>'
    parts = [f"<div>completion</div>{_pre(turn.completion_text)}"]
    parts += [_record(r) for r in turn.records]
    parts += [_parse_error(e) for e in turn.parse_errors]
    parts += [
        _call(c, r, image_base_url=image_base_url) for c, r in zip(turn.calls, turn.results, strict=True)
    ]
    if folds:
        appended = "observation (not appended: it went into the next segment's prompt)"
    else:
        appended = f"appended after the completion ({len(turn.observation_ids)} tokens)"
    parts.append(_collapsed(appended, _pre(turn.observation_text)))
    return f'<details class="turn"><summary>{label}</summary>{"".join(parts)}</details>'


def _record(record: Record) -> str:
    return f'<div class="record">recorded {record.item}: {escape(record.text)}</div>'


def _parse_error(err: ParseError) -> str:
    return f'<div class="bad">parse error {escape(err.kind)}: {escape(err.message)}</div>{_pre(err.raw)}'


def _call(call: ToolCall, result: ToolResult, *, image_base_url: str | None) -> str:
    status = (
        '<span class="ok">ok</span>'
        if result.ok
        else f'<span class="bad">{escape(str(result.error_kind))}</span>'
    )
    label = (
        f"<b>{escape(call.name)}</b> · {status} · {result.latency_ms:.0f} ms · "
        f"tokens read {result.tokens_read:,} / returned {result.tokens_returned:,}"
        + (" · cached" if result.cached else "")
    )
    parts = [
        "<div>arguments</div>" + _pre(json.dumps(call.arguments, indent=2, ensure_ascii=False)),
        "<div>observation (what the policy read)</div>" + _pre(result.observation),
        _collapsed("call as written", _pre(call.raw)),
        _payload(result.payload, image_base_url=image_base_url),
    ]
    return f'<details class="call"><summary>{label}</summary>{"".join(parts)}</details>'


# ---- sub-agent detail (the raw payload) -------------------------------------------------------------------------


def _payload(payload: dict[str, object] | None, *, image_base_url: str | None) -> str:
    if not payload:
        return '<div class="muted">no payload</div>'
    parts = [_facts([(k, _pre(_text(payload[k]))) for k in _SCALARS if payload.get(k) not in (None, "")])]
    parts.append(_image(payload, image_base_url))
    parts.append(_chunks(payload.get("chunks")))
    parts += [_items(key, payload[key], cols) for key, cols in _LISTS.items() if payload.get(key)]
    other = {k: v for k, v in payload.items() if k not in _HANDLED}
    if other:
        parts.append(_collapsed("other fields", _pre(json.dumps(other, indent=2, ensure_ascii=False))))
    return f'<details class="detail" open><summary>sub-agent detail</summary>{"".join(parts)}</details>'


def _image(payload: dict[str, object], image_base_url: str | None) -> str:
    thumb = payload.get("thumbnail_url")
    if image_base_url is None or not isinstance(thumb, str) or not thumb:
        return ""
    alt = escape(_text(payload.get("image_id", "")))
    return f'<div><img src="{escape(image_base_url + thumb)}" alt="{alt}" style="max-width:320px"></div>'


def _chunks(chunks: object) -> str:
    if chunks in (None, "", []):
        return ""
    if not isinstance(chunks, list):
        return _collapsed("chunks", _pre(_text(chunks)), open_=True)
    body = "".join(f"<div>chunk {i}</div>{_pre(_text(c))}" for i, c in enumerate(chunks))
    return _collapsed(f"{len(chunks)} chunks the sub-agent read", body, open_=True)


def _items(key: str, items: object, cols: tuple[str, ...]) -> str:
    if not isinstance(items, list):
        return _collapsed(key, _pre(_text(items)))
    head = "".join(f"<th>{escape(c)}</th>" for c in cols)
    rows = "".join(_item_row(item, cols) for item in items)
    return _collapsed(f"{escape(key)} ({len(items)})", f"<table><tr>{head}</tr>{rows}</table>", open_=True)


def _item_row(item: object, cols: tuple[str, ...]) -> str:
    if not isinstance(item, dict):
        return f'<tr><td colspan="{len(cols)}">{escape(_text(item))}</td></tr>'
    return "<tr>" + "".join(f"<td>{escape(_text(item.get(c, '')))}</td>" for c in cols) + "</tr>"


# ---- small pieces -----------------------------------------------------------------------------------------------


def _facts(rows: list[tuple[str, str]]) -> str:
    """A two-column table; `rows` hold an escaped label and already-rendered HTML."""
    if not rows:
        return ""
    return (
        '<table class="facts">'
        + "".join(f"<tr><td>{escape(k)}</td><td>{v}</td></tr>" for k, v in rows)
        + "</table>"
    )


def _collapsed(label: str, body_html: str, *, open_: bool = False) -> str:
    return f"<details{' open' if open_ else ''}><summary>{label}</summary>{body_html}</details>"


def _pre(text: str) -> str:
    return f"<pre>{escape(text)}</pre>"


def _text(value: object) -> str:
    """A payload value as text: strings as they are, anything else as compact JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _sec(seconds: float) -> str:
    return f"{seconds:.2f} s"


def _reward(reward: float | None) -> str:
    return "—" if reward is None else f"{reward:.3f}"


def _stop(ep: Episode) -> str:
    cls = "bad" if ep.stop_reason == "infra_failed" else "ok" if ep.answer is not None else "muted"
    return f'<span class="{cls}">{escape(ep.stop_reason)}</span>'
