"""benchmarks/studies/research: the per-question record and its failure category on hand-built corpus_qa episodes,
the table's measures, the paired difference and the power calculation (pure; the data test skips without it)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from benchmarks.common.chunks import EXPERT, claim
from benchmarks.studies.research.bench import episodes_file
from benchmarks.studies.research.records import CATEGORIES, record, supporting_pages
from benchmarks.studies.research.second_search_reward import compare
from benchmarks.studies.research.summary import detectable, paired, power, questions_needed, summarise
from main_agent.types import Episode, ToolCall, ToolResult, Turn
from training.metrics import save_rollouts
from training.tasks import Task
from training.tasks.task import TaskMeta

PAGES = {
    "Bridge.md": "# Bridge\n\nThe album Tinted Windows was released by the band Tinted Windows.",
    "Answer.md": "# Answer\n\nTinted Windows first performed in Tulsa, Oklahoma.",
}


def corpus_task(reference: str = "Tulsa") -> Task:
    titles = ("Other", "Bridge", "Answer", "Answer of AB")
    meta = TaskMeta(
        supporting_titles=("Bridge", "Answer"),
        page_titles=titles,
        page_paths=("dev/Other.md", "dev/Bridge.md", "dev/Answer.md", "dev/XAnswer.md"),
        split="dev",
    )
    return Task(
        "corpus-q1",
        "corpus_qa",
        "Where did the band first perform?",
        ("search", "page_qa"),
        reference,
        meta=meta,
    )


def url(name: str) -> str:
    return f"file:///tmp/corpus/dev/{name}"


def search(*names: str, ok: bool = True) -> Turn:
    hits = {"hits": [{"id": f"d_{i}", "url": url(n), "title": n} for i, n in enumerate(names)]}
    return turn(ToolResult("search", ok, "hits", None, 1.0, 0, 0, False, hits))


def read(name: str, answer: str, *, ok: bool = True) -> Turn:
    return turn(
        ToolResult("page_qa", ok, answer, None, 1.0, 0, 0, False, {"url": url(name), "answer": answer})
    )


def turn(*results: ToolResult) -> Turn:
    calls = [ToolCall(r.name, {}, "") for r in results]
    return Turn([1], [0.0], [], "", "", calls, list(results), [], 0, 0.0, 0.0)


def episode(*turns: Turn, answer: str | None = "Boston", stop: str = "answer") -> Episode:
    return Episode("corpus-q1", "q", [1], list(turns), answer, stop, 0, 1.0, 1.0, 0.0)  # type: ignore[arg-type]


def category(
    *turns: Turn, answer: str | None = "Boston", stop: str = "answer", reference: str = "Tulsa"
) -> str:
    return record(corpus_task(reference), episode(*turns, answer=answer, stop=stop), pages=PAGES)["category"]


def test_right_and_infra_failed_come_before_what_was_read():
    """An exact match is `right` whatever was read; an episode the tools failed is `infra_failed` even if right."""
    assert category(answer="tulsa.") == "right"
    assert category(search("Answer.md"), answer="Tulsa", stop="infra_failed") == "infra_failed"


def test_nothing_read_ok_is_no_read():
    """Only a page_qa call that came back ok counts as a read: searches and failed reads give `no_read`."""
    assert category() == "no_read"
    assert category(search("Answer.md"), read("Answer.md", "Tulsa", ok=False)) == "no_read"


def test_a_read_that_returned_the_gold_blames_the_final_answer_before_any_search_check():
    """page_qa answered with the gold (as whole tokens) but the policy answered otherwise: `answer_not_from_read`,
    even with one search on a two-hop question (the evidence reached it); an unanswered episode too."""
    assert category(search("Answer.md"), read("Answer.md", "in Tulsa, Oklahoma")) == "answer_not_from_read"
    assert category(search("Answer.md"), read("Answer.md", "Tulsa"), answer=None) == "answer_not_from_read"
    assert category(search("Answer.md"), read("Answer.md", "Tulsans")) != "answer_not_from_read"


def test_the_answer_page_read_without_the_gold_is_reader_missed():
    """The page holding the gold was read and page_qa answered something else: `reader_missed`, even when the
    bridge page was never read (the answer was on the page it read)."""
    assert category(search("Answer.md"), read("Answer.md", "Oklahoma")) == "reader_missed"


def test_answer_page_unread_on_one_search_is_no_second_search_before_wrong_hit():
    """Two hops, one search, the answer page shown but not read: `no_second_search` (checked before
    `wrong_hit_read`); with a second search it becomes `wrong_hit_read`."""
    first = (search("Bridge.md", "Answer.md"), read("Bridge.md", "Tinted Windows"))
    assert category(*first) == "no_second_search"
    assert category(*first, search("Answer.md")) == "wrong_hit_read"


def test_answer_page_never_shown_is_not_retrieved():
    """Two searches whose hits never listed the answer page (a file whose name merely ends alike does not count):
    `not_retrieved`; a failed search's hits are not shown."""
    turns = (search("Bridge.md"), read("Bridge.md", "Tinted Windows"), search("XAnswer.md", "Other.md"))
    assert category(*turns) == "not_retrieved"
    assert category(*turns, search("Answer.md", ok=False)) == "not_retrieved"


