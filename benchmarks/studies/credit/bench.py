"""Credit quality against the truth, without gradient steps: every credit mode's per-turn advantages on episodes of
one fixed policy, scored against Monte Carlo advantages from exact replays (VinePPO's test of an estimator).

    python -m benchmarks.studies.credit.bench             # the pinned warm start; N 1 2 4 8; 24 episodes;
                                                          # 16 replays
    python -m benchmarks.studies.credit.bench --recorded  # the table and plot of the records; nothing sampled
                                                          # (an N whose truth is not whole: with --partial)
    python -m benchmarks.studies.credit.bench --policy conductor-default --n-items 1 2 --episodes 2 \\
        --group-size 2 --replays 2 --tag smoke            # the smoke run (docs/credit.md)

The policy (`--policy`) stays fixed. Its default is the plate_audit warm start beside the study,
benchmarks/studies/credit/warm_start/: SmolLM2-135M-Instruct plus a LoRA adapter (its README says how it was made),
the same bytes on every machine, named by the commit that holds them and read back from it when the study samples
(benchmarks.common.pinned); the records before it (results/credit/main, warm2, warm2-dev) were sampled from a
full-weight warm start, runs/sft-audit/model, that resumes only where it was made. Any reference the project loads works
(`conductor-default`, `smollm2-135m-instruct`, a checkpoint). It samples as training does: the rollout budgets,
sampling (temperature 1; `--set sampling.temperature=T` for another), final reward (`reward_kind`), turn rewards
and credit settings of `--config` (examples/train_audit.toml), the family and N from the flags: every stage's
rewards are the trainer's (training.step.rewarded). For every N (`--n-items`: photos per plate_audit episode, or
questions per multihop_batch episode with `--family multihop_batch`), five stages:

  1. episodes: `--episodes` episodes in groups of `--group-size` on the first tasks of the split (training.play)
  2. branch: branch credit's continuations exactly as training samples them (training.branching.branch_values) at
     the k and the turns per episode it trains with (`[credit] branch_k`, `branch_turns`)
  3. branch_all: the same at the same k around every scored turn (VinePPO's estimate; every turn by default)
  4. matched: per group, as many more episodes from the task's start as branch's continuations' tokens would buy
     at the group's tokens per episode (stages.matched_episodes), their final rewards kept: outcome credit token
     for token with branch credit is GRPO in a group that much larger (outcome_matched)
  5. truth: for each scored turn t, the true advantage V(after t) - V(before t), each V the mean final reward of
     `--replays` continuations from that state (training.branching.continue_from: the episode's turns replayed
     exactly, then sampled on). Before turn 0 is the task's start, shared by the group; after the last turn
     nothing follows and V is the episode's own reward. The episode is not one of its continuations, so the
     truth shares no sample with any mode's estimate. Its standard error per turn is sqrt(s_a²/n_a + s_b²/n_b);
     the report gives the mean and the noise share, mean(se²) / var(truth): 0 for an exact truth, 1 for pure
     noise (a correlation with the truth is attenuated by about sqrt(1 - noise share)). `--truth-turns m`
     scores m turns per episode, chosen at random (seeded per task and episode), instead of every turn.

The credit modes are computed by the functions training calls (training.advantages) on the same scored episodes:
outcome (GRPO), turn (return-to-go, turn-index baseline), anchor (turn credit, anchor baseline), branch (the
outcome advantage on turns it did not choose), branch_all (with `--truth-turns m`: around the m scored turns only,
and so are its tokens), outcome_matched (outcome credit of the group's episodes with the matched ones in its
baseline; a row has it once every scored group's matched line is recorded). Scores (scores.py): Spearman rank
correlation with the truth, sign agreement and pairwise "which of two turns of an episode was better" accuracy,
each with a 95 % bootstrap interval over episodes; and the tokens each mode samples per episode (outcome and turn:
the episodes; branch: plus its continuations; outcome_matched: plus the matched episodes). The truth's own tokens
are reported apart.

Records: benchmarks/results/credit/<tag, or main>/records/<family>-n<N>-<digest>/ holds settings.json and one JSONL
per stage, appended a group (episodes, branch) or a state (truth) at a time, each line with the wall seconds since
the stage's previous line (their sum is the stage's time, over sessions), and gzipped once the N's stages are
whole (stages.Records.seal): that is when they are committed, once, as the horizon study's records are. A study
cut short resumes where it stopped (its open .jsonl files), and on a clean checkout where its committed records
end: the same flags find the same folder (the digest
covers every setting but `--replays`), and settings.json's SHA-256 of the policy's weights refuses records of
another warm start (an adapter's hash covers its base's weights); a resumed folder first replays one recorded
episode whole and stops (`ToolsChanged`) if a tool observes anything else now than when it was recorded. The tools
replay recorded episodes exactly on another machine; the SFT command remakes a warm start bit for bit only on the
same kind of machine (docs/credit.md), which is why the default warm start is kept, named by the commit that holds
it, rather than remade. What a resumed stage samples anew is drawn from the same distribution, not the same
draws: the sampler's seed is offset by the lines recorded so far. Raising `--replays` on a recorded study gives
every recorded state the continuations it lacks and nothing else; the report uses every continuation recorded.

Cost, in sampled tokens. Per episode of T turns, in turns sampled: the episode T; branch (k = 2 around 2 turns)
~4T; branch_all k T²/2 (every turn) or ~k m T (m scored turns); matched as much as branch; the truth R T²/2 + T/G (every turn) or ~m R T. The
smoke runs sampled 5-7 tokens/s on 2 cores shared with a training run, at nice 19 (idle 2 cores: ~13 with
transformers, bench_ray; 25-26 with vLLM and the tools, bench_learning's rollouts). With the warm start's
T ≈ 2 + 4N and ~50 tokens a turn (bench_horizon), the full study (24 episodes, N 1 2 4 8, 16 replays, every
turn) is ~18M tokens: ~35 days at 6 tokens/s, ~16 at 13, ~8 with vLLM: a GPU's study. Two 3-hour sessions hold
~0.28M tokens at 13/s, ~0.55M with vLLM: `--n-items 1 2 4 --episodes 12 --truth-turns 2 --set
sampling.backend=vllm --set sampling.temperature=1.15 --set reward_kind=graded` (~0.84M, three to four sessions;
24 scored turns and 12 within-episode pairs per N, intervals of about ±0.3; measured: N = 1 in 44 min, N = 2 in
89, N = 4's truth forecast 3.3 h) or, with transformers, `--n-items 1 2 --episodes 8 --truth-turns 2 --set
sampling.temperature=1.15` (~0.26M).
The temperature and the graded reward (1 - normalised edit distance per plate) are bench_learning's choices: at
1.0 an SFT warm start's groups come out identical (the smoke runs: every truth 0, every score undefined), exact
match leaves a group of misread plates at 0 whatever its turns did, and what training samples and rewards is what
its credit must be graded on. Before its truth stage each N prints the forecast from its own episodes.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks import ROOT
from benchmarks.common.records import summary_path, write_summary
from benchmarks.studies.credit.folders import Options, claim, recorded_lines, recorded_ns, seal, weights_sha
from benchmarks.studies.credit.report import METRICS, MODES, report
from benchmarks.studies.credit.stages import Session, run_stages
from conductor.stopping import stop_like_ctrl_c
from training import tasks as task_data
from training.config import TrainConfig, config_to_dict, load_train_config, with_device_sizes
from training.play import tool_session
from training.plot import save_figure
from training.tasks import Task

CONFIG = ROOT / "examples" / "train_audit.toml"
WARM_START = (
    "benchmarks/studies/credit/warm_start"  # SmolLM2 + a LoRA adapter named by commit: resumes anywhere
)


def interval(value: list[float]) -> str:
    """ "+0.12 [-0.05, +0.30]"; "–" where the metric is undefined (a truth without spread: every state's
    continuations ended alike)."""
    return "–" if math.isnan(value[0]) else f"{value[0]:+.2f} [{value[1]:+.2f}, {value[2]:+.2f}]"


def table(rows: Sequence[dict]) -> str:
    head = (
        f"{'N':>3} | {'mode':<15} | {'spearman [95% CI]':<20} | {'sign':<20} | {'pairwise':<20} | tokens/ep"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        for mode, m in r["modes"].items():
            cells = " | ".join(f"{interval(m[k]):<20}" for k in METRICS)
            lines.append(f"{r['n']:>3} | {mode:<15} | {cells} | {m['sampled_tokens_per_episode']:9.0f}")
        t, st = r["truth"], r["stage_s"]
        lines.append(
            f"    truth: {r['episodes']} episodes, {r['turns_scored']} turns scored "
            f"({r['turns_nonzero']} with a truth not 0), {r['mean_turns']:.1f} turns/ep, "
            f"reward {r['mean_reward']:.2f}; |A| {t['mean_abs']:.3f}, se {t['mean_se']:.3f}, noise share "
            f"{t['noise_share']:.2f}, {t['replays_per_state']:.0f} replays/state, "
            f"{t['sampled_tokens_per_episode']:.0f} tokens/ep{states(t)}; stages (min): "
            + ", ".join(f"{k} {v / 60:.1f}" for k, v in st.items())
        )
    return "\n".join(lines)


def states(truth: dict) -> str:
    """ ", 10 of 46 states" where the row's truth is not whole; nothing where it is (or the row is pooled)."""
    done, needed = truth.get("states", (0, 0))
    return f", {done} of {needed} states" if done < needed else ""


