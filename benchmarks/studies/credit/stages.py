"""bench.py's sampling: the episodes, branch credit's values and the truth's continuations of one N,
each stage recorded line by line so that a study cut short resumes (see bench.py's docstring).

    await run_stages(tasks, Session(cfg, policy, tokenizer, tools, schemas), folder, replays=16, truth_turns=0)

Stage files in `folder` (each gzipped to <stage>.jsonl.gz once the study's stages of the N are whole: `seal`):
episodes.jsonl (a group of episodes a line), branch.jsonl and branch_all.jsonl (a
group's BranchValues and BranchStats a line), matched.jsonl (a group's more episodes' final rewards a line: outcome
credit at branch credit's sampled tokens), truth.jsonl (a state's continuation rewards a line, and another where
its replays were raised). Every line carries `elapsed_s`, the wall seconds since the stage's previous line
in the same process.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gzip
import json
import os
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from main_agent.policy import Policy
from main_agent.types import Episode
from tool_server.client import ToolClient
from training.branching import branch_values, chosen_turns, continue_from, learnable, sampled_tokens, states
from training.config import TrainConfig, with_device_sizes
from training.data_order import seed_step
from training.play import play
from training.step import rewarded
from training.tasks import Task

STAGES = ("episodes", "branch", "branch_all", "matched", "truth")
"""The stage files of one N's folder, in the order they are sampled."""
State = tuple[int, int, int]
"""(group, episode in the group, turns replayed); the task's start, shared by the group, is (group, 0, 0)."""


@dataclass
class Session:
    """What the stages sample with: the run's settings, the fixed policy, the tool server."""

    cfg: TrainConfig
    policy: Policy
    tokenizer: object
    tools: ToolClient
    schemas: list[dict[str, object]]
    draws: int = 0
    """Sets this process's random draws apart from those of every earlier process on the same records (the
    lines recorded before it started): a resumed stage, or more replays of a recorded state, must not repeat
    the draws it adds to."""

    def __post_init__(self) -> None:
        # episodes in flight, as a training run on this device would play them
        self.cfg = with_device_sizes(self.cfg, self.cfg.device)


