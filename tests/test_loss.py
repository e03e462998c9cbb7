"""The clipped token-level policy loss and per-token log-probs, on tiny tensors and a tiny random Llama."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import pytest
import torch

from training.loss import all_finite, policy_loss, token_logprobs

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM


def leaf(values: list[list[float]]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, requires_grad=True)


def test_ratio_one_gives_minus_mean_advantage_and_its_gradient() -> None:
    """At logp == old_logp the loss is -mean(A) over masked tokens and d loss / d logp_t = -A_t / N."""
    logprobs = leaf([[-1.0, -2.0, -0.5], [-0.3, -0.7, -1.2]])
    adv = torch.tensor([[1.0, -2.0, 3.0], [0.5, 0.5, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    out = policy_loss(logprobs, logprobs.detach().clone(), adv, mask)
    out.loss.backward()
    assert out.n_tokens == 5
    assert out.loss.item() == pytest.approx(-(1 - 2 + 3 + 0.5 + 0.5) / 5)
    assert logprobs.grad is not None
    expected = torch.where(mask.bool(), -adv / 5, torch.zeros_like(adv))
    torch.testing.assert_close(logprobs.grad, expected)
    assert out.ratio_mean.item() == pytest.approx(1.0)
    assert out.clip_frac.item() == 0.0


def test_masked_positions_change_nothing() -> None:
    """Any value at a masked-out position, inf and NaN included, leaves loss, metrics and gradient unchanged."""
    mask = torch.tensor([[1, 0, 1]])
    adv = torch.tensor([[1.0, 5.0, -1.0]])
    old = torch.tensor([[-1.0, -1.0, -1.0]])
    results = []
    for junk in (-1.5, 30.0, math.inf, math.nan):
        logprobs = leaf([[-0.9, junk, -1.1]])
        out = policy_loss(logprobs, old, adv, mask, ref_logprobs=old, kl_coef=0.1)
        out.loss.backward()
        assert logprobs.grad is not None and all_finite(out.loss, logprobs.grad)
        results.append((out.loss.item(), out.kl.item(), out.ratio_mean.item(), logprobs.grad.clone()))
    for loss, kl, ratio_mean, grad in results[1:]:
        assert (loss, kl, ratio_mean) == pytest.approx(results[0][:3])
        torch.testing.assert_close(grad, results[0][3])
    assert results[0][3][0, 1].item() == 0.0


def test_clipping_engages_exactly_outside_the_asymmetric_bounds() -> None:
    """Bounds [0.8, 1.28]: with A > 0 only ratio 1.3 is clipped (1.25 is not: clip-higher), with A < 0 only
    ratio 0.7; clip_frac = 2 / 10 and exactly the clipped tokens get zero gradient."""
    ratios = [0.7, 0.9, 1.1, 1.25, 1.3]
    old = torch.zeros(2, 5)
    logprobs = leaf([[math.log(r) for r in ratios]] * 2)
    adv = torch.tensor([[1.0] * 5, [-1.0] * 5])
    out = policy_loss(logprobs, old, adv, torch.ones(2, 5))
    out.loss.backward()
    assert out.clip_frac.item() == pytest.approx(2 / 10)
    assert logprobs.grad is not None
    zero_grad = logprobs.grad == 0
    expected = torch.zeros(2, 5, dtype=torch.bool)
    expected[0, 4] = True  # A > 0, ratio 1.3 > 1.28
    expected[1, 0] = True  # A < 0, ratio 0.7 < 0.8
    assert torch.equal(zero_grad, expected)
    # surrogate: A>0 row uses min(r, clip(r)) = [0.7, 0.9, 1.1, 1.25, 1.28]; A<0 row uses -max(r, clip(r))
    expected_loss = (-(0.7 + 0.9 + 1.1 + 1.25 + 1.28) + (0.8 + 0.9 + 1.1 + 1.25 + 1.3)) / 10
    assert out.loss.item() == pytest.approx(expected_loss, abs=1e-6)


def test_clipping_does_not_engage_on_the_helpful_side() -> None:
    """A ratio beyond a bound but in the direction that lowers the objective is not clipped (PPO's min)."""
    old = torch.zeros(1, 2)
    logprobs = leaf([[math.log(0.5), math.log(2.0)]])
    adv = torch.tensor([[1.0, -1.0]])  # A>0 with a shrunken ratio, A<0 with a grown one
    out = policy_loss(logprobs, old, adv, torch.ones(1, 2))
    out.loss.backward()
    assert out.clip_frac.item() == 0.0
    assert logprobs.grad is not None and bool((logprobs.grad != 0).all())


def test_empty_mask_gives_zero_loss_with_finite_grad() -> None:
    """No masked-in token (e.g. every turn truncated): loss exactly 0, backward works, gradient finite and 0."""
    logprobs = leaf([[-1.0, -2.0]])
    out = policy_loss(
        logprobs,
        torch.zeros(1, 2),
        torch.ones(1, 2),
        torch.zeros(1, 2),
        ref_logprobs=torch.zeros(1, 2),
        kl_coef=0.1,
    )
    out.loss.backward()
    assert out.loss.item() == 0.0 and out.n_tokens == 0
    assert out.loss.requires_grad
    assert logprobs.grad is not None and all_finite(out.loss, logprobs.grad)
    assert torch.equal(logprobs.grad, torch.zeros(1, 2))


def test_kl_is_zero_against_itself_and_k3_otherwise() -> None:
    """k3 = e^d - d - 1 with d = ref - logp: 0 when ref == logp; d = ln 2 gives 1 - ln 2 on that token."""
    logprobs = leaf([[-1.0, -2.0]])
    mask = torch.ones(1, 2)
    same = policy_loss(
        logprobs, logprobs.detach(), torch.zeros(1, 2), mask, ref_logprobs=logprobs.detach(), kl_coef=0.5
    )
    assert same.kl.item() == pytest.approx(0.0, abs=1e-7)
    ref = logprobs.detach() + torch.tensor([[math.log(2.0), 0.0]])
    other = policy_loss(logprobs, logprobs.detach(), torch.zeros(1, 2), mask, ref_logprobs=ref, kl_coef=0.5)
    assert other.kl.item() == pytest.approx((1 - math.log(2.0)) / 2)
    assert other.loss.item() == pytest.approx(0.5 * other.kl.item())


def test_normalizer_replaces_token_count() -> None:
    """With normalizer=M the loss is sum / M, so micro-batch losses add up to the step's token mean."""
    logprobs = leaf([[-1.0, -1.0]])
    adv = torch.tensor([[1.0, 3.0]])
    out = policy_loss(logprobs, logprobs.detach(), adv, torch.ones(1, 2), normalizer=8.0)
    assert out.loss.item() == pytest.approx(-4.0 / 8.0)


def test_bad_arguments_raise() -> None:
    """Mismatched shapes and a KL coefficient without reference log-probs fail fast."""
    x = torch.zeros(1, 3)
    with pytest.raises(ValueError, match="shape"):
        policy_loss(x, torch.zeros(1, 2), x, x)
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(x, x, x, x, kl_coef=0.1)


def test_all_finite() -> None:
    """NaN and inf anywhere make it False."""
    assert all_finite(torch.ones(2), torch.zeros(3))
    assert not all_finite(torch.ones(2), torch.tensor([1.0, math.nan]))
    assert not all_finite(torch.tensor([math.inf]))


def tiny_llama() -> LlamaForCausalLM:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(cfg).eval()


def test_token_logprobs_match_naive_prefix_computation() -> None:
    """Position t holds log_softmax(model(x_<t))[x_t], computed one prefix at a time; position 0 and right
    padding hold 0."""
    model = tiny_llama()
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 100, (2, 7), generator=generator)
    attention = torch.ones(2, 7, dtype=torch.long)
    attention[1, 5:] = 0  # row 1: 5 real tokens, 2 padding
    with torch.no_grad():
        fast = token_logprobs(model, ids, attention)
        naive = torch.zeros(2, 7)
        for b, length in ((0, 7), (1, 5)):
            for t in range(1, length):
                logits = model(input_ids=ids[b : b + 1, :t]).logits[0, -1]
                naive[b, t] = torch.log_softmax(logits, dim=-1)[ids[b, t]]
    assert fast.shape == (2, 7)
    torch.testing.assert_close(fast, naive, atol=1e-5, rtol=1e-5)
    assert bool((fast[:, 0] == 0).all()) and bool((fast[1, 5:] == 0).all())


