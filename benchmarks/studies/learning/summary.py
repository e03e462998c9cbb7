"""The maths of the learning study (bench.py) on records alone (no training): a run's curves from its metrics,
the sweep's choice, the per-mode summary (its table and plot are tables.py's; what the episode files say is
benchmarks/common/episodes.py's, and goes into the records).

    training_summary(run_dir) -> dict       curves (graded reward, success), sampled tokens and seconds per step
    choose(cells, default=...) -> dict      the sweep cell with the steepest reward rise per CPU-hour
    exploration_summary(run_dir) -> dict    one step's groups without signal, identical groups, confident tokens
    choose_temperature(explored) -> dict    the coolest temperature whose groups mostly carry signal
    summarise(warm_eval, cells, choice, heat, runs, controls) -> dict   per credit mode: reward first vs last,
                                            over the control's at the same seed, dev success
    sampled_summary(warm, runs, how) -> dict   per credit mode: sampled dev scores over the warm start's, photo by
                                            photo (each from episodes.sampled_scores)

Spread over seeds is the sample standard deviation (NaN with one seed). "Rises" means every seed's mean reward
of its last K steps is above that of its first K (K = 5, or half the steps of a shorter run); "rises over
control" the same of the reward minus its seed's control's, step by step (the control samples the same photos
from the untrained warm start, so the difference leaves out which photos came up); the dev gain is "outside the
spread" when the mean over seeds of final dev success minus the warm start's exceeds the seeds' spread of it. The
table marks it (*) only when it also exceeds twice the evaluation's own standard error (`_flip_se`): two seeds
that each win the same one photo of 49 have no spread, and decide nothing. The graded (token F1) dev gain gets
the same mark by the same rule, with the paired standard error over tasks of each seed's graded difference.
The sampled dev evaluation (several episodes per photo at the training temperature) is compared photo by photo:
each seed's mean over photos of its score minus the warm start's, with the standard error of that mean over the
photos (the two evaluations' sampling noise and the photos' together).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path

from benchmarks.common.episodes import how_sure
from training.metrics import load_episodes, read_metrics

K = 5
"""Steps averaged at each end of a curve."""
MOST_WITHOUT_SIGNAL = 1 / 3
"""A temperature that leaves this share of its groups without reward variance or more explores too little: those
groups train on nothing (at 1.0 the seed-0 runs lost 21-24 of 40)."""
LONGER = 1.25
"""Episodes longer than this many times the coolest temperature's (in sampled tokens) cost that much more per
step, and a hotter sampler's extra length is its own tokens' noise (calls that miss, answers that ramble)."""


def training_summary(run_dir: Path) -> dict:
    """From metrics.jsonl: the per-step graded reward and success curves, sampled tokens and wall seconds per step,
    and the groups that had no signal."""
    rows = read_metrics(run_dir / "metrics.jsonl")
    return {
        "steps": len(rows),
        "reward": [r["reward/final"] for r in rows],
        "success": [r["success"] for r in rows],
        "sampled_tokens": [r["tokens/sampled"] for r in rows],
        "step_s": [r["time/rollout"] + r["time/train"] + r["time/weight_sync"] for r in rows],
        "groups": sum(r.get("groups/total", 0) for r in rows),
        "groups_zero_variance": sum(r.get("groups/zero_variance", 0) for r in rows),
    }


def ends(curve: Sequence[float], k: int = K) -> tuple[float, float]:
    """The mean of the first and of the last min(k, len // 2) values (the whole curve at both ends when it has
    one value; NaN for none). NaN values (a step with nothing scored) are left out of the means."""
    if not curve:
        return math.nan, math.nan
    n = max(min(k, len(curve) // 2), 1)
    return _mean(curve[:n]), _mean(curve[-n:])


def slope(curve: Sequence[float]) -> float:
    """Least-squares slope of the curve against its step index (per step); 0 for fewer than two points."""
    points = [(i, y) for i, y in enumerate(curve) if not math.isnan(y)]
    if len(points) < 2:
        return 0.0
    mx = statistics.mean(i for i, _ in points)
    my = statistics.mean(y for _, y in points)
    var = sum((i - mx) ** 2 for i, _ in points)
    return sum((i - mx) * (y - my) for i, y in points) / var


def slope_se(curve: Sequence[float]) -> float:
    """Standard error of the least-squares slope (per step); infinite below three points (no residual left)."""
    points = [(i, y) for i, y in enumerate(curve) if not math.isnan(y)]
    if len(points) < 3:
        return math.inf
    b = slope(curve)
    mx, my = statistics.mean(i for i, _ in points), statistics.mean(y for _, y in points)
    residual = sum((y - my - b * (i - mx)) ** 2 for i, y in points) / (len(points) - 2)
    return math.sqrt(residual / sum((i - mx) ** 2 for i, _ in points))


def _hours(trained: Mapping) -> float:
    return statistics.mean(trained["step_s"]) / 3600 if trained["step_s"] else math.nan


def rate(trained: Mapping) -> float:
    """Reward gained per CPU-hour: the reward's slope per step over the hours a step took."""
    hours = _hours(trained)
    return slope(trained["reward"]) / hours if hours > 0 else math.nan


