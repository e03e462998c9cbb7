"""A learning curve that rises: plate_reading from its SFT warm start, outcome vs turn credit, 3 seeds.

    python -m benchmarks.studies.learning.bench --sampler vllm  # the study (vLLM env) -> results/learning/plates/
    python -m benchmarks.studies.learning.bench --recipe research --cells lora-lr1e-4 --sampler vllm
        # the same stages on the research assistant's recipe (RECIPES): the chained SFT adapter named by commit
        # in research_warm_start/, on corpus_qa -> results/learning/research/, runs/learning-research-vllm/
    python -m benchmarks.studies.learning.bench --sampler vllm --recorded  # the table and plot so far
    python -m benchmarks.studies.learning.bench --steps 1 --seeds 1 --sweep-steps 1 --eval-n 2 --tag smoke \
        --cells full-lr1e-5 lora16-lr2e-4 --policy /abs/path/to/runs/sft-plates/model

The warm start (`--policy`, runs/sft-plates/model as examples/train_plates.toml makes it) passes about half of the
49 dev photos greedy (0.510 when made), neither hopeless nor perfect, so RL has room both ways. Every stage runs
through the `conductor` CLI as a user would, and writes a record (below):

  1. warm: `conductor eval` of the warm start, greedy, on the first `--eval-n` dev photos (all 49 by default)
  2. sweep: short runs (`--sweep-steps` steps, outcome credit, seed 0) of a few cells of the settings that set
     learning per CPU-hour (SWEEP: learning rate, LoRA vs full, group size at equal episodes per step, and the
     exact reward beside the graded one); `choose` picks the cell of the main runs from their records
  3. exploration: for each of `--temperatures`, one step of 16 groups at learning rate 0 (EXPLORE): how many
     groups have reward variance to learn from, how many are token for token the same, how sure the sampler is;
     `choose_temperature` picks the coolest at which fewer than 1/3 of the groups lack signal, without longer
     episodes (the warm start is near-deterministic: at 1.0 the seed-0 runs trained on nothing in 21-24 of 40)
  3b. screen (recipes with `screen`, research): the first `screen` train tasks, SAMPLES episodes each by the warm
     start at the chosen temperature (`conductor eval --split train`, nothing updated); the main runs and
     controls train on those whose rewards differed (`task_ids`), the only groups an update learns from
  4. main: for each seed and credit mode (outcome; turn with the anchor baseline, the best per-call mode of
     bench_horizon), `conductor train` for `--steps` steps with the chosen cell and temperature, then
     `conductor eval` of its last checkpoint (greedy) on the same dev photos as the warm start; and per seed its
     control (CONTROL): the same run at learning rate 0, whose curve is the photo order's alone
  5. sampled: `conductor eval` with `--set samples=SAMPLES` at the chosen temperature, of the warm start (once)
     and of each main run's last checkpoint, on the same dev photos: whether what training adds to the sampler's
     reward on its own photos (over the control) carries to photos it never saw, where the greedy policy has not
     moved (`summary.sampled_summary`, photo by photo); and the warm start once more at COOLER: whether
     training did more than cool the sampler (recipes with `sampled`; not research: what ships is greedy)

Rewards: the graded plate score (`reward_kind = "graded"`: 1 - normalised edit distance) trains; success (exact)
is logged beside it. Groups whose rewards are all equal train on nothing and are counted (`groups/*`).
Equal sampled tokens: both credit modes play the same B x G episodes per step from the same seeded task order;
they differ only in how the rewards become advantages, so their sampling budgets are equal by design; the table
shows the sampled tokens per step each really used. The longer-horizon evaluation of the issue (train plate_audit
N = 2, test N = 8) applies to plate_audit; this study trains plate_reading and does not run it.

Records: each finished stage writes results/learning/<recipe>[_tag]/records/<stage>.json: its settings, the
SHA-256 of the warm start's weights, the evaluation and the training summary. A stage with a record of the same settings and warm
start is not run again; a run cut short resumes from its last checkpoint (`--resume`); a record from another warm
start is reported and left out of the table (and run again unless `--recorded`). So the study spreads over
sessions and machines: on a new machine the SFT command of examples/train_plates.toml remakes the warm start bit
for bit (the same SHA-256; ~20 min on 2 cores), and the first main stage evaluates it again for the episodes its
record does not hold (runs/ is not committed; ~5 min). Time on 2 cores, measured on this task: with
transformers sampling ~1.8 min a step of 8 episodes and ~10 min an evaluation of 49 photos (~5.2 h in all); with
vLLM (the recorded study; greedy dev success of the warm start is the same, 25 of 49) ~40-50 s of rollout plus
~25 s of update a step and ~5 min an evaluation: ~38 min a main stage (seed 0: 32-33 min of 20 steps, 5-6 min of
evaluation), ~4.5 h in all; at 1.15 a main stage took 33-38 min, a control (20 steps, no evaluation) 26 min and a
sampled evaluation ~16 min (196 episodes).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import time
from pathlib import Path

from benchmarks import ROOT
from benchmarks.common.episodes import moved, sampled_scores
from benchmarks.common.records import summary_path, write_summary
from benchmarks.common.stages import conductor, train_to, warm_start_sha
from benchmarks.studies.learning.recipes import (
    CONTROL,
    COOLER,
    CREDITS,
    DEFAULT_CREDITS,
    EXPLORE,
    RECIPES,
    SAMPLES,
    TEMPERATURES,
    Options,
)
from benchmarks.studies.learning.summary import (
    choose,
    choose_temperature,
    exploration_summary,
    sampled_summary,
    summarise,
    training_summary,
)
from benchmarks.studies.learning.tables import plot, table
from conductor.stopping import stop_like_ctrl_c
from training.checkpoint import find_latest
from training.tasks import load_family


def train(name: str, sets: tuple[str, ...], steps: int, seed: int, opts: Options) -> Path:
    """A finished run of `steps` steps (trained, resumed or reused) in runs/.../<name>."""
    run_dir = opts.runs / name
    sets = (
        f"policy={opts.policy}", f"steps={steps}", f"seed={seed}", f"run_dir={run_dir}",
        f"sampling.backend={opts.sampler}", *opts.recipe.base, *sets,
        *([f"task_ids={json.dumps(opts.task_ids)}"] if opts.task_ids else []),
    )  # fmt: skip
    return train_to(opts.recipe.config, run_dir, sets, steps)


def evaluate(
    policy: str, out: Path, opts: Options, *sets: str, split: str = "dev", n: int | None = None
) -> dict:
    """`conductor eval` of `policy` on the first `n` (default `eval_n`) tasks of `split`, greedy unless `sets`
    say otherwise (reused when present)."""
    if not out.exists():
        task, n = opts.recipe.task, n or opts.eval_n
        args = ["eval", "--policy", policy, "--task", task, "--split", split, "--n", str(n)]
        sets = (f"sampling.backend={opts.sampler}", *opts.recipe.eval_sets, *sets)
        args += [arg for x in sets for arg in ("--set", x)]
        conductor(*args, "--out", str(out), log=out.with_suffix(".log"))
    return json.loads(out.read_text(encoding="utf-8"))


def episodes_of(out: Path) -> Path:
    """The episodes `conductor eval --out X.json` writes beside its report."""
    return out.with_name(f"{out.stem}.episodes.jsonl")


def read_record(path: Path, settings: dict, sha: str | None, opts: Options) -> dict | None:
    """The record at `path` when it was made under `settings` from the warm start `sha` (None: unknown, any);
    else None, saying why."""
    if not path.exists():
        return None
    record = json.loads(path.read_text(encoding="utf-8"))
    then = "left out" if opts.recorded_only else "running it again"
    if record["settings"] != settings:
        print(f"{path.name}: made with {record['settings']}, not {settings}: {then}", flush=True)
        return None
    if sha is not None and record["warm_start"]["sha256"] != sha:
        other = record["warm_start"]["sha256"][:12]
        print(f"{path.name}: from another warm start ({other}, not {sha[:12]}): {then}", flush=True)
        return None
    return record


def stage(name: str, settings: dict, make, opts: Options) -> dict | None:
    """The record of stage `name`: read when it matches, else made by `make()` -> (eval or None, training
    summary or None) and written (None when only recorded stages are wanted, or when `make()` returns None)."""
    path = opts.records / f"{name}.json"
    sha = reference_sha(opts)
    record = read_record(path, settings, sha, opts)
    if record is not None or opts.recorded_only:
        return record
    sha = weights_sha(opts.policy)  # before running, so that a missing warm start stops the study at once
    made = make()
    if made is None:  # what it needs is not here (it said what)
        return None
    evaluation, trained = made
    record = {
        "stage": name,
        "settings": settings,
        "warm_start": {"policy": opts.policy, "sha256": sha},
        "eval": evaluation,
        "training": trained,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return record


def reference_sha(opts: Options) -> str | None:
    """The warm start the table is about: its weights' SHA-256 when present here, else the warm record's (a clean
    checkout tabulating records made elsewhere), else None."""
    if (ROOT / opts.policy).is_dir() and any((ROOT / opts.policy).glob("*.safetensors")):
        return weights_sha(opts.policy)
    warm = opts.records / "warm.json"
    return json.loads(warm.read_text(encoding="utf-8"))["warm_start"]["sha256"] if warm.exists() else None


@functools.cache
def weights_sha(policy: str) -> str:
    """The warm start's SHA-256, hashed once per process (every stage checks its record against it)."""
    return warm_start_sha(policy, made_by="the recipe's SFT command (examples/)")


