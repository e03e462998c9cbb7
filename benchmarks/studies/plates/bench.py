"""Plate reading by country: the scripted expert and policies on plate_reading photos, US and EU apart.

    OMP_NUM_THREADS=1 python -m benchmarks.studies.plates.bench --policy expert --split train --split dev
    python -m benchmarks.studies.plates.bench --policy conductor-default --split dev --n 12
    python -m benchmarks.studies.plates.bench --policy expert --policy conductor-default --split dev --recorded

`expert` is the scripted plate expert (training/tasks/plates.py, as `conductor sft` plays it); any other name is
a policy played as `conductor eval --task plate_reading` plays it: greedy, the tools in this process, the shipped
recipe's budgets (rollout.max_turns=8, max_new_tokens=192, as examples/default_policy_sft.toml; `--set` changes
them), and the expert plays under the same budgets. Each split's photos are the first n of each country (`--n`;
all by default), played in chunks (`--chunk`) whose episodes are kept in runs/bench_plates/<policy>/ as they
finish, so an interrupted run plays only the photos it has no episode of; a policy's folder refuses other
settings. Each episode becomes a record (records.py) and the records a table per policy, country and split:
success, answered, plate-shaped answers, retried (and the share of successes that retried: the demonstrations
SFT keeps), calls a photo, tool error rate, the label shown in a read, and the plate-shaped rule's hits where it
was. Records and tables go to benchmarks/results/plates/main/summary.json. docs/plates.md: which split chose what.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from benchmarks import ROOT
from benchmarks.common.chunks import claim, folder_name, play_chunks, recorded
from benchmarks.common.records import summary_path, write_summary
from benchmarks.studies.plates.records import country, format_table, groups, record
from training import tasks as task_data
from training.evaluate import load_eval_config
from training.tasks import Task

FAMILY = "plate_reading"
RECIPE_SETS = ("rollout.max_turns=8", "rollout.max_new_tokens=192")
"""The shipped default's SFT budgets (examples/default_policy_sft.toml): what its plate demonstrations fit."""


def photos(split: str, n: int | None) -> list[Task]:
    """The first `n` photos (all: None) of each country of `split`, in load order."""
    tasks = task_data.load_family(FAMILY, split)
    return [t for c in sorted({country(t) for t in tasks}) for t in [t for t in tasks if country(t) == c][:n]]


def play(policy: str, tasks: Sequence[Task], folder: Path, *, chunk: int, sets: Sequence[str]) -> None:
    """Play the photos of `tasks` that `folder` has no episode of yet, `chunk` at a time, in one tool session;
    each chunk's episodes are written once all of them are played (<first task id>+<count>)."""
    done = recorded(folder)
    todo = [t for t in tasks if t.task_id not in done]
    parts = [todo[k : k + chunk] for k in range(0, len(todo), chunk)]
    cfg = load_eval_config(None, [f"policy={json.dumps(policy)}", f"task={FAMILY}", *sets])
    play_chunks([(f"{c[0].task_id}+{len(c)}", c) for c in parts], folder, cfg=cfg)


def records_of(tasks: Sequence[Task], folder: Path) -> list[dict]:
    """The records of the photos of `tasks` that `folder` has episodes of, in task order."""
    episodes = recorded(folder)
    return [record(t, episodes[t.task_id]) for t in tasks if t.task_id in episodes]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--policy", action="append", required=True, help="expert, a built-in name or a checkpoint"
    )
    parser.add_argument("--split", action="append", help="train, dev, test; repeat (default: dev)")
    parser.add_argument(
        "--n", type=int, default=None, help="the first n photos of each country (default: all)"
    )
    parser.add_argument("--chunk", type=int, default=8, help="photos a chunk: the unit of resuming")
    parser.add_argument("--set", dest="sets", action="append", default=[], help="eval setting key=value")
    parser.add_argument("--recorded", action="store_true", help="tabulate what is recorded; play nothing")
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "bench_plates")
    parser.add_argument("--out", type=Path, default=summary_path("plates", "main"))
    args = parser.parse_args()
    tasks = [t for split in args.split or ["dev"] for t in photos(split, args.n)]
    sets = [*RECIPE_SETS, *args.sets]
    rows, records = [], {}
    for policy in args.policy:
        folder = args.work / folder_name(policy)
        if not args.recorded:
            claim(folder, policy, sets)
            play(policy, tasks, folder, chunk=args.chunk, sets=sets)
        records[policy] = records_of(tasks, folder)
        rows += groups(policy, records[policy])
    table = format_table(rows)
    found = {"family": FAMILY, "settings": sets, "rows": rows, "table": table}
    print(f"\n## plate_reading by country\n{table}")
    write_summary(args.out, found | {"records": records})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
