"""Supervised warm-start: a scripted expert plays tasks through the real tool server; the policy imitates it.

    conductor sft --set 'tasks=["plate_reading"]' --set limit=32 --set epochs=2 --set out_dir=runs/sft

1. The scripted experts (training/experts.py: `OraclePolicy`, each family's `oracle_reply` through the real tool
   server) play the tasks, and `generate_expert_episodes` keeps the episodes worth imitating (a right answer;
   item tasks: `experts.worth_imitating`).
2. `sft` minimises the cross-entropy of the oracle's tokens only (the loss mask of `main_agent.tokens`: 0 on the
   prompt and every observation), on exactly the ids the rollout laid down.
3. `run_sft` evaluates a small dev sample before and after (format validity, success) and reports both.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from conductor.models import portable_adapter
from conductor.settings import load_settings, shared
from main_agent.backends import load_policy
from main_agent.policy import SamplingConfig
from main_agent.rollout import RolloutConfig
from main_agent.tokens import collate, micro_batches, to_sequences
from main_agent.transformers_policy import TransformersPolicy
from main_agent.types import Episode
from tool_server.client import ToolClient
from tool_server.embedded import ToolAccess
from training import tasks as task_data
from training.config import RunSettings, device_sizes
from training.evaluate import EvalConfig, EvalReport, evaluate_policy
from training.experts import play_experts, worth_imitating
from training.loss import all_finite, token_logprobs
from training.metrics import load_episodes, save_rollouts
from training.play import tool_session
from training.tasks import Task

logger = logging.getLogger(__name__)

MAX_GRAD_NORM = 1.0  # the usual clip for fine-tuning a small LM: one odd batch cannot wreck the weights


# ---------------------------------------------------------------- demonstrations


async def generate_expert_episodes(
    tasks: Sequence[Task], tools: ToolClient, tokenizer, cfg: SFTConfig
) -> list[Episode]:
    """The oracle's successful episodes, in task order; the kept and played counts per family are logged."""
    episodes = await play_experts(
        tasks, tools, tokenizer, rollout=cfg.rollout, max_concurrent=cfg.max_concurrent_episodes,
        trust_reference=cfg.trust_reference, mistakes=cfg.mistakes, seed=cfg.run.seed, chain=cfg.chain,
    )  # fmt: skip
    played = Counter(t.family for t in tasks)
    kept = [(t, e) for t, e in zip(tasks, episodes, strict=True) if worth_imitating(t, e)]
    counts = Counter(t.family for t, _ in kept)
    recovered = Counter(t.family for t, e in kept if not all(turn.trained for turn in e.turns))
    gave_up = Counter(t.family for t, e in kept if task_data.gave_up(t, e.answer))
    for family in sorted(played):
        logger.info(
            "expert episodes %s: %d of %d kept (%d of them giving up in plain words), %d recovering from a "
            "deliberate mistake", family, counts[family], played[family], gave_up[family], recovered[family],
        )  # fmt: skip
    return [e for _, e in kept]


# ---------------------------------------------------------------- supervised fine-tuning


def masked_nll(model: nn.Module, batch) -> torch.Tensor:
    """Mean negative log-likelihood of the tokens with loss mask 1 (the expert's completions): a scalar."""
    logprobs = token_logprobs(
        model, batch.input_ids, batch.attention_mask, loss_mask=batch.loss_mask
    )  # [B, T]
    mask = batch.loss_mask  # [B, T], 0 on prompt, observations and padding
    return -(logprobs * mask).sum() / mask.sum().clamp(min=1.0)


def sft(
    model: nn.Module,
    tokenizer,
    episodes: Sequence[Episode],
    *,
    epochs: int,
    lr: float,
    micro_batch_tokens: int,
    seed: int = 0,
) -> list[float]:
    """AdamW on the expert's tokens, one optimizer step per length-sorted micro-batch, micro-batches shuffled
    each epoch; returns the loss of every step. A non-finite loss or gradient raises: the data is fixed and
    clean, so it is a bug or divergence, not noise to skip."""
    sequences = [s for e in episodes if e.turns for s in to_sequences(e, [0.0] * len(e.turns))]
    if not sequences:
        raise ValueError("no expert episodes to fine-tune on")
    batches = micro_batches(sequences, max_tokens=micro_batch_tokens)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)
    device = str(next(model.parameters()).device)
    model.train()
    losses: list[float] = []
    for epoch in range(epochs):
        random.Random(seed * 1_000_003 + epoch).shuffle(batches)
        for chunk in batches:
            losses.append(
                _step(
                    model, optimizer, collate(chunk, pad_id=pad_id, device=device), params, step=len(losses)
                )
            )
        logger.info("sft epoch %d: mean loss %.4f", epoch + 1, sum(losses[-len(batches) :]) / len(batches))
    return losses


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, batch, params: list, *, step: int) -> float:
    loss = masked_nll(model, batch)
    if not all_finite(loss):
        raise FloatingPointError(f"sft step {step}: loss is {loss.item()}")
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
    if not all_finite(grad_norm):
        raise FloatingPointError(f"sft step {step}: gradient norm is {grad_norm.item()}")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.item())


