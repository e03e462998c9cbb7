"""Joining or starting a Ray cluster (conductor/cluster.py): a local cluster starts whatever TMPDIR is."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from conductor.cluster import AF_UNIX_PATH_MAX, RAY_SOCKET_TAIL, RayConfig, cluster, ray_temp_dir


def test_a_short_temp_dir_is_ray_s_own_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray's default stands while its socket paths fit; RAY_TMPDIR comes before TMPDIR, as in Ray."""
    monkeypatch.setenv("TMPDIR", "/tmp/x")
    monkeypatch.delenv("RAY_TMPDIR", raising=False)
    assert ray_temp_dir() is None
    monkeypatch.setenv("RAY_TMPDIR", "/" + "r" * (AF_UNIX_PATH_MAX - len(RAY_SOCKET_TAIL)))
    assert ray_temp_dir() is not None


def test_a_long_temp_dir_is_replaced_by_a_short_one(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A TMPDIR that would put Ray's sockets past the AF_UNIX limit gives /tmp/ray-UID, and the log says why."""
    monkeypatch.delenv("RAY_TMPDIR", raising=False)
    monkeypatch.setenv("TMPDIR", "/" + "t" * 60)
    with caplog.at_level("INFO", logger="conductor.cluster"):
        short = ray_temp_dir()
    assert short == f"/tmp/ray-{os.getuid()}"
    assert len((short + RAY_SOCKET_TAIL).encode()) <= AF_UNIX_PATH_MAX
    assert "too long for Ray's socket paths" in caplog.text


@pytest.mark.slow
def test_a_local_cluster_starts_under_a_long_tmpdir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """With TMPDIR 100 bytes long Ray alone fails to start (its socket path passes 107 bytes); `cluster`
    starts it under the short temp dir."""
    pytest.importorskip("ray", reason="Ray is the optional extra `distributed`")
    long = tmp_path / ("d" * max(1, 100 - len(str(tmp_path)) - 1))
    long.mkdir()
    monkeypatch.setenv("TMPDIR", str(long))
    monkeypatch.delenv("RAY_TMPDIR", raising=False)
    with cluster(RayConfig()) as joined:
        assert joined.local and joined.cpus >= 1


@pytest.mark.slow
def test_a_local_cluster_starts_whatever_ray_address_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """`address = "local"` starts a cluster of its own even where RAY_ADDRESS names another one (here one that
    is not there): Ray alone would try to join it."""
    pytest.importorskip("ray", reason="Ray is the optional extra `distributed`")
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    with cluster(RayConfig()) as joined:
        assert joined.local and joined.cpus >= 1
