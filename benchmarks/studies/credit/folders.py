"""Where bench_credit's records live and whose they are: one folder per family and N, named by a digest of the
study's settings (an older folder still matches when only config fields added since at their default differ), its
settings.json with the SHA-256 of the policy's weights, and the count of recorded lines a resumed process offsets
its sampler's seed by. The records themselves (one JSONL per stage) are stages.Records."""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common.stages import warm_start_sha
from benchmarks.studies.credit.stages import STAGES, Records
from training.config import TrainConfig, config_to_dict


@dataclass(frozen=True)
class Options:
    """The command line."""

    family: str
    n_items: list[int]
    episodes: int
    replays: int
    truth_turns: int
    draws: int
    records: Path
    work: Path
    """The tool server's scratch folder (pages, clips): under runs/, never among the records."""

    def folder(self, n: int, cfg: TrainConfig) -> tuple[Path, dict]:
        """Where one N's records live, named by a digest of every setting but the replays, and those settings.
        A folder recorded before a config field existed has another digest; it is still this N's folder when its
        settings.json differs only by fields it lacks that hold their default now (`same_but_added`)."""
        # not --replays: raising it adds continuations to the same folder's states
        settings = {"n": n, "episodes": self.episodes, "truth_turns": self.truth_turns}
        settings["config"] = config_to_dict(cfg)
        digest = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:10]
        exact = self.records / f"{self.family}-n{n}-{digest}"
        if exact.exists():
            return exact, settings
        return older_folder(self.records.glob(f"{self.family}-n{n}-*"), settings) or exact, settings


def older_folder(folders: Iterable[Path], settings: dict) -> Path | None:
    """The folder among `folders` whose settings.json holds `settings` but for config fields added since, at
    their default now (`same_but_added`); None if there is none."""
    current = json.loads(json.dumps(settings, default=str))  # as settings.json holds it (tuples as lists)
    defaults = json.loads(json.dumps(config_to_dict(TrainConfig()), default=str))
    for folder in sorted(folders):
        path = folder / "settings.json"
        if not path.exists():
            continue
        recorded = json.loads(path.read_text(encoding="utf-8"))
        recorded.pop("policy_sha256", None)
        study = {k: v for k, v in recorded.items() if k != "config"}  # n, episodes, truth_turns: exactly
        if study == {k: v for k, v in current.items() if k != "config"} and same_but_added(
            recorded.get("config", {}), current["config"], defaults
        ):
            return folder
    return None


def same_but_added(recorded: dict, current: dict, defaults: dict) -> bool:
    """`recorded` holds `current`'s settings, but for keys added since (absent from `recorded`) whose current
    value is their default: what a field added to the config at its default leaves as it was."""
    if recorded.keys() - current.keys():
        return False  # a field removed since: the settings are not comparable
    for key, value in current.items():
        if key not in recorded:
            if value != defaults.get(key):
                return False
        elif isinstance(value, dict) and isinstance(recorded[key], dict):
            if not same_but_added(recorded[key], value, defaults.get(key) or {}):
                return False
        elif recorded[key] != value:
            return False
    return True


def recorded_ns(opts: Options, cfg: TrainConfig) -> set[int]:
    """The N whose records under `opts.records` were sampled with these settings: a run that samples one N
    still tables the others, so its results file keeps their rows, with folders recorded before a config field
    existed (Options.folder)."""
    ns = set()
    for folder in opts.records.glob(f"{opts.family}-n*-*"):
        n = folder.name.removeprefix(f"{opts.family}-n").split("-")[0]
        if (
            n.isdigit()
            and opts.folder(int(n), cfg)[0] == folder
            and Records(folder / "episodes.jsonl").exists()
        ):
            ns.add(int(n))
    return ns


def weights_sha(policy: str) -> str:
    """SHA-256 over the policy's weight files (an adapter's after its base's): which policy a record was
    sampled from."""
    return warm_start_sha(policy, made_by="examples/train_audit.toml's SFT command")


def claim(folder: Path, settings: dict, sha: str) -> None:
    """Write the folder's settings.json, or check that the records there come from the same policy weights."""
    path = folder / "settings.json"
    if path.exists():
        recorded = json.loads(path.read_text(encoding="utf-8"))["policy_sha256"]
        if recorded != sha:
            sys.exit(
                f"{folder} was sampled from weights {recorded[:12]}, {settings['config']['policy']} is {sha[:12]}"
            )
        return
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps({**settings, "policy_sha256": sha}, indent=2, default=str) + "\n", encoding="utf-8"
    )


def recorded_lines(folders: Sequence[Path]) -> int:
    """The lines recorded in the folders' stages: it grows with every process that records, so offsetting the
    sampler's seed by it keeps a resumed process from repeating an earlier one's draws (Session.draws)."""
    return sum(len(Records(folder / f"{stage}.jsonl").read()) for folder in folders for stage in STAGES)


def seal(folder: Path) -> None:
    """Gzip every stage file of a folder whose stages are whole (stages.Records.seal): what is committed."""
    for stage in STAGES:
        Records(folder / f"{stage}.jsonl").seal()