def test_a_gold_on_no_page_needs_both_pages_read():
    """When no supporting page holds the gold (a yes/no answer), reading one page is not enough for
    `reader_missed`: both must be read."""
    one = (search("Bridge.md", "Answer.md"), read("Answer.md", "Tulsa"), search("Bridge.md"))
    assert category(*one, answer="no", reference="yes") == "wrong_hit_read"
    both = (*one, read("Bridge.md", "no"))
    assert category(*both, answer="no", reference="yes") == "reader_missed"


def test_record_counts_calls_and_marks_each_hop_read():
    """The record scores the answer (EM, F1), counts searches and reads, and marks hop 1 (the first supporting
    title) and hop 2 read by the page_qa URLs that came back ok."""
    played = episode(
        search("Bridge.md"), read("Answer.md", "Tulsa"), read("Bridge.md", "x", ok=False), answer="Tulsa OK"
    )
    got = record(corpus_task(), played, pages=PAGES)
    assert supporting_pages(corpus_task()) == ["Bridge.md", "Answer.md"]
    assert (got["searches"], got["reads"], got["tool_errors"], got["tool_results"]) == (1, 2, 1, 3)
    assert (got["hop1_read"], got["hop2_read"], got["two_hop"]) == (False, True, True)
    assert got["em"] == 0.0 and got["f1"] == pytest.approx(2 / 3)
    assert got["category"] in CATEGORIES


def rec(
    task_id: str,
    f1: float,
    *,
    category: str = "right",
    hops: tuple[bool, bool] = (True, True),
    second: str | None = None,
) -> dict:
    return {"task_id": task_id, "f1": f1, "em": float(f1 == 1.0), "answer": "a", "calls": 2, "searches": 1,
            "reads": 1, "invalid_calls": 0, "two_hop": True, "hop1_read": hops[0], "hop2_read": hops[1],
            "second_search": second, "tool_errors": 1, "tool_results": 4, "category": category,
            "repeated_calls": 0, "stop_reason": "answer"}  # fmt: skip


def searched(query: str) -> Turn:
    hits = {"hits": [{"id": "d_0", "url": url("Other.md"), "title": "Other"}]}
    result = ToolResult("search", True, "hits", None, 1.0, 0, 0, False, hits)
    return Turn([1], [0.0], [], "", "", [ToolCall("search", {"query": query}, "")], [result], [], 0, 0.0, 0.0)


