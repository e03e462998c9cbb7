"""The policies: sampled ids and log-probs are what training needs, in-process and over the completions protocol."""

from __future__ import annotations

import asyncio

import pytest

from main_agent.openai_policy import OpenAIPolicy
from main_agent.policy import PolicyError, SamplingConfig
from main_agent.transformers_policy import TransformersPolicy, load_model
from tests.fake_openai_server import serve, unused_port
from tests.fake_vllm_server import completions_app
from tests.fakes import ByteChatTokenizer
from tests.misbehaving_reader import misbehaving_reader


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    return load_model(smollm2_path)


def prompt_ids(tokenizer, question: str) -> list[int]:
    messages = [{"role": "user", "content": question}]
    return list(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    )


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [1.0, 1.5])
async def test_sampler_logprobs_match_a_recompute(smollm2, temperature: float):
    """The log-probs the policy reports are the model's log-probs of the sampled ids at its temperature, as the
    update recomputes them (the ratio starts at 1)."""
    import torch

    from training.loss import token_logprobs

    model, tokenizer = smollm2
    policy = TransformersPolicy(model, tokenizer, cfg=SamplingConfig(temperature=temperature))
    prompt = prompt_ids(tokenizer, "Name a colour.")
    sample = await policy.sample(prompt, max_new_tokens=12)
    await policy.aclose()
    ids = torch.tensor([prompt + sample.ids])
    recomputed = token_logprobs(model, ids, torch.ones_like(ids), temperature=temperature)[0, len(prompt) :]
    assert torch.allclose(recomputed, torch.tensor(sample.logprobs), atol=2e-3), (recomputed, sample.logprobs)


@pytest.mark.slow
async def test_concurrent_samples_share_one_generate(smollm2):
    """Samples requested together by several episodes are batched, each cut at its own EOS and limit."""
    model, tokenizer = smollm2
    policy = TransformersPolicy(model, tokenizer, cfg=SamplingConfig(temperature=0.0))
    prompts = [prompt_ids(tokenizer, q) for q in ("Say hi.", "Count to three.", "What is 2+2?")]
    samples = await asyncio.gather(
        *(policy.sample(p, max_new_tokens=n) for p, n in zip(prompts, (4, 16, 16), strict=False))
    )
    await policy.aclose()
    assert policy._batcher.batch_sizes == [3]
    assert len(samples[0].ids) <= 4
    for sample in samples:
        assert len(sample.ids) == len(sample.logprobs)
        assert sample.finish_reason == "length" or sample.ids[-1] == tokenizer.eos_token_id


@pytest.mark.slow
async def test_openai_policy_reads_token_ids_from_a_completions_server(smollm2):
    """Against a loopback server speaking vLLM's protocol, the endpoint policy gets exact ids and log-probs."""
    model, tokenizer = smollm2
    local = TransformersPolicy(model, tokenizer, cfg=SamplingConfig(temperature=0.0))
    prompt = prompt_ids(tokenizer, "What is the capital of France?")
    with serve(completions_app(local)) as url:
        remote = OpenAIPolicy(url, "smollm2", tokenizer, cfg=SamplingConfig(temperature=0.0))
        sample = await remote.sample(prompt, max_new_tokens=16)
        await remote.aclose()
    expected = await local.sample(prompt, max_new_tokens=16)
    await local.aclose()
    assert sample.exact and sample.ids == expected.ids
    assert sample.logprobs == pytest.approx(expected.logprobs)


async def test_openai_policy_without_token_ids_marks_samples_inexact():
    """A server that returns only text is usable for `ask`, but its samples are flagged as not trainable."""

    class Echo:
        version, eos_token_id = 0, ByteChatTokenizer.eos_token_id

        async def sample(self, prompt_ids, *, max_new_tokens):
            from main_agent.policy import Sample

            return Sample([104, 105, 257], [-0.1, -0.2, -0.3], "hi", "stop")

    tokenizer = ByteChatTokenizer()
    with serve(completions_app(Echo(), token_ids=False)) as url:  # type: ignore[arg-type]
        policy = OpenAIPolicy(url, "m", tokenizer)
        sample = await policy.sample([1, 2, 3], max_new_tokens=8)
        await policy.aclose()
    assert not sample.exact
    assert sample.ids == [104, 105, 257] and sample.text == "hi"