def warm_out(opts: Options) -> Path:
    """Where the warm start's evaluation report goes (its episodes beside it: `episodes_of`)."""
    return opts.runs / f"eval-warm-first{opts.eval_n}.json"


def warm(opts: Options) -> dict | None:
    return stage(
        "warm", opts.settings("warm"), lambda: (evaluate(opts.policy, warm_out(opts), opts), None), opts
    )


def warm_episodes(opts: Options) -> Path:
    """The warm start's greedy dev episodes, evaluated again where its record came from another machine or
    session (records are committed; runs/ is not)."""
    evaluate(opts.policy, warm_out(opts), opts)
    return episodes_of(warm_out(opts))


def explore(temperature: float, opts: Options) -> dict | None:
    def make() -> tuple[None, dict]:
        sets = (*EXPLORE, f"sampling.temperature={temperature}")
        return None, exploration_summary(train(f"explore-t{temperature:g}", sets, 1, 0, opts))

    return stage(f"explore-t{temperature:g}", opts.settings("explore", temperature=temperature), make, opts)


def screen(temperature: float, opts: Options) -> dict | None:
    """The recipe's first `screen` train tasks played SAMPLES times each by the warm start at `temperature` (an
    evaluation: nothing is updated), and the ids of those whose rewards differed, which the main runs train on."""
    n = opts.recipe.screen
    out = opts.runs / f"screen-train-t{temperature:g}x{SAMPLES}-first{n}.json"

    def make() -> tuple[dict, None]:
        sets = (f"samples={SAMPLES}", f"sampling.temperature={temperature}")
        evaluation = evaluate(opts.policy, out, opts, *sets, split="train", n=n)
        scores = sampled_scores(episodes_of(out), load_family(opts.recipe.task, "train", limit=n))
        ids = [t for t, spread in zip(scores["task_ids"], scores["spread"], strict=True) if spread > 1e-9]
        return evaluation | {"per_task": scores, "task_ids": ids}, None

    settings = {"n": n, "samples": SAMPLES, "temperature": temperature, "sampler": opts.sampler}
    return stage(f"screen-t{temperature:g}", settings, make, opts)