def rate_se(trained: Mapping) -> float:
    """The standard error of `rate` (the slope's, over the same hours)."""
    hours = _hours(trained)
    return slope_se(trained["reward"]) / hours if hours > 0 else math.nan


def choose(cells: Mapping[str, Mapping], *, default: str) -> dict:
    """The cell with the highest reward gain per CPU-hour (`rate`), if it gains and beats the default's rate by
    more than twice their combined standard error; else `default` (a flat or falling sweep, or one whose
    differences are within its noise, says nothing better than the example's settings). Records the inputs."""
    rates = {cell: rate(trained) for cell, trained in cells.items()}
    errors = {cell: rate_se(trained) for cell, trained in cells.items()}
    gaining = {c: r for c, r in rates.items() if r > 0}
    record = {"rates": rates, "rate_errors": errors}
    if not gaining:
        return {"cell": default, "why": "no cell's reward rose: the default"} | record
    best = max(gaining, key=lambda c: gaining[c])
    base, base_se = (rates[default], errors[default]) if default in rates else (0.0, 0.0)
    margin = 2 * math.hypot(errors[best], base_se)
    if best != default and not rates[best] - base > margin:
        why = f"{best} ({rates[best]:.3f}/h) is within 2 standard errors ({margin:.3f}/h) of the default: the default"
        return {"cell": default, "why": why} | record
    return {"cell": best, "why": f"highest reward slope per CPU-hour ({gaining[best]:.3f}/h)"} | record


def paired_gain(reference: Mapping, scores: Mapping, key: str) -> tuple[float, float]:
    """Photo by photo, `scores[key]` minus the reference's (a sampled evaluation of the warm start) on the same
    photos: the mean and its standard error over the photos both scored."""
    assert scores["task_ids"] == reference["task_ids"], "sampled evaluations of different dev photos"
    diffs = [
        a - b
        for a, b in zip(scores[key], reference[key], strict=True)
        if not (math.isnan(a) or math.isnan(b))
    ]
    se = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) >= 2 else math.nan
    return _mean(diffs), se


def sampled_summary(
    references: Mapping[str, Mapping], runs: Mapping[str, Sequence[Mapping]], how: str
) -> dict:
    """The sampled dev evaluations (`episodes.sampled_scores`) of each run's last checkpoint, made as `how`
    says, against those of the warm start in `references` ("warm": at the runs' temperature; "cooler": at 1.0,
    whether training did more than cool the sampler): per credit mode its scores (`_sampled_means`), and per
    reference each seed's success and graded reward over it (mean, standard error), their mean over seeds and
    its spread. Empty without the "warm" reference."""
    if "warm" not in references:
        return {}
    modes = {}
    for mode, records in runs.items():
        modes[mode] = {
            "seeds": [r["seed"] for r in records],
            **_sampled_means([r["per_task"] for r in records]),
        }
        for name, reference in references.items():
            for key in ("success", "graded"):
                pairs = [paired_gain(reference, r["per_task"], key) for r in records]
                modes[mode][f"over_{name}_{key}"] = {
                    "per_seed": [g for g, _ in pairs], "se_per_seed": [se for _, se in pairs],
                    "mean": _mean([g for g, _ in pairs]), "spread": spread([g for g, _ in pairs]),
                }  # fmt: skip
    means = {name: _sampled_means([reference]) for name, reference in references.items()}
    return {"how": how, "references": means, "modes": modes}


