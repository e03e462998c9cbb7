"""Atomic checkpoints and exact resume.

A run directory holds complete checkpoints and a pointer to the newest:

    run_dir/step_N/model/          model.save_pretrained: HF weights, or a peft adapter
               optimizer.pt        optimizer.state_dict()
               scheduler.pt        scheduler.state_dict() (absent when the run has no scheduler)
               rng.pt              Python, NumPy, torch CPU and (when present) CUDA generator states
               state.json          TrainState: step, policy version, data cursor, counters, config hash
               config.json         the resolved config the run was started with
               MANIFEST.json       written last: every other file with its size and sha256
    run_dir/latest                 "step_N", replaced atomically: the commit point of a save

`save_checkpoint` writes everything into `step_N.tmp/`, fsyncs each file and folder, writes the manifest last,
renames the folder to `step_N`, then replaces `latest`. A crash at any point leaves `latest` on the previous
complete checkpoint; the `.tmp` debris is removed by the next save's pruning. `find_latest` trusts `latest` when
its target validates and otherwise scans `step_*` newest first. A checkpoint is valid when its manifest exists
and every listed file has the recorded size and sha256, so a truncated or missing file is caught before loading.

Exact resume: weights, optimizer, scheduler and every RNG are restored, and TrainState carries the data cursor
(seed, epoch, position), so the next task ids and random draws are those an uninterrupted run would have made.
Limits: one writer per run directory; only a peft model's default adapter is saved and loaded; pruning checks
sizes, not hashes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import random
import re
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler as Scheduler

from conductor.models import portable_adapter

if TYPE_CHECKING:  # annotations only: peft is imported lazily where it is needed
    from peft import PeftModel
    from transformers import PreTrainedModel
    from transformers import PreTrainedTokenizerBase as Tokenizer

    Model = PreTrainedModel | PeftModel

logger = logging.getLogger(__name__)

MANIFEST = "MANIFEST.json"
LATEST = "latest"
_STEP_DIR = re.compile(r"step_(\d+)")
_HASH_CHUNK = 1 << 20  # read 1 MiB at a time: a 540 MB weights file hashes without holding it in memory


class CheckpointError(RuntimeError):
    """A checkpoint is incomplete, damaged or does not fit the run being resumed."""


@dataclass(frozen=True)
class TrainState:
    """Everything beyond weights, optimizer and RNG that a resumed run needs to continue exactly."""

    step: int = 0
    """Optimizer steps completed."""
    policy_version: int = 0
    """Version of the policy weights; episodes record the version that sampled them."""
    epoch: int = 0
    """Data cursor: completed passes over the task list."""
    position: int = 0
    """Data cursor: index of the next task in this epoch's order."""
    seed: int = 0
    """Data cursor: the order of epoch e is a shuffle seeded by (seed, e), so the cursor replays it exactly."""
    episodes: int = 0
    """Episodes rolled out so far, invalid ones included."""
    invalid_episodes: int = 0
    """Episodes that ended in an infrastructure failure and were not trained on."""
    elapsed_s: float = 0.0
    """Training wall-clock time before this checkpoint, so time budgets survive a resume."""
    config_hash: str = ""
    """sha256 of the resolved config JSON; `save_checkpoint` fills it."""
    items: int = 0
    """Item tasks: the current horizon N (training/curriculum.py); 0 for other families."""
    recent: tuple[bool, ...] = ()
    """Item tasks: successes of the latest episodes at the current N, the curriculum's rolling window."""


