"""One real episode: real SmolLM2 policy, real tool server over loopback HTTP, a real page from the shared data."""

from __future__ import annotations

import dataclasses
import json

import pytest

from app.trace import render_html
from main_agent.policy import SamplingConfig
from main_agent.rollout import RolloutConfig, RolloutTask, rollout
from main_agent.tokens import segment_ids
from main_agent.transformers_policy import TransformersPolicy, load_model
from tests.tool_server_fakes import page_server, serving
from tool_server.app import create_app
from tool_server.client import ToolClient
from tool_server.config import ServerConfig

QUESTION = "Which country will the United States lift sanctions on?"


class RecordingPolicy(TransformersPolicy):
    """The real policy, remembering each prompt it was given (to compare with the training sequence)."""

    prompts: list[list[int]]

    async def sample(self, prompt_ids, *, max_new_tokens):
        self.prompts.append(list(prompt_ids))
        sample = await super().sample(prompt_ids, max_new_tokens=max_new_tokens)
        self.last = sample
        return sample


@pytest.mark.slow
async def test_real_episode_over_a_real_page(smollm2_path, shared_data):
    """The real policy's call reaches page_qa on a real article; the token stream is exactly what it saw;
    the HTML trace shows every call."""
    html = (shared_data / "pages/readability/nytimes-1/source.html").read_text()
    model, tokenizer = load_model(smollm2_path)
    policy = RecordingPolicy(model, tokenizer, cfg=SamplingConfig(temperature=0.0))
    policy.prompts = []
    base = ServerConfig()
    server_cfg = dataclasses.replace(
        base, fetch=dataclasses.replace(base.fetch, allow_private_cidrs=("127.0.0.0/8",))
    )
    with page_server(html) as pages, serving(create_app(server_cfg)) as tools_url:
        url = f"{pages}/nytimes-1.html"
        # Test the machinery, not the model: the prefix is the whole call and the model writes on after it. The
        # page's loopback port differs run by run, so the prompt does too, and a greedy 135M completion of the
        # question's string ran on past the token budget in some runs (an unclosed call, no call run).
        call = {"name": "page_qa", "arguments": {"url": url, "question": QUESTION}}
        prefix = f"<tool_call>{json.dumps(call)}</tool_call>"
        cfg = RolloutConfig(max_turns=2, max_new_tokens=48, first_turn_prefix=prefix)
        async with ToolClient(tools_url) as tools:
            task = RolloutTask("nyt", QUESTION, await tools.tools(), context=f"Page: {url}")
            episode = await rollout(task, policy, tools, tokenizer, cfg)
    await policy.aclose()

    first = episode.turns[0]
    assert episode.stop_reason != "infra_failed", episode.infra_error
    assert first.calls and first.calls[0].name == "page_qa", first.completion_text
    result = first.results[0]
    assert result.ok, result.observation
    payload = result.payload or {}
    assert str(payload["quote"]) in html or str(payload["quote"]) in str(payload["chunks"])
    assert result.tokens_read > 10 * result.tokens_returned  # the page stayed out of the main context
    assert segment_ids(episode) == [policy.prompts[-1] + policy.last.ids + episode.turns[-1].observation_ids]
    page = render_html([episode])
    for turn in episode.turns:
        for call in turn.calls:
            assert call.name in page and url in page
