"""The research assistant's headline benchmark: policies on corpus_qa dev, question by question.

    OMP_NUM_THREADS=1 python -m benchmarks.studies.research.bench --policy conductor-default --n 12
    python -m benchmarks.studies.research.bench --policy conductor-default --policy runs/x/model --n 300
    python -m benchmarks.studies.research.bench --policy conductor-default --n 12 --recorded   # tabulate only
    python -m benchmarks.studies.research.bench --policy expert --n 72   # the scripted expert SFT imitates
    python -m benchmarks.studies.research.bench --n 72 --episodes warm=W.episodes.jsonl --episodes rl=R.episodes.jsonl

Every policy plays the first n questions of corpus_qa dev (HotpotQA dev, 300 questions, its pages and every other
question's pages as one searched corpus) as `conductor eval --task corpus_qa --split dev` plays them: greedy, the
tools in this process, the shipped recipe's budgets (rollout.max_turns=8, max_new_tokens=192; `--set` changes
them). Questions run in chunks (`--chunk`; one tool session for the run, the policy loaded per chunk); each chunk's
episodes are kept in runs/bench_research/<policy>/ as they finish, so an interrupted run plays only the
questions it has no episode of, and a policy's folder refuses other settings. `--episodes NAME=FILE` tabulates
episodes played elsewhere (a study's greedy `conductor eval --task corpus_qa --split dev` with the same budgets)
under NAME, after the played policies. Each episode becomes a record
(records.py: answer, EM, F1, searches, reads, hop 1 and hop 2 read, the failure category); the table (summary.py) gives per policy
answer rate, EM, F1, calls per question, both supporting pages read, tool error rate and the categories, and for
two or more policies the paired F1 difference of each against the first over the questions both played. Power:
the questions a paired comparison needs to detect 0.05 F1 (summary.power). Records, tables and power go to
benchmarks/results/research/main/summary.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from benchmarks import ROOT
from benchmarks.common.chunks import claim, folder_name, play_chunks, recorded
from benchmarks.common.records import summary_path, write_summary
from benchmarks.studies.research.records import record
from benchmarks.studies.research.summary import format_table, paired, power, summarise
from main_agent.types import Episode
from training import tasks as task_data
from training.evaluate import load_eval_config
from training.metrics import load_episodes
from training.rewards import supporting_pages
from training.tasks import Task
from training.tasks.corpus_qa import write_corpus

FAMILY, SPLIT = "corpus_qa", "dev"
RECIPE_SETS = ("rollout.max_turns=8", "rollout.max_new_tokens=192")
"""The shipped default's rollout budgets (examples/default_policy.toml), so the benchmark measures what it was
trained for."""


def play(policy: str, tasks: Sequence[Task], folder: Path, *, chunk: int, sets: Sequence[str]) -> None:
    """Play the questions of `tasks` that `folder` has no episode of yet, `chunk` at a time, in one tool
    session; each chunk's episodes are written once all of them are played (q<first index>+<count>)."""
    done = recorded(folder)
    todo = [(i, t) for i, t in enumerate(tasks) if t.task_id not in done]
    parts = [todo[k : k + chunk] for k in range(0, len(todo), chunk)]
    cfg = load_eval_config(None, [f"policy={json.dumps(policy)}", f"task={FAMILY}", f"split={SPLIT}", *sets])
    play_chunks([(f"q{c[0][0]:04d}+{len(c)}", [t for _, t in c]) for c in parts], folder, cfg=cfg)


def records_of(tasks: Sequence[Task], episodes: Mapping[str, Episode], corpus: Path) -> list[dict]:
    """The records of the questions of `tasks` that `episodes` (by task id) has, in task order; `corpus` holds
    the split's pages (`write_corpus`)."""
    out = []
    for task in [t for t in tasks if t.task_id in episodes]:
        pages = {p: (corpus / SPLIT / p).read_text(encoding="utf-8") for p in supporting_pages(task)}
        out.append(record(task, episodes[task.task_id], pages=pages))
    return out


