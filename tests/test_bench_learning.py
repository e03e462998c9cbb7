"""benchmarks/studies/learning/: its records and resume, the sweep's choice and the summary maths, on fake
records and metrics (nothing trains)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from benchmarks.common import episodes as es
from benchmarks.common import stages
from benchmarks.studies.learning import bench as bl
from benchmarks.studies.learning import recipes as lr
from benchmarks.studies.learning import summary as ls
from benchmarks.studies.learning import tables as lt
from main_agent.types import Episode, Turn
from training.tasks import Task, TaskMeta


def options(tmp_path: Path, *, recorded_only: bool = False) -> lr.Options:
    policy = tmp_path / "warm"
    policy.mkdir(exist_ok=True)
    (policy / "model.safetensors").write_bytes(b"weights")
    return lr.Options(
        str(policy), 20, 3, 49, "transformers", tmp_path / "runs", tmp_path / "records", recorded_only
    )


def trained(reward: list[float], *, step_s: float = 360.0, zero: int = 0) -> dict:
    n = len(reward)
    return {
        "steps": n, "reward": reward, "success": [0.0] * n, "sampled_tokens": [1000.0] * n,
        "step_s": [step_s] * n, "groups": 2 * n, "groups_zero_variance": zero,
    }  # fmt: skip


def test_a_stage_is_made_once_and_read_back_while_its_settings_and_warm_start_hold(tmp_path: Path) -> None:
    """The first call makes and writes the record; the same settings read it back without running anything;
    other settings run it again; `--recorded` never runs, and leaves out a record of other settings."""
    opts = options(tmp_path)
    calls = []

    def make() -> tuple[dict, dict]:
        calls.append(1)
        return {"success_rate": 0.5}, trained([0.1, 0.2])

    settings = opts.settings("main", "full-lr1e-5")
    first = bl.stage("outcome-s0", settings, make, opts)
    assert first is not None and len(calls) == 1
    assert first["warm_start"]["sha256"] == bl.warm_start_sha(
        opts.policy, made_by=lr.RECIPES["plates"].config.name
    )
    assert bl.stage("outcome-s0", settings, make, opts) == first and len(calls) == 1
    other = opts.settings("main", "full-lr3e-5")
    assert bl.stage("outcome-s0", other, make, options(tmp_path, recorded_only=True)) is None
    assert bl.stage("outcome-s0", other, make, opts) is not None and len(calls) == 2


def test_a_record_from_another_warm_start_is_reported_not_mixed(tmp_path: Path, capsys) -> None:
    """A record whose warm start's SHA-256 differs from this one's is left out (and named) under `--recorded`."""
    opts = options(tmp_path, recorded_only=True)
    settings = opts.settings("warm")
    path = opts.records / "warm.json"
    path.parent.mkdir(parents=True)
    record = {"stage": "warm", "settings": settings, "warm_start": {"policy": "x", "sha256": "f" * 64}}
    path.write_text(json.dumps(record | {"eval": {"success_rate": 0.5}, "training": None}), encoding="utf-8")
    assert bl.stage("warm", settings, lambda: pytest.fail("nothing runs"), opts) is None
    assert "another warm start (ffffffffffff" in capsys.readouterr().out


def test_ends_and_slope_of_a_curve() -> None:
    """First and last K means (half the curve when shorter than 2K, NaN steps left out); least-squares slope."""
    curve = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1]
    assert ls.ends(curve) == pytest.approx((0.2, 0.9))
    assert ls.ends([0.2, math.nan, 0.6, 0.8]) == pytest.approx((0.2, 0.7))
    assert ls.ends([0.4]) == (0.4, 0.4) and all(math.isnan(x) for x in ls.ends([]))
    assert ls.slope(curve) == pytest.approx(0.1) and ls.slope([0.3]) == 0.0


def test_the_sweep_picks_the_fastest_rise_per_cpu_hour_or_the_default() -> None:
    """Rate = slope per step / hours per step: a cell rising half as fast at a third of the cost wins; when no
    cell rises the default is chosen, and the rates are recorded either way."""
    cells = {"slow": trained([0.0, 0.2, 0.4], step_s=360.0), "cheap": trained([0.0, 0.1, 0.2], step_s=120.0)}
    choice = ls.choose(cells, default="slow")
    assert choice["cell"] == "cheap" and choice["rates"]["cheap"] == pytest.approx(0.1 / (120 / 3600))
    flat = {"a": trained([0.3, 0.3, 0.3]), "b": trained([0.4, 0.2, 0.1])}
    assert ls.choose(flat, default="a")["cell"] == "a"


def test_the_sweep_keeps_the_default_when_a_rise_is_within_its_noise() -> None:
    """A cell whose faster rise is within twice the combined standard error of its and the default's rates does
    not replace the default; the same rise with less noise does."""
    noisy = {"default": trained([0.3, 0.3, 0.31]), "other": trained([0.1, 0.6, 0.3, 0.7])}
    choice = ls.choose(noisy, default="default")
    assert choice["cell"] == "default" and "within 2 standard errors" in choice["why"]
    assert ls.slope_se([0.1, 0.2, 0.3]) == pytest.approx(0.0) and ls.slope_se([0.1, 0.2]) == math.inf
    clean = {"default": trained([0.3, 0.3, 0.31]), "other": trained([0.1, 0.3, 0.5, 0.7])}
    assert ls.choose(clean, default="default")["cell"] == "other"


def test_a_mode_rises_when_every_seed_does_and_gains_outside_the_spread() -> None:
    """Rises needs every seed's last steps above its first; the dev gain counts when it exceeds the seeds' spread,
    and its evaluation noise is that of the photos that flipped. The greedy graded gain is each seed's own (NaN
    for a record made before it was kept)."""
    vs_warm = {"graded_warm": 0.6, "graded_now": 0.65}
    seeds = [
        {"training": trained([0.2] * 5 + [0.6] * 5), "eval": {"success_rate": 0.70, "vs_warm": vs_warm}},
        {"training": trained([0.3] * 5 + [0.5] * 5), "eval": {"success_rate": 0.66}},
    ]
    m = ls.mode_summary(seeds, warm_success=0.51)
    assert m["rises"] and m["reward_first"] == pytest.approx(0.25) and m["reward_last"] == pytest.approx(0.55)
    assert m["dev_graded_gain"][0] == pytest.approx(0.05) and math.isnan(m["dev_graded_gain"][1])
    assert m["dev_gain"] == pytest.approx(0.17) and m["gain_outside_spread"]
    seeds[1]["training"] = trained([0.5] * 5 + [0.4] * 5)
    seeds[1]["eval"] = {"success_rate": 0.30}
    m = ls.mode_summary(seeds, warm_success=0.51)
    assert not m["rises"] and not m["gain_outside_spread"]
    assert math.isnan(ls.mode_summary(seeds[:1], warm_success=0.51)["dev_success_spread"])


def test_a_graded_gain_counts_beyond_its_spread_and_twice_its_paired_standard_error() -> None:
    """The greedy graded (F1) gain, what the research recipe is judged on, is marked only when its mean over seeds
    exceeds the seeds' spread and twice the standard error of that mean (each seed's paired error over tasks)."""

    def seed(gain: float, se: float) -> dict:
        vs_warm = {"graded_warm": 0.10, "graded_now": 0.10 + gain, "graded_gain_se": se}
        return {"training": trained([0.2] * 10), "eval": {"success_rate": 0.1, "vs_warm": vs_warm}}

    m = ls.mode_summary([seed(0.06, 0.02), seed(0.08, 0.02), seed(0.07, 0.02)], warm_success=0.1)
    assert m["dev_graded_gain_se"] == pytest.approx(math.sqrt(3 * 0.02**2) / 3)
    assert m["graded_gain_beyond_noise"]
    noisy = ls.mode_summary([seed(0.06, 0.08), seed(0.08, 0.08), seed(0.07, 0.08)], warm_success=0.1)
    assert not noisy["graded_gain_beyond_noise"]  # 0.07 < 2 x 0.046
    spread_out = ls.mode_summary([seed(0.20, 0.01), seed(-0.05, 0.01), seed(0.06, 0.01)], warm_success=0.1)
    assert not spread_out["graded_gain_beyond_noise"]
    flips = [{"tasks": 49, "won": 1, "lost": 0}, {"tasks": 49, "won": 1, "lost": 0}]
    one_photo = [
        {"training": trained([0.5] * 10), "eval": {"success_rate": 0.53, "vs_warm": f}} for f in flips
    ]
    m = ls.mode_summary(one_photo, warm_success=0.51)
    assert m["gain_outside_spread"] and m["dev_gain_se"] == pytest.approx(math.sqrt(2) / 49 / 2)
    assert m["dev_gain"] < 2 * m["dev_gain_se"]  # one photo won at each seed: no spread, and decided nothing


def explored(zero: int, *, tokens: float = 300.0, groups: int = 16) -> dict:
    return {
        "groups": groups, "groups_zero_variance": zero, "groups_identical": zero // 2, "confident_share": 0.98,
        "tokens_per_episode": tokens, "turns_per_episode": 2.0, "reward": 0.5, "success": 0.4, "rollout_s": 400.0,
    }  # fmt: skip


def test_the_coolest_temperature_with_signal_in_two_thirds_of_its_groups_is_chosen() -> None:
    """Of the temperatures whose episodes are not much longer than the coolest's, the coolest with fewer than
    1/3 of its groups without reward variance; else the one with the fewest such groups; 1.0 with none."""
    pick = ls.choose_temperature
    assert pick({1.0: explored(8), 1.15: explored(5), 1.3: explored(2)})["temperature"] == 1.15
    assert pick({1.0: explored(5), 1.15: explored(2)})["temperature"] == 1.0  # 5/16 < 1/3 already
    assert pick({1.0: explored(8), 1.15: explored(7), 1.3: explored(7)})["temperature"] == 1.15  # the fewest
    longer = {1.0: explored(8), 1.15: explored(6), 1.3: explored(1, tokens=400.0)}
    assert pick(longer)["temperature"] == 1.15  # 1.3 gives signal but 1.33x longer episodes
    assert pick({})["temperature"] == 1.0 and pick({1.0: explored(8)})["explored"]["1"]["groups"] == 16


def test_exploration_summary_reads_groups_and_the_sampled_tokens(tmp_path: Path) -> None:
    """From one step's metrics and rollouts: groups without variance (metrics), groups whose episodes are
    token for token the same, the share of tokens drawn with p > 0.99, sampled tokens and turns per episode."""
    from main_agent.types import Episode, Turn

    def episode(task_id: str, logprobs: list[float]) -> str:
        ids = list(range(len(logprobs)))
        turn = Turn(ids, logprobs, [], "", "", [], [], [], 0, 0.0, 0.0)
        return Episode(task_id, "?", [1], [turn, turn], "A", "answer", 0, 1.0, 0.5, 0.5).to_json()

    sure = [-0.001, -0.001]
    lines = [episode("a", sure), episode("a", sure), episode("b", sure), episode("b", [-0.001, -2.0, -0.5])]
    (tmp_path / "rollouts").mkdir()
    (tmp_path / "rollouts" / "step_1.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    row = {"groups/total": 2, "groups/zero_variance": 1, "reward/final": 0.5, "success": 0.5}
    row |= {"time/rollout": 9.0, "step": 1}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(row) + "\n", encoding="utf-8")
    e = ls.exploration_summary(tmp_path)
    assert (e["groups"], e["groups_zero_variance"], e["groups_identical"]) == (2, 1, 1)
    assert e["confident_share"] == pytest.approx(14 / 18) and e["tokens_per_episode"] == 4.5
    assert e["turns_per_episode"] == 2


def test_a_stage_never_takes_a_run_trained_with_other_settings(tmp_path: Path, monkeypatch) -> None:
    """A run directory whose checkpoint was trained with other settings (here another temperature) stops the
    stage with the difference named, instead of being reused as if it were this stage's; a longer run of the
    same settings, or the same run moved, is no difference. The main runs at another temperature are named apart."""
    from training.config import config_to_dict, load_train_config

    sets = ("seed=0", "steps=5", f"run_dir={tmp_path / 'old'}", "lr=0")
    ckpt = tmp_path / "run" / "step_5"
    ckpt.mkdir(parents=True)
    (ckpt / "config.json").write_text(
        json.dumps(config_to_dict(load_train_config(lr.RECIPES["plates"].config, sets)))
    )
    again = ("seed=0", "steps=20", f"run_dir={tmp_path / 'run'}", "lr=0")
    assert stages.run_differs(ckpt, lr.RECIPES["plates"].config, again) == []
    hotter = (*again, "sampling.temperature=1.3")
    assert stages.run_differs(ckpt, lr.RECIPES["plates"].config, hotter) == [
        "sampling.temperature: 1.0 -> 1.3"
    ]
    monkeypatch.setattr(stages, "find_latest", lambda run_dir: ckpt)
    monkeypatch.setattr(stages, "conductor", lambda *a, **k: pytest.fail("nothing trains"))
    with pytest.raises(SystemExit, match="sampling.temperature: 1.0 -> 1.3"):
        stages.train_to(lr.RECIPES["plates"].config, tmp_path / "run", hotter, 20)
    assert bl.run_name("turn", 2, 1.0) == "turn-s2" and bl.run_name("turn", 2, 1.15) == "turn-s2-t1.15"


@pytest.mark.parametrize("recipe", list(lr.RECIPES))
def test_every_credit_kind_makes_a_train_config_and_only_the_pair_runs_by_default(recipe: str) -> None:
    """Each kind's settings load on every recipe's config (a typo in a kind would fail only hours into a study);
    "turn-contested" is the anchor turn credit with the shaping confined to groups whose answers differ; a study
    runs outcome and turn unless `--credits` names more, so the recorded studies' tables keep their rows."""
    from training.config import load_train_config

    configs = {
        kind: load_train_config(lr.RECIPES[recipe].config, sets).credit for kind, sets in lr.CREDITS.items()
    }
    assert configs["turn-contested"] == dataclasses.replace(configs["turn"], shaping="contested")
    assert configs["turn"].shaping == "every_group" and configs["outcome"].mode == "outcome"
    assert lr.DEFAULT_CREDITS == ("outcome", "turn")


