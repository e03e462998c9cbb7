"""The learning study's report as a reader sees it: the table of the sweep, the exploration and every credit mode
(summary.py's numbers), the sampled dev evaluations, and the plot of the training reward.

    table(report) -> str                    the sweep, the temperatures explored, one row per credit mode
    plot(report, out) -> Path               the graded reward per step, a line per seed, the controls dashed
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

from training.plot import save_figure


def table(report: Mapping) -> str:
    """The sweep, then one row per credit mode."""
    lines = [
        f"warm start dev success: {report['warm_success']:.3f}",
        "",
        "sweep cell | reward/h (se) | slope/step | s/step | zero-var",
    ]
    for cell, s in report["sweep"].items():
        mark = " <-" if cell == report["choice"]["cell"] else ""
        lines.append(
            f"{cell} | {s['rate_per_hour']:8.3f} ({s['rate_error']:.3f}) | {s['reward_slope']:+10.4f} | "
            f"{s['step_s']:6.0f} | "
            f"{s['zero_variance_share']:8.2f}{mark}"
        )
    lines += ["", *exploration_table(report["exploration"]), ""]
    lines += [
        "mode | seeds | reward first5 -> last5 (spread) | rises | control first5 -> last5 | over control first5"
        " -> last5 (spread) | seeds rising | dev success (spread) | gain | dev episodes acted otherwise (tokens) per seed"
        " | dev graded gain"
        " per seed (se of their mean) | tokens/step",
    ]
    for mode, m in report["modes"].items():
        lines.append(
            f"{mode} | {m['seeds']} | {m['reward_first']:.3f} ({m['reward_first_spread']:.3f}) -> "
            f"{m['reward_last']:.3f} ({m['reward_last_spread']:.3f}) | {'yes' if m['rises'] else 'no'} | "
            f"{m['control_first']:.3f} -> {m['control_last']:.3f} | {m['over_control_first']:+.3f} -> "
            f"{m['over_control_last']:+.3f} ({m['over_control_last_spread']:.3f}) | "
            f"{m['seeds_rising_over_control']} of {m['controlled_seeds']} | "
            f"{m['dev_success']:.3f} ({m['dev_success_spread']:.3f}) | {m['dev_gain']:+.3f}"
            f"{' *' if m.get('gain_beyond_noise') else ''}"
            f" (se {m['dev_gain_se']:.3f}) | {_changed_cell(m)} | "
            f"{' '.join(f'{g:+.3f}' for g in m['dev_graded_gain'])}{' *' if m['graded_gain_beyond_noise'] else ''}"
            f" ({m['dev_graded_gain_se']:.3f}) | {m['sampled_tokens_per_step']:.0f}"
        )
    return "\n".join(lines + sampled_table(report.get("sampled", {})))


def _changed_cell(m: Mapping) -> str:
    """Per seed, the greedy dev episodes that acted otherwise than the warm start's, and those whose tokens
    changed at all in parentheses: "7 (49)"."""
    return " ".join(f"{a:.0f} ({c:.0f})" for a, c in zip(m["dev_acted"], m["dev_changed"], strict=True))


def sampled_table(sampled: Mapping) -> list[str]:
    """The sampled dev evaluations: the warm start's scores (per reference), then per credit mode its scores and
    its gain over each reference per seed (standard error over photos) and over seeds (spread)."""
    if not sampled:
        return []
    names = list(sampled["references"])
    gains = [
        f"over {name}: {key} per seed (se) -> mean (spread)"
        for name in names
        for key in ("success", "graded")
    ]
    lines = ["", " | ".join([f"dev, sampled ({sampled['how']})", "seeds", "success", "graded", "p>.99",
                             "photos identical", "no answer", *gains])]  # fmt: skip
    rows = {f"warm start ({name})": m for name, m in sampled["references"].items()} | sampled["modes"]
    for mode, m in rows.items():
        cells = [_gain_cell(m.get(f"over_{name}_{key}")) for name in names for key in ("success", "graded")]
        lines.append(
            f"{mode} | {len(m.get('seeds', [])) or '-'} | {m['success']:.3f} | {m['graded']:.3f} | "
            f"{m['confident_share']:.3f} | {m['photos_identical']:.1f} | {m['unanswered']:.3f} | {' | '.join(cells)}"
        )
    return lines


def _gain_cell(gain: Mapping | None) -> str:
    """A mode's gain over the warm start: each seed's (standard error), then the mean (spread); "-" for none."""
    if gain is None:
        return "-"
    pairs = zip(gain["per_seed"], gain["se_per_seed"], strict=True)
    return (
        " ".join(f"{x:+.3f} ({se:.3f})" for x, se in pairs)
        + f" -> {gain['mean']:+.3f} ({gain['spread']:.3f})"
    )


def exploration_table(heat: Mapping) -> list[str]:
    """One row per temperature explored, the chosen one marked."""
    lines = ["temperature | groups without signal | identical | p>.99 | tokens/episode | turns | reward"]
    for t, e in heat["explored"].items():
        mark = " <-" if float(t) == heat["temperature"] else ""
        lines.append(
            f"{t} | {e['groups_zero_variance']}/{e['groups']} | {e['groups_identical']} | "
            f"{e['confident_share']:.3f} | {e['tokens_per_episode']:.0f} | {e['turns_per_episode']:.1f} | "
            f"{e['reward']:.3f}{mark}"
        )
    return lines + [f"chosen temperature: {heat['temperature']:g} ({heat['why']})"]


def plot(report: Mapping, out: Path, *, title: str = "plate_reading: graded reward while training") -> Path:
    """The training reward (graded) per step, one line per seed, a colour per credit mode; the controls dashed."""
    import matplotlib

    matplotlib.use("Agg")  # files only
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for colour, (mode, m) in zip(
        ("tab:blue", "tab:orange", "tab:green"), report["modes"].items(), strict=False
    ):
        for seed, curve in enumerate(m["curves"]):
            ax.plot(range(1, len(curve) + 1), curve, color=colour, alpha=0.8, label=f"{mode} (seed {seed})")
    for seed, curve in report.get("controls", {}).items():
        ax.plot(
            range(1, len(curve) + 1),
            curve,
            color="grey",
            linestyle="--",
            label=f"control, lr 0 (seed {seed})",
        )
    if not math.isnan(report["warm_success"]):
        ax.axhline(report["warm_success"], color="grey", linestyle=":", label="warm start, dev success")
    ax.set(title=title, xlabel="step", ylabel="reward (graded)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return save_figure(fig, out)