def test_the_second_search_is_told_apart_by_where_its_query_came_from():
    """A second search holding an answer a read returned before it is `from_read` (a bridge followed); one that
    repeats the first query (case and spaces aside) is `copied`; a read's "not in the page" is no answer to
    follow; no second search is None. The summary gives the share of questions with one and the kinds' shares."""
    q = "Where did the band first perform?"
    kind = {
        "from_read": episode(
            searched(q), read("Bridge.md", "Tinted Windows"), searched("Tinted Windows first")
        ),
        "copied": episode(
            searched(q),
            read("Bridge.md", "Tinted Windows"),
            searched("  where did the BAND  first perform? "),
        ),
        "other": episode(searched(q), read("Bridge.md", "not in the page"), searched("not in the page band")),
        None: episode(searched(q), read("Bridge.md", "Tinted Windows")),
    }
    assert {k: record(corpus_task(), e, pages=PAGES)["second_search"] for k, e in kind.items()} == {
        k: k for k in kind
    }
    got = summarise([rec("a", 0, second="from_read"), rec("b", 0, second="copied"), rec("c", 0)])
    assert (got["second_search"], got["second_from_read"], got["second_copied"]) == (
        pytest.approx(2 / 3),
        0.5,
        0.5,
    )


def refused(query: str) -> Turn:
    result = ToolResult("search", False, "error", "invalid_args", 1.0, 0, 0, False, None)
    return Turn([1], [0.0], [], "", "", [ToolCall("search", {"query": query}, "")], [result], [], 0, 0.0, 0.0)


def test_a_call_repeated_in_tool_and_arguments_is_counted_and_so_is_running_out_of_turns():
    """A call whose tool and arguments (case and spaces aside) an earlier call made counts as repeated, the first
    of them not, as the turn reward counts it: a refused call made again is malformed, not a repeat. The summary
    averages the repeats and gives the share of questions that reached the turn limit."""
    q = "Where did the band first perform?"
    again = episode(
        searched(q),
        read("Bridge.md", "Tinted Windows"),
        searched(" where did the BAND first perform?"),
        searched(q),
    )
    assert record(corpus_task(), again, pages=PAGES)["repeated_calls"] == 2
    assert (
        record(corpus_task(), episode(searched(q), read("Bridge.md", "x")), pages=PAGES)["repeated_calls"]
        == 0
    )
    assert record(corpus_task(), episode(refused(""), refused("")), pages=PAGES)["repeated_calls"] == 0
    looped = rec("b", 0) | {"repeated_calls": 3, "stop_reason": "max_turns"}
    got = summarise([rec("a", 0), looped])
    assert (got["repeated_calls_per_question"], got["out_of_turns"]) == (1.5, 0.5)


def test_summary_leaves_infra_failures_out_of_scores_and_counts_both_pages_read():
    """F1 and both-pages-read are over the episodes the tools did not fail; every category is counted."""
    records = [rec("a", 1.0), rec("b", 0.0, hops=(True, False)), rec("c", 1.0, category="infra_failed")]
    got = summarise(records)
    assert (got["n"], got["n_infra_failed"], got["f1"], got["both_read"]) == (3, 1, 0.5, 0.5)
    assert got["tool_error_rate"] == 0.25 and got["categories"]["infra_failed"] == 1


def test_paired_difference_is_over_shared_scored_questions():
    """The paired F1 difference is b - a over the questions both scored, with the sd of the differences."""
    a = [rec("q1", 0.0), rec("q2", 0.5), rec("q3", 1.0), rec("q4", 0.0, category="infra_failed")]
    b = [rec("q1", 1.0), rec("q2", 0.5), rec("q4", 1.0), rec("q5", 1.0)]
    got = paired(a, b)
    assert got["n_shared"] == 2 and got["f1_diff"] == 0.5
    assert got["sd_diff"] == pytest.approx(math.sqrt(0.5)) and got["f1_diff_se"] == pytest.approx(0.5)


def test_questions_needed_is_the_normal_paired_formula():
    """n = ((1.96 + 0.84) sd / d)^2 rounded up, and `detectable` inverts it; more spread needs more questions."""
    assert questions_needed(0.05, 0.4) == 503
    assert detectable(503, 0.4) == pytest.approx(0.05, abs=1e-4)
    assert questions_needed(0.05, 0.2) < questions_needed(0.05, 0.4)
    assert power([[rec("q1", 0.0)]])["sd_from"].startswith("assumed")
    one = power([[rec("q1", 0.0), rec("q2", 1.0)]], available=300)
    assert one["sd_diff"] == pytest.approx(1.0) and one["available"] == 300