async def test_unreachable_policy_endpoint_raises_policy_error():
    """A dead endpoint is an infrastructure failure (PolicyError), not an empty completion."""
    policy = OpenAIPolicy(f"http://127.0.0.1:{unused_port()}/v1", "m", ByteChatTokenizer())
    with pytest.raises(PolicyError, match="unreachable"):
        await policy.sample([1, 2], max_new_tokens=4)
    await policy.aclose()


async def test_the_policy_endpoint_is_held_to_the_readers_bars() -> None:
    """The policy reaches its endpoint through the reader's hardened client (conductor/http.py): a redirect, a
    reply past the cap, a gzip bomb and a body that is not JSON are each one PolicyError at the first request;
    a 503 is retried (twice) before it is one."""
    with misbehaving_reader() as reader:
        reader.huge_bytes = 100 << 20
        for shape, wording in [
            ("loop", "redirect"),
            ("huge", "too large"),
            ("gzip_bomb", "too large"),
            ("not_json", "not JSON"),
            ("retry_after_superscript", "503"),
        ]:
            policy = OpenAIPolicy(reader.url(shape), "m", ByteChatTokenizer())
            with pytest.raises(PolicyError, match=wording):
                await policy.sample([1, 2], max_new_tokens=4)
            await policy.aclose()
        sent = [path.split("/")[1] for path in reader.requests]
    assert sent == ["loop", "huge", "gzip_bomb", "not_json", *["retry_after_superscript"] * 3]


def test_auto_samples_with_vllm_when_it_is_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """ "auto" (the default) picks vllm when the package is installed and the checkpoint is dense, transformers
    otherwise (a LoRA adapter, or no vllm); an explicit backend is kept as given."""
    import importlib.util

    from main_agent import backends
    from main_agent.backends import chosen_backend

    real = importlib.util.find_spec
    monkeypatch.setattr(
        backends.importlib.util, "find_spec", lambda name: None if name == "vllm" else real(name)
    )
    assert chosen_backend(SamplingConfig()) == "transformers"
    monkeypatch.setattr(
        backends.importlib.util, "find_spec", lambda name: object() if name == "vllm" else real(name)
    )
    assert chosen_backend(SamplingConfig()) == "vllm"
    assert chosen_backend(SamplingConfig(), adapter=True) == "transformers"
    assert chosen_backend(SamplingConfig(backend="transformers")) == "transformers"


