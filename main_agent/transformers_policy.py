"""The trainable in-process policy (`[sampling] backend = "transformers"`) and the loading of its weights.

`load_model(path)` reads a dense checkpoint or a LoRA adapter (optionally adding fresh adapters to train), and
`merged_checkpoint(path)` writes an adapter merged into its base for samplers that read dense weights only;
`TransformersPolicy` samples it, micro-batching concurrent episodes' turns into one decode (`generate`, or
main_agent/decode.py's loop on a CPU).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from conductor.batching import GenerationError, MicroBatcher, left_pad
from conductor.models import (
    ModelNotFound,
    conductor_home,
    default_device,
    is_prepared,
    past_key_values_accepted,
    resolve_model,
)
from main_agent.decode import static_decode
from main_agent.policy import PolicyError, Sample, SamplingConfig
from main_agent.tokens import common_prefix

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def load_model(path: Path, *, lora_rank: int = 0, device: str = "auto"):
    """The trainable weights in `path` and their tokenizer: a dense checkpoint, or a LoRA adapter on top of the
    base model its adapter_config names; with `lora_rank` > 0 a dense model gets fresh adapters (alpha = 2 x
    rank on q, k, v, o). Float32, on `device` ("auto": cuda when a GPU is visible, else cpu)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = adapter_base(path)
    model = AutoModelForCausalLM.from_pretrained(base or path, local_files_only=True, dtype="float32")
    if base is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, path, is_trainable=True, local_files_only=True)
    elif lora_rank:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, target_modules=list(LORA_TARGETS))
        model = get_peft_model(model, lora)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir(path), local_files_only=True)
    return model.to(default_device() if device == "auto" else device), tokenizer


def merged_checkpoint(path: Path) -> Path:
    """A dense checkpoint of the LoRA adapter in `path`, its adapters merged into its base, for a sampler that
    reads only dense weights (a vLLM engine). Written once under $CONDUCTOR_HOME/merged/<digest of the adapter's
    files and its base's path> (~540 MB float32, a few seconds on a CPU) and reused; written to a temporary
    folder and renamed (`save_dense`), so a run cut short leaves no half checkpoint."""
    digest = hashlib.sha256(str(adapter_base(path)).encode())
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        digest.update((path / name).read_bytes())
    target = conductor_home() / "merged" / digest.hexdigest()[:16]
    if is_prepared(target):
        return target
    model, tokenizer = load_model(path, device="cpu")
    return save_dense(model.merge_and_unload(), tokenizer, target)


def save_dense(model, tokenizer, folder: Path) -> Path:
    """Write a dense `model` (and `tokenizer`, when given) as an HF checkpoint in `folder`, replacing what was
    there: written to `folder`.tmp and renamed, so a reader never sees half a checkpoint."""
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder


def tokenizer_dir(path: Path) -> Path:
    """Where the tokenizer of the checkpoint in `path` is: its own, else (an adapter without one) its base's."""
    if (path / "tokenizer_config.json").is_file():
        return path
    return adapter_base(path) or path


def adapter_base(path: Path) -> Path | None:
    """The base checkpoint of the LoRA adapter in `path` (None for a dense checkpoint). The adapter names it by
    path, or by built-in name (a shipped adapter: conductor/policies/), resolved here; an adapter without its
    own tokenizer uses the base's."""
    config = path / "adapter_config.json"
    if not config.is_file():
        return None
    base = json.loads(config.read_text(encoding="utf-8")).get("base_model_name_or_path")
    if not base:
        raise ModelNotFound(f"{path}: adapter_config.json names no base model")
    return resolve_model(str(base))


# Prompts sharing fewer leading ids than this are sampled without a shared prefix: the extra one-row forward
# would cost about what it saves.
MIN_SHARED_PREFIX = 32


STATIC_TESTED = (5, 24)
"""The oldest transformers the static loop's cache calls were tested on (tests/test_decode.py ran on 5.25; the
vLLM environment pins an older one): "auto" keeps `generate` below it."""


def _transformers_version() -> tuple[int, int]:
    import transformers

    major, minor = transformers.__version__.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


