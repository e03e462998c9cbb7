"""The synchronous RL loop for the main policy, top to bottom (`conductor train CONFIG [--set key=value ...]`).

Per step s = 1 .. steps:
    1. pick B tasks from a seeded shuffle (the cursor is part of the checkpoint) and reseed torch from (seed, s)
    2. collect: G episodes per task, all concurrent, so the policy batches their turns into one generate
       (branch credit then continues exact replays of chosen turns' states: training/branching.py)
    3. filter_groups: drop groups with an infrastructure failure (fail the step when too many failed)
    4. score: final reward from the task, turn rewards from what each turn did
    5. group_to_sequences: group advantages (outcome or turn credit) laid onto each episode's tokens
    6. update: one optimizer step of the clipped token-level loss, accumulated over micro-batches (split over
       data-parallel ranks on Ray: training/ray_trainer.py)
    7. sync_weights: push the trained weights to the sampler (its own model copy, or a vLLM engine: sampler.py)
    8. log a metrics row and a printed line, save the rollouts, checkpoint every `save_every` steps and at the end

Exact resume: model, optimizer, scheduler, cursor and step come back from the checkpoint, and torch is reseeded
from (seed, step) before each step's sampling, so a resumed run samples and learns exactly what an uninterrupted
one would have (given the same episode concurrency; batched generation pads differently when batches differ).
train_async.py is the same loop with step s+1's rollouts running while step s trains.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import torch
from torch import nn

from main_agent.tokens import Batch, TrainSequence, collate, micro_batches, to_sequences
from main_agent.types import Episode, Turn
from tool_server.client import ToolClient
from training import tasks as task_data
from training.advantages import BranchValues, EpisodeCredit, TurnCredit, branch_advantages, group_advantages
from training.branching import BranchStats, branch_values
from training.config import TrainConfig
from training.loss import LossOutput, batch_logprobs, policy_loss
from training.metrics import reward_metrics, rollout_metrics
from training.rewards import (
    TurnFacts,
    TurnRewardParts,
    TurnRewardWeights,
    call_key,
    contains_evidence,
    turn_reward,
)
from training.run import (
    Run,
    StepHook,
    collect,
    finish_step,
    next_tasks,
    seed_step,
    start_run,
    steps_left,
    tool_session,
)
from training.sampler import sync_weights
from training.tasks import Task

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

logger = logging.getLogger(__name__)

# Parse errors that are not a malformed call: an answer dropped beside valid calls, calls past the per-turn cap.
# Every other parse error (no action, bad JSON, unknown tool, ...) counts as one malformed call.
NOT_MALFORMED = frozenset({"answer_ignored", "too_many_calls"})


class InfraFailure(RuntimeError):
    """Too many episodes of a step failed for infrastructure reasons to train on the rest."""


# ---------------------------------------------------------------- scoring and credit


def score(episode: Episode, task: Task, weights: TurnRewardWeights) -> list[TurnRewardParts]:
    """Fill `episode.reward` (the task's final reward) and `episode.turn_rewards`; return each turn's parts."""
    parts = [turn_reward(facts, weights) for facts in turn_facts(episode, task)]
    episode.reward = task_data.reward_for(task, episode.answer)
    episode.turn_rewards = [p.total for p in parts]
    return parts


def turn_facts(episode: Episode, task: Task) -> list[TurnFacts]:
    """Per turn: new valid calls, malformed ones (parse errors, rejected arguments), repeats, first evidence,
    the score of items recorded for the first time."""
    seen: set[str] = set()
    recorded: set[int] = set()
    found = False
    facts = []
    for turn in episode.turns:
        first = [r for r in turn.records if r.item not in recorded and not recorded.add(r.item)]  # type: ignore[func-returns-value]
        progress = sum(task_data.item_reward(task, r.item, r.text) for r in first) / max(len(task.items), 1)
        valid = repeated = 0
        malformed = sum(e.kind not in NOT_MALFORMED for e in turn.parse_errors)
        for call, result in zip(turn.calls, turn.results, strict=True):
            key = call_key(call.name, call.arguments)
            if result.error_kind == "invalid_args":
                malformed += 1
            elif key in seen:
                repeated += 1
            else:
                valid += 1
            seen.add(key)
        evidence = not found and any(
            r.ok and contains_evidence(r.observation, task.reference) for r in turn.results
        )
        found = found or evidence
        facts.append(TurnFacts(valid, malformed, repeated, evidence, progress))
    return facts


def anchor(turn: Turn) -> str | None:
    """Turn credit's anchor: the key of the turn's first call (turns asking the same thing share a baseline)."""
    return call_key(turn.calls[0].name, turn.calls[0].arguments) if turn.calls else None


def group_to_sequences(
    episodes: Sequence[Episode], cfg: TrainConfig, branches: Sequence[Sequence[BranchValues]] | None = None
) -> list[TrainSequence]:
    """One group's advantages laid onto its episodes' tokens; episodes without turns have nothing to train.
    Branch credit reads each episode's continuation values (`branches`, training/branching.py)."""
    credits = []
    for e in episodes:
        assert e.reward is not None, f"episode of {e.task_id} is not scored"
        turns = tuple(TurnCredit(r, anchor(t)) for r, t in zip(e.turn_rewards, e.turns, strict=True))
        credits.append(EpisodeCredit(e.reward, turns))
    if cfg.credit.mode == "branch":
        assert branches is not None, "branch credit needs the continuations' values"
        advantages = branch_advantages(credits, branches, normalize_std=cfg.credit.normalize_std)
    else:
        advantages = group_advantages(credits, cfg.credit)
    trainable = zip(episodes, advantages, strict=True)
    return [s for e, a in trainable if e.turns and e.exact for s in to_sequences(e, a)]


def filter_groups(groups: Sequence[list[Episode]], cfg: TrainConfig) -> list[list[Episode]]:
    """Groups without infrastructure failures; raise InfraFailure when the episodes that cannot be trained on
    (infra-failed, or inexact: a sampler that re-tokenised or lost log-probs) exceed the limit.

    An inexact episode keeps its group: its reward is a real outcome of the policy and serves the baseline, but
    `group_to_sequences` lays none of its tokens into the loss (its log-probs are stand-ins)."""
    episodes = [e for g in groups for e in g]
    failed = [e for e in episodes if e.stop_reason == "infra_failed"]
    inexact = [e for e in episodes if e.stop_reason != "infra_failed" and not e.exact]
    if episodes and (len(failed) + len(inexact)) / len(episodes) > cfg.max_infra_failure_frac:
        reasons = sorted({str(e.infra_error) for e in failed})[:3]
        if inexact:
            reasons.append(f"{len(inexact)} inexact (re-tokenised ids or missing log-probs)")
        raise InfraFailure(
            f"{len(failed) + len(inexact)} of {len(episodes)} episodes cannot be trained on "
            f"(limit {cfg.max_infra_failure_frac:.0%}): {'; '.join(reasons)}"
        )
    return [list(g) for g in groups if not any(e.stop_reason == "infra_failed" for e in g)]


@dataclass(frozen=True)
class Scored:
    """A step's valid groups after scoring, and what they train on."""

    groups: list[list[Episode]]
    sequences: list[TrainSequence]
    successes: list[bool]
    turn_parts: list[TurnRewardParts]
    ledgers: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    """Item tasks, per episode: the share of items recorded, and the share recorded right (`ledger_scores`)."""


def ledger_scores(episode: Episode, task: Task) -> tuple[float, float]:
    """The share of the task's items the episode recorded, and the share it recorded right (item scores)."""
    entries = [(i, text) for i, text in enumerate(episode.ledger, start=1) if text is not None]
    right = sum(task_data.item_reward(task, i, text) for i, text in entries)
    return len(entries) / len(task.items), right / len(task.items)


def score_groups(
    groups: Sequence[list[Episode]],
    tasks: Sequence[Task],
    cfg: TrainConfig,
    branches: Sequence[list[list[BranchValues]]] | None = None,
) -> Scored:
    """filter_groups, then score every episode and build the training sequences (`branches[g]`: group g's
    continuation values under branch credit)."""
    by_id = {t.task_id: t for t in tasks}
    kept = filter_groups(groups, cfg)
    parts: list[TurnRewardParts] = []
    for e in (e for g in kept for e in g):
        parts += score(e, by_id[e.task_id], cfg.turn_rewards)
    successes = [task_data.success(by_id[e.task_id], e.answer) for g in kept for e in g]
    values = branches if branches is not None else [None] * len(groups)
    valid = [
        (g, b)
        for g, b in zip(groups, values, strict=True)
        if not any(e.stop_reason == "infra_failed" for e in g)
    ]
    sequences = [s for g, b in valid for s in group_to_sequences(g, cfg, b)]
    ledgers = [ledger_scores(e, by_id[e.task_id]) for g in kept for e in g if by_id[e.task_id].items]
    return Scored(kept, sequences, successes, parts, ledgers)


# ---------------------------------------------------------------- the optimizer step


@dataclass(frozen=True)
class UpdateStats:
    """What one optimizer step did; `skipped` says why it did nothing (None when it stepped)."""

    pg_loss: float = math.nan
    kl: float = math.nan
    clip_frac: float = math.nan
    ratio_mean: float = math.nan
    grad_norm: float = math.nan
    n_tokens: int = 0
    skipped: str | None = None

    def metrics(self) -> dict[str, float]:
        return {
            "loss/pg": self.pg_loss,
            "loss/kl": self.kl,
            "clip_frac": self.clip_frac,
            "ratio_mean": self.ratio_mean,
            "grad_norm": self.grad_norm,
            "update/tokens": self.n_tokens,
            "update/skipped": float(self.skipped is not None),
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
    mean. Any non-finite advantage, loss or gradient skips the whole step (logged, weights untouched).
    With `dp` every rank passes the same `sequences` and steps on the same summed gradients, so the replicas stay
    identical; a skip (decided from the sequences, or from a flag all ranks share) happens on every rank together.
    """
    n_tokens = masked_tokens(sequences)
    if n_tokens == 0:
        return _skip("no sampled tokens to train on")
    if not all(math.isfinite(a) for s in sequences for a in s.advantages):
        return _skip("non-finite advantage")
    sums = accumulate_gradients(model, sequences, cfg, ref_model=ref_model, dp=dp)
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
    return UpdateStats(sums["pg"], sums["kl"], sums["clip"], sums["ratio"], grad_norm, n_tokens)


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
) -> dict[str, float] | None:
    """Backward over the step's micro-batches (with `dp`: this rank's share, then the gradients summed over the
    ranks), leaving the gradient of the step's loss in each trainable parameter's `.grad`. Returns the logged
    sums (pg, kl, clip, ratio), or None when a loss was not finite (on any rank): its gradients are partial.

    Every rank normalises by the whole step's token count, so the ranks' losses add up to the step's loss and a
    SUM of their gradients is its gradient (not DDP's mean)."""
    n_tokens = masked_tokens(sequences)
    assert n_tokens > 0, f"no trained tokens in {len(sequences)} sequences"
    model.train()
    sums = {"pg": 0.0, "kl": 0.0, "clip": 0.0, "ratio": 0.0}
    device = str(next(model.parameters()).device)
    chunks = micro_batches(sequences, max_tokens=cfg.micro_batch_tokens, share_prefix=cfg.share_prefix)
    finite = True
    for chunk in chunks if dp is None else chunks[dp.rank :: dp.world]:
        batch = collate(chunk, pad_id=0, device=device, share_prefix=cfg.share_prefix)
        out = micro_batch_loss(model, batch, cfg, n_tokens=n_tokens, ref_model=ref_model)
        if not math.isfinite(out.loss.item()):
            finite = False
            break  # with dp the rank still joins the all-reduces below, which tell every rank to skip
        out.loss.backward()
        share = out.n_tokens / n_tokens
        sums["pg"] += out.pg_loss.item()
        sums["kl"] += out.kl.item()
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
        logprobs = batch_logprobs(model, batch)  # [B, T], float32 whatever the matmuls ran in
        ref = None
        if ref_model is not None and cfg.kl_coef > 0:
            with torch.no_grad():
                ref = batch_logprobs(ref_model, batch)
    return policy_loss(
        logprobs,
        batch.old_logprobs,
        batch.advantages,
        batch.loss_mask,
        clip_eps_low=cfg.clip_eps_low,
        clip_eps_high=cfg.clip_eps_high,
        ref_logprobs=ref,
        kl_coef=cfg.kl_coef,
        normalizer=n_tokens,
    )


def _skip(reason: str) -> UpdateStats:
    logger.warning("optimizer step skipped: %s", reason)
    return UpdateStats(skipped=reason)


# ---------------------------------------------------------------- rollouts


def step_row(
    step: int,
    version: int,
    collected: Sequence[list[Episode]],
    scored: Scored,
    stats: UpdateStats,
    *,
    seconds: tuple[float, float, float],
    stale_dropped: int = 0,
    branching: BranchStats | None = None,
) -> dict[str, float]:
    """The metrics row of one step (keys listed in training/metrics.py); `seconds`: rollout, train, weight sync."""
    return {
        "step": step,
        "policy_version": version,
        **reward_metrics(
            [e for g in scored.groups for e in g],
            successes=scored.successes,
            turn_parts=scored.turn_parts,
            ledgers=scored.ledgers,
        ),
        **rollout_metrics([e for g in collected for e in g], seconds=seconds[0]),
        **stats.metrics(),
        "episodes/stale_dropped": stale_dropped,
        "time/train": seconds[1],
        "time/weight_sync": seconds[2],
        **(branching.metrics() if branching is not None else {}),
    }


# ---------------------------------------------------------------- the loop


async def train_loop(run: Run, *, transport: httpx.AsyncBaseTransport | None = None) -> None:
    """Steps state.step+1 .. steps, one after the other: collect, learn, sync."""
    cfg = run.cfg
    async with tool_session(run, transport=transport) as (tools, tasks):
        for step in steps_left(run):
            batch, state = next_tasks(tasks, run.state, cfg)
            seed_step(cfg, step)
            t0 = time.monotonic()
            groups = await collect(run, tools, batch)
            branches, branching = await branch(run, tools, batch, groups, step)
            t1 = time.monotonic()
            scored = score_groups(groups, batch, cfg, branches)
            stats = update(run.model, run.optimizer, scored.sequences, cfg, ref_model=run.ref_model)
            t2 = time.monotonic()
            sync_s = await sync_weights(run.model, run.policy, cfg) if stats.skipped is None else 0.0
            seconds = (t1 - t0, t2 - t1, sync_s)
            row = step_row(
                step, run.policy.version, groups, scored, stats, seconds=seconds, branching=branching
            )
            episodes = [e for g in groups for e in g]
            finish_step(
                run, step, row, state=state, episodes=episodes, stepped=stats.skipped is None,
                successes=scored.successes, items=len(batch[0].items),
            )  # fmt: skip


async def branch(
    run: Run, tools: ToolClient, tasks: Sequence[Task], groups: Sequence[list[Episode]], step: int
) -> tuple[list[list[list[BranchValues]]] | None, BranchStats | None]:
    """Branch credit's continuations for this step's groups (training/branching.py); nothing for other modes."""
    if run.cfg.credit.mode != "branch":
        return None, None

    def reward_of(task: Task, episode: Episode) -> float:
        score(episode, task, run.cfg.turn_rewards)
        assert episode.reward is not None
        return episode.reward

    return await branch_values(
        groups, tasks, policy=run.policy, tools=tools, tokenizer=run.tokenizer, cfg=run.cfg, step=step,
        reward_of=reward_of,
    )  # fmt: skip


def train(
    cfg: TrainConfig,
    *,
    resume: Path | None = None,
    force: bool = False,
    on_step: StepHook | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> Path:
    """Train (or resume the run in `resume`) up to `cfg.steps`; returns the run directory. `on_step` gets every
    step's metrics row; `transport` replaces the tool server (tests pass an `httpx.MockTransport`)."""
    run = drive(train_loop, cfg, resume=resume, force=force, on_step=on_step, transport=transport)
    return asyncio.run(run)


async def drive(
    loop: Callable[..., Awaitable[None]],
    cfg: TrainConfig,
    *,
    resume: Path | None,
    force: bool,
    on_step: StepHook | None,
    transport: httpx.AsyncBaseTransport | None,
) -> Path:
    """Start (or resume) a run, drive `loop` over it, release the sampler and the log whatever happens."""
    run = await start_run(cfg, resume=resume, force=force, on_step=on_step)
    try:
        await loop(run, transport=transport)
    finally:
        await run.policy.aclose()
        run.log.close()
    return run.cfg.run_dir
