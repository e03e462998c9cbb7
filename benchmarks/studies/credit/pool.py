"""Pools bench.py's results of several studies of one recipe (warm starts, splits, seeds): for every N, the
scored turns of all of them scored again as one set, with bootstrap intervals over all their episodes.

    python -m benchmarks.studies.credit.pool benchmarks/results/credit/main/summary.json \\
        benchmarks/results/credit/warm2/summary.json benchmarks/results/credit/warm2-dev/summary.json
                                                   # -> benchmarks/results/credit/pooled/summary.{json,png}

Each result row carries its (estimate, truth) pairs per episode and its truths with their standard errors
(report.py), so nothing is sampled or read from the records. Counts and stage times add up; per-episode
figures (turns, reward, tokens) are averaged weighted by episodes. Each mode's Spearman is also given over outcome
credit's on the same episodes, with a paired bootstrap interval (scores.paired_difference), and branch credit's over
outcome_matched's, outcome credit at branch credit's sampled tokens, where every study has it; the plot shows both
against N, each mode's Spearman and its paired difference, with their intervals; and how much each mode's lead
over outcome grew from the shortest N to each longer one (scores.trend). A pooled score
answers "how well does this mode's credit track the truth on warm starts of this recipe", not on one warm start:
its interval includes the spread between the studies only as far as their episodes differ.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

from benchmarks import ROOT
from benchmarks.common.records import summary_path, write_summary
from benchmarks.studies.credit import scores as cs
from benchmarks.studies.credit.bench import errorbars, interval, n_axis, table
from benchmarks.studies.credit.report import METRICS, MODES
from training.plot import save_figure


def pool(rows: Sequence[dict], *, draws: int = 1000) -> dict:
    """One row from rows of the same N: their episodes' pairs scored as one set."""
    [n] = {r["n"] for r in rows}
    episodes = sum(r["episodes"] for r in rows)

    def weighted(get) -> float:
        return sum(get(r) * r["episodes"] for r in rows) / episodes

    truths = [(a, se) for r in rows for a, se in r["truths"]]
    # outcome_matched only where every study has it
    modes = [m for m in MODES if all(m in r["modes"] for r in rows)]
    pairs = {m: [[(e, t) for e, t in ep] for r in rows for ep in r["pairs"][m]] for m in modes}
    return {
        "n": n,
        "studies": len(rows),
        **{k: sum(r[k] for r in rows) for k in ("groups", "episodes", "turns_scored", "turns_nonzero")},
        "mean_turns": weighted(lambda r: r["mean_turns"]),
        "mean_reward": weighted(lambda r: r["mean_reward"]),
        "truth": {
            "mean_abs": statistics.fmean(abs(a) for a, _ in truths),
            "mean_se": statistics.fmean(se for _, se in truths),
            "noise_share": cs.noise_share(truths),
            "replays_per_state": weighted(lambda r: r["truth"]["replays_per_state"]),
            "sampled_tokens_per_episode": weighted(lambda r: r["truth"]["sampled_tokens_per_episode"]),
        },
        "modes": {
            m: {
                **{name: cs.estimate(metric, pairs[m], draws=draws) for name, metric in METRICS.items()},
                "sampled_tokens_per_episode": weighted(
                    lambda r, m=m: r["modes"][m]["sampled_tokens_per_episode"]
                ),
            }
            for m in modes
        },
        "spearman_over_outcome": {
            m: cs.paired_difference(cs.spearman, pairs[m], pairs["outcome"], draws=draws) for m in modes[1:]
        },
        "spearman_over_matched": {  # branch credit against outcome credit at the same sampled tokens
            m: cs.paired_difference(cs.spearman, pairs[m], pairs["outcome_matched"], draws=draws)
            for m in ("branch", "branch_all")
            if "outcome_matched" in pairs
        },
        "stage_s": {k: sum(r["stage_s"][k] for r in rows) for k in rows[0]["stage_s"]},
        "pairs": pairs,
        "truths": truths,
    }


