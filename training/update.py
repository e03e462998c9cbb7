"""The optimizer step: the clipped token-level policy-gradient loss over a step's sequences, accumulated over
micro-batches, on one process or split over data-parallel ranks (training/ray_trainer.py).

    stats = update(model, optimizer, sequences, cfg, ref_model=None, dp=None)   # UpdateStats; skipped says why

Without a KL term a sequence whose every advantage is 0 (a group whose rewards are all equal under outcome credit,
or whose turn advantages all cancel) has no gradient: its clipped surrogate is 0 whatever the ratio. Such
sequences are left out of the forward and backward (`with_signal`) but still count in the loss's normaliser, so
the loss and the gradient are the whole step's; a step with no other sequence skips the optimizer step (no
momentum-only move of the weights, no weight push). The step's freed activations go back to the system after it
(conductor/heap.py: glibc would keep them, and a run grew ~3 GB a step). An off-policy sequence (an expert's
episode, training/expert_mix.py) trains at ratio 1: its old log-probs are the trained policy's own (`old_logprobs`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from conductor.heap import trim_heap
from main_agent.tokens import Batch, TrainSequence, collate, micro_batches
from training.config import TrainConfig, device_sizes
from training.loss import LossOutput, batch_logprobs, policy_loss

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class UpdateStats:
    """What one optimizer step did; `skipped` says why it did nothing (None when it stepped)."""

    pg_loss: float = math.nan
    kl: float = math.nan
    clip_frac: float = math.nan
    ratio_mean: float = math.nan
    grad_norm: float = math.nan
    n_tokens: int = 0
    tokens_skipped: int = 0
    """Masked-in tokens of the sequences left out of the forward and backward (every advantage 0)."""
    skipped: str | None = None
    lld: float | None = None
    """The likelihood-displacement term (training/loss.py) of a step with `lld_coef` > 0; None when the guard is
    off or the step was skipped, and then not logged (a run without it logs what it always did)."""

    def metrics(self) -> dict[str, float]:
        return {
            "loss/pg": self.pg_loss,
            "loss/kl": self.kl,
            "clip_frac": self.clip_frac,
            "ratio_mean": self.ratio_mean,
            "grad_norm": self.grad_norm,
            "update/tokens": self.n_tokens,
            "update/tokens_skipped": self.tokens_skipped,
            "update/skipped": float(self.skipped is not None),
            **({"loss/lld": self.lld} if self.lld is not None else {}),
        }


@dataclass(frozen=True)
class DataParallel:
    """This process's place in a data-parallel update (training/ray_trainer.py builds it): every rank gets the
    whole step and runs micro-batches rank, rank + world, ...; the gradients are summed across ranks once."""

    rank: int
    world: int
    group: ProcessGroup | None = None
    """The torch.distributed process group of the ranks; None: the default one."""


def update(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    sequences: Sequence[TrainSequence],
    cfg: TrainConfig,
    *,
    ref_model: nn.Module | None = None,
    dp: DataParallel | None = None,
) -> UpdateStats:
    """One optimizer step on all sequences; gradients accumulate over micro-batches of `micro_batch_tokens`.

    The loss is normalised by the step's total masked-in tokens, so the sum over micro-batches is the step's token
    mean. Any non-finite advantage, loss or gradient skips the whole step (logged, weights untouched), and so
    does learning rate 0, before any forward pass.
    With `dp` every rank passes the same `sequences` and steps on the same summed gradients, so the replicas stay
    identical; a skip (decided from the sequences, or from a flag all ranks share) happens on every rank together.
    """
    n_tokens = masked_tokens(sequences)
    if n_tokens == 0:
        return _skip("no sampled tokens to train on")
    if (
        cfg.lr == 0
    ):  # a control run (or an exploration step): the weights cannot move, so no gradient is computed
        return _skip("learning rate 0", tokens_skipped=n_tokens)
    if not all(math.isfinite(a) for s in sequences for a in s.advantages):
        return _skip("non-finite advantage")
    live = with_signal(sequences, cfg)
    idle = n_tokens - masked_tokens(live)
    if not live:
        return _skip("every advantage is 0: no gradient", tokens_skipped=idle)
    try:
        return _step(model, optimizer, live, cfg, ref_model=ref_model, dp=dp, n_tokens=n_tokens, idle=idle)
    finally:
        trim_heap()  # the micro-batches' activations go back to the system, else the process grows every step


def _step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    live: Sequence[TrainSequence],
    cfg: TrainConfig,
    *,
    ref_model: nn.Module | None,
    dp: DataParallel | None,
    n_tokens: int,
    idle: int,
) -> UpdateStats:
    """Backward over the sequences with a gradient, then the optimizer step unless a loss or the gradient is not
    finite (`n_tokens`: the step's, the loss's normaliser; `idle`: the tokens left out)."""
    sums = accumulate_gradients(model, live, cfg, ref_model=ref_model, dp=dp, normalizer=n_tokens)
    if sums is None:
        optimizer.zero_grad(set_to_none=True)
        return _skip("non-finite loss")
    params = [p for p in model.parameters() if p.requires_grad]
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm))
    if not math.isfinite(grad_norm):
        optimizer.zero_grad(set_to_none=True)
        return _skip("non-finite gradient")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    lld = sums["lld"] if cfg.lld_coef > 0 else None
    return UpdateStats(
        sums["pg"], sums["kl"], sums["clip"], sums["ratio"], grad_norm, n_tokens, idle, lld=lld
    )


def with_signal(sequences: Sequence[TrainSequence], cfg: TrainConfig) -> list[TrainSequence]:
    """The sequences with a gradient: all of them with a KL term (it trains every token), else those with a
    non-zero advantage on some masked-in token."""
    if cfg.kl_coef > 0:
        return list(sequences)
    return [
        s for s in sequences if any(a != 0.0 for a, m in zip(s.advantages, s.loss_mask, strict=True) if m)
    ]


def masked_tokens(sequences: Sequence[TrainSequence]) -> int:
    """The step's trained (masked-in) tokens: the loss's normaliser."""
    return sum(sum(s.loss_mask) for s in sequences)


def accumulate_gradients(
    model: nn.Module,
    sequences: Sequence[TrainSequence],
    cfg: TrainConfig,
    *,
    ref_model: nn.Module | None = None,
    dp: DataParallel | None = None,
    normalizer: int | None = None,
) -> dict[str, float] | None:
    """Backward over the step's micro-batches (with `dp`: this rank's share, then the gradients summed over the
    ranks), leaving the gradient of the step's loss in each trainable parameter's `.grad`. Returns the logged
    sums (pg, kl, lld, clip, ratio; clip and ratio as means over `sequences`' tokens), or None when a loss was not
    finite (on any rank): its gradients are partial.

    Every rank normalises by the whole step's token count (`normalizer`: the step's, when `sequences` leave out
    some of it; default their own), so the ranks' losses add up to the step's loss and a SUM of their gradients
    is its gradient (not DDP's mean)."""
    trained = masked_tokens(sequences)
    assert trained > 0, f"no trained tokens in {len(sequences)} sequences"
    n_tokens = normalizer if normalizer is not None else trained
    model.train()
    sums = {"pg": 0.0, "kl": 0.0, "lld": 0.0, "clip": 0.0, "ratio": 0.0}
    device = str(next(model.parameters()).device)
    # A run's learner set the size (training/learner.py); a direct call with it unset gets its model's device's.
    tokens = cfg.micro_batch_tokens or device_sizes(device).micro_batch_tokens
    chunks = micro_batches(sequences, max_tokens=tokens, share_prefix=cfg.share_prefix)
    finite = True
    for chunk in chunks if dp is None else chunks[dp.rank :: dp.world]:
        batch = collate(chunk, pad_id=0, device=device, share_prefix=cfg.share_prefix)
        out = micro_batch_loss(model, batch, cfg, n_tokens=n_tokens, ref_model=ref_model)
        if not math.isfinite(out.loss.item()):
            finite = False
            break  # with dp the rank still joins the all-reduces below, which tell every rank to skip
        out.loss.backward()
        share = out.n_tokens / trained
        sums["pg"] += out.pg_loss.item()
        sums["kl"] += out.kl.item()
        sums["lld"] += out.lld.item()
        sums["clip"] += out.clip_frac.item() * share
        sums["ratio"] += out.ratio_mean.item() * share
    if dp is not None:
        finite = all_reduce_sums(sums, finite=finite, dp=dp, device=device)
        if finite:
            all_reduce_gradients(model, dp)
    return sums if finite else None


def all_reduce_sums(sums: dict[str, float], *, finite: bool, dp: DataParallel, device: str) -> bool:
    """Sum the logged sums over the ranks (in place) and whether every rank's losses were finite."""
    import torch.distributed as dist

    values = torch.tensor([*sums.values(), float(not finite)], dtype=torch.float64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.SUM, group=dp.group)
    for key, value in zip(list(sums), values[:-1].tolist(), strict=True):
        sums[key] = value
    return values[-1].item() == 0.0


def all_reduce_gradients(model: nn.Module, dp: DataParallel) -> None:
    """Sum the trainable parameters' gradients over the ranks in one flat bucket; each `.grad` becomes a view of
    it. A parameter no micro-batch of a rank reached counts as zero there (and ends with a zero gradient rather
    than none when no rank reached it: AdamW then still decays its moments, as under DDP)."""
    import torch.distributed as dist

    params = [p for p in model.parameters() if p.requires_grad]
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    bucket = torch.cat([g.reshape(-1) for g in grads])  # [sum of numel]: one collective, not one per tensor
    dist.all_reduce(bucket, op=dist.ReduceOp.SUM, group=dp.group)
    for p, flat in zip(params, bucket.split([p.numel() for p in params]), strict=True):
        p.grad = flat.view_as(p)


def micro_batch_loss(
    model: nn.Module, batch: Batch, cfg: TrainConfig, *, n_tokens: int, ref_model: nn.Module | None
) -> LossOutput:
    """The loss of one micro-batch ([B, T] tensors after its shared prefix) as its share of the step's token mean
    (`n_tokens`)."""
    device = next(model.parameters()).device.type
    with torch.autocast(device, dtype=torch.bfloat16, enabled=cfg.precision == "bf16"):
        # [B, T], float32 whatever the matmuls ran in; at the sampler's temperature, as its old log-probs are
        logprobs = batch_logprobs(model, batch, temperature=cfg.sampling.temperature)
        ref = None
        if ref_model is not None and cfg.kl_coef > 0:
            with torch.no_grad():
                ref = batch_logprobs(ref_model, batch, temperature=cfg.sampling.temperature)
    return policy_loss(
        logprobs,
        old_logprobs(logprobs, batch),
        batch.advantages,
        batch.loss_mask,
        clip_eps_low=cfg.clip_eps_low,
        clip_eps_high=cfg.clip_eps_high,
        ref_logprobs=ref,
        kl_coef=cfg.kl_coef,
        lld_coef=cfg.lld_coef,
        normalizer=n_tokens,
    )


def old_logprobs(logprobs: torch.Tensor, batch: Batch) -> torch.Tensor:
    """The micro-batch's old log-probs [B, T]: the sampler's, but on an off-policy row (an expert's episode,
    training/expert_mix.py) the trained policy's own, detached: ratio 1 on every token of it (one optimizer step a
    batch), so the clip never applies and its gradient is A grad log p."""
    old = cast(torch.Tensor, batch.old_logprobs)  # [B, T]
    off = cast("torch.Tensor | None", batch.off_policy)  # [B]
    if off is None or not bool(off.any()):
        return old
    return torch.where(off[:, None], logprobs.detach(), old)


def _skip(reason: str, *, tokens_skipped: int = 0) -> UpdateStats:
    logger.warning("optimizer step skipped: %s", reason)
    return UpdateStats(tokens_skipped=tokens_skipped, skipped=reason)
