"""What a training run's reward said about the second search: within a group (one question at one step), the
episodes whose second search was written from a read's answer against those that copied the first query.

    python -m benchmarks.studies.research.second_search_reward runs/learning-research-vllm/outcome-s0

Over all episodes the two kinds are far apart, but that mixes questions: a question whose first read finds the
bridge is both easier and the one where a query can be written from it. Inside a group the question is the same,
so the mean difference over groups that hold both kinds is what the update could see (records.second_search
names the kinds). Prints both and, per step, how many episodes of each kind were drawn.
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections import Counter, defaultdict
from pathlib import Path

from benchmarks.studies.research.records import second_search
from training.metrics import load_episodes

KINDS = ("from_read", "copied")


def steps(run_dir: Path) -> list[tuple[int, Path]]:
    """The run's rollout files (rollouts/step_N.jsonl) in step order."""
    found = [(int(path.stem.split("_")[1]), path) for path in (run_dir / "rollouts").glob("step_*.jsonl")]
    return sorted(found)


def compare(run_dir: Path) -> dict:
    """Per kind the episodes and their mean reward; the within-group differences from_read - copied (mean,
    standard error, groups better and worse); per step the count of each kind."""
    rewards: dict[str, list[float]] = defaultdict(list)
    diffs, per_step = [], {}
    for step, path in steps(run_dir):
        groups: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        kinds = Counter()
        for episode in load_episodes(path):
            kind = str(second_search(episode))
            rewards[kind].append(episode.reward)
            groups[episode.task_id][kind].append(episode.reward)
            kinds[kind] += 1
        per_step[step] = dict(kinds)
        diffs += [
            statistics.mean(g["from_read"]) - statistics.mean(g["copied"])
            for g in groups.values()
            if all(g[k] for k in KINDS)
        ]
    return {
        "episodes": {k: len(v) for k, v in rewards.items()},
        "mean_reward": {k: statistics.mean(v) for k, v in rewards.items()},
        "within_groups": len(diffs),
        "within_mean": statistics.mean(diffs) if diffs else math.nan,
        "within_se": statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else math.nan,
        "within_better": sum(d > 0 for d in diffs),
        "within_worse": sum(d < 0 for d in diffs),
        "per_step": per_step,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+", type=Path, help="training runs (with rollouts/)")
    for run_dir in parser.parse_args().run_dirs:
        found = compare(run_dir)
        means = ", ".join(
            f"{k} {found['episodes'][k]} at {found['mean_reward'][k]:.3f}" for k in found["episodes"]
        )
        print(f"{run_dir.name}: episodes by second search (mean reward): {means}")
        print(
            f"  within {found['within_groups']} groups holding both: from_read - copied "
            f"{found['within_mean']:+.3f} ± {found['within_se']:.3f} "
            f"({found['within_better']} better, {found['within_worse']} worse)"
        )
        for step, kinds in found["per_step"].items():
            print(f"  step {step:2d}: " + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())))


if __name__ == "__main__":
    main()
