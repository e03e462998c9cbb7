"""The masked, clipped, token-level policy-gradient loss, and per-token log-probs of a causal LM.

For every token with mask 1 (the policy's sampled tokens; prompt, observation and padding tokens have mask 0):

    ratio_t   = exp(logp_t - old_logp_t)                      importance ratio to the policy that sampled it
    pg_t      = -min(ratio_t A_t, clip(ratio_t, 1 - eps_low, 1 + eps_high) A_t)       PPO's clipped surrogate
    kl_t      = exp(ref_t - logp_t) - (ref_t - logp_t) - 1    the k3 estimator of KL(policy || reference), >= 0
    lld_t     = relu(old_logp_t - logp_t) where A_t > 0, else 0              the likelihood-displacement guard
    loss      = sum_t (pg_t + kl_coef kl_t + lld_coef lld_t) / N

N is the number of masked-in tokens in the whole batch (or the `normalizer` given), so every token weighs the
same whatever the length of its episode: DAPO's token-level normalisation. Plain GRPO first averages within each
sequence, which lets long (often wrong) answers dilute their per-token penalty; Dr. GRPO divides by a constant
instead of N, which we do not do. Clipping is asymmetric by default (DAPO's "clip-higher", eps_high 0.28 >
eps_low 0.2): an unlikely token with positive advantage may gain more probability per step than any token may
lose, which counters the collapse of exploration (entropy) that symmetric clipping causes.

No 1/T: nothing here, in training/advantages.py or in main_agent/tokens.py divides an episode's advantage or loss
by its number of turns, so an episode of 4 like turns weighs twice one of 2 (a per-turn 1/T would pay for ending
early, Dr. MAMR's "serial collapse"; tests/test_recipe_rewards.py pins it).

The guard lld (off at lld_coef 0) answers Lazy Likelihood Displacement (arXiv 2512.04220): under GRPO on search
tasks the log-likelihood of right trajectories falls until training collapses. That paper's LLDS penalises a fall
of likelihood on actions of non-negative advantage, gated per action (a turn) and applied to the tokens that fell;
ours is our reading of it, token by token and ungated: a positive-advantage token whose log-prob fell below the
sampler's is pulled back up, any other token is untouched. Positive, not non-negative: tokens of advantage 0 are
not run at all (training/update.py `with_signal`). With one optimizer step per batch the trainer's log-probs start
at the sampler's, so the guard acts where they disagree: a stale batch (overlap) or the sampler's own numerics.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from conductor.models import past_key_values_accepted
from main_agent.tokens import Batch


@dataclass(frozen=True)
class LossOutput:
    """The loss to backpropagate and what to log about it (logged values are detached scalars)."""

    loss: Tensor
    """Scalar with grad: pg_loss + kl_coef * kl + lld_coef * lld."""
    pg_loss: Tensor
    """The clipped policy-gradient term alone."""
    kl: Tensor
    """Mean k3 KL to the reference policy (0 without reference log-probs)."""
    clip_frac: Tensor
    """Share of masked-in tokens whose gradient the clip removed (ratio beyond the bound in the advantage's direction)."""
    ratio_mean: Tensor
    """Mean importance ratio over masked-in tokens; far from 1 means the sampler and trainer disagree."""
    lld: Tensor
    """The likelihood-displacement term sum_t lld_t / N, computed whatever lld_coef (0 where nothing fell)."""
    n_tokens: int
    """Masked-in tokens in this batch."""


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.28,
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
    lld_coef: float = 0.0,
    normalizer: float | None = None,
) -> LossOutput:
    """Token-level clipped policy-gradient loss (see the module docstring). All tensors are [B, T].

    `normalizer` replaces N, the batch's masked-in token count: pass the whole step's count when gradients are
    accumulated over micro-batches, so that the sum of the micro-batch losses is the step's token mean.
    An all-zero mask gives a loss of exactly 0 that still has a (zero) gradient.
    """
    _check_args(logprobs, old_logprobs, advantages, mask, ref_logprobs, kl_coef, clip_eps_low, clip_eps_high)
    if lld_coef < 0.0:
        raise ValueError(f"lld_coef must be >= 0, got {lld_coef}")
    mask = mask.bool()
    n_tokens = int(mask.sum())
    denom = float(normalizer) if normalizer is not None else float(max(n_tokens, 1))
    # [B, T]. Masked-out positions get log-ratio 0 and advantage 0 *before* any exp or product, so that an inf or
    # NaN there (padding logits, a -inf old log-prob) can reach neither the loss nor its gradient.
    log_ratio = torch.where(mask, logprobs - old_logprobs, 0.0)
    ratio = torch.exp(log_ratio)
    adv = torch.where(mask, advantages.to(ratio.dtype), 0.0)
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high) * adv)
    pg_loss = -surrogate.sum() / denom
    kl = _k3_kl(logprobs, ref_logprobs, mask).sum() / denom
    loss = pg_loss + kl_coef * kl if kl_coef > 0.0 else pg_loss
    lld = _displacement(log_ratio, adv).sum() / denom
    loss = loss + lld_coef * lld if lld_coef > 0.0 else loss  # at 0 the graph and the loss are as without it
    clipped = mask & (
        ((adv > 0) & (ratio > 1.0 + clip_eps_high)) | ((adv < 0) & (ratio < 1.0 - clip_eps_low))
    )
    count = max(n_tokens, 1)
    return LossOutput(
        loss=loss,
        pg_loss=pg_loss.detach(),
        kl=kl.detach(),
        clip_frac=(clipped.sum() / count).detach(),
        ratio_mean=(torch.where(mask, ratio, 0.0).sum() / count).detach(),
        lld=lld.detach(),
        n_tokens=n_tokens,
    )


