"""What bench_learning trains and how its records are told apart: the recipes (`--recipe`), the settings every
stage adds (sweep cells, exploration, control, sampled evaluations) and the command line's options, whose
`settings(kind)` a stage's record must match to be reused (bench.py runs the stages).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from benchmarks import ROOT

BASE = ("reward_kind=graded", "save_every=5", "keep_last=1")
"""Settings of every plates run on top of the example's (group_size 4, batch_tasks 2, lr 1e-5); one checkpoint kept
(1.6 GB with the optimizer's state), every 5 steps, so a run cut short loses at most 5 steps."""
CREDITS = {
    "outcome": ("credit.mode=outcome",),
    "turn": ("credit.mode=turn", "credit.baseline=anchor"),
    # turn credit whose turn rewards train only where the final rewards differ: the research recipe's "turn" runs
    # trained on the shaping alone in steps without a right answer (docs/learning.md); it shares their controls
    "turn-contested": ("credit.mode=turn", "credit.baseline=anchor", "credit.shaping=contested"),
}
DEFAULT_CREDITS = ("outcome", "turn")
"""The credit modes a study runs unless `--credits` names others (the recorded studies' pair)."""
SWEEP = {  # cell -> its settings; every cell plays 8 episodes a step
    "full-lr1e-5": ("lr=1e-5",),
    "full-lr3e-5": ("lr=3e-5",),
    "lora16-lr2e-4": ("lora_rank=16", "lr=2e-4"),
    "full-lr1e-5-g8": ("lr=1e-5", "group_size=8", "batch_tasks=1"),
    "full-lr1e-5-exact": ("lr=1e-5", "reward_kind=task"),  # what the graded reward buys: groups with signal
}


@dataclass(frozen=True)
class Recipe:
    """What the study trains and evaluates: a config, its task, the settings every run adds, the sweep's cells
    (the first is the default), those `choose` may pick, the warm start, dev tasks per evaluation and the
    settings every evaluation adds."""

    config: Path
    task: str
    base: tuple[str, ...]
    sweep: dict[str, tuple[str, ...]]
    candidates: tuple[str, ...]
    policy: str
    eval_n: int
    eval_sets: tuple[str, ...] = ()
    screen: int = 0
    """Train tasks screened before the main runs (`screen`): the first `screen` of the split, played SAMPLES times
    each by the warm start at the chosen temperature; the main runs and controls train on those whose rewards
    differed (`task_ids`). 0: they train on the whole split."""
    sampled: bool = True
    """Whether the study runs the sampled evaluations (stage 5)."""

    @property
    def default_cell(self) -> str:
        return next(iter(self.sweep))


RECIPES = {
    "plates": Recipe(
        ROOT / "examples" / "train_plates.toml", "plate_reading", BASE, SWEEP,
        ("full-lr1e-5", "full-lr3e-5", "lora16-lr2e-4", "full-lr1e-5-g8"),  # exact reward: measured, not a choice
        "runs/sft-plates/model", 49,
    ),
    # The research assistant's recipe (examples/default_policy.toml): RL of the chained SFT adapter (v10,
    # named by the commit that holds it so its records resume anywhere: research_warm_start/README.md) on corpus_qa
    # train, token F1 as the reward (the family's own: graded by nature), evaluated greedy on the first 72
    # corpus_qa dev questions under the default's rollout budgets (as benchmarks.studies.research.bench).
    "research": Recipe(
        ROOT / "examples" / "default_policy.toml", "corpus_qa", ("save_every=5", "keep_last=1"),
        # the default cell: a LoRA run learns best at ~10x full fine-tuning's rate, more in runs under 100 steps
        # (Schulman et al. 2025, "LoRA Without Regret"); the plates example trains full weights at 1e-5, and the
        # warm start's LoRA SFT ran at 1e-4. 5e-5 (examples/default_policy.toml) would move 20 steps half as far
        {"lora-lr1e-4": ("lr=1e-4",), "lora-lr5e-5": ("lr=5e-5",), "lora-lr2e-4": ("lr=2e-4",)},
        ("lora-lr1e-4", "lora-lr5e-5", "lora-lr2e-4"),
        "benchmarks/studies/learning/research_warm_start", 72,
        ("rollout.max_turns=8", "rollout.max_new_tokens=192"),
        # 11 of 16 groups had no reward variance at 1.0 (explore-t1): most of a step would train on nothing, so
        # the runs train on the screened questions whose sampled answers differ (~1/3 of 96, each run ~1 epoch)
        screen=96,
        # at 4 samples a question a sampled evaluation is 288 episodes, ~45 min on 2 cores, and there would be
        # eight of them; what ships is the greedy policy, so the study measures that
        sampled=False,
    ),
}  # fmt: skip
"""The recipes the study runs (`--recipe`); plates is the recorded study."""
TEMPERATURES = (1.0, 1.15, 1.3)
"""Sampling temperatures the exploration stage measures: the sampler's own distribution and two hotter ones (the
warm start draws 98 % of its tokens with p > 0.99 at 1.0, so half its groups carry no signal)."""
EXPLORE = ("lr=0", "batch_tasks=16", *CREDITS["outcome"])
"""One step of 16 groups of 4 that learns nothing (lr 0): what a temperature gives the update before any training
(a share of groups moves by 1/16)."""
CONTROL = ("lr=0",)
"""A main run's settings at learning rate 0: the same photos in the same seeded order at the same temperature,
sampled from the warm start throughout. Its curve is what the main runs' would be had nothing been learned (which
photos came up, and the sampler's luck); the main runs' reward over it is what training added."""
SAMPLES = 4
"""Episodes per dev photo in the sampled evaluations: 196 on the 49 photos, enough that a gain of the size
measured on the training photos over the control (+0.08 a step) is about 2-3 standard errors, paired by photo.
An evaluation takes ~16 min on 2 cores with vLLM (the warm start's: 920 s of episodes)."""
COOLER = 1.0
"""The warm start's own temperature, its sampled dev evaluation the reference a sharpened sampler must beat: at
1.0 it drew 98 % of its tokens with p > 0.99 where at 1.15 it drew 97 % (the exploration stage), so part of any
gain at 1.15 could be a policy that learned to sample as if cooler, not to read better."""


@dataclass(frozen=True)
class Options:
    """The command line, shared by every stage."""

    policy: str
    steps: int
    sweep_steps: int
    eval_n: int
    sampler: str
    runs: Path
    records: Path
    recorded_only: bool
    recipe: Recipe = RECIPES["plates"]
    task_ids: tuple[str, ...] = ()
    """The screened tasks the main runs and controls train on (set once the screen is recorded; empty: all)."""

    def settings(self, kind: str, cell: str | None = None, temperature: float = 1.0) -> dict:
        """What a stage's record must match to be reused: its kind's sizes, the cell it trained and the
        temperature it sampled at."""
        common = {"sampler": self.sampler, "base": list(self.recipe.base)}
        if kind == "warm":
            return {"eval_n": self.eval_n, "sampler": self.sampler}
        if kind == "sampled":
            return {
                "eval_n": self.eval_n,
                "sampler": self.sampler,
                "samples": SAMPLES,
                "temperature": temperature,
            }
        if kind == "explore":
            return common | {"steps": 1, "explore": list(EXPLORE), "temperature": temperature}
        if kind == "sweep":
            return common | {"steps": self.sweep_steps, "cell": list(self.cell(cell))}
        run = common | {
            "steps": self.steps,
            "cell": list(self.cell(cell)),
            "temperature": temperature,
        }
        run |= {"task_ids": list(self.task_ids)} if self.task_ids else {}
        return run | ({"control": list(CONTROL)} if kind == "control" else {"eval_n": self.eval_n})

    def cell(self, name: str | None) -> tuple[str, ...]:
        """A sweep cell's settings (None: the recipe's default cell)."""
        return self.recipe.sweep[name or self.recipe.default_cell]
