"""The main policy sampled by a vLLM engine in this process: the trainer's GPU path (also runs on vllm-cpu).

    policy = VLLMPolicy.start(folder, tokenizer, cfg=SamplingConfig(backend="vllm"), max_model_len=4096)
    sample = await policy.sample(prompt_ids, max_new_tokens=256)   # exact ids and log-probs, as TransformersPolicy
    await policy.reload_weights(new_folder)                        # after each optimizer step
    await policy.aclose()

Same contract as `TransformersPolicy`: token-id prompts in; sampled ids and the log-probs of the distribution
actually sampled from out (vLLM's `processed_logprobs`: after temperature, so at temperature 1 they are the
model's log-probs, which the trainer recomputes). vLLM's `AsyncLLM` batches continuously: an episode's turn
joins the running batch as soon as it is submitted and leaves when it ends, so no episode waits for the longest
turn of a micro-batch.

Weight sync goes by folder, as prime-rl does by default: the trainer writes safetensors (`export_weights`), and
the engine's workers load them in place (`reload_policy`, main_agent/vllm_worker.py: vLLM's `reload_weights` plus
a refresh of a tied output layer), then the prefix cache is reset (cached KV blocks were computed by the old
weights). The same worker call reaches a `vllm serve` process through its dev-mode `/collective_rpc` route
(`OpenAIPolicy.reload_weights`), so in-process and served sampling share one mechanism.
On one GPU with a small policy the write and read cost a second or two per step; tensor transfer over NCCL or
CUDA IPC (vLLM's weight-transfer engines) is the upgrade for large models.
"""

from __future__ import annotations

import itertools
import logging
from pathlib import Path
from typing import Literal

from conductor.models import vllm_cpu_cores, vllm_cpu_kv_cache_bytes
from conductor.stopping import started
from main_agent.policy import WORKER_EXTENSION, PolicyError, Sample, SamplingConfig, finish_sample

logger = logging.getLogger(__name__)


class VLLMPolicy:
    """An `AsyncLLM` engine sampling the policy; `reload_weights` swaps in the trainer's latest weights."""

    def __init__(self, engine, tokenizer, *, cfg: SamplingConfig, version: int = 0) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.version = version
        self.eos_token_id = int(tokenizer.eos_token_id)
        self._ids = itertools.count()  # request ids must be unique within the engine

    @classmethod
    def start(
        cls,
        folder: Path,
        tokenizer,
        *,
        cfg: SamplingConfig,
        seed: int = 0,
        max_model_len: int = 4096,
        version: int = 0,
        dtype: Literal["float32", "bfloat16"] = "float32",
        concurrent: int = 8,
        weight_transfer: Literal["nccl", "ipc"] | None = None,
    ) -> VLLMPolicy:
        """Start an engine on the HF checkpoint in `folder` (config, tokenizer and safetensors). `dtype` is the
        trainer's precision: float32 makes the first importance ratio 1 up to kernel rounding; bfloat16 samples
        faster where the hardware has it, for a trainer that computes in bf16 too. `concurrent`: the sequences
        sampled at once, which a CPU engine's KV cache is sized for (`vllm_cpu_kv_cache_bytes`; a GPU's takes
        `gpu_memory_utilization`). `weight_transfer`: the engine also takes weights streamed from a trainer's GPU
        (training/weight_sync.py) besides `reload_weights`."""
        import torch

        try:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as exc:
            raise PolicyError(
                "sampling backend 'vllm' needs the `vllm` extra: pip install 'conductor[vllm]'"
            ) from exc
        on_gpu = torch.cuda.is_available()
        kv_bytes = None
        if not on_gpu:
            kv_bytes = vllm_cpu_kv_cache_bytes(
                folder, max_model_len=max_model_len, sequences=concurrent, dtype=dtype
            )
            vllm_cpu_cores()
        args = AsyncEngineArgs(
            model=str(folder),
            dtype=dtype,
            max_model_len=max_model_len,
            seed=seed,
            logprobs_mode="processed_logprobs",
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            kv_cache_memory_bytes=kv_bytes,
            enforce_eager=not on_gpu,  # CUDA graphs pay off on GPU; on CPU compiling only delays the start
            worker_extension_cls=WORKER_EXTENSION,
            weight_transfer_config=None if weight_transfer is None else {"backend": weight_transfer},
        )
        logger.info(
            "starting a vLLM engine on %s (%s, KV cache %s)", folder, "cuda" if on_gpu else "cpu", kv_bytes
        )
        # held: a SIGTERM inside vLLM's start-up handshake is swallowed and hangs it for 10 minutes. No local
        # of this frame holds the engine (see `started`).
        return cls(
            started(lambda: AsyncLLM.from_engine_args(args), close=lambda e: e.shutdown()),
            tokenizer,
            cfg=cfg,
            version=version,
        )

    async def sample(self, prompt_ids: list[int], *, max_new_tokens: int) -> Sample:
        from vllm import SamplingParams

        params = SamplingParams(
            temperature=self.cfg.temperature,
            top_p=self.cfg.top_p,
            max_tokens=max_new_tokens,
            logprobs=0,  # the sampled token's log-prob only
        )
        final = None
        try:
            request = {"prompt_token_ids": list(prompt_ids)}
            async for output in self.engine.generate(request, params, request_id=f"policy-{next(self._ids)}"):
                final = output  # outputs are cumulative: the last one holds the whole completion
        except Exception as exc:
            if not engine_failure(exc):
                raise  # a bug on our side: surface it instead of filtering the episode away
            raise PolicyError(f"vLLM engine failed: {exc!r}") from exc
        if final is None or not final.outputs:
            raise PolicyError("vLLM engine returned no output")
        return self._to_sample(final.outputs[0])

    def _to_sample(self, out) -> Sample:
        ids = list(out.token_ids)
        logprobs = [float(step[token].logprob) for step, token in zip(out.logprobs or [], ids, strict=False)]
        exact = len(logprobs) == len(ids)
        if not exact:
            logprobs = [0.0] * len(ids)
        finish = "stop" if out.finish_reason == "stop" else "length"
        return finish_sample(ids, logprobs, self.tokenizer, finish, exact=exact)

    async def reload_weights(self, folder: Path) -> None:
        """Load the safetensors in `folder` into the engine in place; call it while no sample is running."""
        try:
            await self.engine.collective_rpc("reload_policy", kwargs={"weights_path": str(folder)})
            await self.engine.reset_prefix_cache()
        except Exception as exc:
            if not engine_failure(exc):
                raise
            raise PolicyError(f"vLLM could not reload weights from {folder}: {exc!r}") from exc

    async def aclose(self) -> None:
        if self.engine is None:  # closed already
            return
        engine, self.engine = self.engine, None
        engine.shutdown()  # the last reference goes with this frame: vLLM's __del__ shuts it down again now,
        # not at interpreter exit, where it fails on modules already torn down ("Exception ignored in ...")


def engine_failure(exc: Exception) -> bool:
    """Whether `exc` is the engine's failure rather than a bug of ours: vLLM's own errors (`VLLMError`: a dead
    engine, a failed or refused generate), or the bare `Exception` carrying a worker's message with which vLLM's
    core client fails a utility call such as `collective_rpc` (vllm/v1/engine/core_client.py)."""
    from vllm.exceptions import VLLMError

    return isinstance(exc, VLLMError) or type(exc) is Exception
