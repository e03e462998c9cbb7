"""Continuations resampled from truncated near-miss prefixes (`[near_miss]`): a group whose episodes all fail alike
gets rollouts that start where one of them came closest.

    [near_miss]
    per_group = 2             # continuations added to each chosen group (0, the default: off, every step as without it)
    when = "all_fail"         # the groups resampled: no episode a success ("all_fail"), or every group ("always")
    partial_answers = false   # also count an episode with no evidence whose answer scored > 0
    until_step = 0            # resample in steps 1 .. until_step only (0: every step)

Why: under outcome credit a group whose G episodes all fail has advantage 0 everywhere, and a 135M policy fails
most groups at first. Often one of them got part of the way (read a supporting page, saw the answer in an
observation) and then lost it. Continuing that episode from just after its progress samples the rest of the task
from a state the policy rarely reaches, on-policy and through the same frozen tools: where a continuation
succeeds the group has signal (David-GRPO, arXiv 2601.21699, "grounded expansion").

What is computed, per group, after the policy's G episodes (and branch credit's continuations) are played
(`resample`, called by the run's collector):
1. the group is resampled when `when` = "always", or no episode of it is a success (the family's `success`);
   never when one of its episodes failed for infrastructure reasons (scoring drops such a group).
2. the progress of an episode after its turn t (`progress`), non-decreasing in t:
       P(t) = recall(t) + seen(t) + items(t)
   recall: the share of the task's supporting pages that ok page_qa calls of turns 0..t read (rewards.py's
   `evidence_recall`, 0 for a task without supporting pages); seen: 1 once an ok observation of turns 0..t held
   the reference (`rewards.contains_evidence`, turn credit's "new evidence"); items: the item score recorded in
   turns 0..t over the task's items (item tasks).
3. a near miss is a learnable episode (not infra-failed, exact, with turns) that is not a success, with
   P(T - 1) > 0, cut after the turn that first reached that progress: it keeps c = 1 + min{t : P(t) = P(T - 1)}
   turns, when c < T (a turn is left to sample). With `partial_answers`, an episode not counted so that ended
   with an answer turn whose reward R is > 0 (token F1, a graded plate), after at least one other turn, counts
   too, cut before its answer turn (c = T - 1: the continuations answer again from the same observations).
4. the group's prefix: its near miss with the largest (P(T - 1), R), the first in the group on ties.
5. `per_group` continuations of it: main_agent.rollout.rollout(..., replay=its first c turns), the prefix's
   sampled ids taken as they were, its calls re-run and checked byte for byte (training/branching.py's exact
   replay), then sampled on by the policy under the same budgets. One that fails for infrastructure reasons (a
   replay that diverged included) is dropped and counted.

At scoring (training/step.py `score_groups`) each continuation joins its group: scored as the step scores
(`rewarded`, no information gain), and the group's credit (any mode) runs over its G episodes and the k
continuations. With outcome credit

    A_i = R_i - mean(R_1 .. R_G, R_c1 .. R_ck)          all G fail, s of the k continuations succeed:
                                                         A_i = -s / (G + k),  A_c = 1[c right] - s / (G + k)

The replayed prefix trains nothing: its turns are marked untrained (`Turn.trained` False: in the context, loss
mask 0), and a continuation trains only its own sampled turns, on-policy (the sampler's log-probs, the usual
ratio and clip). Why masked rather than trained with the continuation's advantage: (a) the prefix's tokens are
already in the group once, in the near miss itself, with that episode's advantage; k continuations would
weigh the same tokens k + 1 times; (b) the prefix was chosen for its progress, so it is no fair draw from the
policy, and pushing it up by its continuations' outcomes would credit the choice, not a sample. Every token the
update trains stays the policy's own draw given its context. The logged reward, success, curriculum and saved
rollouts stay the policy's own G episodes'; the groups' zero-variance counts include the continuations.

Choices, against the paper's code (github AsadalJung/David-GRPO, `new_otr_resampling_logic`): it resamples a
group whose best score is below full marks, truncates its best-scoring sequence right after the search result
that first reached the most distinct supporting titles (at the prompt when none), samples G continuations, and
only where the best of them beats the group's best does it replace the group's worst sequence, trained whole,
prefix included (re-tokenised text, old log-probs recomputed by the actor). We keep its choice of prefix and its
cut (with our two other signals of progress); we add the continuations rather than replace a sample, all of them,
whatever they score (a draw kept only when it wins biases the baseline it joins); we train none of the prefix;
we need a near miss (a group with no progress is left alone: a restart is just another episode).

Limits: the continuations play on the collector of this process (training/local_session.py); a run on Ray
refuses the setting (training/ray_session.py `check_supported`). Continuations are not saved with the step's
rollouts. With `turn_rewards.info_gain` their turns are scored without information gain. Under turn credit their
replayed turns enter the turn baselines as turns of an episode; under branch credit they take the outcome
advantage. The near miss itself keeps its own advantage, prefix included: the value of its prefix is not credited
(branch credit does that). Not measured here whether it helps this policy learn.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from main_agent.policy import Policy
from main_agent.rollout import RolloutConfig, rollout
from main_agent.types import Episode
from tool_server.client import ToolClient
from training import tasks as task_data
from training.play import rollout_task
from training.rewards import contains_evidence, ending_with, supporting_pages
from training.tasks import Task


@dataclass(frozen=True)
class NearMissConfig:
    """Continuations of near-miss prefixes joining the groups (`[near_miss]`; the module docstring says what)."""

    per_group: int = 0
    """Continuations sampled from each resampled group's prefix; they join the group. 0 (the default): off."""
    when: Literal["all_fail", "always"] = "all_fail"
    """"all_fail": only groups where no episode succeeded (no outcome signal, David-GRPO's rule); "always":
    every group with a near miss."""
    partial_answers: bool = False
    """Also count an episode without evidence whose answer scored > 0, cut before its answer turn."""
    until_step: int = 0
    """Resample in steps 1 .. until_step only; 0: every step."""

    def __post_init__(self) -> None:
        if self.per_group < 0 or self.until_step < 0 or self.when not in ("all_fail", "always"):
            raise ValueError(
                "near_miss needs per_group >= 0, until_step >= 0 and when 'all_fail' or 'always', got "
                f"{self.per_group}, {self.until_step}, {self.when!r}"
            )

    def active(self, step: int) -> bool:
        """Whether step `step` (1-based) resamples."""
        return self.per_group > 0 and (self.until_step == 0 or step <= self.until_step)


