"""How well per-turn advantages agree with the true ones: the credit study's scores, pure Python.

The data is a list of episodes, each a list of (estimate, truth) pairs, one per scored turn. Values closer than
TIE are ties (advantages are differences of means, so "equal" ones can differ by a rounding residue):

    spearman(episodes)   the rank correlation of estimate and truth over all pairs pooled (average ranks for
                         ties; NaN when either side is constant, where it is undefined)
    sign_agreement       over the turns whose truth is not 0: 1 when the estimate has the truth's sign, 1/2 when the
                         estimate is 0 (it says nothing: a coin would be right half the time), 0 otherwise
    pairwise_accuracy    over every two turns of one episode whose truths differ: 1 when the estimates order them
                         as the truths do, 1/2 when the estimates tie, 0 otherwise; pooled over episodes. Outcome
                         credit gives every turn of an episode the same advantage, so it scores exactly 1/2 here
    bootstrap(metric, episodes)   a 95 % percentile interval: episodes drawn with replacement, the metric of each
                         draw, its 2.5th and 97.5th percentiles over the draws where it is defined
    paired_difference(metric, a, b)   metric(a) - metric(b) for two estimators on the same episodes, with the
                         interval of the same resampling applied to both
    trend(metric, shorter, longer)   how much more a leads b on longer chains: the paired difference on the
                         longer chains' episodes minus that on the shorter ones', each set resampled on its own

Episodes are the unit of resampling because turns of one episode are not independent; episodes of one group share
a baseline, so the intervals are, if anything, a little narrow.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable, Sequence

Pairs = Sequence[tuple[float, float]]
"""One episode's scored turns: (estimated advantage, true advantage)."""
TIE = 1e-9


def ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks, ties (within TIE, after rounding) sharing their average rank."""
    keyed = sorted(range(len(values)), key=lambda k: values[k])
    out = [0.0] * len(values)
    start = 0
    while start < len(keyed):
        end = start
        while end + 1 < len(keyed) and values[keyed[end + 1]] - values[keyed[start]] <= TIE:
            end += 1
        for k in keyed[start : end + 1]:
            out[k] = (start + end) / 2 + 1
        start = end + 1
    return out


def pearson(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Pearson's correlation; NaN when either side has no spread."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    sxx, syy = sum((x - mx) ** 2 for x in xs), sum((y - my) ** 2 for y in ys)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else math.nan


def spearman(episodes: Sequence[Pairs]) -> float:
    """Rank correlation of estimates and truths over every episode's pairs pooled."""
    pairs = [p for episode in episodes for p in episode]
    if len(pairs) < 2:
        return math.nan
    estimates, truths = zip(*pairs, strict=True)
    return pearson(ranks(estimates), ranks(truths))


def _agree(estimate: float, truth: float) -> float:
    """1 for the same sign, 1/2 for an estimate of 0, 0 for the opposite sign (truth is not 0)."""
    if abs(estimate) <= TIE:
        return 0.5
    return float((estimate > 0) == (truth > 0))


def sign_agreement(episodes: Sequence[Pairs]) -> float:
    """The mean agreement in sign over the turns whose truth is not 0; NaN when there are none."""
    scores = [_agree(e, t) for episode in episodes for e, t in episode if abs(t) > TIE]
    return statistics.fmean(scores) if scores else math.nan


def pairwise_accuracy(episodes: Sequence[Pairs]) -> float:
    """ "Which of two turns of an episode was better", over every pair whose truths differ; NaN without one."""
    scores = []
    for episode in episodes:
        for a in range(len(episode)):
            for b in range(a + 1, len(episode)):
                truth = episode[a][1] - episode[b][1]
                if abs(truth) > TIE:
                    scores.append(_agree(episode[a][0] - episode[b][0], truth))
    return statistics.fmean(scores) if scores else math.nan


def bootstrap(
    metric: Callable[[Sequence[Pairs]], float],
    episodes: Sequence[Pairs],
    *,
    draws: int = 1000,
    seed: int = 0,
) -> tuple[float, float]:
    """The 95 % percentile interval of `metric` over `draws` resamples of the episodes (NaN, NaN when the
    metric is undefined on every draw)."""
    rng = random.Random(seed)
    values = []
    for _ in range(draws):
        value = metric([episodes[rng.randrange(len(episodes))] for _ in episodes])
        if not math.isnan(value):
            values.append(value)
    if not values:
        return math.nan, math.nan
    values.sort()
    return _quantile(values, 0.025), _quantile(values, 0.975)