def test_a_run_with_a_temperature_in_its_name_logs_under_its_whole_name(tmp_path: Path, monkeypatch) -> None:
    """The log of run "turn-s0-t1.15" is turn-s0-t1.15.log, not turn-s0-t1.log (shared with "turn-s0-t1.3")."""

    logs = []
    monkeypatch.setattr(stages, "conductor", lambda *args, log: logs.append(log.name))
    for name in ("turn-s0-t1.15", "turn-s0-t1.3"):
        stages.train_to(lr.RECIPES["plates"].config, tmp_path / name, ("seed=0",), 20)
    assert logs == ["turn-s0-t1.15.log", "turn-s0-t1.3.log"]


def test_training_summary_reads_the_curves_from_metrics(tmp_path: Path) -> None:
    """Per step: graded reward, success, sampled tokens, wall seconds (rollout + train + sync); groups summed."""
    rows = [
        {"step": s, "reward/final": 0.1 * s, "success": 0.0, "tokens/sampled": 1000 + s, "time/rollout": 60.0,
         "time/train": 40.0, "time/weight_sync": 1.0, "groups/total": 2, "groups/zero_variance": s - 1}
        for s in (1, 2)
    ]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    t = ls.training_summary(tmp_path)
    assert t["reward"] == [0.1, 0.2] and t["sampled_tokens"] == [1001, 1002] and t["step_s"] == [101.0] * 2
    assert (t["groups"], t["groups_zero_variance"]) == (4, 1)


