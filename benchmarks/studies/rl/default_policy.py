"""The shipped default policy against its base model, on questions its recipe never trained on.

    python -m benchmarks.studies.rl.default_policy    # -> results/default_policy/main/ and a table
    python -m benchmarks.studies.rl.default_policy --policies smollm2-135m-instruct \\
        runs/default-rl/step_8/model
    python -m benchmarks.studies.rl.default_policy --n research_corpus=36 multihop_pages=24

For every policy and evaluation set, `conductor eval` exactly as a user would run it (greedy, the first n
questions of the set, the same for every policy; all 36 of research_corpus, 24 of multihop dev by default: on 2
CPU cores the base model alone spends ~12 min on 36, writing turn after turn of text that is not a call):
  research_corpus  the 36 held-out questions about examples/corpus (search the corpus, read a hit, answer)
  multihop_pages   HotpotQA dev: the pages are listed, read them with page_qa and answer

The base model gets no forced first call (`conductor eval` never forces one): this measures what each policy writes
by itself. A report that exists is reused, so an interrupted run continues. Prints one table per set (answer rate,
EM = success rate, F1 = mean reward, valid-call rate, calls per question, ...), and writes all reports to one JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

from benchmarks import ROOT
from benchmarks.common.records import summary_path, write_summary
from conductor.models import DEFAULT_MODEL, DEFAULT_POLICY
from training.evaluate import EvalReport, format_table

SETS = {"research_corpus": "dev", "multihop_pages": "dev"}  # family -> split
DEFAULT_N = ("research_corpus=36", "multihop_pages=24")


def evaluate(policy: str, family: str, n: int, out: Path) -> EvalReport:
    """One `conductor eval` run (skipped when its report exists)."""
    if not out.is_file():
        command = ["conductor", "eval", "--policy", policy, "--task", family, "--split", SETS[family]]
        command += ["--n", str(n), "--out", str(out), "--set", "rollout.max_turns=8"]
        command += ["--set", "rollout.max_new_tokens=192"]
        subprocess.run(command, check=True)
    return EvalReport(**json.loads(out.read_text(encoding="utf-8")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", nargs="+", default=[DEFAULT_MODEL, DEFAULT_POLICY])
    parser.add_argument("--n", nargs="+", default=list(DEFAULT_N), help="questions per set: family=n ...")
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "bench_default_policy")
    parser.add_argument("--out", type=Path, default=summary_path("default_policy", "main"))
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    sizes = {family: int(n) for family, n in (item.split("=") for item in args.n)}
    results: dict[str, list[dict]] = {}
    for family in SETS:
        reports = []
        for i, policy in enumerate(args.policies):
            out = args.work / f"{family}-n{sizes[family]}-{i}.json"
            reports.append(evaluate(policy, family, sizes[family], out))
        print(f"\n## {family} ({SETS[family]}, first {sizes[family]})\n{format_table(reports)}")
        results[family] = [json.loads(r.to_json()) for r in reports]
    write_summary(args.out, results)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