def _displacement(log_ratio: Tensor, adv: Tensor) -> Tensor:
    """Per-token lld_t = relu(old_logp - logp) where the advantage is positive, else 0 (masked-out positions
    have log-ratio and advantage 0 already). [B, T]"""
    return torch.where(adv > 0, torch.relu(-log_ratio), 0.0)


def _k3_kl(logprobs: Tensor, ref_logprobs: Tensor | None, mask: Tensor) -> Tensor:
    """Per-token k3 estimate exp(d) - d - 1 with d = ref - logp, 0 where masked out or without a reference. [B, T]"""
    if ref_logprobs is None:
        return torch.zeros_like(logprobs)
    d = torch.where(mask, ref_logprobs - logprobs, 0.0)
    return torch.exp(d) - d - 1.0


def _check_args(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    ref_logprobs: Tensor | None,
    kl_coef: float,
    clip_eps_low: float,
    clip_eps_high: float,
) -> None:
    """Fail fast on mismatched shapes or settings that make the loss meaningless."""
    others = [old_logprobs, advantages, mask] + ([ref_logprobs] if ref_logprobs is not None else [])
    for other in others:
        if other.shape != logprobs.shape:
            raise ValueError(f"shape {tuple(other.shape)} != logprobs shape {tuple(logprobs.shape)}")
    if logprobs.dim() != 2:
        raise ValueError(f"expected [B, T] tensors, got shape {tuple(logprobs.shape)}")
    if not 0.0 < clip_eps_low < 1.0 or clip_eps_high <= 0.0:
        raise ValueError(
            f"need 0 < clip_eps_low < 1 and clip_eps_high > 0, got {clip_eps_low}, {clip_eps_high}"
        )
    if kl_coef < 0.0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
    if kl_coef > 0.0 and ref_logprobs is None:
        raise ValueError(f"kl_coef={kl_coef} needs ref_logprobs")


def token_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    *,
    loss_mask: Tensor | None = None,
    temperature: float = 1.0,
) -> Tensor:
    """log p(x_t | x_<t) for every position of a right-padded batch: [B, T], position 0 and padding get 0; p is
    the softmax of the logits over `temperature`, the distribution a sampler at that temperature draws from.

    `model` is a causal LM returning `.logits` [B, T, V] (a transformers model). Left padding would shift the
    positions a Llama-style model sees, so batches must be right-padded.

    With `loss_mask` [B, T], the output head runs only where some row's next token is trained
    (transformers' `logits_to_keep`); other positions get 0. The [B, T, V] logits are most of a small model's
    activation memory (49k vocabulary) and a fifth of its FLOPs, and observation tokens never need them.
    """
    if loss_mask is None:
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits  # [B, T, V]
        return logprobs_from_logits(logits, input_ids, attention_mask, temperature=temperature)
    keep = loss_mask[:, 1:].bool().any(dim=0).nonzero().squeeze(-1)  # [K]: position t predicts token t + 1
    logits = model(
        input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=keep
    ).logits  # [B, K, V]
    logp = _chosen(logits, input_ids[:, keep + 1], temperature)  # [B, K]
    logp = torch.where(attention_mask[:, keep + 1].bool(), logp, 0.0)
    out = torch.zeros(input_ids.shape, dtype=logp.dtype, device=logp.device)  # [B, T]
    out[:, keep + 1] = logp
    return out