def episodes_file(spec: str, every: Sequence[Task]) -> tuple[str, dict[str, Episode]]:
    """NAME=FILE: the name and the episodes of FILE by task id; exits when FILE is missing or holds an episode
    of a task that is not a corpus_qa dev question (another split's or family's evaluation)."""
    name, sep, path = spec.partition("=")
    if not (sep and name and path):
        sys.exit(f"--episodes: {spec!r} is not NAME=FILE")
    if not Path(path).is_file():
        sys.exit(f"--episodes: {path} is not a file")
    episodes = {e.task_id: e for e in load_episodes(Path(path))}
    if strays := sorted(set(episodes) - {t.task_id for t in every}):
        sys.exit(
            f"--episodes: {path} has {len(strays)} episodes of tasks not in {FAMILY} {SPLIT}, e.g. {strays[0]}"
        )
    return name, episodes


def results(policies: Sequence[str], record_sets: Sequence[list[dict]], *, n: int, available: int) -> dict:
    """The JSON the benchmark writes: per policy its measures and records, the paired differences, the power."""
    summaries = [summarise(rs) for rs in record_sets]
    return {
        "family": FAMILY,
        "split": SPLIT,
        "n": n,
        "policies": {p: s for p, s in zip(policies, summaries, strict=True)},
        "paired_vs_first": {
            p: paired(record_sets[0], rs) for p, rs in zip(policies[1:], record_sets[1:], strict=True)
        },
        "power": power(record_sets, available=available),
        "table": format_table(policies, summaries),
        "records": {p: rs for p, rs in zip(policies, record_sets, strict=True)},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", action="append", default=[], help="built-in name or checkpoint; repeat")
    parser.add_argument(
        "--episodes", action="append", default=[], metavar="NAME=FILE",
        help="also tabulate an evaluation's corpus_qa dev episodes under NAME (same budgets); repeat",
    )  # fmt: skip
    parser.add_argument(
        "--n", type=int, default=12, help="the first n questions of corpus_qa dev (300 in all)"
    )
    parser.add_argument("--chunk", type=int, default=4, help="questions a chunk: the unit of resuming")
    parser.add_argument("--set", dest="sets", action="append", default=[], help="eval setting key=value")
    parser.add_argument("--recorded", action="store_true", help="tabulate what is recorded; play nothing")
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "bench_research")
    parser.add_argument("--out", type=Path, default=summary_path("research", "main"))
    args = parser.parse_args()
    if not args.policy and not args.episodes:
        parser.error("name a --policy to play or an --episodes file to tabulate")
    every = task_data.load_family(FAMILY, SPLIT)
    if not 0 < args.n <= len(every):
        sys.exit(f"--n must be 1..{len(every)} (corpus_qa {SPLIT} has {len(every)} questions)")
    tasks, sets = every[: args.n], [*RECIPE_SETS, *args.sets]
    write_corpus([SPLIT], args.work / "corpus")
    sources = []
    for policy in args.policy:
        folder = args.work / folder_name(policy)
        if not args.recorded:
            claim(folder, policy, sets)
            play(policy, tasks, folder, chunk=args.chunk, sets=sets)
        sources.append((policy, recorded(folder)))
    sources += [episodes_file(spec, every) for spec in args.episodes]
    record_sets = [records_of(tasks, episodes, args.work / "corpus") for _, episodes in sources]
    names = [name for name, _ in sources]
    found = results(names, record_sets, n=args.n, available=len(every))
    found |= {"settings": sets}
    print(f"\n## corpus_qa dev, first {args.n} questions\n{found['table']}")
    for policy, diff in found["paired_vs_first"].items():
        print(
            f"{policy} - {names[0]}: F1 {diff['f1_diff']:+.3f} +- {diff['f1_diff_se']:.3f} "
            f"(n {diff['n_shared']})"
        )
    p = found["power"]
    print(f"power: {p['n']} questions detect d = {p['d']} (sd_diff {p['sd_diff']:.3f}, {p['sd_from']}); "
          f"the {p['available']} dev questions detect {p['detectable_with_available']:.3f}")  # fmt: skip
    write_summary(args.out, found)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
