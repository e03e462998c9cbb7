"""The sub-agents' in-process transformers backend (`backend = "transformers"`, the default): see llm.py."""

from __future__ import annotations

import logging

from conductor.batching import GenerationError
from subagents.llm import (
    BackendConfig,
    BackendError,
    Generation,
    Message,
    chat_dicts,
    context_error,
    cut_at_eos,
    text_only_error,
)

logger = logging.getLogger(__name__)


class TransformersLLM:
    """An HF causal LM in this process; concurrent `generate` calls are micro-batched (see batching.py).

    Prompts are rendered with the tokenizer's chat template and left-padded into one greedy `generate`
    call; `generate` derives position ids from the attention mask, so a padded row decodes like the
    unpadded prompt. Tested equal for SmolLM2 on CPU; batched matmuls round differently, so a near-tie
    argmax could in principle flip one token between a batched and an unbatched run.
    `completion_tokens` counts generated tokens up to and including EOS.
    """

    def __init__(self, cfg: BackendConfig) -> None:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        from conductor import models
        from conductor.batching import MicroBatcher

        if cfg.multimodal:
            raise BackendError("the transformers backend is text-only; use openai or vllm", retryable=False)
        path = models.resolve_model(cfg.model)
        torch.manual_seed(cfg.seed)
        self.model_id = f"transformers:{cfg.model}"
        self.multimodal = False
        self.device = models.default_device()
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
        self.model.to(self.device).eval()  # type: ignore[arg-type]  # transformers mistypes the wrapped `to`
        self.context = AutoConfig.from_pretrained(path, local_files_only=True).max_position_embeddings
        eos = self.model.generation_config.eos_token_id
        eos_list = eos if isinstance(eos, list) else [eos]
        self.eos_ids = frozenset(e for e in [*eos_list, self.tokenizer.eos_token_id] if e is not None)
        pad = self.tokenizer.pad_token_id
        self.pad_id: int = pad if pad is not None else min(self.eos_ids)
        self.batcher = MicroBatcher(self.generate_batch, max_batch=cfg.max_batch, wait_ms=cfg.batch_wait_ms)
        logger.info("loaded %s from %s on %s", cfg.model, path, self.device)

    @property
    def queue_depth(self) -> int:
        """Requests waiting for a batch, for /metrics."""
        return self.batcher.queue_depth

    def render(self, messages: list[Message]) -> list[int]:
        """Prompt token ids: the chat template with the assistant turn opened."""
        ids = self.tokenizer.apply_chat_template(
            chat_dicts(messages), add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return list(ids)

    async def generate(self, messages: list[Message], *, max_new_tokens: int) -> Generation:
        if any(m.images for m in messages):
            raise text_only_error(self.model_id)
        prompt = self.render(messages)
        if len(prompt) > self.context - max_new_tokens:  # checked here so it never reaches a batch
            raise context_error(len(prompt), max_new_tokens=max_new_tokens, context=self.context)
        try:
            ids = (await self.batcher.submit(prompt, max_new_tokens))[:max_new_tokens]
        except GenerationError as exc:
            raise BackendError(str(exc), retryable=exc.retryable) from exc
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        assert isinstance(text, str), f"decode of one sequence returned {type(text)}"
        return Generation(text=text.strip(), prompt_tokens=len(prompt), completion_tokens=len(ids))

    def generate_batch(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Blocking: left-pad `prompts` into one greedy generate; each row's new ids cut after EOS."""
        import torch
        from transformers import GenerationConfig

        from conductor.batching import left_pad

        input_ids, attention_mask = left_pad(prompts, pad_id=self.pad_id)  # [batch, width]
        width = input_ids.shape[1]
        # An explicit config: the checkpoint's own generation_config may ask for sampling.
        config = GenerationConfig(
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=self.pad_id,
            eos_token_id=sorted(self.eos_ids),
        )
        with torch.inference_mode():  # thread-local, so entered here in the worker thread
            out = self.model.generate(
                input_ids=input_ids.to(self.device),
                attention_mask=attention_mask.to(self.device),
                generation_config=config,
            )  # [batch, width + generated]
        return [cut_at_eos(row, self.eos_ids) for row in out[:, width:].tolist()]

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    async def aclose(self) -> None:
        await self.batcher.aclose()
