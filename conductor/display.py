"""Terminal view of an episode as it happens: one block per turn, one line per sub-agent call."""

from __future__ import annotations

import json

from rich.console import Console
from rich.panel import Panel
from rich.text import Text

from main_agent.types import Episode, ToolResult, Turn

ARGUMENT_CHARS = 90  # one call's arguments on one line; the full arguments are in --json and the trace
RESULT_CHARS = 110  # one line of each result


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
            self.console.print(Text(f"  {_clip(turn.completion_text, RESULT_CHARS)}", style="dim"))
        self._status.start()

    def close(self) -> None:
        """Stop the spinner (the episode ended early, e.g. on a user error)."""
        self._status.stop()

    def final(self, episode: Episode, sources: list[str]) -> None:
        self._status.stop()
        answer = episode.answer if episode.answer is not None else f"(no answer: {episode.stop_reason})"
        if episode.infra_error:
            answer += f"\ninfrastructure failure: {episode.infra_error}"
        body = Text(answer)
        if sources:
            body.append("\n\nsources:\n" + "\n".join(f"  • {s}" for s in sources), style="dim")
        stats = (
            f"{len(episode.turns)} turns, {episode.num_calls} calls, {episode.context_tokens} context tokens, "
            f"{episode.subagent_tokens_read} read by sub-agents, {episode.wall_s:.1f}s"
        )
        self.console.print(Panel(body, title="answer", subtitle=stats, expand=False))


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