@dataclass(frozen=True)
class NearMiss:
    """One step's continuations, as `resample` played them."""

    groups: list[list[Episode]]
    """The step's groups as collected, in order."""
    continuations: list[list[Episode]]
    """Per group of `groups`: its continuations that played through (none where it had no prefix)."""
    prefixes: int = 0
    """Groups whose prefix was continued."""
    succeeded: int = 0
    """Continuations that answered right (the family's `success`)."""
    infra_failed: int = 0
    """Continuations dropped for infrastructure reasons (a diverged replay included)."""
    seconds: float = 0.0

    def of(self, kept: Sequence[list[Episode]]) -> list[list[Episode]]:
        """The continuations of each group of `kept`, a selection of `groups` (by `drop_stale`, `filter_groups`)."""
        by_group = {id(g): c for g, c in zip(self.groups, self.continuations, strict=True)}
        return [by_group[id(g)] for g in kept]

    def metrics(self, *, joined: int) -> dict[str, float]:
        """The step row's `near_miss/*` keys (training/metrics.py); `joined`: the continuations that joined a
        scored group."""
        played = sum(map(len, self.continuations))
        return {
            "near_miss/prefixes": self.prefixes,
            "near_miss/continuations": played,
            "near_miss/joined": joined,
            "near_miss/success": self.succeeded / played if played else math.nan,
            "near_miss/infra_failed": self.infra_failed,
            "time/near_miss": self.seconds,
        }


def progress(task: Task, episode: Episode) -> list[float]:
    """P(t) of every turn t: supporting pages read, the reference seen, items recorded, up to and including it."""
    pages = list(dict.fromkeys(supporting_pages(task)))
    read: set[str] = set()
    seen = False
    recorded: dict[int, float] = {}
    out = []
    for turn in episode.turns:
        ok = [r for r in turn.results if r.ok]
        read |= ending_with([str((r.payload or {}).get("url", "")) for r in ok if r.name == "page_qa"], pages)
        seen = seen or any(contains_evidence(r.observation, task.reference) for r in ok)
        for record in turn.records:
            recorded.setdefault(record.item, task_data.item_reward(task, record.item, record.text))
        items = sum(recorded.values()) / len(task.items) if task.items else 0.0
        out.append((len(read) / len(pages) if pages else 0.0) + float(seen) + items)
    return out


