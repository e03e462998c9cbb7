"""Evaluation reports on a scripted policy and a fake tool server (no weights, no network)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from conductor.settings import ConfigError
from main_agent.types import Episode, ToolCall, ToolResult, Turn
from tests.fakes import ByteChatTokenizer, ScriptedPolicy, call_text, fake_tool_server, ok_result
from tool_server.client import ToolClient
from training.evaluate import (
    EvalConfig,
    evaluate_policy,
    evidence_read,
    format_table,
    load_eval_config,
    summarise,
)
from training.tasks import Task, TaskMeta

FRANCE = Task("t-france", "multihop_pages", "What is the capital of France?", ("search",), "Paris")
HAMLET = Task("t-hamlet", "multihop_pages", "Who wrote Hamlet?", ("page_qa",), "William Shakespeare")


def reply(history: str, turn: int) -> str:
    """France: one search, then the right answer. Hamlet: bad JSON, a page_qa call that fails, a wrong answer."""
    done = history.count("</tool_response>")  # the system prompt names the opening tag only
    if "France" in history:
        return call_text("search", query="capital of France") if done == 0 else "<answer>Paris</answer>"
    if done == 0:
        return "<tool_call>{not json</tool_call>"
    if "page_qa:" not in history:
        return call_text("page_qa", url="http://pages.test/hamlet", question="author?")
    return "<answer>Christopher Marlowe</answer>"


async def handler(name: str, arguments: dict[str, object]) -> dict[str, object]:
    if name == "page_qa":
        error = {"kind": "fetch_failed", "message": "the page did not load", "retryable": True}
        return {
            **ok_result("error (fetch_failed): the page did not load", tokens_read=0),
            "ok": False,
            "error": error,
        }
    return ok_result("Paris is the capital of France.", tokens_read=120)


async def run_eval(tasks: list[Task], cfg: EvalConfig | None = None) -> tuple:
    cfg = cfg or EvalConfig(max_concurrent_episodes=2)
    policy = ScriptedPolicy(reply, ByteChatTokenizer())
    async with ToolClient("http://tools", transport=fake_tool_server(handler), deadline_s=5.0) as tools:
        return await evaluate_policy(policy, policy.tokenizer, tasks, tools=tools, cfg=cfg, label="scripted")


async def test_report_counts_success_format_calls_errors_and_tokens():
    """Every measure of the report matches what the scripted episodes did."""
    report, episodes = await run_eval([FRANCE, HAMLET])
    assert [e.answer for e in episodes] == ["Paris", "Christopher Marlowe"]
    assert [e.reward for e in episodes] == [1.0, 0.0]  # the episodes file carries what the report scored
    assert (report.n, report.n_infra_failed, report.success_rate) == (2, 0, 0.5)
    assert report.mean_reward == 0.5  # token F1: 1 for Paris, 0 for a disjoint name
    assert report.format_validity == 4 / 5  # France 2 clean turns; Hamlet 1 bad turn of 3
    assert report.calls_per_tool == {"page_qa": 0.5, "search": 0.5}
    assert report.tool_error_rate == 0.5
    assert report.answer_rate == 1.0
    assert report.valid_call_rate == 1 / 3  # search served; the bad JSON call and the failed page_qa are not
    lengths = sorted(e.context_tokens for e in episodes)
    assert report.main_tokens_mean == sum(lengths) / 2 and report.main_tokens_median == sum(lengths) / 2
    assert report.subagent_tokens_read == 60.0
    assert report.mean_turns == 2.5 and report.stop_reasons == {"answer": 2}
    assert report.tasks == "multihop_pages" and report.policy == "scripted"


async def test_episodes_come_back_in_task_order_whatever_finishes_first():
    """The i-th episode belongs to the i-th task, so reports pair answers with the right references."""
    _, episodes = await run_eval([HAMLET, FRANCE, HAMLET])
    assert [e.task_id for e in episodes] == ["t-hamlet", "t-france", "t-hamlet"]


async def test_samples_play_each_task_that_many_times_and_score_them_all():
    """With samples = 3 every task is played 3 times, its episodes together in task order, and every measure is
    over all 6 episodes (the sampler's success on the split, not one draw's)."""
    cfg = load_eval_config(None, ["samples=3", "sampling.temperature=1.15", "max_concurrent_episodes=4"])
    report, episodes = await run_eval([HAMLET, FRANCE], cfg)
    assert [e.task_id for e in episodes] == ["t-hamlet"] * 3 + ["t-france"] * 3
    assert (report.n, report.success_rate, report.answer_rate) == (6, 0.5, 1.0)
    assert report.calls_per_tool == {"page_qa": 0.5, "search": 0.5}


def test_samples_of_a_greedy_policy_are_refused():
    """samples > 1 at temperature 0 would score one episode several times: a clear error, not a silent repeat;
    samples < 1 too."""
    with pytest.raises(ConfigError, match="temperature > 0 with samples > 1"):
        load_eval_config(None, ["samples=4"])
    with pytest.raises(ConfigError, match="samples >= 1"):
        load_eval_config(None, ["samples=0", "sampling.temperature=1.0"])
    assert load_eval_config(None, ["samples=4", "sampling.temperature=1.15"]).samples == 4


def episode(task_id: str, *, stop_reason: str, answer: str | None) -> Episode:
    return Episode(task_id, "q", [1, 2, 3], [], answer, stop_reason, 0, 0.0, 0.0, 0.0)  # type: ignore[arg-type]


def test_infrastructure_failures_are_counted_but_not_scored():
    """An episode the tool server failed is excluded from success and reward instead of scoring 0."""
    failed = episode("t-hamlet", stop_reason="infra_failed", answer=None)
    report = summarise(
        [FRANCE, HAMLET],
        [episode("t-france", stop_reason="answer", answer="Paris"), failed],
        policy="p",
        wall_s=1.0,
    )
    assert (report.n, report.n_infra_failed, report.success_rate, report.mean_reward) == (2, 1, 1.0, 1.0)
    assert report.stop_reasons == {"answer": 1, "infra_failed": 1}
    assert math.isnan(report.format_validity) and math.isnan(report.tool_error_rate)  # no turns, no calls
    assert report.answer_rate == 1.0 and math.isnan(report.valid_call_rate)  # over the played episodes


async def test_report_serialises_and_tabulates_side_by_side():
    """to_json round-trips through json; the table has one column per report and every tool row."""
    report, _ = await run_eval([FRANCE, HAMLET])
    assert json.loads(report.to_json())["success_rate"] == 0.5
    table = format_table([report, report])
    assert "success rate" in table and table.count("0.500") >= 4
    assert "calls/episode page_qa" in table and "calls/episode search" in table
    assert len({len(line) for line in table.splitlines()}) == 1  # aligned columns


async def test_tool_session_readies_a_mixed_task_list(shared_data, tmp_path):
    """Multihop tasks get their loopback page lines and the pages are served; a plate task in the same list keeps
    its image line (the session must not blank other families' context)."""
    import httpx

    from tool_server.embedded import ToolAccess
    from training import tasks as task_data
    from training.play import tool_session

    multihop = task_data.load_family("multihop_pages", "dev", data_dir=shared_data, limit=1)
    plates = task_data.load_family("plate_reading", "dev", data_dir=shared_data, limit=1)
    tasks = [*multihop, *plates]
    session = tool_session(
        tasks, work_dir=tmp_path, access=ToolAccess(), data_dir=shared_data, transport=fake_tool_server()
    )
    async with session as (_, ready):
        pages = [a.source for a in ready[0].attachments]
        assert len(pages) == len(multihop[0].meta.page_titles) and pages[0].startswith("http://127.0.0.1:")
        assert ready[0].context.splitlines()[0] == ready[0].attachments[0].line
        async with httpx.AsyncClient() as http:
            assert "<h1>" in (await http.get(pages[0])).text
    assert ready[1].context == plates[0].context and ready[1].context.startswith("Image: img_")


def read_turn(*urls_ok: tuple[str, bool]) -> Turn:
    """A turn of page_qa calls, each reading `url` with or without error."""
    calls = [ToolCall("page_qa", {"url": "d_000000", "question": "q"}, "") for _ in urls_ok]
    results = [
        ToolResult("page_qa", ok, "", None if ok else "fetch_failed", 1.0, 1, 1, False, {"url": url})
        for url, ok in urls_ok
    ]
    return Turn([1], [0.0], [2], "", "", calls, results, [], 0, 0.0, 0.0)


def test_evidence_read_counts_a_served_read_of_a_supporting_page():
    """A page task's episode read its evidence when page_qa served a supporting page (every listed page when
    none is marked); a failed read, another page or a task with no pages does not count (None: not a page
    task)."""
    pages = TaskMeta(supporting_titles=("B",), page_titles=("A", "B"), page_paths=("t/0.html", "t/1.html"))
    task = Task("t", "multihop_pages", "q", ("page_qa",), "x", "", pages)
    played = episode("t", stop_reason="answer", answer="x")
    assert evidence_read(task, dataclasses.replace(played, turns=[read_turn(("http://h/t/1.html", True))]))
    assert not evidence_read(
        task, dataclasses.replace(played, turns=[read_turn(("http://h/t/1.html", False))])
    )
    assert not evidence_read(
        task, dataclasses.replace(played, turns=[read_turn(("http://h/t/0.html", True))])
    )
    source = Task(
        "r",
        "research_corpus",
        "q",
        ("page_qa",),
        "x",
        "",
        TaskMeta(page_titles=("s",), page_paths=("s.html",)),
    )
    assert evidence_read(source, dataclasses.replace(played, turns=[read_turn(("file:///c/s.html", True))]))
    assert evidence_read(dataclasses.replace(task, meta=TaskMeta()), played) is None


def test_episodes_in_flight_follow_the_device_unless_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """Evaluation sizes its episodes in flight by training's rule: 8 on a CPU (as before), 256 on an H200-sized
    GPU; a set value stays."""
    import training.config
    from training import evaluate as evaluate_module

    monkeypatch.setattr(evaluate_module, "default_device", lambda: "cpu")
    assert evaluate_module.in_flight(EvalConfig()).max_concurrent_episodes == 8
    monkeypatch.setattr(evaluate_module, "default_device", lambda: "cuda")
    monkeypatch.setattr(training.config, "device_memory_gib", lambda device: 139.8)  # device_sizes asks it
    assert evaluate_module.in_flight(EvalConfig()).max_concurrent_episodes == 256
    assert evaluate_module.in_flight(EvalConfig(max_concurrent_episodes=3)).max_concurrent_episodes == 3