def plot(rows: Sequence[dict], out: Path) -> Path:
    """Each metric against N, one line per mode with its 95 % interval."""
    import matplotlib

    matplotlib.use("Agg")  # files only
    from matplotlib import pyplot as plt

    fig, axes = plt.subplots(1, len(METRICS), figsize=(12, 3.6))
    for ax, name in zip(axes, METRICS, strict=True):
        for k, mode in enumerate(MODES):
            errorbars(ax, rows, lambda r, m=mode, x=name: r["modes"].get(m, {}).get(x), k, mode, f"C{k}")
        spearman = name == "spearman"
        n_axis(ax, [r["n"] for r in rows], title=name, ylim=(-1.05, 1.05) if spearman else (-0.05, 1.05))
        ax.axhline(0.0 if spearman else 0.5, color="grey", lw=0.8, ls=":")
    axes[0].legend(fontsize="small")
    return save_figure(fig, out)


def errorbars(ax, rows: Sequence[dict], value, k: float, label: str, color: str, ls: str = "-") -> None:
    """`value(row)`'s [value, low, high] at each N that has it (None or NaN: nothing), offset beside the other
    modes so that their intervals do not overlap."""
    points = [(r["n"], v) for r in rows if (v := value(r)) is not None and not math.isnan(v[0])]
    if not points:
        return
    xs = [n * 1.04 ** (k - 2.5) for n, _ in points]
    err = [[v[0] - v[1] for _, v in points], [v[2] - v[0] for _, v in points]]
    ax.errorbar(
        xs, [v[0] for _, v in points], yerr=err, marker="o", capsize=3, label=label, color=color, ls=ls
    )