def with_trends(rows: list[dict], *, draws: int = 1000) -> list[dict]:
    """Each row past the shortest N gets, per mode, how much its Spearman's lead over outcome credit's grew
    from the shortest N (`scores.trend`: the thesis that per-call credit helps more on longer chains)."""
    first = rows[0]["pairs"] if rows else {}
    for r in rows[1:]:
        r["trend_over_outcome"] = {
            m: cs.trend(
                cs.spearman,
                (first[m], first["outcome"]),
                (r["pairs"][m], r["pairs"]["outcome"]),
                draws=draws,
            )
            for m in r["spearman_over_outcome"]
            if m in first
        }
    return rows


def plot(rows: Sequence[dict], out: Path) -> Path:
    """Two panels against N, each point with its 95 % interval: every mode's Spearman with the truth, and each
    mode's paired difference over outcome credit's (branch credit's also over outcome_matched's, dashed: the
    same sampled tokens). A difference whose interval holds 0 decides nothing at that N."""
    import matplotlib

    matplotlib.use("Agg")  # files only
    from matplotlib import pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for k, mode in enumerate(MODES):
        color = f"C{k}"
        errorbars(left, rows, lambda r, m=mode: r["modes"].get(m, {}).get("spearman"), k, mode, color)
        over = f"{mode} - outcome"
        errorbars(right, rows, lambda r, m=mode: r["spearman_over_outcome"].get(m), k, over, color)
        if mode in ("branch", "branch_all"):
            at_tokens = functools.partial(_over_matched, mode=mode)
            errorbars(right, rows, at_tokens, k + 0.5, f"{mode} - outcome_matched", color, "--")
    for ax, title in ((left, "Spearman with the truth"), (right, "paired difference (Spearman)")):
        n_axis(ax, [r["n"] for r in rows], title=title, ylim=(-1.05, 1.05))
        ax.axhline(0.0, color="grey", lw=0.8, ls=":")
        ax.legend(fontsize="x-small")
    return save_figure(fig, out)


def _over_matched(row: dict, *, mode: str) -> list[float] | None:
    """A branch mode's paired Spearman over outcome_matched's (the same sampled tokens), where the row has it."""
    return row["spearman_over_matched"].get(mode)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, nargs="+", help="credit runs' summary.json files")
    parser.add_argument("--draws", type=int, default=1000, help="bootstrap resamples")
    parser.add_argument("--out", type=Path, default=summary_path("credit", "pooled"))
    args = parser.parse_args()
    by_n: dict[int, list[dict]] = {}
    for path in args.results:
        for row in json.loads(path.read_text(encoding="utf-8"))["rows"]:
            if "pairs" not in row:
                sys.exit(
                    f"{path} has no pairs: rebuild it with benchmarks.studies.credit.bench --recorded"
                    " and the flags that made it"
                )
            by_n.setdefault(row["n"], []).append(row)
    rows = with_trends([pool(by_n[n], draws=args.draws) for n in sorted(by_n)], draws=args.draws)
    png = plot(rows, args.out.with_suffix(".png"))
    print(table(rows))
    for r in rows:
        print(
            f"  N = {r['n']}, Spearman over outcome's (paired bootstrap over episodes): "
            + ", ".join(f"{m} {interval(v)}" for m, v in r["spearman_over_outcome"].items())
        )
        if "trend_over_outcome" in r:
            print(
                f"           its change from N = {rows[0]['n']} (longer minus shorter): "
                + ", ".join(f"{m} {interval(v)}" for m, v in r["trend_over_outcome"].items())
            )
        if r["spearman_over_matched"]:
            print(
                "           over outcome_matched's (the same sampled tokens): "
                + ", ".join(f"{m} {interval(v)}" for m, v in r["spearman_over_matched"].items())
            )
    print(f"\nplot: {png}")
    sources = [
        str(p.resolve().relative_to(ROOT)) if p.resolve().is_relative_to(ROOT) else str(p)
        for p in args.results
    ]
    write_summary(args.out, {"rows": rows, "sources": sources})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
