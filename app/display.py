"""Terminal view of an episode as it happens: one block per turn, one line per sub-agent call."""

from __future__ import annotations

import json
import re

from rich.console import Console
from rich.panel import Panel
from rich.text import Text

from main_agent.types import Episode, ToolResult, Turn

ARGUMENT_CHARS = 90  # one call's arguments on one line; the full arguments are in --json and the trace
RESULT_CHARS = 110  # one line of each result
INDEX_BAR_FILES = 50  # below this a first index takes a few seconds at most: no bar
# An echoed observation, closed or cut off by the token budget: the policy parroting a result, not answering.
_ECHO = re.compile(r"<tool_response>.*?(?:</tool_response>|$)", re.DOTALL)
# The protocol's tags (main_agent.parse, the observation blocks) and chat-template tokens such as <|im_end|>.
_TAG = re.compile(r"</?(?:tool_call|tool_response|answer|record)\b[^<>]*>|<\|[^<>|]*\|>")


class LiveView:
    """Prints each turn as the rollout reports it, then the answer with its sources."""

    def __init__(self, question: str, *, console: Console | None = None) -> None:
        self.console = console or Console()
        self.index = 0
        self.console.print(Panel(Text(question), title="question", expand=False))
        self._status = self.console.status("policy thinking…")
        self._status.start()

    def turn(self, turn: Turn) -> None:
        self.index += 1
        self._status.stop()
        header = f"turn {self.index}  policy {turn.policy_s:.1f}s  tools {turn.tools_s:.1f}s  v{turn.policy_version}"
        self.console.print(Text(header, style="bold cyan"))
        for call, result in zip(turn.calls, turn.results, strict=True):
            args = _clip(json.dumps(call.arguments, ensure_ascii=False), ARGUMENT_CHARS)
            self.console.print(Text.assemble(("  → ", "dim"), (call.name, "bold"), f"({args})"))
            self.console.print(_result_line(result))
        for error in turn.parse_errors:
            self.console.print(Text(f"  ✗ {error.kind}: {error.message}", style="yellow"))
        if not turn.calls and not turn.parse_errors:
            text = shown_answer(turn.completion_text)  # the answer turn: the panel below shows it whole
            self.console.print(Text(f"  {_clip(text, RESULT_CHARS)}", style="dim"))
        self._status.start()

    def close(self) -> None:
        """Stop the spinner (the episode ended early, e.g. on a user error)."""
        self._status.stop()

    def note(self, line: str) -> None:
        """A line of diagnostics (e.g. the cold-start time under -v) above the episode."""
        self.console.print(Text(line, style="dim"))

    def final(self, episode: Episode, sources: list[str]) -> None:
        """The answer as a reader wants it (protocol tags removed; the episode keeps the raw text), its sources
        numbered [1], [2], … and the episode's size in the subtitle."""
        self._status.stop()
        if episode.answer is None:
            body = Text(f"(no answer: {episode.stop_reason})")
        else:
            body = Text(shown_answer(episode.answer) or "(an empty answer)")
            if episode.stop_reason == "last_turn_answer":
                body.append(
                    "\n(its last turn: the turn budget ran out and the answer was asked for)", style="dim"
                )
        if episode.infra_error:
            body.append(f"\ninfrastructure failure: {episode.infra_error}")
        if sources:
            numbered = (f"  [{i}] {source}" for i, source in enumerate(sources, start=1))
            body.append("\n\nsources:\n" + "\n".join(numbered), style="dim")
        stats = (
            f"{len(episode.turns)} turns, {episode.num_calls} calls, {episode.context_tokens} context tokens, "
            f"{episode.subagent_tokens_read} read by sub-agents, {episode.wall_s:.1f}s"
        )
        self.console.print(Panel(body, title="answer", subtitle=stats, expand=False))


def shown_answer(text: str) -> str:
    """`text` without protocol tags: echoed `<tool_response>` blocks dropped, other tags removed, tag contents
    kept. If the text was nothing but an echo, the echo's contents are shown rather than nothing."""
    kept = _TAG.sub("", _ECHO.sub("", text)).strip()
    return kept or _TAG.sub("", text).strip()


def _result_line(result: ToolResult) -> Text:
    mark, style = ("✓", "green") if result.ok else ("✗", "red")
    cached = " cached" if result.cached else ""
    timing = f"{result.latency_ms / 1000:.1f}s{cached}"
    return Text.assemble(
        (f"    {mark} ", style), (f"{timing}  ", "dim"), _clip(result.observation, RESULT_CHARS)
    )


def _clip(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


class IndexBar:
    """`progress(done, total)` for search.Corpus.build: a rich bar on stderr, started at the first report of a
    folder with over INDEX_BAR_FILES files (a cached index reports nothing, so shows nothing)."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import Progress

        self._progress = Progress(console=Console(stderr=True), transient=True)
        self._task: int | None = None

    def __call__(self, done: int, total: int) -> None:
        if total <= INDEX_BAR_FILES:
            return
        if self._task is None:
            self._progress.start()
            self._task = self._progress.add_task("indexing the corpus", total=total)
        self._progress.update(self._task, completed=done)  # type: ignore[arg-type]

    def close(self) -> None:
        if self._task is not None:  # stopping a bar never started still writes a blank line
            self._progress.stop()