def test_summary_table_and_plot_from_records(tmp_path: Path) -> None:
    """The report holds the sweep (with the choice marked in the table) and each mode; the plot is written."""
    cells = {"full-lr1e-5": {"training": trained([0.1, 0.2, 0.3], zero=3)}}
    choice = ls.choose({c: r["training"] for c, r in cells.items()}, default="full-lr1e-5")
    runs = {"outcome": [{"training": trained([0.2, 0.4]), "eval": {"success_rate": 0.6}}], "turn": []}
    heat = ls.choose_temperature({1.0: explored(8), 1.3: explored(4)})
    report = ls.summarise({"success_rate": 0.51}, cells, choice, heat, runs)
    assert list(report["modes"]) == ["outcome"] and report["exploration"]["temperature"] == 1.3
    assert report["sweep"]["full-lr1e-5"]["zero_variance_share"] == 0.5
    assert "full-lr1e-5 |" in lt.table(report) and "1.3 | 4/16 | 2 |" in lt.table(report)
    assert lt.table(report).count(" <-") == 2
    assert lt.plot(report, tmp_path / "curves.png").stat().st_size > 0


def episode(task_id: str, ids: list[int], answer: str, stop_reason: str = "answer") -> str:
    """One episode's JSON line: one turn that sampled `ids`, then `answer`."""
    turn = Turn(ids, [0.0] * len(ids), [], "", "", [], [], [], 0, 0.0, 0.0)
    return Episode(task_id, "?", [1], [turn], answer, stop_reason, 0, 1.0, 0.5, 0.5).to_json()  # type: ignore[arg-type]