def test_token_logprobs_has_gradient() -> None:
    """The log-probs backpropagate into the model's parameters (the training path)."""
    model = tiny_llama()
    ids = torch.randint(0, 100, (1, 5), generator=torch.Generator().manual_seed(2))
    token_logprobs(model, ids, torch.ones(1, 5, dtype=torch.long)).sum().backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and all_finite(g) for g in grads)
    assert sum(float(g.abs().sum()) for g in grads if g is not None) > 0


def test_masked_token_logprobs_equal_the_full_ones_where_trained() -> None:
    """With a loss mask, the output head runs only where needed: the trained positions get exactly the full
    computation's log-probs (padding and untrained positions that no row trains get 0) and gradients flow."""
    model = tiny_llama()
    ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(3))
    attention = torch.ones(2, 9, dtype=torch.long)
    attention[1, 7:] = 0
    mask = torch.zeros(2, 9)
    mask[0, 3:5] = 1  # a completion in the middle (an observation follows it)
    mask[1, 6] = 1
    full = token_logprobs(model, ids, attention)
    sparse = token_logprobs(model, ids, attention, loss_mask=mask)
    trained = mask.bool()
    torch.testing.assert_close(sparse[trained], full[trained], atol=1e-5, rtol=1e-5)
    assert bool((sparse[:, :3] == 0).all()) and bool((sparse[:, 7:] == 0).all())
    (sparse * mask).sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


# ---------------------------------------------------------------- the shared-prefix update


