"""The horizon of item tasks (plate_audit's N photos, multihop_batch's K questions) and its curriculum.

    [horizon]
    items = 4          # N at the start
    max_items = 32     # grow N up to this (0 or <= items: N stays fixed)
    raise_at = 0.5     # ... when the success rate of the last `window` episodes at the current N reaches this
    window = 32
    factor = 2         # N becomes min(N x factor, max_items)

Start small, raise when the rolling success rate passes the threshold: the policy meets a long horizon once it
masters a shorter one. The rolling window only holds episodes played at the current N and is emptied at every
raise, so a raise is earned at the new N. The current N and the window are part of the checkpoint (TrainState),
so a resumed run raises exactly when an uninterrupted one would. Every raise is logged (and is a metrics key,
`horizon/items`). Families without items ignore all of this.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HorizonConfig:
    """Items per item task, and the curriculum that grows them (`[horizon]`)."""

    items: int = 4
    """N (or K) at the start: items per task of an item family. A plate photo is ~3-4 image_ops calls."""
    max_items: int = 0
    """Curriculum ceiling; 0 (or anything <= items) keeps N fixed."""
    raise_at: float = 0.5
    """Rolling success rate (every item right) at which N is raised."""
    window: int = 32
    """Episodes in the rolling success rate; it must be full at the current N before a raise."""
    factor: int = 2
    """N is multiplied by this at each raise (capped at max_items)."""

    def __post_init__(self) -> None:
        if self.items < 1 or self.window < 1 or self.factor < 2 or not 0.0 < self.raise_at <= 1.0:
            raise ValueError(f"horizon needs items >= 1, window >= 1, factor >= 2, 0 < raise_at <= 1: {self}")


@dataclass(frozen=True)
class Horizon:
    """Where the curriculum stands: the current N and the recent successes at that N (oldest first)."""

    items: int
    recent: tuple[bool, ...] = ()


def advance(horizon: Horizon, successes: Sequence[bool], cfg: HorizonConfig) -> Horizon:
    """The horizon after a step whose episodes (all at `horizon.items`) succeeded as `successes`."""
    recent = (*horizon.recent, *successes)[-cfg.window :]
    rate = sum(recent) / len(recent) if recent else 0.0
    ceiling = max(cfg.max_items, cfg.items)
    if horizon.items < ceiling and len(recent) >= cfg.window and rate >= cfg.raise_at:
        items = min(horizon.items * cfg.factor, ceiling)
        logger.info(
            "horizon raised: %d -> %d items (success %.2f over %d episodes)",
            horizon.items,
            items,
            rate,
            len(recent),
        )
        return Horizon(items)
    return Horizon(horizon.items, recent)


def horizons(cfg: HorizonConfig) -> list[int]:
    """Every N the curriculum can reach, in order: items, items x factor, ..., max_items."""
    values = [cfg.items]
    while values[-1] < cfg.max_items:
        values.append(min(values[-1] * cfg.factor, cfg.max_items))
    return values
