"""The task-family contract (training/tasks/family.py): adding a family is one module and one entry of `FAMILIES`.

tests/echo_family.py is a family defined outside training/tasks; one entry (`FAMILIES["echo"]`, set for the test)
is all it takes for the loaders, the expert and the training loop to play it.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from main_agent.rollout import RolloutConfig
from main_agent.types import Episode
from tests import echo_family
from tests.fakes import ByteChatTokenizer, fake_tool_server
from tests.test_train import TINY_ROLLOUT, final_weights, tiny_config
from tool_server.client import ToolClient
from training import tasks as task_data
from training.config import RunSettings
from training.experts import play_experts, worth_imitating
from training.loop import train
from training.metrics import read_metrics
from training.tasks import Family


@pytest.fixture
def echo(monkeypatch: pytest.MonkeyPatch) -> Family:
    """The one entry: echo's `Family` in `FAMILIES` for this test."""
    monkeypatch.setitem(task_data.FAMILIES, echo_family.NAME, echo_family.FAMILY)
    return echo_family.FAMILY


def test_every_family_is_a_family_under_its_own_name() -> None:
    """`FAMILIES` maps each name to a `Family` of that name: the literal dict is the only registry."""
    assert task_data.FAMILIES and all(
        isinstance(family, Family) and family.name == name for name, family in task_data.FAMILIES.items()
    )


def test_the_item_families_are_exactly_those_whose_load_takes_items() -> None:
    """`item_reward` is set exactly where `load` takes `items=N` (what loaders and SFT ask, `has_items`)."""
    scoring = {name for name, family in task_data.FAMILIES.items() if family.has_items}
    taking = {n for n, f in task_data.FAMILIES.items() if "items" in inspect.signature(f.load).parameters}
    assert scoring == taking == {"plate_audit", "multihop_batch"}


def test_every_familys_tasks_call_only_its_tools(shared_data: Path) -> None:
    """`Family.tools` covers every tool its tasks offer the policy (`Task.tools`): what a server must serve."""
    for name, family in task_data.FAMILIES.items():
        tasks = task_data.load_family(name, "dev", data_dir=shared_data, limit=2)
        assert tasks and all(set(t.tools) <= set(family.tools) for t in tasks), name


def test_a_give_up_phrase_must_be_lower_case() -> None:
    """`gave_up` answers are matched lower-cased and stripped, so a phrase that is not would never match."""
    with pytest.raises(ValueError, match="lower case"):
        dataclasses.replace(echo_family.FAMILY, gave_up="Could not read")


async def test_a_new_family_loads_and_its_expert_plays_it(echo: Family, tmp_path: Path) -> None:
    """Through the entry alone: `load_family` loads echo's tasks, `reward_for` and `success` score by its rules,
    and its expert plays each task through the tool client (search, then the word) to an episode worth
    imitating."""
    tasks = task_data.load_family("echo", "train", data_dir=tmp_path, limit=2)
    assert [t.task_id for t in tasks] == ["echo-apple", "echo-river"] and all(
        t.tools == echo.tools for t in tasks
    )
    assert task_data.reward_for(tasks[0], "pale") == 1.0 and not task_data.success(tasks[0], "pale")
    assert task_data.family_of(tasks[0]) is echo and not task_data.gave_up(tasks[0], "apple")
    rollout = RolloutConfig(max_turns=3, max_new_tokens=128, max_context_tokens=4096)
    with task_data.prepared(tasks, tmp_path) as ready:
        async with ToolClient("http://tools", transport=fake_tool_server()) as client:
            episodes = await play_experts(
                ready, client, ByteChatTokenizer(), rollout=rollout, max_concurrent=2
            )
    for task, episode in zip(ready, episodes, strict=True):
        assert episode.turns[0].calls[0].arguments == {"query": task.reference}
        assert episode.answer == task.reference and worth_imitating(task, episode)


@pytest.mark.slow
def test_a_new_family_trains_a_step_in_the_one_loop(echo: Family, tiny_policy: Path, tmp_path: Path) -> None:
    """One RL step of the project's training loop on echo, a tiny random policy against the fake tool server:
    its tasks are drawn, its reward scores every episode (an untagged turn is the answer, so each has one), and
    the update runs and moves the weights."""
    rollout = dataclasses.replace(TINY_ROLLOUT, untagged_is_answer=True)
    run = RunSettings(policy=str(tiny_policy), data_dir=tmp_path)
    cfg = tiny_config(
        tmp_path / "run", tiny_policy, run=run, task="echo", steps=1, group_size=4, rollout=rollout
    )
    run_dir = train(cfg, transport=fake_tool_server())
    [row] = read_metrics(run_dir / "metrics.jsonl")
    assert row["episodes/collected"] == 8 and row["update/skipped"] == 0.0 and math.isfinite(row["loss/pg"])
    lines = (run_dir / "rollouts" / "step_1.jsonl").read_text().splitlines()
    for episode in map(Episode.from_json, lines):
        word = episode.task_id.removeprefix("echo-")
        assert word in echo_family.WORDS and episode.answer is not None
        assert episode.reward == echo.reward(episode.answer, word)
    assert json.loads((run_dir / "step_1" / "state.json").read_text())["episodes"] == 8
    before, after = load_file(tiny_policy / "model.safetensors"), final_weights(run_dir)
    assert any(not torch.equal(before[k], after[k]) for k in before)