class TransformersPolicy:
    """The trainable in-process policy. `model` is a plain HF causal LM (optionally a peft model); `max_batch`
    concurrent samples share one decode (bounded by memory, the KV cache, on CPU).

    The decode is `[sampling] decoder`'s; "auto" (the default) picks by the model's device: on a CPU the
    fixed-shape loop of main_agent/decode.py, which sampled 1.08x generate's tokens/s at 4 rows x 96 tokens and
    1.12x at 8 x 128 on the policy's prompts with the same tokens and log-probs (benchmarks/perf/decode.py, one
    CPU thread: no concatenation of the cache each step); on a GPU `generate`, the path before it, until the
    same benchmark says otherwise there, and `generate` too under a transformers older than the loop was tested
    on (STATIC_TESTED). A decoder named in the settings always wins."""

    def __init__(
        self,
        model,
        tokenizer,
        *,
        cfg: SamplingConfig = SamplingConfig(),
        max_batch: int = 16,
        version: int = 0,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.version = version
        self.eos_token_id = int(tokenizer.eos_token_id)
        self._batcher = MicroBatcher(self._sample_batch, max_batch=max_batch, wait_ms=cfg.batch_wait_ms)

    async def sample(self, prompt_ids: list[int], *, max_new_tokens: int) -> Sample:
        """Raises PolicyError when generation fails (as the vLLM samplers do): the episode is infra-failed."""
        try:
            ids, logprobs = await self._batcher.submit(list(prompt_ids), max_new_tokens)
        except GenerationError as exc:
            raise PolicyError(f"in-process policy generation failed: {exc}") from exc
        return self._cut(ids, logprobs, max_new_tokens)

    async def aclose(self) -> None:
        await self._batcher.aclose()

    def _sample_batch(self, prompts: list[list[int]], max_new: int) -> list[tuple[list[int], list[float]]]:
        """One padded decode of several episodes' prompts (runs in a worker thread): ids and log-probs.

        The ids all prompts share (a group's prompt, at least the system prompt) run once: their keys and values
        are computed for one row and repeated for all, and the rows' rests are left-padded after them (positions
        come from the attention mask, so padding in the middle moves nothing). Greedy decoding gives the same
        tokens as without sharing (tests/test_policy.py). `[sampling] decoder` picks the loop: `generate` or
        main_agent/decode.py's fixed-shape one (the same tokens and log-probs, tests/test_decode.py).
        """
        import torch

        shared = common_prefix(prompts, limit=len(prompts[0])) if len(prompts) > 1 else 0
        shared = shared if shared >= MIN_SHARED_PREFIX else 0
        was_training = self.model.training
        self.model.eval()
        with torch.inference_mode():
            if self.decoder == "generate":
                out = self._generate(prompts, max_new, shared=shared)
            else:
                out = static_decode(
                    self.model,
                    prompts,
                    max_new,
                    temperature=self.cfg.temperature,
                    top_p=self.cfg.top_p,
                    eos_token_id=self.eos_token_id,
                    shared=shared,
                    compile_step=self.decoder == "compiled",
                )
        self.model.train(was_training)
        return out

    @property
    def decoder(self) -> str:
        """The decoder this policy runs: the setting's, or for "auto" the one that won on the model's device."""
        if self.cfg.decoder != "auto":
            return self.cfg.decoder
        import torch

        on_cpu = torch.device(self.model.device).type == "cpu"
        return "static" if on_cpu and _transformers_version() >= STATIC_TESTED else "generate"

    def _generate(
        self, prompts: list[list[int]], max_new: int, *, shared: int
    ) -> list[tuple[list[int], list[float]]]:
        """`model.generate` over the shared prefix's cache (a DynamicCache, grown a step at a time)."""
        import torch

        rests, attention = left_pad([p[shared:] for p in prompts], pad_id=self.eos_token_id)
        head = torch.tensor([prompts[0][:shared]] * len(prompts), dtype=torch.long)
        input_ids = torch.cat([head, rests], dim=1).to(self.model.device)
        attention = torch.cat([torch.ones_like(head), attention], dim=1).to(self.model.device)
        with past_key_values_accepted():
            cache = self._prefix_cache(head[:1], rows=len(prompts)) if shared else None
            out = self.model.generate(
                input_ids=input_ids,
                attention_mask=attention,
                past_key_values=cache,
                generation_config=self.generation_config(max_new),
            )
        return generated(out, prompt_width=input_ids.shape[1], temperature=self.cfg.temperature)

    def _prefix_cache(self, prefix, *, rows: int):
        """The keys and values of `prefix` ([1, P] ids), computed once and repeated for `rows` rows."""
        from transformers.cache_utils import DynamicCache

        cache = DynamicCache(config=self.model.config)
        self.model(input_ids=prefix.to(self.model.device), past_key_values=cache, use_cache=True)
        cache.batch_repeat_interleave(rows)
        return cache

    def generation_config(self, max_new: int):
        """Explicit settings: the checkpoint's own generation_config may ask for other sampling."""
        from transformers import GenerationConfig

        common = dict(
            max_new_tokens=max_new,
            pad_token_id=self.eos_token_id,
            eos_token_id=self.eos_token_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
        if self.cfg.temperature <= 0:  # greedy (ask, eval)
            return GenerationConfig(do_sample=False, **common)
        return GenerationConfig(
            do_sample=True, temperature=self.cfg.temperature, top_p=self.cfg.top_p, top_k=0, **common
        )

    def _cut(self, ids: list[int], logprobs: list[float], limit: int) -> Sample:
        """Keep tokens up to and including the first EOS, at most `limit` of them."""
        end = ids.index(self.eos_token_id) + 1 if self.eos_token_id in ids else len(ids)
        end = min(end, limit)
        ids, logprobs = ids[:end], logprobs[:end]
        finish = "stop" if ids and ids[-1] == self.eos_token_id else "length"
        return Sample(ids, logprobs, self.tokenizer.decode(ids, skip_special_tokens=True), finish)


def generated(out, *, prompt_width: int, temperature: float) -> list[tuple[list[int], list[float]]]:
    """Each row's new ids and their log-probs at `temperature` from generate's output (`output_logits`)."""
    import torch

    # out.sequences: [B, P + N]; out.logits: N tensors of [B, V] (raw, before temperature)
    new = out.sequences[:, prompt_width:]
    logits = torch.stack(out.logits, dim=1).float() / max(temperature, 1e-5)  # [B, N, V]
    logp = torch.log_softmax(logits, dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)  # [B, N]
    return [(new[i].tolist(), logp[i].tolist()) for i in range(new.shape[0])]