# ---------------------------------------------------------------- the entry point


@dataclass(frozen=True)
class SFTConfig:
    """One supervised warm-start of the main policy on expert episodes (`conductor sft`)."""

    run: RunSettings = shared(lambda: RunSettings(limit=16))
    """The policy to start from, the split demonstrated and the first `limit` tasks of each family (on 2 CPU cores
    each expert episode costs 10-60 s), data folder, and the seed of the micro-batch order and the evaluations:
    keys of this table."""
    tasks: tuple[str, ...] = ("multihop_pages", "plate_reading")
    """Task families to demonstrate (keys of `training.tasks.FAMILIES`)."""
    limits: tuple[int, ...] = ()
    """Tasks of each family in `tasks`, in its order, where families need different numbers (one whose expert
    succeeds less often needs more tasks for as many demonstrations); empty: `limit` for every family."""
    items: tuple[int, ...] = (1, 2, 4)
    """Item families (plate_audit, multihop_batch): one set of `limit` tasks per value, a mix of horizons, so the
    policy has recorded and folded before RL grows N."""
    demonstrations: tuple[Path, ...] = ()
    """Kept expert episodes of earlier runs (their `expert_episodes.jsonl`), imitated besides the experts played
    now, so a recipe that changes one family replays only that family; an episode of a task played now is
    dropped for the new one. Only the experts' code makes them: reuse files made by the code you run."""
    epochs: int = 3
    """Passes over the kept expert episodes."""
    lr: float = 1e-5
    """AdamW learning rate: 1e-5 suits full fine-tuning of a 135M model; LoRA adapters need ~1e-4."""
    lora_rank: int = 0
    """0 fine-tunes every weight; > 0 trains a LoRA of this rank on q, k, v, o and saves only the adapter (the
    shipped default policy is one: examples/default_policy.toml)."""
    micro_batch_tokens: int | None = None
    """Padded tokens per optimizer step; the [tokens, vocab] logits dominate memory (400 MB at 2048 x 49152).
    None (the default): by the policy's device, as training sizes it (`training.config.device_sizes`: 2048 on a
    CPU, up to 65,536 on a GPU); the report records the value used."""
    out_dir: Path = Path("runs/sft")
    """Where the model (`model/`), the expert episodes, the report and the task pages and videos go."""
    max_concurrent_episodes: int = 4
    """Episodes in flight at once, expert and evaluation alike."""
    eval_split: str = "dev"
    """Split of the before/after evaluation."""
    eval_n: int = 8
    """Evaluation tasks per family (the first ones of `eval_split`); 0 skips the evaluation."""
    trust_reference: bool = False
    """The oracle answers the reference even when no observation showed it (see the module docstring)."""
    mistakes: float = 0.0
    """Probability that the expert makes its family's mistake where one is offered (`mistake_reply`: plates
    zoom on a region before find_text, or on r2 right after it), untrained, so that the demonstration shows the
    recovery a refused call needs, or the retry a read without a plate needs (`OraclePolicy`). 0: none."""
    chain: bool = True
    """corpus_qa's expert on a question with two supporting pages: where the first read said "not in the page",
    read the search's next two hits and answer the first useful read (`training.tasks.corpus_qa`); false: answer
    what the first read answered whatever it was (v24's plan)."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """The budgets the demonstrations and both evaluations play under (`[rollout]`): the training defaults, so
    every demonstration fits the turns and tokens RL will allow."""
    tools: ToolAccess = field(default_factory=ToolAccess)
    """The tool server (`[tools]`): a running one, or one in this process set up for the tasks."""

    def __post_init__(self) -> None:
        if self.limits and len(self.limits) != len(self.tasks):
            raise ValueError(
                f"limits has {len(self.limits)} values for {len(self.tasks)} tasks: one a family"
            )


MOVED = {"max_new_tokens": "rollout.max_new_tokens", "tools_url": "tools.url"}
"""The flat keys of earlier versions and where each went."""


def load_sft_config(overrides: Sequence[str], path: Path | None = None) -> SFTConfig:
    """Defaults, the TOML file at `path` (if any), then `key=value` overrides, values read as TOML
    (`tasks=["video_qa"]`, `limit=8`, `rollout.max_turns=6`)."""
    return load_settings(SFTConfig, path, overrides, moved=MOVED)


def family_tasks(cfg: SFTConfig, split: str, limit: int | None, limits: Sequence[int] = ()) -> list[Task]:
    """`limit` tasks of each family, or its own of `limits` (of each horizon in `items`, for item families)."""
    load = functools.partial(task_data.load_family, split=split, data_dir=cfg.run.data_dir)
    own = dict(zip(cfg.tasks, limits, strict=True)) if limits else {}
    return [
        t
        for family in cfg.tasks
        for n in (cfg.items if task_data.family_named(family).has_items else (None,))
        for t in load(family, limit=own.get(family, limit), items=n)
    ]


@dataclass(frozen=True)
class SFTReport:
    """What `conductor sft` did: demonstrations kept, losses, and the evaluations before and after."""

    expert_tasks: int
    expert_episodes: int
    losses: list[float]
    before: EvalReport | None
    after: EvalReport | None
    model_dir: Path
    micro_batch_tokens: int
    """The size the fine-tuning used (`SFTConfig.micro_batch_tokens`, or the device's when unset)."""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, default=str)


async def _demonstrate_and_learn(cfg: SFTConfig, policy: TransformersPolicy, tokenizer) -> SFTReport:
    """Evaluate on dev, play the oracle on train, fine-tune `policy.model`, evaluate again (all in one tool
    session)."""
    train = family_tasks(cfg, cfg.run.split, cfg.run.limit, cfg.limits)
    dev = family_tasks(cfg, cfg.eval_split, cfg.eval_n) if cfg.eval_n else []
    # the run's seed; the policy and the tasks are handed to evaluate_policy below
    eval_cfg = EvalConfig(
        run=cfg.run, max_concurrent_episodes=cfg.max_concurrent_episodes, rollout=cfg.rollout
    )
    reports: list[EvalReport] = []
    session = tool_session(
        [*train, *dev], work_dir=cfg.out_dir / "work", access=cfg.tools, data_dir=cfg.run.data_dir
    )
    async with session as (tools, ready):
        train, dev = ready[: len(train)], ready[len(train) :]

        async def check(label: str) -> None:
            if dev:
                report, _ = await evaluate_policy(
                    policy, tokenizer, dev, tools=tools, cfg=eval_cfg, label=label
                )
                reports.append(report)

        await check("before sft")
        episodes = recorded_demonstrations(cfg.demonstrations, replaced=train)
        episodes += await generate_expert_episodes(train, tools, tokenizer, cfg)
        save_rollouts(cfg.out_dir / "expert_episodes.jsonl", episodes)
        tokens = micro_batch_tokens(cfg, str(next(policy.model.parameters()).device))
        learn = functools.partial(sft, epochs=cfg.epochs, lr=cfg.lr, micro_batch_tokens=tokens)
        losses = await asyncio.to_thread(learn, policy.model, tokenizer, episodes, seed=cfg.run.seed)
        await check("after sft")
    await policy.aclose()
    before, after = (reports[0], reports[1]) if reports else (None, None)
    return SFTReport(len(train), len(episodes), losses, before, after, cfg.out_dir / "model", tokens)


def recorded_demonstrations(paths: Sequence[Path], *, replaced: Sequence[Task]) -> list[Episode]:
    """The episodes of `paths`, in order, but those of a task in `replaced` (played again now); the count per
    file is logged."""
    again = {t.task_id for t in replaced}
    kept: list[Episode] = []
    for path in paths:
        episodes = [e for e in load_episodes(Path(path)) if e.task_id not in again]
        logger.info("recorded demonstrations %s: %d episodes", path, len(episodes))
        kept += episodes
    return kept


def micro_batch_tokens(cfg: SFTConfig, device: str, *, memory_gib: float | None = None) -> int:
    """`cfg.micro_batch_tokens`, or where unset the size for `device` and its memory (`memory_gib` None: asked of
    the device), as training's learner chooses it."""
    if cfg.micro_batch_tokens is not None:
        return cfg.micro_batch_tokens
    return device_sizes(device, memory_gib).micro_batch_tokens


def run_sft(cfg: SFTConfig) -> SFTReport:
    """The `conductor sft` entry point: the fine-tuned checkpoint goes to `<out_dir>/model`, the report beside
    it (`sft_report.json`)."""
    torch.manual_seed(cfg.run.seed)
    # In process: SFT trains these weights; the before/after evaluations decode them greedily.
    sampling = SamplingConfig(backend="transformers", temperature=0.0)
    policy, tokenizer = load_policy(
        cfg.run.policy,
        sampling,
        lora_rank=cfg.lora_rank,
        max_batch=cfg.max_concurrent_episodes,
        seed=cfg.run.seed,
    )
    assert isinstance(policy, TransformersPolicy), policy
    report = asyncio.run(_demonstrate_and_learn(cfg, policy, tokenizer))
    policy.model.save_pretrained(report.model_dir)
    portable_adapter(report.model_dir)
    tokenizer.save_pretrained(report.model_dir)  # type: ignore[attr-defined]
    (cfg.out_dir / "sft_report.json").write_text(report.to_json() + "\n", encoding="utf-8")
    return report