def dev_photos(n: int) -> list[Task]:
    """n dev plate photos p0..p{n-1}, all of the plate YG9X2G."""
    return [
        Task(f"p{i}", "plate_reading", "?", ("image_ops",), "YG9X2G", meta=TaskMeta(split="dev"))
        for i in range(n)
    ]


def test_moved_counts_changed_greedy_episodes_and_the_successes_they_turned(tmp_path: Path) -> None:
    """A dev episode counts as changed when any sampled token differs from the warm start's, and as acted
    otherwise when its calls, records or answer do (p4: other tokens, the same answer); of the changed, a miss
    turned right is won and a success turned wrong is lost; an unchanged episode counts in none. The graded
    reward of both is over every task, with the standard error of their paired difference."""
    tasks = dev_photos(5)
    warm = [
        episode("p0", [5], "YG9X2G"),
        episode("p1", [5], "AB"),
        episode("p2", [5], "YG9X2G"),
        episode("p3", [5], "AB"),
        episode("p4", [5], "AB"),
    ]
    now = [
        episode("p0", [5], "YG9X2G"),
        episode("p1", [6], "YG9X2G"),
        episode("p2", [6], "AB"),
        episode("p3", [7], "CD"),
        episode("p4", [8], "AB"),
    ]
    (tmp_path / "warm.jsonl").write_text("\n".join(warm) + "\n")
    (tmp_path / "now.jsonl").write_text("\n".join(now) + "\n")
    assert es.moved(tmp_path / "warm.jsonl", tmp_path / "now.jsonl", tasks) == {
        "tasks": 5, "changed": 4, "acted": 3, "won": 1, "lost": 1, "graded_warm": 0.4, "graded_now": 0.4,
        "graded_gain_se": pytest.approx(math.sqrt(0.5 / 5)),  # differences 0, +1, -1, 0, 0
    }  # fmt: skip


