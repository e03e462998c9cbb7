"""The trained policy and what steps it, built alike wherever a run trains.

    learner = load_learner(cfg)                    # the policy on its device, its reference, AdamW, the schedule;
                                                   # learner.cfg: precision and sizes made concrete for it
    state = resume_learner(learner, checkpoint)    # a checkpoint's weights, optimizer, schedule, RNG: its state
    model, tokenizer = trained_model(cfg, device="cpu")   # the policy's structure alone (a Ray rollout worker's)

Built in this process (training/local_session.py) and in every data-parallel trainer worker on Ray
(training/ray_trainer.py); `trained_model` is the one place the trained model is made, so every process that
builds it holds the same LoRA adapters.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from conductor.models import native_bf16, resolve_model
from main_agent.transformers_policy import load_model
from training import checkpoint as ckpt
from training.checkpoint import TrainState
from training.config import TrainConfig, with_device_sizes

if TYPE_CHECKING:
    from training.checkpoint import Model

logger = logging.getLogger(__name__)


@dataclass
class Learner:
    """The trained policy and what steps it: in this process (training/local_session.py) and in every
    data-parallel trainer worker on Ray (training/ray_trainer.py)."""

    cfg: TrainConfig
    """The run's settings made concrete for the model's device: precision (`with_precision`), micro-batch and
    episodes in flight (`with_device_sizes`)."""
    model: Model
    tokenizer: object
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    ref_model: nn.Module | None
    """The frozen starting policy the KL is measured against (kl_coef > 0), else None."""


def trained_model(cfg: TrainConfig, *, device: str):
    """The policy a run trains, on `device`, and its tokenizer: `cfg.run.policy`'s weights, with fresh LoRA
    adapters (`lora_rank` > 0) drawn from `cfg.run.seed`, so every process that builds it (the learner, each
    Ray trainer and rollout worker) holds the same ones. Raises ModelNotFound for an unknown policy."""
    torch.manual_seed(cfg.run.seed)  # LoRA initialisation draws from it
    return load_model(resolve_model(cfg.run.policy), lora_rank=cfg.lora_rank, device=device)


def load_learner(cfg: TrainConfig) -> Learner:
    """The policy on its device (`trained_model`), its frozen reference when kl_coef > 0, AdamW and the linear
    warm-up schedule."""
    model, tokenizer = trained_model(cfg, device=cfg.device)
    device = str(next(model.parameters()).device)
    cfg = with_device_sizes(with_precision(cfg, device.split(":")[0]), device)
    ref_model = copy.deepcopy(model).eval().requires_grad_(False) if cfg.kl_coef > 0 else None
    params = [p for p in model.parameters() if p.requires_grad]
    # No weight decay: with all advantages 0 a step must leave the weights where they are.
    optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / (cfg.warmup_steps + 1))
    )
    return Learner(cfg, model, tokenizer, optimizer, scheduler, ref_model)


def with_precision(cfg: TrainConfig, device: str) -> TrainConfig:
    """`cfg` with precision "auto" made concrete for `device` (bf16 where the hardware has it), said in the log."""
    if cfg.precision != "auto":
        return cfg
    precision = "bf16" if native_bf16(device) else "fp32"
    logger.info("precision auto: %s on %s", precision, device)
    return dataclasses.replace(cfg, precision=precision)


def resume_learner(learner: Learner, checkpoint: Path) -> TrainState:
    """Load `checkpoint` into `learner` (weights, optimizer, schedule, RNG) at the configured learning rate;
    returns its TrainState."""
    state = ckpt.load_checkpoint(
        checkpoint, model=learner.model, optimizer=learner.optimizer, scheduler=learner.scheduler
    )
    set_learning_rate(learner.optimizer, learner.scheduler, learner.cfg.learning_rate)
    logger.info("resuming %s at step %d", checkpoint, state.step)
    return state


def set_learning_rate(
    optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR, lr: float
) -> None:
    """Make a resumed run use the configured learning rate, not the one its checkpoint saved (the optimizer and
    scheduler states both carry it). With lr unchanged this recomputes the same value, so resume stays exact."""
    if scheduler.base_lrs[0] != lr:
        logger.warning("learning rate changed on resume: %g -> %g", scheduler.base_lrs[0], lr)
    scheduler.base_lrs = [lr] * len(optimizer.param_groups)
    for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas, strict=True):
        group["initial_lr"] = lr
        group["lr"] = lr * factor(scheduler.last_epoch)
