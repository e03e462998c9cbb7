"""benchmarks/results/ as benchmarks/results/README.md lays it out: <study>/<run>/summary.json, each summary stamped
with the commit and the command that made it (benchmarks.common.records); and the studies' warm starts named by
commit, read back from this checkout's history (benchmarks.common.pinned)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks import ROOT
from benchmarks.common import pinned, records

HAS_HISTORY = (
    subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, check=False).returncode == 0
)
needs_history = pytest.mark.skipif(not HAS_HISTORY, reason="not a git checkout")


@needs_history
def test_the_stamp_names_heads_commit_and_the_command(monkeypatch: pytest.MonkeyPatch) -> None:
    """The commit is HEAD's SHA (with "-dirty" when tracked code differs from it); the command is the module run
    with -m and its arguments, quoted as a shell would need them."""
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    main = SimpleNamespace(__spec__=SimpleNamespace(name="benchmarks.perf.flood"))
    monkeypatch.setitem(sys.modules, "__main__", main)
    monkeypatch.setattr(sys, "argv", [str(ROOT / "benchmarks/perf/flood.py"), "--out", "a b.json"])
    stamped = records.stamp({"rows": [1], "command": "an older one"})
    assert stamped["commit"].removesuffix("-dirty") == head and len(head) == 40
    assert stamped["command"] == "python -m benchmarks.perf.flood --out 'a b.json'"
    assert list(stamped) == ["commit", "command", "rows"]
    monkeypatch.setitem(sys.modules, "__main__", SimpleNamespace(__spec__=None))
    assert records.command([str(ROOT / "tools" / "x.py"), "-n", "2"]) == "python tools/x.py -n 2"


def test_outside_a_checkout_the_commit_is_unknown(tmp_path: Path) -> None:
    assert records.commit(tmp_path) == "unknown"


def test_changed_code_is_dirty_and_a_runs_own_records_are_not(tmp_path: Path) -> None:
    """A tracked file changed outside benchmarks/results/ makes the commit "-dirty"; the run's own results there
    (records appended while it ran) and untracked files do not."""
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "code.py").write_text("a = 1\n")
    (tmp_path / "benchmarks" / "results" / "r.jsonl").write_text("{}\n")
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "x"]):
        subprocess.run([*git, *args], cwd=tmp_path, check=True, capture_output=True)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout
    (tmp_path / "benchmarks" / "results" / "r.jsonl").write_text("{}\n{}\n")
    (tmp_path / "new.py").write_text("")
    assert records.commit(tmp_path) == head.strip()
    (tmp_path / "code.py").write_text("a = 2\n")
    assert records.commit(tmp_path) == head.strip() + "-dirty"


def test_a_summary_is_written_stamped_and_whole(tmp_path: Path) -> None:
    out = records.write_summary(
        tmp_path / "study" / "run" / "summary.json", {"rows": [{"n": 1}], "p": Path("x")}
    )
    written = json.loads(out.read_text(encoding="utf-8"))
    assert {"commit", "command"} <= set(written) and written["rows"] == [{"n": 1}] and written["p"] == "x"
    assert [p.name for p in out.parent.iterdir()] == ["summary.json"]  # no temporary file left
    assert out.stat().st_mode & 0o777 == 0o644
    assert records.summary_path("credit", "lora2") == ROOT / "benchmarks/results/credit/lora2/summary.json"


def test_results_are_laid_out_by_study_and_run_and_every_summary_is_stamped() -> None:
    """The layout rule of benchmarks/results/README.md: a file at the top is the README; a folder there is a
    study, a folder in it a run; each run has summary.json (stamped: commit and command); every other JSON is a
    raw record under the run's records/."""
    results = records.RESULTS
    assert [p.name for p in results.iterdir() if p.is_file()] == ["README.md"]
    runs = [run for study in results.iterdir() if study.is_dir() for run in study.iterdir()]
    assert runs and all(run.is_dir() for run in runs), "a study folder holds run folders only"
    unstamped = []
    for run in runs:
        summary = json.loads((run / records.SUMMARY).read_text(encoding="utf-8"), object_pairs_hook=_no_twice)
        if not (isinstance(summary.get("commit"), str) and isinstance(summary.get("command"), str)):
            unstamped.append(str(run.relative_to(results)))
    assert not unstamped, f"summaries without a commit and a command: {unstamped}"
    parts = [p.relative_to(results).parts for p in results.rglob("*.json")]
    stray = [
        "/".join(x)
        for x in parts
        if not (len(x) == 3 and x[2] == records.SUMMARY or len(x) > 3 and x[2] == "records")
    ]
    assert not stray, f"JSON outside a run's summary.json and records/: {stray}"


def _no_twice(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object whose keys are each there once (a stamp added beside a recorded one would shadow it)."""
    keys = [k for k, _ in pairs]
    assert len(keys) == len(set(keys)), f"a key twice: {keys}"
    return dict(pairs)


@needs_history
@pytest.mark.parametrize("policy", sorted(pinned.PINNED))
def test_a_pinned_warm_start_is_read_back_from_its_commit(policy: str, tmp_path: Path) -> None:
    """Each study's adapter is read from the commit that holds it, byte for byte the blob git names there; a
    second call finds it in place; the name is returned unchanged, so the records made from it still match."""
    pin = pinned.PINNED[policy]
    assert pinned.materialize(policy, into=tmp_path) == policy
    for name in pinned.FILES:
        data = (tmp_path / policy / name).read_bytes()
        expected = subprocess.run(
            ["git", "rev-parse", f"{pin.commit}:{policy}/{name}"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        assert hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() == expected
    assert pinned.materialize(policy + "/", into=tmp_path) == policy + "/"


def test_without_the_history_the_error_names_the_recipe(tmp_path: Path) -> None:
    """A checkout without the pinned commit (a shallow clone; here: no git history at all) is told what to fetch
    or how to rebuild the adapter; a policy that is not pinned is left alone."""
    policy = "benchmarks/studies/credit/warm_start"
    with pytest.raises(pinned.NotInHistory, match="rebuild it") as raised:
        pinned.materialize(policy, into=tmp_path, repo=tmp_path)
    assert "conductor sft" in str(raised.value) and "8899c9946839" in str(raised.value)
    assert not (tmp_path / policy / "adapter_model.safetensors").exists()
    assert pinned.materialize("runs/sft-audit/model", into=tmp_path, repo=tmp_path) == "runs/sft-audit/model"