def test_a_shared_prompt_is_computed_once_and_changes_no_sample() -> None:
    """Prompts sharing their first ids (a group's prompt) are sampled with that prefix run once and repeated:
    greedy tokens and their log-probs equal sampling each prompt alone, whatever the rows' own lengths."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from main_agent import transformers_policy
    from main_agent.tokens import common_prefix

    torch.manual_seed(0)
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=258, num_key_value_heads=2, **shape)).eval()
    tokenizer = ByteChatTokenizer()
    prefix = list(range(40, 40 + transformers_policy.MIN_SHARED_PREFIX + 8))
    prompts = [prefix + list(range(100 + 20 * i, 100 + 20 * i + n)) for i, n in enumerate((3, 11, 6))]
    policy = TransformersPolicy(model, tokenizer, cfg=SamplingConfig(temperature=0.0), max_batch=3)
    assert common_prefix(prompts, limit=100) == len(prefix)
    together = [
        policy._cut(*row, 8) for row in policy._sample_batch(prompts, 8)
    ]  # cut at EOS, as sample does
    alone = [policy._cut(*policy._sample_batch([p], 8)[0], 8) for p in prompts]
    for mine, single in zip(together, alone, strict=True):
        assert mine.ids == single.ids
        torch.testing.assert_close(
            torch.tensor(mine.logprobs), torch.tensor(single.logprobs), atol=1e-4, rtol=1e-4
        )


def test_a_saved_adapter_names_its_built_in_base_and_loads_without_a_tokenizer(smollm2_path, tmp_path):
    """An adapter trained on the built-in model is saved naming the model, not this machine's path, and loads
    from a folder holding only the adapter (the shipped default policy's layout), with the base's tokenizer and
    the adapter's weights in place."""
    import json

    import torch
    from peft import PeftModel

    from conductor.models import DEFAULT_MODEL, portable_adapter
    from main_agent.transformers_policy import load_model

    model, _ = load_model(smollm2_path, lora_rank=2, device="cpu")
    with torch.no_grad():
        next(p for n, p in model.named_parameters() if "lora_B" in n).fill_(0.01)
    model.save_pretrained(tmp_path)
    portable_adapter(tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == DEFAULT_MODEL
    assert not (tmp_path / "tokenizer_config.json").exists()
    loaded, tokenizer = load_model(tmp_path, device="cpu")
    assert isinstance(loaded, PeftModel) and tokenizer.eos_token_id is not None
    saved = dict(model.named_parameters())
    assert all(torch.equal(p, saved[n]) for n, p in loaded.named_parameters() if "lora_B" in n)


def test_a_vllm_engine_samples_an_adapter_from_its_merged_copy(tiny_policy, tmp_path, monkeypatch):
    """load_policy with the vllm backend hands the engine a dense checkpoint of a LoRA adapter: its adapters
    merged into the base, giving the adapter's logits, written once under $CONDUCTOR_HOME/merged and reused."""
    import torch

    from main_agent import backends
    from main_agent.transformers_policy import load_model

    monkeypatch.setenv("CONDUCTOR_HOME", str(tmp_path / "home"))
    model, _ = load_model(tiny_policy, lora_rank=2, device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5)
    model.save_pretrained(tmp_path / "adapter")
    seen: list = []
    monkeypatch.setattr(backends, "build_policy", lambda backend, tok, s, **a: seen.append(a["folder"]))
    for _ in range(2):
        backends.load_policy(str(tmp_path / "adapter"), SamplingConfig(backend="vllm"))
    assert seen[0] == seen[1] and seen[0].parent == tmp_path / "home" / "merged"
    assert not (seen[0] / "adapter_config.json").exists() and (seen[0] / "tokenizer_config.json").is_file()
    dense, _ = load_model(seen[0], device="cpu")
    ids = torch.tensor([[1, 5, 9, 42, 7]])
    with torch.no_grad():
        torch.testing.assert_close(dense(ids).logits, model(ids).logits, atol=1e-4, rtol=1e-4)
        assert not torch.allclose(dense(ids).logits, load_model(tiny_policy, device="cpu")[0](ids).logits)


def test_the_shipped_default_policy_resolves_to_its_adapter():
    """`conductor-default` names the adapter shipped in the package, whose base is the built-in model."""
    import json

    from conductor.models import DEFAULT_MODEL, DEFAULT_POLICY, SHIPPED_POLICIES, resolve_model

    path = resolve_model(DEFAULT_POLICY)
    assert path == SHIPPED_POLICIES[DEFAULT_POLICY]
    config = json.loads((path / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == DEFAULT_MODEL and (path / "README.md").is_file()


def test_vllm_context_is_capped_at_the_checkpoints(smollm2_path, tmp_path, monkeypatch):
    """load_policy caps vLLM's max_model_len at the checkpoint's max_position_embeddings (an engine refuses longer)."""
    import json
    import shutil

    from main_agent import backends

    small = tmp_path / "ckpt"
    shutil.copytree(smollm2_path, small, ignore=shutil.ignore_patterns("*.safetensors", "*.gguf"))
    config = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2048}))
    seen: dict[str, int] = {}

    def fake_build(backend, tokenizer, sampling, **args):
        seen[backend] = args["max_model_len"]
        return object()

    monkeypatch.setattr(backends, "build_policy", fake_build)
    backends.load_policy(str(small), SamplingConfig(backend="vllm"), max_model_len=4096)
    backends.load_policy(
        str(small), SamplingConfig(backend="server", url="http://127.0.0.1:9/v1"), max_model_len=4096
    )
    assert seen == {"vllm": 2048, "server": 4096}