def _sampled_means(scores: Sequence[Mapping]) -> dict:
    """Over seeds, the mean of each sampled evaluation's success, graded reward, share of episodes without an
    answer and `how_sure` measures."""
    return {
        "success": _mean([_mean(s["success"]) for s in scores]),
        "graded": _mean([_mean(s["graded"]) for s in scores]),
        "confident_share": _mean([s.get("confident_share", math.nan) for s in scores]),
        "photos_identical": _mean([s.get("groups_identical", math.nan) for s in scores]),
        "unanswered": _mean([s.get("unanswered", math.nan) for s in scores]),
    }


def exploration_summary(run_dir: Path) -> dict:
    """What one step's sampling gave to learn from (its metrics row and rollouts/step_1.jsonl): its groups, those
    without reward variance and those whose episodes are token for token the same, the share of sampled tokens
    drawn with a probability above episodes.CONFIDENT, sampled tokens and turns per episode, and the
    rollout's seconds."""
    row = read_metrics(run_dir / "metrics.jsonl")[0]
    episodes = load_episodes(run_dir / "rollouts" / "step_1.jsonl")
    return {
        "groups": row["groups/total"],
        "groups_zero_variance": row["groups/zero_variance"],
        **how_sure(episodes),
        "turns_per_episode": statistics.mean(len(e.turns) for e in episodes),
        "reward": row["reward/final"],
        "success": row["success"],
        "rollout_s": row["time/rollout"],
    }


def choose_temperature(explored: Mapping[float, Mapping]) -> dict:
    """The coolest sampling temperature at which fewer than MOST_WITHOUT_SIGNAL of the groups lack reward
    variance, among those whose episodes are not LONGER than at the coolest one measured; when none is, the one
    of those with the fewest such groups. 1.0 (the sampler's own distribution) when nothing was measured."""
    if not explored:
        return {"temperature": 1.0, "why": "nothing explored: the sampler's own distribution", "explored": {}}
    base = explored[min(explored)]["tokens_per_episode"]
    short = sorted(t for t, e in explored.items() if e["tokens_per_episode"] <= LONGER * base)
    without = {t: e["groups_zero_variance"] / e["groups"] for t, e in explored.items()}
    signal = [t for t in short if without[t] < MOST_WITHOUT_SIGNAL]
    best = signal[0] if signal else min(short, key=lambda t: (without[t], t))
    why = f"{without[best]:.2f} of its groups had no reward variance"
    why += " (the coolest under 1/3)" if signal else " (none was under 1/3: the fewest)"
    explored_by_name = {f"{t:g}": dict(explored[t]) for t in sorted(explored)}
    return {"temperature": best, "why": why, "explored": explored_by_name}


def spread(values: Sequence[float]) -> float:
    """Sample standard deviation over seeds; NaN for fewer than two, or where one is NaN (a record without it)."""
    return statistics.stdev(values) if len(values) >= 2 and not any(map(math.isnan, values)) else math.nan


def over_control(records: Sequence[Mapping], controls: Mapping[int, Sequence[float]]) -> dict:
    """Each run's reward minus its seed's control's, step by step (runs with a control of as many steps): the
    first and last K steps of that difference, and of the controls themselves, over seeds."""
    pairs = [
        (r["training"]["reward"], controls[r["seed"]])
        for r in records
        if r.get("seed") in controls and len(controls[r["seed"]]) == len(r["training"]["reward"])
    ]
    over = [ends([a - b for a, b in zip(run, control, strict=True)]) for run, control in pairs]
    first, last = zip(*over, strict=True) if over else ((), ())
    c_first, c_last = zip(*(ends(control) for _, control in pairs), strict=True) if pairs else ((), ())
    return {
        "controlled_seeds": len(pairs),
        "control_first": _mean(c_first), "control_last": _mean(c_last),
        "over_control_first": _mean(first), "over_control_last": _mean(last),
        "over_control_last_spread": spread(last),
        "rises_over_control": bool(pairs) and all(b > a for a, b in zip(first, last, strict=True)),
        "seeds_rising_over_control": sum(b > a for a, b in zip(first, last, strict=True)),
    }  # fmt: skip


