"""Expert episodes mixed off-policy into the early updates (`[expert_mix]`): a small policy that never succeeds
gets a group with signal.

    [expert_mix]
    per_group = 1      # expert episodes added to each group (0, the default: off, every step as without it)
    until_step = 12    # the weight falls linearly to 0 over this many steps; after them no expert plays
    weight = 1.0       # the weight at the first step

Why: under outcome credit a group whose G episodes all fail has advantage 0 everywhere, and a 135M policy fails
most groups at first, so most early steps teach nothing. The scripted expert (training/experts.py `OraclePolicy`,
each family's `oracle_reply`) plays the same task through the same tools (frozen and cached: cheap) in the
policy's own token format, and its episode joins the group.

What is computed. Step s (1-based) has the weight

    w_s = weight x max(0, 1 - (s - 1) / until_step)        (`mix_weight`: w_1 = weight, 0 from s = until_step + 1)

While w_s > 0 the expert plays each distinct task of the step once, after the policy's rollouts (`demonstrate`);
an episode worth imitating (`experts.worth_imitating`: a right answer, the family's plain give-up, an item task's
good ledger) joins as `per_group` copies (the expert is deterministic: k copies weigh it k-fold), the others are
dropped and counted. At scoring (training/step.py `score_groups`) a copy joins its group only when its final reward
beats every policy episode's (`joins`), so its outcome advantage is positive. The group's credit (any mode,
training/advantages.py) then runs over the G policy episodes and the k expert ones: with outcome credit

    A_i = R_i - mean(R_1 .. R_G, R_e x k)                    a group of G failures and a right expert:
                                                             A_i = -k / (G + k) < 0,  A_e = G / (G + k) > 0

Policy episodes train with their A_i as they always do. Expert tokens train with w_s x A_e, and their old
log-probs are the trained policy's own, detached (`TrainSequence.off_policy`, training/update.py): ratio 1, so the
clip never applies and their gradient is w_s A_e grad log p, SFT's gradient (training/sft.py) weighted by the
group's verdict. The logged reward, success and curriculum stay the policy's alone.

Choices, against the papers:
- David-GRPO (arXiv 2601.21699, "expert bootstrapping"; its code injects a gold trajectory into the group in a
  warm-up stage of 50 steps on a few tasks, replacing the lowest-scoring sample only where the gold outscores every
  one, then recomputes old log-probs with the actor, so the gold trains at ratio 1 with the plain group advantage).
  We keep its ratio 1 and its "only where it beats the group" rule; we add the expert rather than replace a sample
  (the policy's G samples keep their own signal), and we fade it out linearly rather than switch stages.
- LUFFY (arXiv 2504.14945, "off-policy guidance"): off-policy traces join the group for the advantage (the
  paper's mean and std over both; its released scripts drop the std, as our default does), and their tokens train
  with a regularised importance weight f(p) = p / (p + 0.1) of the policy's probability p, taking the expert's own
  probability as 1, with the clip removed. f's gradient, 0.1 p / (p + 0.1)^2 grad log p, is ~10x the plain ratio's
  p grad log p for an unlikely token, yet still vanishes as p -> 0. We take ratio 1 instead: our update is one
  optimizer step a batch, so the ratio stays exactly 1 through it; no second model's probabilities are guessed;
  tokens the policy finds unlikely, the expert's lesson, get the full gradient; and LUFFY mixes for the whole run,
  where we stop after `until_step` steps, the guard against rigid imitation that its shaping is there for. Not
  measured here which imitates better for this policy.

Limits: the expert plays on the collector of this process (training/local_session.py); a run on Ray refuses the
setting (training/ray_session.py `check_supported`). Expert episodes are not saved with the step's rollouts. With
`turn_rewards.info_gain` the expert's turns are scored without information gain (the trained model scores only the
policy's). The expert is the default honest one (no deliberate mistakes, the reference only where a tool showed
it), so a family whose expert rarely succeeds mixes in little.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from main_agent.rollout import RolloutConfig
from main_agent.tokens import TrainSequence, to_sequences
from main_agent.types import Episode
from tool_server.client import ToolClient
from training import tasks as task_data
from training.experts import play_experts, worth_imitating
from training.tasks import Task

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExpertMixConfig:
    """Expert episodes in the groups of the first steps (`[expert_mix]`; the module docstring says what)."""

    per_group: int = 0
    """Copies of the expert's episode added to each group while the weight is > 0; 0 (the default): off."""
    until_step: int = 12
    """Steps over which the weight falls linearly from `weight` (step 1) to 0 (step until_step + 1); from then on
    no expert plays."""
    weight: float = 1.0
    """w_1, the factor on the expert tokens' advantages at the first step."""

    def __post_init__(self) -> None:
        if self.per_group < 0 or self.until_step < 1 or self.weight < 0.0:
            raise ValueError(
                "expert_mix needs per_group >= 0, until_step >= 1 and weight >= 0, got "
                f"{self.per_group}, {self.until_step}, {self.weight}"
            )


