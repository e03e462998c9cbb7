"""Atomic checkpoints and exact resume on a tiny random Llama: round trip, crash at every phase, damage, pruning."""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from training.checkpoint import (
    CheckpointError,
    TrainState,
    check_resume_compatible,
    find_latest,
    load_checkpoint,
    save_checkpoint,
    saved_config,
    validate_checkpoint,
)

REPO = Path(__file__).resolve().parent.parent
PHASES = ("weights", "optimizer", "rng", "state", "manifest", "rename", "latest")
CONFIG = json.dumps({"model": {"name": "tiny"}, "rl": {"lr": 0.01}})


def tiny_model(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(cfg)


def trainer(seed: int):
    model = tiny_model(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    return model, optimizer, scheduler


def train_step(model, optimizer, scheduler) -> None:
    """One update on a batch drawn from the torch RNG (so resumed RNG state shows in the weights)."""
    ids = torch.randint(0, 64, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    optimizer.zero_grad()


def save(run_dir: Path, step: int, parts, *, keep_last: int = 3, before_phase=None) -> Path:
    model, optimizer, scheduler = parts
    state = TrainState(step=step, policy_version=step, epoch=1, position=5 + step, seed=7, episodes=4 * step)
    return save_checkpoint(
        run_dir,
        step,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        state=state,
        config_json=CONFIG,
        keep_last=keep_last,
        before_phase=before_phase,
    )


class SimulatedCrash(Exception):
    pass


def crash_at(target: str):
    def hook(phase: str) -> None:
        if phase == target:
            raise SimulatedCrash(phase)

    return hook


def test_save_then_load_resumes_exactly(tmp_path: Path) -> None:
    """Weights, optimizer, scheduler, every RNG and the TrainState come back, so the next update is bit-identical."""
    original = trainer(seed=0)
    train_step(*original)
    path = save(tmp_path, 1, original)
    expected_draws = (torch.rand(3), random.random(), np.random.rand())
    train_step(*original)  # the uninterrupted run's next update (draws its batch after the three above)

    resumed = trainer(seed=1)
    random.seed(123), np.random.seed(123), torch.manual_seed(123)
    state = load_checkpoint(path, model=resumed[0], optimizer=resumed[1], scheduler=resumed[2])
    assert torch.equal(torch.rand(3), expected_draws[0])
    assert (random.random(), np.random.rand()) == expected_draws[1:]
    assert state == TrainState(1, 1, 1, 6, 7, 4, 0, 0.0, hashlib.sha256(CONFIG.encode()).hexdigest())
    assert resumed[0].lm_head.weight is resumed[0].model.embed_tokens.weight  # still tied after loading
    assert resumed[2].last_epoch == 1
    train_step(*resumed)
    for (name, a), b in zip(original[0].state_dict().items(), resumed[0].state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_optimizer_state_is_restored(tmp_path: Path) -> None:
    """AdamW's moments and step counts equal the saved ones after loading into a fresh optimizer."""
    original = trainer(seed=0)
    train_step(*original)
    path = save(tmp_path, 1, original)
    resumed = trainer(seed=0)
    load_checkpoint(path, model=resumed[0], optimizer=resumed[1], scheduler=resumed[2])
    saved, loaded = original[1].state_dict()["state"], resumed[1].state_dict()["state"]
    assert saved.keys() == loaded.keys() and saved
    for key in saved:
        for field in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(saved[key][field], loaded[key][field]), (key, field)


@pytest.mark.parametrize("phase", PHASES)
def test_crash_in_any_phase_keeps_previous_checkpoint(tmp_path: Path, phase: str) -> None:
    """A save that dies in any phase leaves `find_latest` on the previous complete checkpoint; the next save works
    and clears the debris."""
    parts = trainer(seed=0)
    first = save(tmp_path, 1, parts)
    with pytest.raises(SimulatedCrash):
        save(tmp_path, 2, parts, before_phase=crash_at(phase))
    assert find_latest(tmp_path) == first
    assert (tmp_path / "latest").read_text().strip() == "step_1"
    for folder in tmp_path.glob("step_*"):  # no crash leaves an incomplete folder under a final name
        if folder.suffix != ".tmp":
            validate_checkpoint(folder)
    second = save(tmp_path, 2, parts)
    assert find_latest(tmp_path) == second
    assert not list(tmp_path.glob("*.tmp"))


def test_truncated_or_corrupted_file_is_detected(tmp_path: Path) -> None:
    """A truncated weights file fails validation naming the file, and find_latest falls back to the older one."""
    parts = trainer(seed=0)
    first = save(tmp_path, 1, parts)
    second = save(tmp_path, 2, parts)
    weights = second / "model" / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model/model.safetensors"):
        validate_checkpoint(second)
    assert find_latest(tmp_path) == first
    weights.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # same size, one bit flipped
    with pytest.raises(CheckpointError, match="sha256"):
        validate_checkpoint(second)


def test_missing_manifest_is_skipped_and_refused(tmp_path: Path) -> None:
    """A checkpoint without its manifest is incomplete: find_latest skips it and loading refuses it clearly."""
    parts = trainer(seed=0)
    first = save(tmp_path, 1, parts)
    second = save(tmp_path, 2, parts)
    (second / "MANIFEST.json").unlink()
    assert find_latest(tmp_path) == first
    with pytest.raises(CheckpointError, match="incomplete"):
        load_checkpoint(second, model=parts[0], optimizer=parts[1], scheduler=parts[2])


def test_keep_last_prunes_old_checkpoints_and_debris(tmp_path: Path) -> None:
    """Only the newest keep_last checkpoints survive; stale .tmp folders from old crashes are removed."""
    parts = trainer(seed=0)
    (tmp_path / "step_0.tmp").mkdir()
    for step in range(1, 5):
        save(tmp_path, step, parts, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_3", "step_4"]
    assert (tmp_path / "latest").read_text().strip() == "step_4"


def test_empty_or_missing_run_dir_has_no_checkpoint(tmp_path: Path) -> None:
    """Nothing saved yet (or no folder at all) means a fresh start, not an error."""
    assert find_latest(tmp_path) is None
    assert find_latest(tmp_path / "absent") is None


def test_config_change_refused_unless_forced(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A changed key is named in the error; unchanged keys are not; force turns the refusal into a warning."""
    path = save(tmp_path, 1, trainer(seed=0))
    saved = saved_config(path)
    new = {"model": {"name": "other"}, "rl": {"lr": 0.01}}
    keys = ("model.name", "rl.lr", "rl.gamma")
    with pytest.raises(CheckpointError, match="model.name: 'tiny' -> 'other'") as info:
        check_resume_compatible(saved, new, force=False, keys=keys)
    assert "rl.lr" not in str(info.value) and "rl.gamma" not in str(info.value)
    check_resume_compatible(saved, new, force=True, keys=keys)
    assert "model.name" in caplog.text
    with pytest.raises(CheckpointError, match=r"rl.gamma: <absent> -> 0.9"):
        check_resume_compatible(saved, {**saved, "rl": {"lr": 0.01, "gamma": 0.9}}, force=False, keys=keys)
    check_resume_compatible(saved, json.loads(CONFIG), force=False, keys=keys)


def test_peft_adapter_round_trip(tmp_path: Path) -> None:
    """A LoRA model saves only its adapter and loads it back into a fresh LoRA model over the same base."""
    from peft import LoraConfig, get_peft_model

    def lora(seed: int):
        model = get_peft_model(tiny_model(0), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
        torch.manual_seed(seed)
        return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2), None

    original = lora(0)
    train_step(*original)
    path = save(tmp_path, 1, original)
    assert (path / "model" / "adapter_model.safetensors").is_file()
    resumed = lora(1)
    load_checkpoint(path, model=resumed[0], optimizer=resumed[1], scheduler=None)
    for (name, a), b in zip(original[0].state_dict().items(), resumed[0].state_dict().values(), strict=True):
        assert torch.equal(a, b), name


CHILD = """
import sys
from pathlib import Path
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from training.checkpoint import TrainState, save_checkpoint

cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=64, tie_word_embeddings=True)
model = LlamaForCausalLM(cfg)
optimizer = torch.optim.AdamW(model.parameters())
for step in range(1, 1000):
    def announce(phase, step=step):
        print(step, phase, flush=True)
    save_checkpoint(Path(sys.argv[1]), step, model=model, optimizer=optimizer, scheduler=None,
                    state=TrainState(step=step), config_json="{}", keep_last=2, before_phase=announce)
"""


@pytest.mark.slow
def test_sigkill_during_save_leaves_a_complete_checkpoint(tmp_path: Path) -> None:
    """A real process killed with SIGKILL as it starts step 2's manifest (every other file written, nothing
    cleaned up) leaves `find_latest` a checkpoint that validates and loads."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    argv = [sys.executable, "-c", CHILD, str(tmp_path)]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env) as child:
        assert child.stdout is not None
        for line in child.stdout:
            if line.split() == ["2", "manifest"]:
                child.send_signal(signal.SIGKILL)
                break
        assert child.wait(timeout=60) == -signal.SIGKILL
    latest = find_latest(tmp_path)
    assert latest is not None and latest.name in ("step_1", "step_2")
    validate_checkpoint(latest)
    model = tiny_model(0)
    state = load_checkpoint(
        latest, model=model, optimizer=torch.optim.AdamW(model.parameters()), scheduler=None
    )
    assert state.step == int(latest.name.removeprefix("step_"))


def test_checkpoint_model_folder_loads_on_its_own(tmp_path: Path) -> None:
    """With the tokenizer saved beside the weights, `step_N/model` is a complete policy for eval and ask."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    from main_agent.transformers_policy import load_model

    words = Tokenizer(WordLevel({"<unk>": 0, "plate": 1}, unk_token="<unk>"))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>")
    model, optimizer, scheduler = trainer(seed=0)
    state = TrainState(step=1, policy_version=1, epoch=0, position=0, seed=0, episodes=0)
    path = save_checkpoint(
        tmp_path,
        1,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        state=state,
        config_json=CONFIG,
        keep_last=1,
        tokenizer=tokenizer,
    )
    validate_checkpoint(path)
    loaded, loaded_tokenizer = load_model(path / "model")
    assert loaded_tokenizer("plate")["input_ids"] == [1]
    assert torch.equal(loaded.model.embed_tokens.weight, model.model.embed_tokens.weight)
