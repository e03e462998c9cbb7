"""One N's records scored: every credit mode's per-turn advantages, computed by the functions training calls on
the recorded episodes and branch values, paired with the true advantages from the recorded continuations, and
the table's row of scores (scores.py) with its intervals and sampled tokens. Nothing is sampled here; bench.py
records, pool.py pools rows of several studies."""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections.abc import Sequence
from pathlib import Path

from benchmarks.studies.credit import scores as cs
from benchmarks.studies.credit.stages import (
    STAGES,
    Records,
    State,
    matched_rewards,
    truth_plan,
    truth_rewards,
    truth_states,
    usable,
)
from main_agent.types import Episode
from training.advantages import BranchValues, EpisodeCredit, branch_advantages, group_advantages
from training.branching import sampled_tokens
from training.config import TrainConfig
from training.step import episode_credits, score
from training.tasks import Task

MODES = ("outcome", "turn", "anchor", "branch", "branch_all", "outcome_matched")
"""Every mode a row may score; outcome_matched only where its stage is recorded for every group scored."""
Pairs = dict[str, list[list[tuple[float, float]]]]
"""Per mode, each scored episode's (the mode's advantage, the true advantage) at its scored turns."""
METRICS = {"spearman": cs.spearman, "sign": cs.sign_agreement, "pairwise": cs.pairwise_accuracy}


def mode_advantages(
    group: Sequence[Episode], cfg: TrainConfig, branches: dict[str, dict], more: Sequence[float] | None
) -> dict[str, list]:
    """Every mode's advantages [episode][turn] of one scored group, by the functions training calls; with `more`
    (the final rewards of the group's matched episodes), outcome_matched: outcome credit in the group that
    large, on the group's own episodes."""
    credits = episode_credits(group)
    credit = cfg.credit
    outcome = dataclasses.replace(credit, mode="outcome")
    out = {
        "outcome": group_advantages(credits, outcome),
        "turn": group_advantages(credits, dataclasses.replace(credit, mode="turn", baseline="turn_index")),
        "anchor": group_advantages(credits, dataclasses.replace(credit, mode="turn", baseline="anchor")),
    }
    for mode, line in branches.items():
        values = [
            [BranchValues(v["turn"], tuple(v["before"]), tuple(v["after"])) for v in vs]
            for vs in line["values"]
        ]
        out[mode] = branch_advantages(credits, values, normalize_std=credit.normalize_std)
    if more is not None:
        larger = [*credits, *(EpisodeCredit(r, ()) for r in more)]
        out["outcome_matched"] = group_advantages(larger, outcome)[: len(group)]
    return out


def true_advantage(
    group: Sequence[Episode], g: int, i: int, t: int, truth: dict[State, list[float]]
) -> tuple[float, float] | None:
    """(V(after t) - V(before t), its standard error); None when a state has no continuation recorded."""
    before = truth.get((g, i, t) if t else (g, 0, 0), [])
    last = t + 1 == len(group[i].turns)
    after = [group[i].reward] if last else truth.get((g, i, t + 1), [])
    if not before or not after:
        return None
    return statistics.fmean(after) - statistics.fmean(before), cs.truth_error(after, before, exact_after=last)


@dataclasses.dataclass
class StudyRecords:
    """One N's records, read: every stage's lines, and the parts scoring looks up by group or state."""

    lines: dict[str, list[dict]]
    groups: dict[int, list[Episode]]
    branch: dict[str, dict[int, dict]]  # mode -> group -> its line
    truth: dict[State, list[float]]
    more: dict[int, list[float]]  # group -> its matched episodes' final rewards

    @classmethod
    def read(cls, folder: Path) -> StudyRecords:
        lines = {name: Records(folder / f"{name}.jsonl").read() for name in STAGES}
        groups = {
            r["group"]: [Episode.from_json(json.dumps(e)) for e in r["episodes"]] for r in lines["episodes"]
        }
        return cls(
            lines=lines,
            groups=groups,
            branch={mode: {r["group"]: r for r in lines[mode]} for mode in ("branch", "branch_all")},
            truth=truth_rewards(lines["truth"]),
            more=matched_rewards(lines["matched"]),
        )