def batch_logprobs(model: nn.Module, batch: Batch, *, temperature: float = 1.0) -> Tensor:
    """log p of every trained token of a micro-batch, [B, T] over the rest after its prefix (0 elsewhere), p at
    the sampler's `temperature` (token_logprobs).

    Without a prefix this is `token_logprobs`. With one, the prefix runs once, its keys and values are repeated
    for the B rows (`batch_repeat_interleave`: autograd sums the rows' gradients back into the one prefix), and
    the rows run on top of them; the first token after the prefix is predicted by the prefix's last position.
    Same values and gradients as running every full sequence (tests/test_loss.py checks both), in P + B x T
    tokens instead of B x (P + T).
    """
    if batch.prefix_ids.numel() == 0:
        return token_logprobs(
            model, batch.input_ids, batch.attention_mask, loss_mask=batch.loss_mask, temperature=temperature
        )
    from transformers.cache_utils import DynamicCache

    rows, width = batch.input_ids.shape
    n_prefix = batch.prefix_ids.numel()
    cache = DynamicCache(config=model.config)
    with past_key_values_accepted():
        head = _forward(model, batch.prefix_ids[None], cache=cache, logits_to_keep=1)  # [1, 1, V]
        cache.batch_repeat_interleave(rows)
        keep = (
            batch.loss_mask[:, 1:].bool().any(dim=0).nonzero().squeeze(-1)
        )  # [K]: position j predicts j + 1
        ones = torch.ones(
            rows, n_prefix, dtype=batch.attention_mask.dtype, device=batch.attention_mask.device
        )
        positions = torch.arange(n_prefix, n_prefix + width, device=batch.input_ids.device).expand(rows, -1)
        rest = _forward(
            model,
            batch.input_ids,
            cache=cache,
            logits_to_keep=keep,
            attention_mask=torch.cat([ones, batch.attention_mask], dim=1),
            position_ids=positions,
        )  # [B, K, V]
    out = torch.zeros(batch.input_ids.shape, dtype=torch.float32, device=batch.input_ids.device)  # [B, T]
    out[:, keep + 1] = _chosen(rest, batch.input_ids[:, keep + 1], temperature)
    out[:, 0] = _chosen(head.expand(rows, -1, -1), batch.input_ids[:, :1], temperature)[:, 0]
    return torch.where(batch.attention_mask.bool(), out, 0.0)


def _forward(model: nn.Module, input_ids: Tensor, *, cache, logits_to_keep, **kwargs) -> Tensor:
    return model(
        input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=logits_to_keep, **kwargs
    ).logits


def _chosen(logits: Tensor, targets: Tensor, temperature: float) -> Tensor:
    """log-softmax of `targets` under `logits` / `temperature` ([B, K, V] x [B, K] -> [B, K]), in float32."""
    pred = _tempered(logits, temperature)
    return pred.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(pred, dim=-1)


def logprobs_from_logits(
    logits: Tensor, input_ids: Tensor, attention_mask: Tensor, *, temperature: float = 1.0
) -> Tensor:
    """Log-prob of each token under the logits of the position before it: [B, T, V] x [B, T] -> [B, T].

    Computed as the chosen logit minus logsumexp over the vocabulary, so no full [B, T, V] log-softmax is kept.
    Upcast to float32 first: bf16 log-probs (8 bits of mantissa) are too coarse for importance ratios near 1.
    """
    pred = _tempered(logits[:, :-1], temperature)  # [B, T-1, V]: position t-1 predicts token t
    target = input_ids[:, 1:]  # [B, T-1]
    chosen = pred.gather(-1, target.unsqueeze(-1)).squeeze(-1)  # [B, T-1]
    logp = chosen - torch.logsumexp(pred, dim=-1)  # [B, T-1]
    logp = torch.where(attention_mask[:, 1:].bool(), logp, 0.0)
    return F.pad(logp, (1, 0), value=0.0)  # [B, T]: the first token has no prefix


def _tempered(logits: Tensor, temperature: float) -> Tensor:
    """The logits in float32 over `temperature`; at 1 no copy beyond the upcast (the logits are most of the
    update's activation memory)."""
    pred = logits.float()
    return pred if temperature == 1.0 else pred / temperature


def all_finite(*tensors: Tensor) -> bool:
    """True when no tensor holds a NaN or an infinity (check losses and gradients before an optimizer step)."""
    return all(bool(torch.isfinite(t).all()) for t in tensors)