def save_checkpoint(
    run_dir: Path,
    step: int,
    *,
    model: Model,
    optimizer: Optimizer,
    scheduler: Scheduler | None,
    state: TrainState,
    config_json: str,
    keep_last: int,
    tokenizer: Tokenizer | None = None,
    before_phase: Callable[[str], None] | None = None,
) -> Path:
    """Write checkpoint `step_N` atomically, point `latest` at it, keep the newest `keep_last`; return its path.

    `model` is a transformers or peft model (anything with `save_pretrained`); `tokenizer`, when given, is saved
    beside it so that `model/` loads on its own (`conductor eval --policy run/step_N/model`). `before_phase`, a test seam, is
    called with "weights", "optimizer", "rng", "state", "manifest", "rename" and "latest" before each phase.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    announce = before_phase or (lambda phase: None)
    final, tmp = run_dir / f"step_{step}", run_dir / f"step_{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)  # debris of an earlier crash at this step
    tmp.mkdir(parents=True)
    config_hash = hashlib.sha256(config_json.encode()).hexdigest()
    announce("weights")
    model.save_pretrained(str(tmp / "model"))
    portable_adapter(tmp / "model")
    if tokenizer is not None:
        tokenizer.save_pretrained(str(tmp / "model"))
    announce("optimizer")
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    if scheduler is not None:
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
    announce("rng")
    torch.save(_rng_state(), tmp / "rng.pt")
    announce("state")
    saved_state = dataclasses.replace(state, config_hash=config_hash)
    (tmp / "state.json").write_text(json.dumps(dataclasses.asdict(saved_state), indent=2) + "\n")
    (tmp / "config.json").write_text(config_json)
    _fsync_tree(tmp)
    announce("manifest")
    _write_manifest(tmp, step=step, config_hash=config_hash)
    announce("rename")
    _install(tmp, final)
    announce("latest")
    _point_latest(run_dir, final.name)
    _prune(run_dir, keep_last=keep_last, current=final)
    return final


def _rng_state() -> dict[str, object]:
    """Every generator the run draws from, in a form `torch.load(weights_only=True)` accepts."""
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, object] = {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(np.asarray(keys, dtype=np.int64)), pos, has_gauss, cached),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_path(path: Path) -> None:
    """fsync a file or a folder (a folder's entry list is only durable once the folder itself is synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for folder, _, files in os.walk(root, topdown=False):
        for name in files:
            _fsync_path(Path(folder) / name)
        _fsync_path(Path(folder))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _write_manifest(folder: Path, *, step: int, config_hash: str) -> None:
    files = {p.relative_to(folder).as_posix(): p for p in sorted(folder.rglob("*")) if p.is_file()}
    entries = {name: {"size": p.stat().st_size, "sha256": _sha256(p)} for name, p in files.items()}
    manifest = {"step": step, "config_hash": config_hash, "files": entries}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    _fsync_path(folder / MANIFEST)
    _fsync_path(folder)


def _install(tmp: Path, final: Path) -> None:
    """Rename the finished folder into place. A folder already there (this step saved before, e.g. by a run that
    crashed before committing `latest`) is replaced."""
    if final.exists():
        logger.warning("replacing existing checkpoint %s", final)
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_path(final.parent)


def _point_latest(run_dir: Path, name: str) -> None:
    pointer = run_dir / (LATEST + ".tmp")
    pointer.write_text(name + "\n")
    _fsync_path(pointer)
    os.replace(pointer, run_dir / LATEST)
    _fsync_path(run_dir)


def _step_dirs(run_dir: Path) -> list[Path]:
    """`step_N` folders (never `.tmp`), newest first."""
    found = [(int(m[1]), p) for p in run_dir.iterdir() if (m := _STEP_DIR.fullmatch(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found, reverse=True)]


def _prune(run_dir: Path, *, keep_last: int, current: Path) -> None:
    """Delete `.tmp` debris and every step folder but `current` and the newest `keep_last` complete ones (their
    sizes checked, not their hashes)."""
    complete = [p for p in _step_dirs(run_dir) if _is_valid(p, check_hashes=False)]
    keep = {current, *complete[:keep_last]}
    for path in run_dir.iterdir():
        is_step = _STEP_DIR.fullmatch(path.name) or _STEP_DIR.fullmatch(path.name.removesuffix(".tmp"))
        if is_step and path.is_dir() and path not in keep:
            logger.info("pruning checkpoint %s", path)
            shutil.rmtree(path)


def validate_checkpoint(path: Path, *, check_hashes: bool = True) -> dict:
    """The checkpoint's manifest, after checking that every listed file exists with the recorded size (and
    sha256 unless `check_hashes` is False); `CheckpointError` naming the problem otherwise."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"{path}: no {MANIFEST}, the checkpoint is incomplete (a save did not finish)")
    try:
        manifest = json.loads(manifest_path.read_text())
        entries = manifest["files"].items()
    except (json.JSONDecodeError, KeyError, AttributeError) as exc:
        raise CheckpointError(f"{manifest_path}: unreadable manifest ({exc})") from exc
    for name, entry in entries:
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{path}: file {name} listed in the manifest is missing")
        if (size := file.stat().st_size) != entry["size"]:
            raise CheckpointError(
                f"{path}: file {name} has {size} bytes, expected {entry['size']} (truncated?)"
            )
        if check_hashes and _sha256(file) != entry["sha256"]:
            raise CheckpointError(f"{path}: file {name} does not match its sha256 (damaged)")
    return manifest


def _is_valid(path: Path, *, check_hashes: bool = True) -> bool:
    try:
        validate_checkpoint(path, check_hashes=check_hashes)
    except CheckpointError as exc:
        logger.warning("skipping checkpoint: %s", exc)
        return False
    return True


def find_latest(run_dir: Path) -> Path | None:
    """The newest complete checkpoint: `latest`'s target when it validates, else the newest valid `step_N`."""
    if not run_dir.is_dir():
        return None
    pointer = run_dir / LATEST
    if pointer.is_file():
        name = pointer.read_text().strip()
        if _STEP_DIR.fullmatch(name) and _is_valid(run_dir / name):
            return run_dir / name
        logger.warning("%s names %r, which is not a valid checkpoint; scanning step folders", pointer, name)
    return next((p for p in _step_dirs(run_dir) if _is_valid(p)), None)


def load_checkpoint(
    path: Path, *, model: Model, optimizer: Optimizer, scheduler: Scheduler | None
) -> TrainState:
    """Validate `path`, load weights, optimizer, scheduler and RNG states in place, and return the TrainState."""
    validate_checkpoint(path)
    _load_weights(model, path / "model")
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True))
    if scheduler is not None:
        if not (path / "scheduler.pt").is_file():
            raise CheckpointError(f"{path}: the run has a scheduler but the checkpoint saved none")
        scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    _set_rng_state(torch.load(path / "rng.pt", weights_only=True))
    fields = json.loads((path / "state.json").read_text())
    try:
        return TrainState(**{**fields, "recent": tuple(fields.get("recent", ()))})
    except TypeError as exc:
        raise CheckpointError(f"{path}/state.json does not fit TrainState: {exc}") from exc