def report(
    n: int, tasks: Sequence[Task], folder: Path, cfg: TrainConfig, *, truth_turns: int, draws: int
) -> dict | None:
    """One N's scores from its records: the groups recorded in every stage, the turns whose truth is recorded;
    None before any (a study stopped ahead of its truth stage has nothing to score yet). The row counts the
    truth's states recorded against those its scored turns need (`truth.states`): a row whose truth is not
    whole scores the turns recorded so far, a partial look."""
    rec = StudyRecords.read(folder)
    every = [rec.groups.get(g, []) for g in range(len(tasks))]
    chosen = truth_plan(every, tasks, turns=truth_turns, seed=cfg.run.seed)
    branched = [g for g in sorted(rec.groups) if all(g in b for b in rec.branch.values())]
    kept = [g for g in branched if usable(rec.groups[g])]
    modes = [m for m in MODES if m != "outcome_matched" or all(g in rec.more for g in kept)]
    pairs, truths = scored_pairs(rec, kept, modes, chosen, tasks, cfg)
    if not truths:
        return None
    needed = truth_states(every, chosen)
    out = row(n, rec, kept, pairs, truths, draws)
    out["truth"]["states"] = [sum(state in rec.truth for state in needed), len(needed)]
    return out


def scored_pairs(
    rec: StudyRecords,
    kept: list[int],
    modes: list[str],
    chosen: dict[tuple[int, int], list[int]],
    tasks: Sequence[Task],
    cfg: TrainConfig,
) -> tuple[Pairs, list[tuple[float, float]]]:
    """Per mode, each scored episode's (the mode's advantage, the true advantage) at its scored turns whose
    truth is recorded; and every such truth with its standard error."""
    pairs: Pairs = {mode: [] for mode in modes}
    truths: list[tuple[float, float]] = []
    for g in kept:
        group = rec.groups[g]
        for e in group:
            score(e, tasks[g], cfg.turn_rewards, cfg.reward_kind)
        advantages = mode_advantages(group, cfg, {m: rec.branch[m][g] for m in rec.branch}, rec.more.get(g))
        for i in range(len(group)):
            at = chosen.get((g, i), [])
            scored = [(t, a) for t in at if (a := true_advantage(group, g, i, t, rec.truth))]
            truths += [a for _, a in scored]
            for mode in modes:
                pairs[mode].append([(advantages[mode][i][t], a[0]) for t, a in scored])
    return pairs, truths


def row(
    n: int, rec: StudyRecords, kept: list[int], pairs: Pairs, truths: list[tuple[float, float]], draws: int
) -> dict:
    """The table's row of one N: the episodes and the truth they were scored on, and each mode's scores with
    their intervals and sampled tokens per episode."""
    episodes = [e for g in kept for e in rec.groups[g]]
    spent = sum(sampled_tokens(e, 0) for e in episodes)
    extra = {m: sum(rec.branch[m][g]["stats"]["sampled_tokens"] for g in kept) for m in rec.branch}
    extra["outcome_matched"] = sum(r["sampled_tokens"] for r in rec.lines["matched"] if r["group"] in kept)
    values = [a for a, _ in truths]
    truth_tokens = sum(r["sampled_tokens"] for r in rec.lines["truth"])
    return {
        "n": n,
        "groups": len(kept),
        "episodes": len(episodes),
        "turns_scored": len(truths),
        "turns_nonzero": sum(abs(a) > cs.TIE for a in values),
        "mean_turns": statistics.fmean(len(e.turns) for e in episodes),
        "mean_reward": statistics.fmean(e.reward for e in episodes),
        "truth": {
            "mean_abs": statistics.fmean(abs(v) for v in values),
            "mean_se": statistics.fmean(se for _, se in truths),
            "noise_share": cs.noise_share(truths),
            "replays_per_state": statistics.fmean(len(r) for r in rec.truth.values()),
            "sampled_tokens_per_episode": truth_tokens / len(episodes),
        },
        "modes": {
            mode: {
                **{name: cs.estimate(metric, pairs[mode], draws=draws) for name, metric in METRICS.items()},
                "sampled_tokens_per_episode": (spent + extra.get(mode, 0)) / len(episodes),
            }
            for mode in pairs
        },
        "stage_s": {name: sum(r["elapsed_s"] for r in lines) for name, lines in rec.lines.items()},
        "pairs": pairs,  # what the scores are computed from, so that rows of several studies pool (pool.py)
        "truths": truths,
    }