def sweep_cell(cell: str, opts: Options) -> dict | None:
    def make() -> tuple[None, dict]:
        run_dir = train(f"sweep-{cell}", (*CREDITS["outcome"], *opts.cell(cell)), opts.sweep_steps, 0, opts)
        return None, training_summary(run_dir)

    return stage(f"sweep-{cell}", opts.settings("sweep", cell), make, opts)


def run_name(kind: str, seed: int, temperature: float) -> str:
    """A main run's or control's stage and run directory: credit mode (or "control") and seed, and the temperature
    unless it is 1.0."""
    return f"{kind}-s{seed}" + (f"-t{temperature:g}" if temperature != 1.0 else "")


def main_run(credit: str, seed: int, cell: str, temperature: float, opts: Options) -> dict | None:
    name = run_name(credit, seed, temperature)

    def make() -> tuple[dict, dict]:
        sets = (*CREDITS[credit], *opts.cell(cell), f"sampling.temperature={temperature}")
        run_dir = train(name, sets, opts.steps, seed, opts)
        latest = find_latest(run_dir)
        assert latest is not None, f"{run_dir} has no checkpoint after training"
        out = run_dir / f"eval-dev-{latest.name}-first{opts.eval_n}.json"
        evaluation = evaluate(str(latest / "model"), out, opts)
        dev = load_family(opts.recipe.task, "dev", limit=opts.eval_n)
        vs_warm = moved(warm_episodes(opts), episodes_of(out), dev)
        return evaluation | {"vs_warm": vs_warm}, training_summary(run_dir)

    return stage(name, opts.settings("main", cell, temperature), make, opts)