def cut_of(task: Task, episode: Episode, *, reward: float, partial_answers: bool) -> int | None:
    """The turns a continuation of `episode` replays (step 3 of the module docstring), None for no near miss;
    `reward`: its answer's reward R."""
    p = progress(task, episode)
    if p and p[-1] > 0.0 and (cut := 1 + p.index(p[-1])) < len(p):
        return cut
    answered = episode.stop_reason in ("answer", "last_turn_answer")
    if partial_answers and reward > 0.0 and answered and len(p) >= 2:
        return len(p) - 1
    return None


def choose(
    group: Sequence[Episode], task: Task, *, cfg: NearMissConfig, reward_kind: str
) -> tuple[Episode, int] | None:
    """The group's prefix (steps 1-4 of the module docstring): its near miss and its cut, None for none."""
    if any(e.stop_reason == "infra_failed" for e in group):
        return None
    if cfg.when == "all_fail" and any(task_data.success(task, e.answer) for e in group):
        return None
    best: tuple[tuple[float, float], Episode, int] | None = None
    for e in group:
        if not (e.exact and e.turns) or task_data.success(task, e.answer):
            continue
        reward = task_data.reward_for(task, e.answer, kind=reward_kind)
        cut = cut_of(task, e, reward=reward, partial_answers=cfg.partial_answers)
        key = (progress(task, e)[-1], reward)
        if cut is not None and (best is None or key > best[0]):
            best = (key, e, cut)
    return None if best is None else (best[1], best[2])


async def continue_after(
    episode: Episode,
    cut: int,
    task: Task,
    schemas: Sequence[dict[str, object]],
    *,
    policy: Policy,
    tools: ToolClient,
    tokenizer,
    cfg: RolloutConfig,
) -> Episode:
    """One continuation: `episode`'s first `cut` turns replayed exactly and marked untrained (in the context,
    never a target), then sampled on by `policy` under `cfg`'s budgets."""
    prefix = [dataclasses.replace(t, trained=False) for t in episode.turns[:cut]]
    return await rollout(rollout_task(task, schemas), policy, tools, tokenizer, cfg, replay=prefix)


async def resample(
    groups: Sequence[list[Episode]],
    tasks: Sequence[Task],
    *,
    cfg: NearMissConfig,
    step: int,
    policy: Policy,
    tools: ToolClient,
    tokenizer,
    rollout: RolloutConfig,
    reward_kind: str,
    max_concurrent: int,
) -> NearMiss:
    """Step `step`'s continuations of the near-miss prefixes of `groups` (one per task of `tasks`, in order), at
    most `max_concurrent` in flight; `reward_kind`: the answers' reward (TrainConfig.reward_kind) that ranks near
    misses and finds partial answers. Nothing is played when the setting is off at this step."""
    if not cfg.active(step):
        return NearMiss(list(groups), [[] for _ in groups])
    start = time.monotonic()
    chosen = [choose(g, t, cfg=cfg, reward_kind=reward_kind) for g, t in zip(groups, tasks, strict=True)]
    jobs = [
        (g, *prefix) for g, prefix in enumerate(chosen) if prefix is not None for _ in range(cfg.per_group)
    ]
    schemas = await tools.tools() if jobs else []
    slots = asyncio.Semaphore(max_concurrent)

    async def one(g: int, episode: Episode, cut: int) -> Episode:
        async with slots:
            return await continue_after(
                episode, cut, tasks[g], schemas, policy=policy, tools=tools, tokenizer=tokenizer, cfg=rollout
            )

    played = await asyncio.gather(*(one(*job) for job in jobs))
    continuations: list[list[Episode]] = [[] for _ in groups]
    for (g, _, _), episode in zip(jobs, played, strict=True):
        if episode.stop_reason != "infra_failed":
            continuations[g].append(episode)
    return NearMiss(
        list(groups), continuations, prefixes=sum(p is not None for p in chosen),
        succeeded=sum(task_data.success(tasks[g], e.answer) for g, c in enumerate(continuations) for e in c),
        infra_failed=sum(e.stop_reason == "infra_failed" for e in played), seconds=time.monotonic() - start,
    )  # fmt: skip