def test_every_dev_question_has_two_supporting_pages_in_the_corpus(shared_data):
    """corpus_qa dev (the benchmark's questions) has 300 questions, each with two supporting pages it can find."""
    from training.tasks import load_family

    tasks = load_family("corpus_qa", "dev", data_dir=shared_data)
    assert len(tasks) == 300
    assert all(len(supporting_pages(t)) == 2 for t in tasks)


async def test_the_expert_row_plays_the_scripted_expert_and_writes_its_episodes(tmp_path, smollm2_path):
    """`--policy expert` plays corpus_qa's scripted expert through the given tools (here a fake server): its
    chained calls, its episodes on disk as records read them, and EM and F1 by the family's own scoring."""
    from benchmarks.common import chunks
    from benchmarks.studies.research import bench
    from subagents.handles import handle_for
    from tests.fakes import fake_tool_server, ok_result
    from tool_server.client import ToolClient
    from training.evaluate import load_eval_config
    from training.metrics import load_episodes

    files = ["Bridge.md", "Answer.md", "Other.md"]

    async def handler(name: str, arguments: dict[str, object]) -> dict[str, object]:
        if name == "search":
            hits = [
                {"id": handle_for("page", f"corpus/dev/{f}"), "title": f[:-3], "url": url(f), "snippet": ""}
                for f in files
            ]
            return {**ok_result("hits"), "query": arguments["query"], "hits": hits}
        tulsa = arguments["url"] == handle_for("page", "corpus/dev/Answer.md")
        answer = "Tulsa" if tulsa else "not in the page"
        return {**ok_result(f"answer: {answer}"), "answer": answer, "url": arguments["url"]}

    cfg = load_eval_config(None, ['policy="expert"', "task=corpus_qa", "split=dev", *bench.RECIPE_SETS])
    out = tmp_path / "chunk.jsonl"
    async with ToolClient("http://tools", transport=fake_tool_server(handler), deadline_s=5.0) as tools:
        em, f1 = await chunks.play_chunk([corpus_task()], tools, cfg, out)
    [episode] = load_episodes(out)
    # the top hit said "not in the page", so the expert reads the search's next two hits and answers the first
    # useful read (corpus_qa `_chained`, `_first_useful`)
    assert [c.name for turn in episode.turns for c in turn.calls] == [
        "search",
        "page_qa",
        "page_qa",
        "page_qa",
    ]
    assert (em, f1, episode.answer) == (1.0, 1.0, "Tulsa")


def test_answer_rules_read_only_what_the_policy_saw_and_the_ceiling_bounds_them():
    """answer_rule: each rule picks from the reads' answers in order ("not in the page" skipped where the rule
    says so); the ceiling is the best any read gave, so no rule scores above it."""
    from benchmarks.studies.research import answer_rule

    first_missed = episode(
        search("A.md"),
        read("A.md", "not in the page"),
        search("B.md"),
        turn_of(("B.md", "Boston"), ("C.md", "Ohio")),
    )
    first_right = episode(search("A.md"), read("A.md", "Tulsa"), search("B.md"), turn_of(("B.md", "Ohio")))
    assert answer_rule.reads(first_missed) == (["not in the page"], ["Boston", "Ohio"])
    picks = {name: rule(*answer_rule.reads(first_missed)) for name, rule in answer_rule.RULES.items()}
    assert picks == {
        "first read": "not in the page",
        "first useful": "Boston",
        "last useful": "Ohio",
        "second reads first": "Boston",
    }
    scores = answer_rule.score([("Boston", first_missed), ("Tulsa", first_right)])
    assert scores["first useful"] == {"em": 1.0, "f1": 1.0} and scores["first read"]["em"] == 0.5
    assert all(s["f1"] <= scores[answer_rule.CEILING]["f1"] for s in scores.values())