def mix_weight(cfg: ExpertMixConfig, step: int) -> float:
    """w_s = weight x max(0, 1 - (s - 1) / until_step) for step `step` (1-based); 0 whenever `per_group` is 0."""
    if cfg.per_group == 0:
        return 0.0
    return cfg.weight * max(0.0, 1.0 - (step - 1) / cfg.until_step)


@dataclass(frozen=True)
class ExpertMix:
    """One step's expert episodes, as `demonstrate` collected them."""

    weight: float
    """w_s, the step's factor on the expert tokens' advantages (0: nothing was played)."""
    episodes: dict[str, list[Episode]] = field(default_factory=dict)
    """Task id -> the `per_group` copies of its expert's episode, for each task whose episode is worth imitating."""
    played: int = 0
    """Distinct tasks the expert played."""
    succeeded: int = 0
    """Of them, those it answered right (the family's `success`)."""
    seconds: float = 0.0
    """How long the expert played."""

    def metrics(self, *, joined: int) -> dict[str, float]:
        """The step row's `expert_mix/*` keys (training/metrics.py); `joined`: the copies that joined a group."""
        worthy = sum(1 for copies in self.episodes.values() if copies)
        return {
            "expert_mix/weight": self.weight,
            "expert_mix/played": self.played,
            "expert_mix/dropped": self.played - worthy,
            "expert_mix/episodes": joined,
            "expert_mix/success": self.succeeded / self.played if self.played else math.nan,
            "time/expert_mix": self.seconds,
        }


async def demonstrate(
    tasks: Sequence[Task],
    *,
    mix: ExpertMixConfig,
    step: int,
    tools: ToolClient,
    tokenizer,
    rollout: RolloutConfig,
    max_concurrent: int,
) -> ExpertMix:
    """Step `step`'s expert episodes: while w_s > 0 the expert plays each distinct task once through `tools`, in
    `tokenizer`'s ids under the run's `rollout` budgets, at most `max_concurrent` at once; those worth imitating are
    kept, the others dropped (logged). Nothing is played once the weight is 0."""
    weight = mix_weight(mix, step)
    if weight == 0.0:
        return ExpertMix(0.0)
    start = time.monotonic()
    distinct = list({t.task_id: t for t in tasks}.values())
    played = await play_experts(distinct, tools, tokenizer, rollout=rollout, max_concurrent=max_concurrent)
    pairs = list(zip(distinct, played, strict=True))
    kept = {t.task_id: [e] * mix.per_group for t, e in pairs if imitable(t, e)}
    if len(kept) < len(pairs):
        logger.info("expert mix, step %d: %d of %d expert episodes not worth imitating, dropped",
                    step, len(pairs) - len(kept), len(pairs))  # fmt: skip
    succeeded = sum(task_data.success(t, e.answer) for t, e in pairs)
    return ExpertMix(weight, kept, len(pairs), succeeded, time.monotonic() - start)


def imitable(task: Task, episode: Episode) -> bool:
    """An expert episode the policy may learn from: played through (not infra-failed), with turns, worth
    imitating."""
    return episode.stop_reason != "infra_failed" and bool(episode.turns) and worth_imitating(task, episode)


def joins(expert: Episode, group: Sequence[Episode]) -> bool:
    """Whether a scored expert episode joins the scored `group`: its final reward beats every policy episode's
    (David-GRPO's rule), so its outcome advantage is > 0: under outcome credit the loss never pushes down a
    trajectory the policy did not sample (under turn credit a turn of it may still fall below its baseline)."""
    mine, theirs = expert.reward, [e.reward for e in group if e.reward is not None]
    assert mine is not None and len(theirs) == len(group), "score the expert and its group first"
    return mine > max(theirs)


def expert_sequences(
    episodes: Sequence[Episode], advantages: Sequence[Sequence[float]], *, weight: float
) -> list[TrainSequence]:
    """The expert episodes' advantages times `weight` laid onto their tokens (main_agent.tokens), each sequence
    marked off-policy: the loss takes the trained policy's own log-probs as old (ratio 1)."""
    pairs = zip(episodes, advantages, strict=True)
    return [
        replace(s, off_policy=True) for e, row in pairs for s in to_sequences(e, [weight * a for a in row])
    ]
