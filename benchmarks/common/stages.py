"""Benchmark stages as a user runs them: `conductor` commands with their logs, training runs that resume where
they stopped, and the fingerprint of the warm start a stage trained from (the horizon and learning studies).

    seconds = conductor("eval", "--policy", ckpt, "--task", "plate_reading", log=Path("runs/x.log"))
    run_dir = train_to(config, run_dir, ("policy=...", "seed=0"), steps=20)   # trained, resumed or reused
    sha = warm_start_sha("runs/sft-plates/model", made_by="examples/train_plates.toml")
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks import ROOT
from benchmarks.common.pinned import in_place
from conductor.models import ModelNotFound, resolve_model
from conductor.stopping import wait_or_stop
from training.checkpoint import changed_settings, find_latest, saved_config
from training.config import config_to_dict, load_train_config


def conductor(*args: str, log: Path) -> float:
    """One `conductor` command with its output in `log`; its wall time, or exit on failure."""
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"$ conductor {' '.join(args)}   (log: {log})", flush=True)
    start = time.monotonic()
    with log.open("w", encoding="utf-8") as out:
        child = subprocess.Popen(["conductor", *args], stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        code = wait_or_stop(child)  # a study stopped stops its command too, which closes its engine
    if code != 0:
        sys.exit(f"conductor {args[0]} failed with exit code {code}; see {log}")
    return time.monotonic() - start


def train_to(config: Path, run_dir: Path, sets: Sequence[str], steps: int) -> Path:
    """`conductor train config --set ...` until `run_dir` holds step `steps` (`sets` name it and `run_dir`):
    trained, resumed from its last checkpoint when cut short, or reused when finished. Exits, naming the
    differences, when the run there was trained with other `sets` (a stage must not take another stage's run)."""
    latest = find_latest(run_dir) if run_dir.exists() else None
    if latest is not None and (changed := run_differs(latest, config, sets)):
        sys.exit(f"{run_dir} was trained with other settings ({'; '.join(changed)}): move it away first")
    if latest is None or latest.name != f"step_{steps}":
        resume = ("--resume", str(run_dir)) if latest is not None else ()
        args = ["train", str(config), *[a for s in sets for a in ("--set", s)], *resume]
        conductor(*args, log=run_dir.parent / f"{run_dir.name}.log")  # not with_suffix: "x-t1.15" has a dot
    return run_dir


def run_differs(checkpoint: Path, config: Path, sets: Sequence[str]) -> list[str]:
    """The settings of `sets` that the checkpoint's run was not trained with, as "key: then -> now"; but for
    `steps` (a longer run continues a shorter one) and `run_dir` (a run moved is the same run)."""
    keys = [k for k, _ in (s.split("=", 1) for s in sets) if k not in ("steps", "run_dir")]
    wanted = config_to_dict(load_train_config(config, sets))
    return changed_settings(saved_config(checkpoint), wanted, keys)


def warm_start_sha(policy: str, *, made_by: str) -> str:
    """SHA-256 over the warm start's weight files, in name order: which warm start a stage was trained from. An
    adapter's hash covers its base model's weights first (the same adapter on another base is another policy).
    `policy` is a folder under the project root or a name the project loads (conductor-default); a warm start
    named by commit (pinned.PINNED) is read back from history first. Exits saying how the warm start is made
    (`made_by`) when it has no weights."""
    sha = weights_sha(in_place(policy))
    if sha is None:
        sys.exit(f"no weights (*.safetensors) in {policy}: make the warm start first (see {made_by})")
    return sha


def weights_sha(policy: str) -> str | None:
    """SHA-256 over the policy's weight files (`weight_files`, a base's before its adapter's); None when it has
    none (the scripted expert, or a policy not made yet)."""
    files = weight_files(policy)
    if not files:
        return None
    digest = hashlib.sha256()
    for path in files:
        with path.open("rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()


def weight_files(policy: str) -> list[Path]:
    """The policy's *.safetensors in name order, after its base model's when it is an adapter; [] when the
    folder or the base is missing."""
    try:
        folder = ROOT / policy if (ROOT / policy).is_dir() else resolve_model(policy)
        own = sorted(folder.glob("*.safetensors"))
        config = folder / "adapter_config.json"
        if not own or not config.is_file():
            return own
        base = json.loads(config.read_text(encoding="utf-8"))["base_model_name_or_path"]
        return [*weight_files(str(resolve_model(base))), *own]
    except ModelNotFound:
        return []