class Records:
    """One stage's JSONL: the lines so far, and appending one with the wall seconds since the previous one.
    Lines are appended to `path` (<stage>.jsonl) while the stage runs; `seal` folds them into <stage>.jsonl.gz,
    the form that is committed, and lines added later (raised replays) go to a new <stage>.jsonl until the next
    seal. `read` reads both, the gzipped lines first."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sealed = path.with_name(path.name + ".gz")
        self.last = time.monotonic()

    def exists(self) -> bool:
        return self.path.exists() or self.sealed.exists()

    def text(self) -> str:
        sealed = gzip.decompress(self.sealed.read_bytes()).decode("utf-8") if self.sealed.exists() else ""
        open_ = self.path.read_text(encoding="utf-8") if self.path.exists() else ""
        return (
            sealed if open_ and sealed.endswith(open_) else sealed + open_
        )  # a seal cut short: sealed already

    def read(self) -> list[dict]:
        return [json.loads(line) for line in self.text().splitlines() if line]

    def seal(self) -> None:
        """Gzip every line into <stage>.jsonl.gz (replaced atomically), then remove <stage>.jsonl."""
        if not self.path.exists():
            return
        tmp = self.sealed.with_name(self.sealed.name + ".tmp")
        tmp.write_bytes(gzip.compress(self.text().encode("utf-8"), mtime=0))
        os.replace(tmp, self.sealed)
        self.path.unlink()

    def append(self, line: dict) -> dict:
        now = time.monotonic()
        line = {**line, "elapsed_s": now - self.last}
        self.last = now
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")
        return line


def usable(group: Sequence[Episode]) -> bool:
    """A group training would keep (training.step.filter_groups): no episode failed for infrastructure reasons."""
    return not any(e.stop_reason == "infra_failed" for e in group)


# ---------------------------------------------------------------- stages


async def play_stage(tasks: Sequence[Task], s: Session, records: Records) -> list[list[Episode]]:
    """A group of episodes of every task; each group recorded as it finishes, recorded groups read back."""
    done = {r["group"]: [Episode.from_json(json.dumps(e)) for e in r["episodes"]] for r in records.read()}
    size = s.cfg.group_size
    at_once = asyncio.Semaphore(max(1, s.cfg.max_concurrent_episodes // size))

    async def one(g: int) -> tuple[int, list[Episode]]:
        async with at_once:
            [group] = await play(
                [tasks[g]], lambda _: s.policy, tools=s.tools, tokenizer=s.tokenizer, cfg=s.cfg.rollout,
                group_size=size, max_concurrent=size,
            )  # fmt: skip
        records.append(
            {"group": g, "task": tasks[g].task_id, "episodes": [json.loads(e.to_json()) for e in group]}
        )
        return g, group

    done |= dict(await asyncio.gather(*(one(g) for g in range(len(tasks)) if g not in done)))
    return [done[g] for g in range(len(tasks))]


async def branch_stage(
    groups: Sequence[list[Episode]],
    tasks: Sequence[Task],
    s: Session,
    records: Records,
    *,
    scored: dict[tuple[int, int], list[int]] | None,
) -> None:
    """Branch credit's values of every usable group (training.branching.branch_values), a group at a time:
    around the turns training would choose (`scored` None), or around the scored turns."""
    cfg = dataclasses.replace(s.cfg, credit=dataclasses.replace(s.cfg.credit, mode="branch"))
    done = {r["group"] for r in records.read()}
    for g, (task, group) in enumerate(zip(tasks, groups, strict=True)):
        if g in done or not usable(group):
            continue
        mine = None if scored is None else {(0, i): turns for (h, i), turns in scored.items() if h == g}
        values, stats = await branch_values(
            [group], [task], policy=s.policy, tools=s.tools, tokenizer=s.tokenizer, cfg=cfg, step=g,
            reward_of=rewarded(cfg), chosen=mine,
        )  # fmt: skip
        episodes = [[dataclasses.asdict(v) for v in per_episode] for per_episode in values[0]]
        records.append({"group": g, "values": episodes, "stats": dataclasses.asdict(stats)})


def matched_episodes(group: Sequence[Episode], branch_tokens: int) -> int:
    """How many more episodes of the group's task branch credit's continuations would buy (`branch_tokens`
    sampled) at the group's own sampled tokens per episode: the group outcome credit plays at equal tokens is
    this much larger."""
    per_episode = sum(sampled_tokens(e, 0) for e in group) / len(group)
    return round(branch_tokens / max(per_episode, 1.0))


async def matched_stage(
    groups: Sequence[list[Episode]], tasks: Sequence[Task], s: Session, records: Records, *, branch: Records
) -> None:
    """Outcome credit token for token with branch credit: for every group branch credit scored, as many more
    episodes from the task's start as its continuations' tokens buy (`matched_episodes`), a group's final
    rewards a line. Only the rewards are kept (outcome credit reads nothing else); episodes that failed as
    infrastructure are counted, not scored, and drawn again on the next run, as the truth's are."""
    have = {g: len(rewards) for g, rewards in matched_rewards(records.read()).items()}
    reward_of = rewarded(s.cfg)
    for line in sorted(branch.read(), key=lambda r: r["group"]):
        g = line["group"]
        need = matched_episodes(groups[g], line["stats"]["sampled_tokens"]) - have.get(g, 0)
        if g in have and need <= 0:
            continue
        played = []  # none bought: a line all the same, so the group has its (equal) outcome_matched
        if need > 0:
            [played] = await play(
                [tasks[g]], lambda _: s.policy, tools=s.tools, tokenizer=s.tokenizer, cfg=s.cfg.rollout,
                group_size=need, max_concurrent=min(need, s.cfg.max_concurrent_episodes),
            )  # fmt: skip
        ok = [e for e in played if e.stop_reason != "infra_failed"]
        records.append({
            "group": g, "task": tasks[g].task_id, "rewards": [reward_of(tasks[g], e) for e in ok],
            "sampled_tokens": sum(sampled_tokens(e, 0) for e in played), "infra_failed": len(played) - len(ok),
        })  # fmt: skip


def matched_rewards(lines: Sequence[dict]) -> dict[int, list[float]]:
    """Each group's more episodes' final rewards over matched.jsonl's lines."""
    rewards: dict[int, list[float]] = {}
    for r in lines:
        rewards.setdefault(r["group"], []).extend(r["rewards"])
    return rewards