def test_the_warm_starts_episodes_are_evaluated_again_where_only_its_record_came(
    tmp_path: Path, monkeypatch
) -> None:
    """A clean checkout has the warm stage's record but not its episodes (runs/ is not committed): a main stage
    evaluates the warm start again before comparing with it, once, and reuses the episodes after."""
    opts = options(tmp_path)
    evals = []

    def fake_conductor(*args: str, log: Path) -> float:
        out = Path(args[args.index("--out") + 1])
        out.write_text("{}", encoding="utf-8")
        bl.episodes_of(out).write_text("", encoding="utf-8")
        evals.append(args[args.index("--policy") + 1])
        return 0.0

    monkeypatch.setattr(bl, "conductor", fake_conductor)
    opts.runs.mkdir(parents=True)
    assert bl.warm_episodes(opts) == bl.episodes_of(bl.warm_out(opts)) and evals == [opts.policy]
    assert bl.warm_episodes(opts).exists() and evals == [opts.policy]


def test_the_reward_over_the_control_leaves_out_which_photos_came_up() -> None:
    """A run whose curve is its control's plus a constant rises with its photos but not over its control; one
    that pulls away from its control rises over it; a run whose seed has no control is left out of the
    comparison, not compared with another seed's; the seeds that rise over their controls are counted."""
    control = [0.2, 0.2, 0.8, 0.8]
    same = {"seed": 0, "training": trained([0.3, 0.3, 0.9, 0.9])}
    away = {"seed": 1, "training": trained([0.2, 0.3, 0.9, 1.0])}
    alone = {"seed": 2, "training": trained([0.0, 0.0, 1.0, 1.0])}
    flat = ls.over_control([same, alone], {0: control})
    assert flat["controlled_seeds"] == 1 and not flat["rises_over_control"]
    assert flat["over_control_first"] == pytest.approx(0.1) and flat["over_control_last"] == pytest.approx(
        0.1
    )
    assert flat["control_first"] == pytest.approx(0.2) and flat["control_last"] == pytest.approx(0.8)
    rising = ls.over_control([away], {1: control})
    assert rising["rises_over_control"] and rising["over_control_last"] == pytest.approx(0.15)
    both = ls.over_control([same, away], {0: control, 1: control})
    assert both["seeds_rising_over_control"] == 1 and not both["rises_over_control"]
    assert ls.over_control([same], {})["controlled_seeds"] == 0