def paired_difference(
    metric: Callable[[Sequence[Pairs]], float],
    a: Sequence[Pairs],
    b: Sequence[Pairs],
    *,
    draws: int = 1000,
    seed: int = 0,
) -> list[float]:
    """[value, low, high] of metric(a) - metric(b), where a[i] and b[i] are two estimators' pairs on the same
    episode: each draw resamples the episodes once for both, so what the two share (the truth, the episode)
    cancels in the interval as it does in the value."""
    if len(a) != len(b):
        raise ValueError(
            f"a scores {len(a)} episodes, b {len(b)}: a paired difference needs the same episodes"
        )
    if not a:
        return [math.nan, math.nan, math.nan]
    values = _paired_draws(metric, a, b, random.Random(seed), draws)
    return [metric(a) - metric(b), *_interval(values)]


def trend(
    metric: Callable[[Sequence[Pairs]], float],
    shorter: tuple[Sequence[Pairs], Sequence[Pairs]],
    longer: tuple[Sequence[Pairs], Sequence[Pairs]],
    *,
    draws: int = 1000,
    seed: int = 0,
) -> list[float]:
    """[value, low, high] of how much more estimator a leads estimator b on longer chains: the paired
    difference metric(a) - metric(b) on `longer`'s episodes minus the same on `shorter`'s. The two are different
    episodes, so each draw resamples each set on its own (paired within it) and the interval holds both sets'
    noise; an interval holding 0 shows no trend."""
    (a, b), (c, d) = shorter, longer
    if len(a) != len(b) or len(c) != len(d):
        raise ValueError("a trend compares two estimators on the same episodes within each set")
    if not a or not c:
        return [math.nan, math.nan, math.nan]
    rng = random.Random(seed)
    near, far = _paired_draws(metric, a, b, rng, draws), _paired_draws(metric, c, d, rng, draws)
    values = [y - x for x, y in zip(near, far, strict=True)]
    return [(metric(c) - metric(d)) - (metric(a) - metric(b)), *_interval(values)]


def _paired_draws(
    metric: Callable[[Sequence[Pairs]], float],
    a: Sequence[Pairs],
    b: Sequence[Pairs],
    rng: random.Random,
    draws: int,
) -> list[float]:
    """metric(a) - metric(b) on `draws` resamples of the episodes, each drawn once for both (NaN where
    undefined)."""
    values = []
    for _ in range(draws):
        picked = [rng.randrange(len(a)) for _ in a]
        values.append(metric([a[i] for i in picked]) - metric([b[i] for i in picked]))
    return values


def _interval(values: Sequence[float]) -> list[float]:
    """The 2.5th and 97.5th percentiles of the defined values; NaN, NaN when none is."""
    defined = sorted(v for v in values if not math.isnan(v))
    return [_quantile(defined, 0.025), _quantile(defined, 0.975)] if defined else [math.nan, math.nan]


def _quantile(ordered: Sequence[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    pos = q * (len(ordered) - 1)
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def estimate(metric: Callable[[Sequence[Pairs]], float], episodes: Sequence[Pairs], **kw) -> list[float]:
    """[value, low, high]: the metric on the episodes and its bootstrap interval."""
    if not episodes:
        return [math.nan, math.nan, math.nan]
    return [metric(episodes), *bootstrap(metric, episodes, **kw)]


def truth_error(after: Sequence[float], before: Sequence[float], *, exact_after: bool = False) -> float:
    """The standard error of mean(after) - mean(before), two independent samples: sqrt(s_a^2/n_a + s_b^2/n_b)
    with sample variances. `exact_after`: the value after is known, not sampled (after an episode's last turn it
    is the episode's own reward), and adds nothing. NaN for a sampled set of fewer than 2."""
    return math.sqrt((0.0 if exact_after else _variance_of_mean(after)) + _variance_of_mean(before))


def _variance_of_mean(sample: Sequence[float]) -> float:
    return statistics.variance(sample) / len(sample) if len(sample) >= 2 else math.nan


def noise_share(truths: Sequence[tuple[float, float]]) -> float:
    """mean(se²) / var(truth): the share of the truth's spread that is its own sampling noise."""
    if len(truths) < 2 or statistics.pvariance([a for a, _ in truths]) == 0:
        return float("nan")
    return statistics.fmean(se**2 for _, se in truths) / statistics.pvariance([a for a, _ in truths])