def n_axis(ax, ns: list[int], *, title: str, ylim: tuple[float, float]) -> None:
    """N on a log axis with a tick at each N, the limits set rather than autoscaled (a metric undefined at
    every N plots nothing)."""
    ticks = dict(xticks=ns, xticklabels=[str(n) for n in ns])
    ax.set(xscale="log", xlim=(min(ns) / 1.3, max(ns) * 1.3), **ticks, xlabel="N (items per episode)")
    ax.set(ylim=ylim, title=title)
    ax.grid(alpha=0.3)


async def sample(opts: Options, cfg: TrainConfig, tasks: dict[int, list[Task]]) -> None:
    """Run (or resume) every N's stages with one policy and one tool server."""
    from main_agent.backends import load_policy
    from training.sampler import max_model_len

    sha = weights_sha(cfg.run.policy)
    draws = recorded_lines([opts.folder(n, cfg)[0] for n in opts.n_items])
    # the truth samples a state's `replays` continuations at once: a vLLM engine's KV cache is sized for all of
    # them; transformers keeps max_concurrent_episodes to a generate (64 full contexts in one batch: ~6 GB)
    batch = cfg.max_concurrent_episodes
    if cfg.sampling.backend == "vllm":
        batch = max(batch, opts.replays)
    policy, tokenizer = load_policy(
        cfg.run.policy, cfg.sampling, device=cfg.device, max_batch=batch,
        seed=cfg.run.seed + draws, max_model_len=max_model_len(cfg),
    )  # fmt: skip
    every = [t for n in opts.n_items for t in tasks[n]]
    try:
        session = tool_session(every, work_dir=opts.work, access=cfg.tools, data_dir=cfg.run.data_dir)
        async with session as (tools, ready):
            s = Session(cfg, policy, tokenizer, tools, await tools.tools(), draws=draws)
            for n in opts.n_items:
                folder, settings = opts.folder(n, cfg)
                claim(folder, settings, sha)
                start = time.monotonic()
                mine = ready[: len(tasks[n])]
                ready = ready[len(tasks[n]) :]
                await run_stages(mine, s, folder, replays=opts.replays, truth_turns=opts.truth_turns)
                seal(folder)  # every stage whole: its records gzipped, to be committed once
                print(
                    f"N={n}: stages done in {(time.monotonic() - start) / 60:.1f} min ({folder})", flush=True
                )
    finally:
        await policy.aclose()