def test_the_control_is_the_main_run_at_learning_rate_0_named_by_its_seed(
    tmp_path: Path, monkeypatch
) -> None:
    """Each seed's control trains the main runs' settings with lr 0 last (so it wins over the cell's), at their
    temperature, under its own name and record."""
    opts = options(tmp_path)
    trained_with = []

    def fake_train(name: str, sets: tuple[str, ...], steps: int, seed: int, o: lr.Options) -> Path:
        trained_with.append((name, sets, steps, seed))
        return tmp_path

    monkeypatch.setattr(bl, "train", fake_train)
    monkeypatch.setattr(bl, "training_summary", lambda run_dir: trained([0.5, 0.5]))
    record = bl.control_run(1, "full-lr1e-5", 1.15, opts)
    ((name, sets, steps, seed),) = trained_with
    assert name == "control-s1-t1.15" and steps == 20 and seed == 1
    assert sets.index("lr=0") > sets.index("lr=1e-5") and "sampling.temperature=1.15" in sets
    assert record is not None and record["settings"]["control"] == ["lr=0"]
    assert (opts.records / "control-s1-t1.15.json").exists()


def test_sampled_scores_average_each_photos_samples_and_compare_photo_by_photo(tmp_path: Path) -> None:
    """Each dev photo's score is the mean over its samples (an episode the tools failed left out, not scored 0),
    with how sure the sampler was over them all; a run's gain over the warm start is the mean over photos of the
    paired difference, with its standard error over photos; the table shows both, and the share of episodes
    that ended without an answer."""
    tasks = dev_photos(2)
    warm = [episode("p0", [1], "YG9X2G"), episode("p0", [2], "AB"), episode("p1", [1], "YG9X2Z"),
            episode("p1", [2], "YG9X2G", stop_reason="infra_failed")]  # fmt: skip
    now = [episode("p0", [1], "YG9X2G"), episode("p0", [1], "YG9X2G"), episode("p1", [3], "YG9X2G"),
           episode("p1", [4], None, stop_reason="max_turns")]  # type: ignore[arg-type]  # fmt: skip
    (tmp_path / "warm.jsonl").write_text("\n".join(warm) + "\n")
    (tmp_path / "now.jsonl").write_text("\n".join(now) + "\n")
    w = es.sampled_scores(tmp_path / "warm.jsonl", tasks)
    assert w["samples"] == [2, 1] and w["success"] == [0.5, 0.0]
    assert w["graded"] == pytest.approx([0.5 + 0.5 * 0.0, 5 / 6])  # AB: 0 of 6; YG9X2Z: one edit of 6
    n = es.sampled_scores(tmp_path / "now.jsonl", tasks)
    assert n["success"] == [1.0, 0.5] and (w["unanswered"], n["unanswered"]) == (0.0, 0.25)
    runs = {"outcome": [{"seed": 0, "per_task": n}]}
    summary = ls.sampled_summary({"warm": w, "cooler": n}, runs, "T 1.15, 2 per photo")
    gain = summary["modes"]["outcome"]["over_warm_success"]
    assert gain["per_seed"] == [pytest.approx(0.5)] and gain["se_per_seed"] == [pytest.approx(0.0)]
    assert math.isnan(gain["spread"])  # one seed
    assert summary["modes"]["outcome"]["over_cooler_graded"]["per_seed"] == [0.0]  # against itself
    assert summary["references"]["warm"]["success"] == 0.25 and summary["modes"]["outcome"]["success"] == 0.75
    assert (w["groups_identical"], w["confident_share"], w["tokens_per_episode"]) == (
        1,
        1.0,
        1.0,
    )  # p1: 1 kept
    assert ls.sampled_summary({"cooler": w}, runs, "") == {}  # no gain without the warm start at the runs' T
    lines = lt.sampled_table(summary)
    assert "T 1.15, 2 per photo" in lines[1] and "over cooler: graded" in lines[1] and "no answer" in lines[1]
    assert lines[2].startswith("warm start (warm) | - | 0.250 |") and lines[3].startswith(
        "warm start (cooler)"
    )
    assert lines[-1].startswith("outcome | 1 | 0.750 |") and "+0.500 (0.000) -> +0.500 (nan)" in lines[-1]


