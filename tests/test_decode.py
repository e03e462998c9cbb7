"""The in-process sampler's decoders on a tiny random Llama: their log-probs are the model's, and the fixed-shape
loop (main_agent/decode.py) samples what `generate` samples."""

from __future__ import annotations

import pytest
import torch

from main_agent.policy import SamplingConfig
from main_agent.transformers_policy import MIN_SHARED_PREFIX, TransformersPolicy
from tests.fakes import ByteChatTokenizer
from training.loss import token_logprobs

NEW = 24  # new tokens a batch decodes: rows end early (EOS) and at the limit
EXACT = 1e-5  # float32, the same weights: a cache read and a full forward differ by rounding only


def tiny_model():
    """Two layers of width 64 over ByteChatTokenizer's 258 ids, its EOS made likely enough that some rows end."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=258, num_key_value_heads=2, **shape)).eval()
    with torch.no_grad():
        model.lm_head.weight[ByteChatTokenizer.eos_token_id] *= 6
    return model


def prompts() -> list[list[int]]:
    """Three prompts sharing a prefix long enough to be run once, each with a rest of its own length."""
    prefix = list(range(40, 40 + MIN_SHARED_PREFIX + 8))
    return [prefix + list(range(100 + 20 * i, 100 + 20 * i + n)) for i, n in enumerate((3, 11, 6))]


def sample(model, decoder: str, *, temperature: float, top_p: float = 1.0, seed: int = 0):
    """Each prompt's Sample, decoded together by `decoder` from the random state `seed`."""
    cfg = SamplingConfig(temperature=temperature, top_p=top_p, decoder=decoder)
    policy = TransformersPolicy(model, ByteChatTokenizer(), cfg=cfg, max_batch=3)
    torch.manual_seed(seed)
    return [policy._cut(ids, logprobs, NEW) for ids, logprobs in policy._sample_batch(prompts(), NEW)]


@pytest.mark.parametrize("decoder", ["generate", "static"])
@pytest.mark.parametrize("temperature", [1.0, 1.5])
def test_sampled_logprobs_equal_a_teacher_forced_forward(decoder: str, temperature: float) -> None:
    """The log-probs a decoder reports are what the update recomputes for the same tokens with the same model
    (training.loss.token_logprobs, one full forward at the same temperature), within EXACT: the importance
    ratio starts at 1."""
    model = tiny_model()
    samples = sample(model, decoder, temperature=temperature)
    assert {s.finish_reason for s in samples} == {"stop", "length"}, [s.finish_reason for s in samples]
    for prompt, s in zip(prompts(), samples, strict=True):
        ids = torch.tensor([prompt + s.ids])
        forward = token_logprobs(model, ids, torch.ones_like(ids), temperature=temperature)[0, len(prompt) :]
        torch.testing.assert_close(torch.tensor(s.logprobs), forward, atol=EXACT, rtol=0)


@pytest.mark.parametrize(("temperature", "top_p"), [(0.0, 1.0), (1.0, 1.0), (1.3, 0.9)])
def test_the_static_loop_samples_what_generate_samples(temperature: float, top_p: float) -> None:
    """From the same random state the fixed-shape loop picks generate's tokens (greedy: the same argmax;
    sampled: the same warpers and draws), ends each row where generate does, and reports the same log-probs."""
    model = tiny_model()
    today, static = (sample(model, d, temperature=temperature, top_p=top_p) for d in ("generate", "static"))
    assert [s.ids for s in static] == [s.ids for s in today]
    assert [s.finish_reason for s in static] == [s.finish_reason for s in today]
    for mine, theirs in zip(static, today, strict=True):
        if temperature > 0:  # greedy log-probs divide by 1e-5: rounding is blown up, not compared
            torch.testing.assert_close(
                torch.tensor(mine.logprobs), torch.tensor(theirs.logprobs), atol=EXACT, rtol=0
            )


def test_a_lora_policy_decodes_as_generate_does() -> None:
    """The trained policy is often a peft model (LoRA adapters): the static loop drives it through peft's forward
    and still samples generate's tokens and log-probs."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        tiny_model(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    today, static = (sample(model, d, temperature=1.0) for d in ("generate", "static"))
    assert [s.ids for s in static] == [s.ids for s in today]
    for mine, theirs in zip(static, today, strict=True):
        torch.testing.assert_close(
            torch.tensor(mine.logprobs), torch.tensor(theirs.logprobs), atol=EXACT, rtol=0
        )


def test_auto_decodes_with_the_static_loop_on_a_cpu_unless_told(monkeypatch) -> None:
    """[sampling] decoder "auto" runs the loop that won on the model's device (the static one on a CPU, under a
    transformers it was tested on; `generate` under an older one); a decoder named in the settings wins."""
    from main_agent import transformers_policy

    model = tiny_model()

    def chosen() -> dict[str, str]:
        return {
            d: TransformersPolicy(model, ByteChatTokenizer(), cfg=SamplingConfig(decoder=d)).decoder
            for d in ("auto", "generate", "static")
        }

    monkeypatch.setattr(transformers_policy, "_transformers_version", lambda: (5, 25))
    assert chosen() == {"auto": "static", "generate": "generate", "static": "static"}
    monkeypatch.setattr(transformers_policy, "_transformers_version", lambda: (5, 19))
    assert chosen() == {"auto": "generate", "generate": "generate", "static": "static"}


@pytest.mark.slow
def test_the_compiled_step_changes_no_sample() -> None:
    """The loop with its step through torch.compile samples the uncompiled loop's tokens and log-probs (a CPU
    compiles the tiny model's step in tens of seconds)."""
    model = tiny_model()
    eager, compiled = (sample(model, d, temperature=1.0) for d in ("static", "compiled"))
    assert [s.ids for s in compiled] == [s.ids for s in eager]
    for mine, theirs in zip(compiled, eager, strict=True):
        torch.testing.assert_close(
            torch.tensor(mine.logprobs), torch.tensor(theirs.logprobs), atol=EXACT, rtol=0
        )