def saved_config(path: Path) -> dict:
    """The resolved config a checkpoint was saved with (for `check_resume_compatible`)."""
    return json.loads((path / "config.json").read_text())


def _load_weights(model: Model, folder: Path) -> None:
    """Load a peft adapter into a peft model, or full weights into a plain model. A plain model's saved files
    leave out tied weights (lm_head shares the embedding), so only keys that share storage with a loaded key
    may be missing."""
    from peft import PeftModel, set_peft_model_state_dict  # lazily: peft's import is slow and often unused
    from safetensors.torch import load_file

    if isinstance(model, PeftModel):
        adapter = folder / "adapter_model.safetensors"
        if not adapter.is_file():
            raise CheckpointError(f"{folder}: the model is a peft model but no adapter was saved")
        result = set_peft_model_state_dict(model, load_file(adapter))
        unexpected = result.unexpected_keys  # type: ignore[attr-defined]  # peft annotates a bare namedtuple
        if unexpected:
            raise CheckpointError(f"{adapter}: keys the model does not have: {unexpected[:5]}")
        return
    weights = {}
    for file in sorted(folder.glob("*.safetensors")):
        weights.update(load_file(file))
    if not weights:
        raise CheckpointError(f"{folder}: no *.safetensors weights (an adapter saved for a plain model?)")
    result = model.load_state_dict(weights, strict=False)
    untied = [k for k in result.missing_keys if not _tied_to_loaded(model, k, weights)]
    if result.unexpected_keys or untied:
        raise CheckpointError(f"{folder}: missing keys {untied[:5]}, unexpected {result.unexpected_keys[:5]}")


def _tied_to_loaded(model: torch.nn.Module, key: str, loaded: dict[str, torch.Tensor]) -> bool:
    """Whether parameter `key` shares storage with (is tied to) a parameter that was loaded."""
    params = model.state_dict()
    return any(params[name].data_ptr() == params[key].data_ptr() for name in loaded if name != key)


def _lookup(config: dict, dotted: str) -> str:
    """The repr of the value at a dotted path such as "model.name", or "<absent>" (unlike a JSON null)."""
    value: object = config
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return "<absent>"
        value = value[part]
    return repr(value)


def changed_settings(saved: dict, new: dict, keys: Sequence[str]) -> list[str]:
    """Each of `keys` (dotted paths into the config dicts, e.g. "model.name") whose value differs between the
    `saved` and the `new` config, as "key: old -> new"."""
    values = [(key, _lookup(saved, key), _lookup(new, key)) for key in keys]
    return [f"{key}: {old} -> {now}" for key, old, now in values if old != now]


def check_resume_compatible(saved: dict, new: dict, *, force: bool, keys: tuple[str, ...]) -> None:
    """Refuse to resume when any of `keys` changed (`changed_settings`); the error names each change. With
    `force` the changes are logged and the resume goes ahead."""
    changed = changed_settings(saved, new, keys)
    if not changed:
        return
    message = "config changed since the checkpoint: " + "; ".join(changed)
    if not force:
        raise CheckpointError(message + " (resume with force to accept)")
    logger.warning("%s; resuming anyway (force)", message)