def tabled(rows: list[dict], ns: list[int], *, partial: bool) -> list[dict]:
    """The rows to table: an N whose truth is whole, or with `partial` any N with a truth recorded; each N left
    out (or tabled partial) named."""
    if waiting := sorted(set(ns) - {r["n"] for r in rows}):
        print(f"no truth recorded yet for N = {', '.join(map(str, waiting))}: not tabled")
    for r in [r for r in rows if not whole(r)]:
        done, needed = r["truth"]["states"]
        left = "a partial look" if partial else "not tabled (--partial tables it)"
        print(f"N = {r['n']}: {done} of the truth's {needed} states recorded: {left}")
    return [r for r in rows if partial or whole(r)]


def whole(row: dict) -> bool:
    """Every state its scored turns need has its truth recorded (a row of older results, without the count,
    was written whole)."""
    done, needed = row["truth"].get("states", (0, 0))
    return done == needed


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--policy", default=WARM_START, help="the fixed policy (the warm start)")
    add("--family", default="plate_audit", choices=("plate_audit", "multihop_batch"))
    add("--n-items", type=int, nargs="+", default=[1, 2, 4, 8], help="items per episode")
    add("--episodes", type=int, default=24, help="episodes per N (a multiple of the group size)")
    add("--group-size", type=int, default=None, help="episodes per task; default: the config's")
    add("--replays", type=int, default=16, help="continuations per state for the truth")
    add("--truth-turns", type=int, default=0, help="turns scored per episode; 0: every turn")
    add("--split", default="train")
    add("--config", type=Path, default=CONFIG, help="rollout, sampling, credit, turn rewards")
    add("--set", dest="sets", action="append", default=[], help="key=value, as conductor train")
    add("--draws", type=int, default=1000, help="bootstrap resamples")
    add("--recorded", action="store_true", help="sample nothing: score what is recorded")
    add("--tag", default="", help="names the records and results apart")
    add("--partial", action="store_true", help="table an N whose truth is not whole yet too")
    return parser.parse_args()


def main() -> None:
    stop_like_ctrl_c()  # `kill` stops the study as Ctrl-C does: its engine and commands close first
    args = arguments()
    suffix = f"_{args.tag}" if args.tag else ""
    sets = [
        f"policy={args.policy}",
        f"task={args.family}",
        f"split={args.split}",
        "run_dir=runs/bench_credit",
    ]
    sets += [f"group_size={args.group_size}"] if args.group_size else []
    # sized as a training run on this device would be (unchanged on a CPU, so the records' digests are too)
    cfg = with_device_sizes(load_train_config(args.config, [*sets, *args.sets]), "auto")
    if args.episodes % cfg.group_size:
        sys.exit(f"--episodes {args.episodes} is not a multiple of the group size {cfg.group_size}")
    out = summary_path("credit", args.tag or "main")
    records = out.parent / "records"
    opts = Options(
        args.family, args.n_items, args.episodes, args.replays, args.truth_turns, args.draws, records,
        work=ROOT / "runs" / f"bench_credit{suffix}" / "work",
    )  # fmt: skip
    load = functools.partial(task_data.load_family, args.family, args.split, data_dir=cfg.run.data_dir)
    ns = sorted(set(args.n_items) | recorded_ns(opts, cfg))
    tasks = {n: load(limit=args.episodes // cfg.group_size, items=n) for n in ns}
    start = time.monotonic()
    if not args.recorded:
        asyncio.run(sample(opts, cfg, tasks))
    scored = (
        report(n, tasks[n], opts.folder(n, cfg)[0], cfg, truth_turns=args.truth_turns, draws=args.draws)
        for n in ns
    )
    rows = tabled([r for r in scored if r is not None], ns, partial=args.partial)
    if not rows:
        sys.exit(f"no N to table under {records} for these settings")
    png = plot(rows, out.with_suffix(".png"))
    print("\n" + table(rows) + f"\n\nplot: {png}\nwall time now: {(time.monotonic() - start) / 60:.1f} min")
    settings = vars(args) | {"config": config_to_dict(cfg)}
    write_summary(out, {"rows": rows, "settings": settings, "plot": str(png.relative_to(ROOT))})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