def control_run(seed: int, cell: str, temperature: float, opts: Options) -> dict | None:
    """The main runs' control at `seed` (CONTROL): their photos and temperature, nothing learned; not evaluated
    (its policy is the warm start)."""
    name = run_name("control", seed, temperature)

    def make() -> tuple[None, dict]:
        sets = (*CREDITS["outcome"], *opts.cell(cell), *CONTROL, f"sampling.temperature={temperature}")
        return None, training_summary(train(name, sets, opts.steps, seed, opts))

    return stage(name, opts.settings("control", cell, temperature), make, opts)


def sampled_eval(policy: str, out: Path, temperature: float, opts: Options) -> dict:
    """`conductor eval` of `policy` with SAMPLES episodes per dev photo at `temperature`, and its scores photo by
    photo (`sampled_scores`)."""
    evaluation = evaluate(policy, out, opts, f"samples={SAMPLES}", f"sampling.temperature={temperature}")
    dev = load_family(opts.recipe.task, "dev", limit=opts.eval_n)
    return evaluation | {"per_task": sampled_scores(episodes_of(out), dev)}


def sampled_name(temperature: float, opts: Options) -> str:
    """The sampled evaluations' report name: temperature, samples per photo, photos."""
    return f"eval-dev-sampled-t{temperature:g}x{SAMPLES}-first{opts.eval_n}.json"


def sampled_warm(temperature: float, opts: Options) -> dict | None:
    """The warm start's sampled dev evaluation at `temperature`."""
    out = opts.runs / f"warm-{sampled_name(temperature, opts)}"

    def make() -> tuple[dict, None]:
        return sampled_eval(opts.policy, out, temperature, opts), None

    return stage(
        f"sampled-warm-t{temperature:g}", opts.settings("sampled", temperature=temperature), make, opts
    )


def sampled_run(credit: str, seed: int, cell: str, temperature: float, opts: Options) -> dict | None:
    """The sampled dev evaluation of a main run's last checkpoint; it waits (None) where the run's checkpoints are
    not on this machine (records are committed, runs/ is not), rather than training the run again."""
    name = run_name(credit, seed, temperature)
    settings = opts.settings("sampled", temperature=temperature) | {
        "run": opts.settings("main", cell, temperature)
    }

    def make() -> tuple[dict, None] | None:
        latest = find_latest(opts.runs / name)
        if latest is None:
            print(f"sampled-{name}: no checkpoint of {name} here; its sampled evaluation waits", flush=True)
            return None
        out = opts.runs / name / f"{latest.name}-{sampled_name(temperature, opts)}"
        return sampled_eval(str(latest / "model"), out, temperature, opts), None

    return stage(f"sampled-{name}", settings, make, opts)