def turn_of(*reads: tuple[str, str]) -> Turn:
    """One turn of several page_qa reads, (page, answer) each."""
    return turn(*[read(name, answer).results[0] for name, answer in reads])


def test_a_policy_folder_refuses_episodes_of_other_weights_or_settings(tmp_path) -> None:
    """The benchmarks' episode folders are named by policy name, so a name whose weights changed (a new
    conductor-default shipped) must not count the old weights' episodes: claim exits naming other weights; other
    --set values exit too; the same weights and settings pass; the expert has no weights and passes."""
    policy = tmp_path / "policy"
    policy.mkdir()
    (policy / "model.safetensors").write_bytes(b"one")
    folder = tmp_path / "work" / "policy"
    claim(folder, str(policy), ["rollout.max_turns=8"])
    claim(folder, str(policy), ["rollout.max_turns=8"])
    with pytest.raises(SystemExit, match="same --set"):
        claim(folder, str(policy), ["rollout.max_turns=6"])
    (policy / "model.safetensors").write_bytes(b"two")
    with pytest.raises(SystemExit, match="other weights"):
        claim(folder, str(policy), ["rollout.max_turns=8"])
    claim(tmp_path / "work" / "expert", EXPERT, [])
    claim(tmp_path / "work" / "expert", EXPERT, [])


def test_an_episodes_file_is_read_by_task_and_refused_when_it_is_not_corpus_qa_dev(tmp_path):
    """`--episodes NAME=FILE` tabulates another evaluation's episodes: they come back by task id under NAME, and a
    file with an episode of a task outside corpus_qa dev (another split's evaluation), a missing file or a spec
    without a name exits with a message instead of scoring the wrong questions."""

    path = tmp_path / "eval.episodes.jsonl"
    save_rollouts(path, [episode(search("Answer.md"), answer="Tulsa")])
    name, episodes = episodes_file(f"rl-s0={path}", [corpus_task()])
    assert name == "rl-s0" and list(episodes) == ["corpus-q1"] and episodes["corpus-q1"].answer == "Tulsa"
    for spec in (f"rl-s0={path}", f"={path}", "rl-s0", f"rl-s0={tmp_path / 'missing.jsonl'}"):
        others = [] if spec == f"rl-s0={path}" else [corpus_task()]
        with pytest.raises(SystemExit):
            episodes_file(spec, others)


def test_second_search_reward_compares_kinds_within_a_group_not_across_questions(tmp_path):
    """The within-group difference is taken only over groups (a question at a step) that drew both kinds, so an
    easy question where every episode chained does not count as chaining's win; the overall means mix them."""

    q = "Where did the band first perform?"

    def played(task: str, kind: str, reward: float) -> Episode:
        second = searched("Tinted Windows first" if kind == "from_read" else q)
        chained = episode(searched(q), read("Bridge.md", "Tinted Windows"), second)
        return dataclasses.replace(chained, task_id=task, reward=reward)

    save_rollouts(tmp_path / "rollouts" / "step_1.jsonl", [
        played("easy", "from_read", 1.0), played("easy", "from_read", 1.0),
        played("hard", "from_read", 0.5), played("hard", "copied", 0.0), played("hard", "copied", 0.0),
    ])  # fmt: skip
    save_rollouts(tmp_path / "rollouts" / "step_2.jsonl", [
        played("hard", "from_read", 0.0), played("hard", "copied", 0.25),
    ])  # fmt: skip
    found = compare(tmp_path)
    assert found["within_groups"] == 2 and found["within_mean"] == pytest.approx((0.5 - 0.25) / 2)
    assert (found["within_better"], found["within_worse"]) == (1, 1)
    assert found["mean_reward"]["from_read"] == pytest.approx(2.5 / 4) and found["episodes"]["copied"] == 3
    assert found["per_step"][1] == {"from_read": 3, "copied": 2}