def mode_summary(
    records: Sequence[Mapping], warm_success: float, controls: Mapping[int, Sequence[float]] | None = None
) -> dict:
    """One credit mode over its seeds' records: reward and success first vs last K steps, the same over the
    control at each seed (`over_control`), dev success."""
    trained = [r["training"] for r in records]
    first, last = zip(*(ends(t["reward"]) for t in trained), strict=True) if trained else ((), ())
    s_first, s_last = zip(*(ends(t["success"]) for t in trained), strict=True) if trained else ((), ())
    dev = [r["eval"]["success_rate"] for r in records]
    gain = _mean(dev) - warm_success
    se = _flip_se([r["eval"].get("vs_warm", {}) for r in records])
    graded = [_graded_gain(r["eval"].get("vs_warm", {})) for r in records]
    graded_se = _mean_se([r["eval"].get("vs_warm", {}).get("graded_gain_se", math.nan) for r in records])
    return {
        "seeds": len(records),
        "reward_first": _mean(first), "reward_first_spread": spread(first),
        "reward_last": _mean(last), "reward_last_spread": spread(last),
        "success_first": _mean(s_first), "success_last": _mean(s_last),
        "rises": bool(trained) and all(b > a for a, b in zip(first, last, strict=True)),
        "dev_success": _mean(dev), "dev_success_spread": spread(dev), "dev_per_seed": dev,
        "dev_gain": gain, "gain_outside_spread": bool(gain > spread(dev)),
        "dev_gain_se": se,
        "gain_beyond_noise": bool(gain > spread(dev) and gain > 2 * se),
        "dev_changed": [r["eval"].get("vs_warm", {}).get("changed", math.nan) for r in records],
        "dev_acted": [r["eval"].get("vs_warm", {}).get("acted", math.nan) for r in records],
        "dev_graded_gain": graded, "dev_graded_gain_se": graded_se,
        "graded_gain_beyond_noise": bool(_mean(graded) > spread(graded) and _mean(graded) > 2 * graded_se),
        "sampled_tokens_per_step": _mean([x for t in trained for x in t["sampled_tokens"]]),
        "step_s": _mean([x for t in trained for x in t["step_s"]]),
        "zero_variance_share": _share(trained),
        "curves": [t["reward"] for t in trained],
    } | over_control(records, controls or {})  # fmt: skip


def _flip_se(moves: Sequence[Mapping]) -> float:
    """The evaluation's standard error of the mean over seeds of dev success gains: per seed, the same photos
    before and after, so only the photos that flipped vary, sqrt(won + lost) / photos (the paired difference's
    normal approximation); NaN where a record did not keep them."""
    return _mean_se([math.sqrt(m["won"] + m["lost"]) / m["tasks"] if "won" in m else math.nan for m in moves])


def _mean_se(per_seed: Sequence[float]) -> float:
    """The standard error of a mean over seeds of independent estimates with these standard errors."""
    return math.sqrt(sum(se * se for se in per_seed)) / len(per_seed) if per_seed else math.nan


def _graded_gain(vs_warm: Mapping) -> float:
    """Greedy dev graded reward over the warm start's (NaN in records made before it was kept)."""
    return vs_warm.get("graded_now", math.nan) - vs_warm.get("graded_warm", math.nan)


def summarise(
    warm_eval: Mapping | None,
    cells: Mapping[str, Mapping],
    choice: Mapping,
    heat: Mapping,
    runs: Mapping[str, Sequence[Mapping]],
    controls: Mapping[int, Sequence[float]] | None = None,
) -> dict:
    """The study's report: the warm start's dev success, the sweep and its choice, the temperatures explored and
    the one chosen (`choose_temperature`), each credit mode's summary (over the controls' reward curves, by
    seed, where recorded)."""
    warm_success = warm_eval["success_rate"] if warm_eval else math.nan
    sweep = {
        cell: {
            "rate_per_hour": choice["rates"].get(cell, math.nan),
            "rate_error": choice.get("rate_errors", {}).get(cell, math.nan),
            "reward_slope": slope(r["training"]["reward"]),
            "step_s": _mean(r["training"]["step_s"]),
            "zero_variance_share": _share([r["training"]]),
        }
        for cell, r in cells.items()
    }
    modes = {mode: mode_summary(records, warm_success, controls) for mode, records in runs.items() if records}
    return {
        "warm_success": warm_success, "sweep": sweep, "choice": dict(choice), "exploration": dict(heat),
        "modes": modes, "controls": {str(seed): list(curve) for seed, curve in (controls or {}).items()},
    }  # fmt: skip


def _share(trained: Sequence[Mapping]) -> float:
    groups = sum(t["groups"] for t in trained)
    return sum(t["groups_zero_variance"] for t in trained) / groups if groups else math.nan


def _mean(values: Sequence[float]) -> float:
    kept = [v for v in values if not math.isnan(v)]
    return statistics.mean(kept) if kept else math.nan