def truth_plan(
    groups: Sequence[list[Episode]], tasks: Sequence[Task], *, turns: int, seed: int
) -> dict[tuple[int, int], list[int]]:
    """The scored turns of every learnable episode of a usable group: all, or `turns` chosen at random."""
    chosen = {}
    for g, (task, group) in enumerate(zip(tasks, groups, strict=True)):
        for i, episode in enumerate(group):
            if usable(group) and learnable(episode):
                rng = random.Random(f"truth/{seed}/{task.task_id}/{i}")
                chosen[(g, i)] = chosen_turns(len(episode.turns), turns, rng)
    return chosen


def truth_states(groups: Sequence[list[Episode]], chosen: dict[tuple[int, int], list[int]]) -> list[State]:
    """Before each scored turn (the group's start for turn 0) and after it (none after the last turn)."""
    needed = set()
    for (g, i), turns in chosen.items():
        needed |= {(g, i, t) if t else (g, 0, 0) for t in turns}
        needed |= {(g, i, t + 1) for t in turns if t + 1 < len(groups[g][i].turns)}
    return sorted(needed)


async def truth_stage(
    groups: Sequence[list[Episode]],
    tasks: Sequence[Task],
    chosen: dict[tuple[int, int], list[int]],
    s: Session,
    records: Records,
    *,
    replays: int,
) -> None:
    """`replays` continuations of every state the scored turns need, a state recorded as it finishes; a state
    recorded with fewer gets the rest (a line of its own), so a study raises its replays without redoing any.
    Each state recorded prints a line: how far the stage is, and its sampling rate (a study runs for hours)."""
    have = replayed_so_far(records.read())
    reward_of = rewarded(s.cfg)
    at_once = asyncio.Semaphore(max(1, s.cfg.max_concurrent_episodes // replays))
    needed = truth_states(groups, chosen)
    done = sum(have.get(st, 0) >= replays for st in needed)

    async def one(state: State) -> None:
        nonlocal done
        g, i, replayed = state
        async with at_once:
            played = await asyncio.gather(*(
                continue_from(
                    groups[g][i], replayed, tasks[g], s.schemas, policy=s.policy, tools=s.tools,
                    tokenizer=s.tokenizer, cfg=s.cfg.rollout,
                ) for _ in range(replays - have.get(state, 0))
            ))  # fmt: skip
        ok = [e for e in played if e.stop_reason != "infra_failed"]
        line = records.append({
            "state": list(state), "rewards": [reward_of(tasks[g], e) for e in ok],
            "sampled_tokens": sum(sampled_tokens(e, replayed) for e in played), "infra_failed": len(played) - len(ok),
        })  # fmt: skip
        done += len(ok) + have.get(state, 0) >= replays
        tokens, wall = line["sampled_tokens"], line["elapsed_s"]
        print(
            f"{records.path.parent.name}: truth state {state} recorded ({done} of {len(needed)} whole): "
            f"{tokens} tokens, {wall / 60:.1f} min since the previous line ({tokens / max(wall, 1e-9):.0f}/s), "
            f"{line['infra_failed']} failed as infrastructure",
            flush=True,
        )

    await asyncio.gather(*(one(st) for st in needed if have.get(st, 0) < replays))


def replayed_so_far(lines: Sequence[dict]) -> dict[State, int]:
    """The continuations each state has scored over the truth's lines. Those that failed as infrastructure are
    not counted (they stay recorded as such): a resume draws them again, once a run, so a state's truth is
    `replays` rewards, not fewer wherever the tools failed."""
    have: dict[State, int] = {}
    for r in lines:
        state = _state(r)
        have[state] = have.get(state, 0) + len(r["rewards"])
    return have


def truth_rewards(lines: Sequence[dict]) -> dict[State, list[float]]:
    """Each state's continuation rewards over the truth's lines: its first replays, then any added when the
    replays were raised."""
    rewards: dict[State, list[float]] = {}
    for r in lines:
        rewards.setdefault(_state(r), []).extend(r["rewards"])
    return rewards


def _state(line: dict) -> State:
    g, i, replayed = line["state"]
    return g, i, replayed


async def run_stages(
    tasks: Sequence[Task], s: Session, folder: Path, *, replays: int, truth_turns: int
) -> None:
    """The stages of one N into `folder`, each resumed from its records; torch reseeded per stage (and per
    process: `Session.draws`)."""
    seed_step(s.cfg, 5 * s.draws)
    resumed = Records(folder / "episodes.jsonl").exists()  # a stage file is made by its first line
    groups = await play_stage(tasks, s, Records(folder / "episodes.jsonl"))
    if resumed:
        exact = await check_replay(groups, tasks, s, folder)
        print(
            f"{folder.name}: resumed; its {exact} recorded episodes replay exactly on these tools", flush=True
        )
    scored = truth_plan(groups, tasks, turns=truth_turns, seed=s.cfg.run.seed)
    played = Records(folder / "episodes.jsonl").read()
    rate = sum(sampled_tokens(e, 0) for g in groups for e in g) / max(
        sum(r["elapsed_s"] for r in played), 1e-9
    )
    lines = Records(folder / "truth.jsonl").read()
    have = replayed_so_far(lines)
    truth, branch_all = forecast(groups, scored, replays=replays, k=s.cfg.credit.branch_k, have=have)
    where = "the episodes'"
    if lines:  # the truth's own rate, once it has one: its long contexts sample slower than the episodes
        rate = sum(r["sampled_tokens"] for r in lines) / max(sum(r["elapsed_s"] for r in lines), 1e-9)
        where = "the truth's recorded"
    print(
        f"{folder.name}: truth will sample ~{truth:.0f} tokens more (~{truth / rate / 3600:.1f} h at {where} "
        f"{rate:.1f} tokens/s), branch_all ~{branch_all:.0f}",
        flush=True,
    )
    for k, (mode, around) in enumerate((("branch", None), ("branch_all", scored)), start=1):
        seed_step(s.cfg, 5 * s.draws + k)
        await branch_stage(groups, tasks, s, Records(folder / f"{mode}.jsonl"), scored=around)
    seed_step(s.cfg, 5 * s.draws + 3)
    branch = Records(folder / "branch.jsonl")
    await matched_stage(groups, tasks, s, Records(folder / "matched.jsonl"), branch=branch)
    seed_step(s.cfg, 5 * s.draws + 4)
    await truth_stage(groups, tasks, scored, s, Records(folder / "truth.jsonl"), replays=replays)


class ToolsChanged(RuntimeError):
    """Recorded episodes no longer replay: the tools observe something else than they did when recorded."""


async def check_replay(
    groups: Sequence[list[Episode]], tasks: Sequence[Task], s: Session, folder: Path
) -> int:
    """Records resume only on the tools that made them. Every recorded episode that ended by itself (an answer,
    or its turns spent) is replayed whole, no token sampled; if any call observes something else now (a tool's
    observation changed since), stop before a single line is added, rather than fail state after state as
    replays diverge. One episode is not enough: a change shows only on the calls it touches (a read without a
    plate, say). Returns how many were replayed."""
    ended = [
        (g, e) for g, group in enumerate(groups) for e in group if e.stop_reason in ("answer", "max_turns")
    ]
    at_once = asyncio.Semaphore(max(1, s.cfg.max_concurrent_episodes))

    async def again(g: int, episode: Episode) -> Episode:
        async with at_once:
            return await continue_from(
                episode, len(episode.turns), tasks[g], s.schemas, policy=s.policy, tools=s.tools,
                tokenizer=s.tokenizer, cfg=s.cfg.rollout,
            )  # fmt: skip

    replayed = await asyncio.gather(*(again(g, e) for g, e in ended))
    failed = [(g, e) for (g, _), e in zip(ended, replayed, strict=True) if e.stop_reason == "infra_failed"]
    if failed:
        g, e = failed[0]
        raise ToolsChanged(
            f"{folder}: {len(failed)} of {len(ended)} recorded episodes do not replay on these tools, the first of "
            f"{tasks[g].task_id} ({e.infra_error}); they were sampled on other tools: sample anew under another --tag"
        )
    return len(ended)


def forecast(
    groups: Sequence[list[Episode]],
    scored: dict[tuple[int, int], list[int]],
    *,
    replays: int,
    k: int,
    have: dict[State, int],
) -> tuple[float, float]:
    """The tokens the truth (less the continuations it `have`s) and branch_all stages will sample in all, from
    the episodes' own lengths: a state t turns into an episode continues for its remaining turns at the
    episode's tokens per turn."""

    def cost(g: int, i: int, replayed: int) -> float:
        e = groups[g][i]
        return sum(len(t.completion_ids) for t in e.turns) / max(len(e.turns), 1) * (len(e.turns) - replayed)

    truth = sum(max(0, replays - have.get(st, 0)) * cost(*st) for st in truth_states(groups, scored))
    return truth, sum(k * cost(*state) for state in states(groups, scored))