def episodes_with_a_shared_prompt() -> list:
    """Five sequences: three share a 12-token prompt, two another (the first 5 ids common to all); each has a
    trained completion, an untrained observation and a second completion, of different lengths."""
    from main_agent.tokens import TrainSequence

    generator = torch.Generator().manual_seed(4)
    system = torch.randint(0, 100, (5,), generator=generator).tolist()
    prompts = [system + torch.randint(0, 100, (7,), generator=generator).tolist() for _ in range(2)]
    sequences = []
    for i, prompt in enumerate([prompts[0]] * 3 + [prompts[1]] * 2):
        lengths = (3 + i, 2, 2 + (i % 3))  # completion, observation, completion
        rest = torch.randint(0, 100, (sum(lengths),), generator=generator).tolist()
        mask = [0] * len(prompt) + [1] * lengths[0] + [0] * lengths[1] + [1] * lengths[2]
        old = [-1.0 - 0.1 * j if m else 0.0 for j, m in enumerate(mask)]
        advantages = [(0.5 - 0.3 * i) * m for m in mask]
        sequences.append(TrainSequence(prompt + rest, mask, old, advantages))
    return sequences


def loss_and_grads(model, sequences, *, share_prefix: bool, max_tokens: int, temperature: float = 1.0):
    """The step's loss summed over micro-batches, and every parameter's gradient, as `update` computes them."""
    from main_agent.tokens import collate, micro_batches
    from training.loss import batch_logprobs

    model.zero_grad(set_to_none=True)
    n_tokens = sum(sum(s.loss_mask) for s in sequences)
    total = 0.0
    for chunk in micro_batches(sequences, max_tokens=max_tokens, share_prefix=share_prefix):
        batch = collate(chunk, pad_id=0, share_prefix=share_prefix)
        logprobs = batch_logprobs(model, batch, temperature=temperature)
        out = policy_loss(
            logprobs, batch.old_logprobs, batch.advantages, batch.loss_mask, normalizer=n_tokens
        )
        out.loss.backward()
        total += out.loss.item()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return total, grads


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("max_tokens", [10_000, 60])
@pytest.mark.parametrize("temperature", [1.0, 1.7])
def test_the_shared_prefix_update_equals_running_every_whole_sequence(
    lora: bool, max_tokens: int, temperature: float
) -> None:
    """Same batch both ways, one micro-batch or several: the loss and every parameter's gradient of the
    shared-prefix path equal the unshared computation at fp32 tolerance, for full fine-tuning and LoRA, at the
    sampler's temperature or not."""
    model = tiny_llama().train()
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    sequences = episodes_with_a_shared_prompt()
    plain, plain_grads = loss_and_grads(
        model, sequences, share_prefix=False, max_tokens=max_tokens, temperature=temperature
    )
    shared, shared_grads = loss_and_grads(
        model, sequences, share_prefix=True, max_tokens=max_tokens, temperature=temperature
    )
    assert shared == pytest.approx(plain, rel=1e-5, abs=1e-7)
    assert plain_grads.keys() == shared_grads.keys() and plain_grads
    for name, grad in plain_grads.items():
        torch.testing.assert_close(shared_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_shared_batches_run_the_prompt_once_and_never_share_a_trained_token() -> None:
    """Sequences are grouped by prompt; a micro-batch's prefix stops before the first trained id of any of its
    sequences, and its cost counts the prefix once."""
    from main_agent.tokens import collate, micro_batches, shared_prefix_length

    sequences = episodes_with_a_shared_prompt()
    assert shared_prefix_length(sequences) == 5  # the system part all share
    assert shared_prefix_length(sequences[:3]) == 12  # one prompt: up to its first completion token
    batches = micro_batches(sequences, max_tokens=12 + 3 * 15, share_prefix=True)
    assert sorted(len(b) for b in batches) == [2, 3]  # one per prompt
    assert all(len({tuple(s.input_ids[:12]) for s in b}) == 1 for b in batches)
    three = next(b for b in batches if len(b) == 3)
    first = collate(three, pad_id=0, share_prefix=True)
    assert first.prefix_ids.tolist() == sequences[0].input_ids[:12]
    assert first.input_ids.shape == (3, max(len(s.input_ids) for s in three) - 12)
    assert bool((first.loss_mask[:, 0] == 1).all())  # the first trained id is the first of the rest
    unshared = micro_batches(sequences, max_tokens=12 + 3 * 15, share_prefix=False)
    assert len(unshared) > len(batches)  # the same budget holds fewer whole sequences


def test_tempered_logprobs_are_the_log_softmax_of_the_scaled_logits() -> None:
    """token_logprobs at temperature T is log softmax(logits / T) of each next token, with and without a loss
    mask (the distribution a sampler at T draws from, whose log-probs it reports)."""
    model = tiny_llama().eval()
    ids = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(3))
    attention = torch.ones_like(ids)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention).logits
        expected = torch.log_softmax(logits[:, :-1] / 1.7, dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
        full = token_logprobs(model, ids, attention, temperature=1.7)
        sparse = token_logprobs(model, ids, attention, loss_mask=attention, temperature=1.7)
    torch.testing.assert_close(full[:, 1:], expected)
    torch.testing.assert_close(sparse[:, 1:], expected)
    assert not torch.allclose(token_logprobs(model, ids, attention)[:, 1:], expected)
