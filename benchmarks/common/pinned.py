"""Warm starts named by commit: a study's fixed adapter is not in the tree (only the shipped one is,
conductor/policies/default); its folder keeps its card (README.md: how it was made), and its files are read back
from the commit that holds them, into that folder (git ignores them there), the first time a study samples from it.
The policy keeps its name, so the records made from it (their settings, the digests of their folders) still match.

    policy = materialize("benchmarks/studies/credit/warm_start")   # its adapter files read from history if absent
    policy = in_place("benchmarks/studies/credit/warm_start")      # the same, exiting with the recipe if it cannot
    python -m benchmarks.common.pinned benchmarks/studies/learning/research_warm_start   # the same, from the shell
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks import ROOT

FILES = ("adapter_config.json", "adapter_model.safetensors")


@dataclass(frozen=True)
class Pinned:
    """The commit that holds an adapter's files, and the recipe that rebuilds them where history lacks it."""

    commit: str
    recipe: str


EXPORT = "python -c \"from pathlib import Path; from conductor.models import export_adapter; export_adapter(Path('{run}/model'), Path('{folder}'))\""
PINNED = {
    "benchmarks/studies/credit/warm_start": Pinned(
        "8899c99468390aecc430525604b5618cbdcf9ece",
        "conductor sft --set 'tasks=[\"plate_audit\"]' --set 'items=[1, 2, 4, 8]' --set limit=10 --set epochs=2 "
        "--set lora_rank=16 --set lr=2e-4 --set rollout.max_new_tokens=128 --set rollout.fold_at_tokens=1792 "
        "--set rollout.wall_clock_s=3600 --set eval_n=0 --set out_dir=runs/sft-audit-lora && "
        + EXPORT.format(run="runs/sft-audit-lora", folder="benchmarks/studies/credit/warm_start"),
    ),
    "benchmarks/studies/learning/research_warm_start": Pinned(
        "b8b0a3a616160fa2725cd2f094135a29f49c5078",
        "conductor sft examples/default_policy_sft.toml --set 'tasks=[\"corpus_qa\"]' --set 'limits=[240]' "
        "--set 'demonstrations=[\"runs/default-sft-v8/expert_episodes.jsonl\"]' --set out_dir=runs/default-sft-v9 && "
        "conductor sft examples/default_policy_sft.toml --set 'tasks=[\"plate_reading\"]' --set 'limits=[128]' "
        "--set 'demonstrations=[\"runs/default-sft-v9/expert_episodes.jsonl\"]' --set out_dir=runs/default-sft-v10 && "
        + EXPORT.format(run="runs/default-sft-v10", folder="benchmarks/studies/learning/research_warm_start"),
    ),
}
"""The studies' warm starts by folder (relative to the checkout): the commit that last held their files."""


class NotInHistory(RuntimeError):
    """The commit that holds a pinned adapter is not in this checkout's history (a shallow clone, say)."""


def materialize(policy: str, *, into: Path = ROOT, repo: Path = ROOT) -> str:
    """`policy`, unchanged; when it names a pinned adapter (PINNED) whose files are missing under `into`, they are
    first read from its commit in `repo`'s history and written there. Raises NotInHistory, naming the recipe that
    rebuilds it, when `repo` lacks that commit."""
    pin = PINNED.get(policy.rstrip("/"))
    if pin is None:
        return policy
    folder = into / policy.rstrip("/")
    for name in FILES:
        target = folder / name
        if target.is_file():
            continue
        data = blob(repo, pin.commit, f"{policy.rstrip('/')}/{name}", recipe=pin.recipe)
        folder.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{name}.tmp")
        tmp.write_bytes(data)
        tmp.replace(target)  # atomic: a study never loads half an adapter
    return policy


def blob(repo: Path, commit: str, path: str, *, recipe: str) -> bytes:
    """The bytes of `path` at `commit` (`git cat-file`, no filters applied)."""
    try:
        done = subprocess.run(
            ["git", "cat-file", "blob", f"{commit}:{path}"],
            cwd=repo,
            capture_output=True,
            check=False,
            timeout=60,
        )
    except OSError as e:  # no git here
        raise NotInHistory(f"{path}: git is not available ({e}); rebuild it: {recipe}") from e
    if done.returncode != 0:
        raise NotInHistory(
            f"{path} is named by commit {commit[:12]}, which this checkout's history lacks "
            f"({done.stderr.decode(errors='replace').strip()}): fetch it (`git fetch --unshallow`) or rebuild "
            f"it by its recipe: {recipe}"
        )
    return done.stdout


def in_place(policy: str) -> str:
    """`materialize(policy)`, or exit naming what is missing and the recipe that rebuilds it."""
    try:
        return materialize(policy)
    except NotInHistory as e:
        sys.exit(str(e))


def main(argv: list[str] | None = None) -> None:
    names = sys.argv[1:] if argv is None else argv
    for policy in names or list(PINNED):
        if policy.rstrip("/") not in PINNED:
            sys.exit(f"{policy} is not a pinned warm start: {', '.join(PINNED)}")
        print(f"{in_place(policy)}: {', '.join(FILES)} in place")


if __name__ == "__main__":
    main()
