"""One corpus_qa episode as one record: what the policy answered, how it scored, what it searched and read, and
where it went wrong. Pure: a task, its episode and the text of its supporting pages in, a dict out.

    record(task, episode, pages={"Tinted_Windows_band.md": "# Tinted Windows (band)\\n\\n..."}) -> dict

Hop 1 and hop 2 are the question's two supporting pages: the pages of MuSiQue's decomposed hops in hop order,
else HotpotQA's supporting titles in the order its supporting facts name them (for a bridge question usually,
not always, the bridge page first): `training.rewards.supporting_pages`. A page counts as read when a page_qa
call came back ok with the page's file at the end of the URL it opened (`training.rewards.pages_read`, what
training's evidence-recall reward counts), and as shown when a search that came back ok listed it among its
hits. The answer pages are the supporting pages whose text holds the gold answer
(`training.rewards.contains_evidence`); when none does (yes/no, or a gold worded otherwise than its page) both
supporting pages are, and then both must be read.

The category is the first of these that holds, in this order:
    infra_failed          the tools failed (stop reason infra_failed): not the policy's doing, left out of scores
    right                 the answer is an exact match of the gold (SQuAD normalisation)
    no_read               no page_qa call came back ok: nothing was read
    answer_not_from_read  a read's answer holds the gold (as whole tokens), but the final answer is not it: the
                          evidence reached the policy, which answered something else (or nothing)
    reader_missed         the answer page was read (one holding the gold; both supporting pages when none does),
                          yet no read answered with the gold: page_qa missed it or was asked another question
    no_second_search      the answer page was not read, the question has two hops and at most one search was made
    wrong_hit_read        the answer page was not read but a search showed it: a wrong hit was read instead
    not_retrieved         the answer page was not read and no search showed it
Each check assumes the ones before it failed, so each miss has exactly one category: the latest stage of
search -> read -> page_qa's answer -> final answer that went wrong.

The second search, where there is one, is what a bridge needs written from the first read: `from_read` when its
query holds an answer a read returned before it (not "not in the page"), `copied` when it repeats the first
query (case and spaces aside), else `other`; None without a second search. A repeated call is one the turn
reward counts as a repeat (`training.step.turn_facts`): its tool and arguments, case and spaces of its strings
aside, an earlier call of the episode had already made, and the tool did not refuse its arguments (a refused call
is malformed instead). The tools answer it the same, so it reads nothing new (a copied second search is one; a
greedy policy that repeats itself runs out of turns).
"""

from __future__ import annotations

from collections.abc import Mapping

from conductor.answers import exact_match, token_f1
from main_agent.types import Episode, ToolResult
from subagents.page_qa import NOT_FOUND
from training.evaluate import CALL_ERRORS
from training.rewards import contains_evidence, ending_with, pages_read, supporting_pages
from training.step import turn_facts
from training.tasks import Task

CATEGORIES = (
    "infra_failed",
    "right",
    "no_read",
    "answer_not_from_read",
    "reader_missed",
    "no_second_search",
    "wrong_hit_read",
    "not_retrieved",
)
"""Every category, in the order they are checked (see the module docstring)."""


def _ok(episode: Episode, tool: str) -> list[ToolResult]:
    return [r for turn in episode.turns for r in turn.results if r.name == tool and r.ok]


def _read_answers(episode: Episode) -> list[str]:
    return [str((r.payload or {}).get("answer") or "") for r in _ok(episode, "page_qa")]


def second_search(episode: Episode) -> str | None:
    """How the episode's second search came about (see the module docstring), or None without one."""
    queries, answers = [], []
    for turn in episode.turns:
        for call, result in zip(turn.calls, turn.results, strict=False):
            if call.name == "search" and result.ok:
                queries.append(" ".join(str(call.arguments.get("query", "")).lower().split()))
            if len(queries) == 2:
                if any(a.lower() in queries[1] for a in answers):
                    return "from_read"
                return "copied" if queries[1] == queries[0] else "other"
            if call.name == "page_qa" and result.ok:
                answer = str((result.payload or {}).get("answer") or "")
                answers += [answer] if answer and answer != NOT_FOUND else []
    return None


def repeated_calls(episode: Episode, task: Task) -> int:
    """Calls the turn reward counts as repeats (see the module docstring)."""
    return sum(facts.n_repeated for facts in turn_facts(episode, task))


def record(task: Task, episode: Episode, *, pages: Mapping[str, str]) -> dict:
    """The record of `episode` played on `task`; `pages` maps each supporting page's file name to its text."""
    assert episode.task_id == task.task_id, f"episode of {episode.task_id} given task {task.task_id}"
    support = supporting_pages(task)
    hits = [hit for r in _ok(episode, "search") for hit in (r.payload or {}).get("hits") or []]
    read, shown = pages_read(episode, support), ending_with([str(h.get("url", "")) for h in hits], support)
    answer, gold = episode.answer, task.reference
    holding = [page for page in support if contains_evidence(pages[page], gold)]
    facts = {
        "answer_pages": holding or support,
        "answer_read": bool(set(holding) & read) if holding else set(support) <= read,
        "read_gold": any(contains_evidence(a, gold) for a in _read_answers(episode)),
        "searches": sum(c.name == "search" for turn in episode.turns for c in turn.calls),
        "two_hop": len(support) >= 2,
    }
    return {
        "task_id": task.task_id,
        "question": task.question,
        "answer": answer,
        "gold": gold,
        "em": exact_match(answer or "", gold),
        "f1": token_f1(answer or "", gold),
        "searches": facts["searches"],
        "reads": sum(c.name == "page_qa" for turn in episode.turns for c in turn.calls),
        "calls": episode.num_calls,
        "tool_errors": sum(not r.ok for turn in episode.turns for r in turn.results),
        "tool_results": sum(len(turn.results) for turn in episode.turns),
        "invalid_calls": sum(e.kind in CALL_ERRORS for turn in episode.turns for e in turn.parse_errors),
        "two_hop": facts["two_hop"],
        "hop1_read": len(support) > 0 and support[0] in read,
        "hop2_read": len(support) > 1 and support[1] in read,
        "read_answers": _read_answers(episode),
        "second_search": second_search(episode),
        "repeated_calls": repeated_calls(episode, task),
        "stop_reason": episode.stop_reason,
        "category": category(episode, answer=answer, gold=gold, read=read, shown=shown, **facts),
    }


def category(
    episode: Episode,
    *,
    answer: str | None,
    gold: str,
    read: set[str],
    shown: set[str],
    answer_pages: list[str],
    answer_read: bool,
    read_gold: bool,
    searches: int,
    two_hop: bool,
) -> str:
    """The first category of CATEGORIES that holds (the module docstring defines each)."""
    if episode.stop_reason == "infra_failed":
        return "infra_failed"
    if exact_match(answer or "", gold):
        return "right"
    if not _ok(episode, "page_qa"):
        return "no_read"
    if read_gold:
        return "answer_not_from_read"
    if answer_read:
        return "reader_missed"
    if two_hop and searches <= 1:
        return "no_second_search"
    if (set(answer_pages) - read) & shown:
        return "wrong_hit_read"
    return "not_retrieved"