def study(args: argparse.Namespace, opts: Options) -> dict:
    """Every stage in order (warm, sweep, exploration, the screen where the recipe has one, the warm start
    sampled at the chosen temperature and at COOLER, then seed by seed each credit mode, the control and the
    modes' sampled evaluations), then the summary."""
    warm_record = warm(opts)
    cells = {c: r for c in args.cells if (r := sweep_cell(c, opts)) is not None}
    candidates = {c: r["training"] for c, r in cells.items() if c in opts.recipe.candidates}
    choice = choose(candidates, default=opts.recipe.default_cell)
    print(f"chosen cell: {choice['cell']} ({choice['why']})", flush=True)
    explored = {t: r["training"] for t in args.temperatures if (r := explore(t, opts)) is not None}
    heat = choose_temperature(explored)
    print(f"chosen temperature: {heat['temperature']:g} ({heat['why']})", flush=True)
    cell, temperature = choice["cell"], heat["temperature"]
    seeds = range(args.seeds)
    if opts.recipe.screen:
        if (screened := screen(temperature, opts)) is not None:
            opts = dataclasses.replace(opts, task_ids=tuple(screened["eval"]["task_ids"]))
            print(
                f"screened: {len(opts.task_ids)} of {opts.recipe.screen} train tasks had rewards that differed"
            )
        else:  # --recorded, before the screen is: the runs it chooses for have no record either
            seeds = range(0)
    sampled_too = opts.recipe.sampled
    references = {"warm": sampled_warm(temperature, opts)} if sampled_too else {}
    if sampled_too and temperature != COOLER:
        references["cooler"] = sampled_warm(COOLER, opts)
    runs: dict[str, list[dict]] = {c: [] for c in args.credits}
    sampled: dict[str, list[dict]] = {c: [] for c in args.credits}
    controls: dict[int, list[float]] = {}
    for seed in seeds:  # seed by seed: a study cut short has every mode at the same seeds
        for credit in args.credits:
            if (r := main_run(credit, seed, cell, temperature, opts)) is not None:
                runs[credit].append(r | {"seed": seed})
        if (c := control_run(seed, cell, temperature, opts)) is not None:
            controls[seed] = c["training"]["reward"]
        for credit in args.credits if sampled_too else ():
            if (r := sampled_run(credit, seed, cell, temperature, opts)) is not None:
                sampled[credit].append({"seed": seed, "per_task": r["eval"]["per_task"]})
    warm_eval = warm_record["eval"] if warm_record else None
    how = f"{SAMPLES} per photo at T {temperature:g}; the cooler warm start at {COOLER:g}"
    return summarise(warm_eval, cells, choice, heat, runs, controls) | {
        "sampled": sampled_summary(
            {k: r["eval"]["per_task"] for k, r in references.items() if r}, sampled, how
        )
    }


def main() -> None:
    stop_like_ctrl_c()  # `kill` stops the study as Ctrl-C does: its engine and commands close first
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="plates", choices=list(RECIPES), help="what is trained (RECIPES)")
    parser.add_argument("--policy", help="the SFT warm start (default: the recipe's)")
    parser.add_argument("--steps", type=int, default=20, help="RL steps of each main run")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per credit mode")
    parser.add_argument("--sweep-steps", type=int, default=3, help="RL steps of each sweep cell")
    parser.add_argument("--cells", nargs="+", help="sweep cells (default: all of the recipe's)")
    parser.add_argument("--temperatures", nargs="+", type=float, default=list(TEMPERATURES),
                        help="sampling temperatures the exploration stage measures")  # fmt: skip
    parser.add_argument("--credits", nargs="+", default=list(DEFAULT_CREDITS), choices=list(CREDITS))
    parser.add_argument(
        "--eval-n", type=int, help="dev tasks per evaluation, the first ones (default: the recipe's)"
    )
    parser.add_argument("--sampler", default="transformers", choices=("transformers", "vllm", "auto"))
    parser.add_argument("--recorded", action="store_true", help="run nothing: tabulate the recorded stages")
    parser.add_argument("--tag", default="", help="names the runs and results apart")
    args = parser.parse_args()
    recipe = RECIPES[args.recipe]
    args.cells = args.cells or list(recipe.sweep)
    args.policy, args.eval_n = args.policy or recipe.policy, args.eval_n or recipe.eval_n
    if unknown := set(args.cells) - set(recipe.sweep):
        parser.error(f"--cells: {sorted(unknown)} are not cells of {args.recipe} ({', '.join(recipe.sweep)})")
    name = "learning" + ("" if args.recipe == "plates" else f"-{args.recipe}")  # plates: the recorded study
    suffix = f"_{args.tag}" if args.tag else ""
    out = summary_path("learning", f"{args.recipe}{suffix}")
    opts = Options(
        args.policy, args.steps, args.sweep_steps, args.eval_n, args.sampler,
        ROOT / "runs" / f"{name}-{args.sampler}{suffix}", out.parent / "records", args.recorded, recipe,
    )  # fmt: skip  # runs apart by sampler: a stage reuses or resumes only runs made as its record says
    start = time.monotonic()
    report = study(args, opts)
    png = plot(report, out.with_suffix(".png"), title=f"{recipe.task}: graded reward while training")
    print("\n" + table(report))
    report |= {
        "settings": vars(args),
        "plot": str(png.relative_to(ROOT)),
        "wall_s_now": time.monotonic() - start,
    }
    write_summary(out, report)
    print(
        f"\nplot: {png}\nwrote {out}\nstudy wall time (stages run now): {report['wall_s_now'] / 60:.1f} min"
    )


if __name__ == "__main__":
    main()