def test_a_sampled_evaluation_waits_for_its_runs_checkpoint_and_never_trains(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """Where a main run's checkpoints are not here (a clean checkout has its record only), its sampled
    evaluation is reported as waiting and writes no record; with the checkpoint it evaluates the last one with
    SAMPLES episodes per photo at the run's temperature."""
    opts = options(tmp_path)
    monkeypatch.setattr(bl, "train", lambda *a: pytest.fail("a sampled evaluation must not train"))
    assert bl.sampled_run("outcome", 0, "full-lr1e-5", 1.15, opts) is None
    assert "waits" in capsys.readouterr().out and not opts.records.exists()
    model = opts.runs / "outcome-s0-t1.15" / "step_20" / "model"
    model.mkdir(parents=True)
    monkeypatch.setattr(
        bl, "find_latest", lambda run_dir: model.parent
    )  # a checkpoint's files: test_checkpoint
    evals = []

    def fake_conductor(*args: str, log: Path) -> float:
        evals.append(args)
        out = Path(args[args.index("--out") + 1])
        out.write_text(json.dumps({"success_rate": 1.0}), encoding="utf-8")
        lines = [episode(f"p{i}", [1], "YG9X2G") for i in range(2) for _ in range(lr.SAMPLES)]
        bl.episodes_of(out).write_text("\n".join(lines) + "\n", encoding="utf-8")
        return 0.0

    monkeypatch.setattr(bl, "conductor", fake_conductor)
    monkeypatch.setattr(bl, "load_family", lambda task, split, limit: dev_photos(2))
    record = bl.sampled_run("outcome", 0, "full-lr1e-5", 1.15, opts)
    assert record is not None and record["eval"]["per_task"]["success"] == [1.0, 1.0]
    ((args),) = evals
    assert args[args.index("--policy") + 1] == str(model)
    assert f"samples={lr.SAMPLES}" in args and "sampling.temperature=1.15" in args
    assert record["settings"]["run"] == opts.settings("main", "full-lr1e-5", 1.15)


def test_an_adapter_warm_starts_hash_covers_its_base_model(tmp_path: Path) -> None:
    """A LoRA warm start is its base's weights plus the adapter's: the hash changes when either changes, is the
    same for the same bytes, and a missing base is reported as no weights (an exit naming how to make it)."""
    base, adapter = tmp_path / "base", tmp_path / "adapter"
    for folder, name in ((base, "config.json"), (adapter, "adapter_config.json")):
        folder.mkdir()
        (folder / name).write_text(json.dumps({"base_model_name_or_path": str(base)}), encoding="utf-8")
    (base / "model.safetensors").write_bytes(b"base weights")
    (adapter / "adapter_model.safetensors").write_bytes(b"lora factors")
    sha = stages.warm_start_sha(str(adapter), made_by="x")
    assert sha == stages.warm_start_sha(str(adapter), made_by="x")
    assert stages.weight_files(str(adapter)) == [
        base / "model.safetensors",
        adapter / "adapter_model.safetensors",
    ]
    (base / "model.safetensors").write_bytes(b"other base")
    assert stages.warm_start_sha(str(adapter), made_by="x") != sha
    (base / "config.json").unlink()
    (base / "model.safetensors").unlink()
    with pytest.raises(SystemExit, match="make the warm start first"):
        stages.warm_start_sha(str(adapter), made_by="x")


def test_the_screen_keeps_the_tasks_whose_sampled_rewards_differ_and_the_runs_train_on_them(
    tmp_path: Path, monkeypatch
) -> None:
    """A recipe with a screen plays its first `screen` train tasks SAMPLES times each at the chosen temperature
    (an evaluation: nothing trains) and records the ids whose rewards differed; a main run then trains with
    exactly those `task_ids`, and its record's settings name them, so a run on other tasks is never reused."""
    recipe = dataclasses.replace(lr.RECIPES["plates"], screen=3)
    opts = dataclasses.replace(options(tmp_path), recipe=recipe)
    photos = dev_photos(3)
    answers = {
        "p0": ["YG9X2G"] * lr.SAMPLES,
        "p1": ["YG9X2G", "AB"] * (lr.SAMPLES // 2),
        "p2": ["AB"] * lr.SAMPLES,
    }
    evals = []

    def fake_conductor(*args: str, log: Path) -> float:
        evals.append(args)
        out = Path(args[args.index("--out") + 1])
        out.write_text("{}", encoding="utf-8")
        lines = [episode(p, [1], a) for p, said in answers.items() for a in said]
        bl.episodes_of(out).write_text("\n".join(lines) + "\n", encoding="utf-8")
        return 0.0

    monkeypatch.setattr(bl, "conductor", fake_conductor)
    monkeypatch.setattr(bl, "load_family", lambda task, split, limit: photos[:limit])
    opts.runs.mkdir(parents=True)
    record = bl.screen(1.15, opts)
    ((args),) = evals
    assert args[args.index("--split") + 1] == "train" and args[args.index("--n") + 1] == "3"
    assert f"samples={lr.SAMPLES}" in args and "sampling.temperature=1.15" in args
    assert record is not None and record["eval"]["task_ids"] == ["p1"]
    trained_with = []

    def fake_train_to(config: Path, run_dir: Path, sets: tuple[str, ...], steps: int) -> Path:
        trained_with.append(sets)
        return run_dir

    monkeypatch.setattr(bl, "train_to", fake_train_to)
    screened = dataclasses.replace(opts, task_ids=tuple(record["eval"]["task_ids"]))
    monkeypatch.setattr(bl, "training_summary", lambda run_dir: trained([0.5]))
    control = bl.control_run(0, "full-lr1e-5", 1.15, screened)
    assert 'task_ids=["p1"]' in trained_with[0]
    assert control is not None and control["settings"]["task_ids"] == ["p1"]
    assert "task_ids" not in opts.settings("control", "full-lr1e-5", 1.15)
