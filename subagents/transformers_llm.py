"""The sub-agents' in-process transformers backend (`backend = "transformers"`, the default): see llm.py."""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import TYPE_CHECKING

from conductor.batching import GenerationError
from subagents.llm import (
    BackendConfig,
    BackendError,
    Generation,
    Message,
    batch_for,
    chat_dicts,
    context_error,
    cut_at_eos,
    text_only_error,
)

if TYPE_CHECKING:
    import torch

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
        self.scores = True  # `score`: page_qa's "extract" ranks page spans by it
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
        self.max_batch = batch_for(self.device, cfg.max_batch)
        self.batcher = MicroBatcher(self.generate_batch, max_batch=self.max_batch, wait_ms=cfg.batch_wait_ms)
        logger.info("loaded %s from %s on %s (micro-batch %d)", cfg.model, path, self.device, self.max_batch)

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

    async def score(self, messages: list[Message], replies: list[str]) -> list[float]:
        """Log-probability of each reply as the model's whole answer to `messages` (its tokens, then EOS).

        One forward of the prompt, then one forward of every reply packed into one row over its KV cache
        (outside the micro-batcher: a scoring call is already one batch).
        """
        prompt = self.render(messages)
        eos = self.tokenizer.eos_token_id
        assert eos is not None, "scoring needs the tokenizer's end-of-turn token"
        ids = [self.tokenizer.encode(r, add_special_tokens=False) + [eos] for r in replies]
        if len(prompt) + max(map(len, ids), default=0) > self.context:
            raise context_error(len(prompt), max_new_tokens=max(map(len, ids)), context=self.context)
        return await asyncio.to_thread(self.score_batch, prompt, ids) if ids else []

    def score_batch(self, prompt: list[int], replies: list[list[int]]) -> list[float]:
        """Blocking: summed log-probs of each (non-empty) reply after `prompt`.

        The replies are packed one after another into one row after the prompt's cache, each at the positions
        it would have alone, under a mask that lets a reply's tokens see the prompt and its own earlier tokens
        only: the same sums as a batch of one row a reply (equal to ~1e-4 nats), without the batch's padding to
        the longest reply or a copy of the prompt's cache a row (3.4x faster for 97 replies after a 261-token
        prompt on one core: 8.6 s against 29.4 s).
        """
        import torch
        from transformers.cache_utils import DynamicCache

        from conductor.models import past_key_values_accepted

        flat = torch.tensor([t for r in replies for t in r])  # [T]
        owner = torch.repeat_interleave(torch.arange(len(replies)), torch.tensor([len(r) for r in replies]))
        starts = torch.tensor([0, *itertools.accumulate(len(r) for r in replies)][:-1])  # [R]
        offset = torch.arange(len(flat)) - starts[owner]  # each token's place within its reply, [T]
        with torch.inference_mode(), past_key_values_accepted():
            cache = DynamicCache(config=self.model.config)
            # Only the last position's logits: the whole prompt's would be P x vocab (for Gemma 3's 262k-token
            # vocabulary, ~70 GFLOP and ~400 MB for a 400-token prompt), and only the next token is read.
            out = self.model(
                input_ids=torch.tensor([prompt], device=self.device),
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )  # logits [1, 1, vocab]
            first = torch.log_softmax(
                out.logits[0, -1].float(), -1
            ).cpu()  # [vocab]: each reply's first token
            logits = (
                self.model(
                    input_ids=flat[None].to(self.device),
                    position_ids=(len(prompt) + offset)[None].to(self.device),
                    past_key_values=cache,
                    attention_mask=packed_mask(owner, len(prompt)).to(self.device),
                )
                .logits[0]
                .float()
            )  # [T, vocab]
            # Token t of a reply is predicted at its reply's token t - 1; a reply's first token by `first`.
            later = offset[1:] > 0  # [T - 1]: positions whose next token is the same reply's
            scored = logits[:-1][later].cpu()  # [N, vocab]
            logp = scored.gather(1, flat[1:][later, None])[:, 0] - torch.logsumexp(scored, -1)  # [N]
            totals = first[flat[starts]].index_add(0, owner[1:][later], logp)  # [R]
        return totals.tolist()

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    async def aclose(self) -> None:
        await self.batcher.aclose()


def packed_mask(owner: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """The additive attention mask [1, 1, T, P + T] of replies packed after a P-token prompt: token i sees the
    prompt and the tokens j <= i of its own reply (`owner[i]`, [T]), nothing of the other replies."""
    import torch

    place = torch.arange(len(owner))
    own = (owner[:, None] == owner[None, :]) & (place[None, :] <= place[:, None])  # [T, T]
    seen = torch.cat([torch.ones(len(owner), prompt_len, dtype=torch.bool), own], 1)  # [T, P + T]
    return torch.zeros(seen.shape).masked_fill(~seen, torch.finfo(torch.float32).min)[None, None]
