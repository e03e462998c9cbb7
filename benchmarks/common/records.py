"""Where a benchmark's results go and what its summary says of where it came from: benchmarks/results/<study>/<run>/
holds the run's summary.json, its figures and its raw records (records/); every summary names the commit and
the command that made it (benchmarks/results/README.md).

    out = summary_path("credit", "lora2")        # benchmarks/results/credit/lora2/summary.json
    write_summary(out, {"rows": rows})           # {"commit": "<sha>[-dirty]", "command": "python -m ...", "rows": ...}
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import ROOT

RESULTS = ROOT / "benchmarks" / "results"
SUMMARY = "summary.json"
"""A run's summary: the one JSON at the top of its folder; everything under records/ is raw."""


def summary_path(study: str, run: str) -> Path:
    """A run's summary: benchmarks/results/<study>/<run>/summary.json."""
    return RESULTS / study / run / SUMMARY


def commit(root: Path = ROOT) -> str:
    """HEAD's SHA, with "-dirty" when tracked files outside benchmarks/results/ differ from it (a run's own
    records do not make the code it ran dirty); "unknown" outside a git checkout."""
    try:
        head = _git(root, "rev-parse", "HEAD")
        changed = _git(
            root, "status", "--porcelain", "--untracked-files=no", "--", ".", ":!benchmarks/results"
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("-dirty" if changed else "")


def _git(root: Path, *args: str) -> str:
    done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True, timeout=30)
    return done.stdout.strip()


def command(argv: list[str] | None = None) -> str:
    """The command line that is running: `python -m <module> <args>` for a module run with -m, else `python
    <script> <args>`."""
    argv = sys.argv if argv is None else argv
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name:
        head = ["python", "-m", spec.name.removesuffix(".__main__")]
    else:
        script = Path(argv[0]) if argv and argv[0] else Path("python")
        head = ["python", str(script.relative_to(ROOT) if script.is_relative_to(ROOT) else script)]
    return shlex.join([*head, *argv[1:]])


def stamp(summary: dict) -> dict:
    """`summary` with the commit and the command that made it first."""
    rest = {k: v for k, v in summary.items() if k not in ("commit", "command")}
    return {"commit": commit(), "command": command(), **rest}


def write_summary(path: Path, summary: dict) -> Path:
    """Write the stamped `summary` to `path` as indented JSON, atomically (a reader never sees half of it)."""
    text = json.dumps(stamp(summary), indent=2, default=str) + "\n"
    write_atomic(path, text)
    return path


def write_atomic(path: Path, text: str) -> None:
    """`text` to `path` through a temporary file in the same folder, renamed over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(
        "w", encoding="utf-8", dir=path.parent, delete=False, suffix=".tmp"
    ) as f:
        f.write(text)
    os.chmod(f.name, 0o644)  # as write_text would leave it, not the temporary file's 0600
    os.replace(f.name, path)
