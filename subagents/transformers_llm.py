"""The sub-agents' in-process transformers backend (`backend = "transformers"`, the default): see llm.py."""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass
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

# Rows of the output head's logits normalised at once when scoring: 64 x a 152k-token vocabulary in float32 is
# ~39 MB, and a larger block is no faster (the logsumexp is memory-bound).
NORMALISER_ROWS = 64


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
        self.multimodal = False
        self.scores = True  # `score`: page_qa's "extract" ranks page spans by it
        self.device = models.default_device()
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        dtype = models.torch_dtype(cfg.dtype, self.device, getattr(config, "dtype", None))
        self.model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype)
        # In the result cache's keys: the same model in bfloat16 answers differently from float32.
        self.model_id = f"transformers:{cfg.model}" + ("" if dtype == torch.float32 else f":{str(dtype)[6:]}")
        self.model.to(self.device).eval()  # type: ignore[arg-type]  # transformers mistypes the wrapped `to`
        self.context = config.max_position_embeddings
        eos = self.model.generation_config.eos_token_id
        eos_list = eos if isinstance(eos, list) else [eos]
        self.eos_ids = frozenset(e for e in [*eos_list, self.tokenizer.eos_token_id] if e is not None)
        pad = self.tokenizer.pad_token_id
        self.pad_id: int = pad if pad is not None else min(self.eos_ids)
        self.max_batch = batch_for(self.device, cfg.max_batch)
        self.batcher = MicroBatcher(self.generate_batch, max_batch=self.max_batch, wait_ms=cfg.batch_wait_ms)
        logger.info(
            "loaded %s from %s on %s in %s (micro-batch %d)",
            cfg.model,
            path,
            self.device,
            dtype,
            self.max_batch,
        )

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

    async def score(self, prompts: list[list[Message]], replies: list[str]) -> list[list[float]]:
        """Log-probability of each reply as the model's whole answer (its tokens, then EOS) to each of `prompts`.

        The prompts' shared first tokens (page_qa's question and prior prompts share the page) go through the
        model once; then every prompt's own tokens and every reply under it, packed into one row over that
        cache (outside the micro-batcher: a scoring call is already one batch).
        """
        rendered = [self.render(messages) for messages in prompts]
        eos = self.tokenizer.eos_token_id
        assert eos is not None, "scoring needs the tokenizer's end-of-turn token"
        ids = [self.tokenizer.encode(r, add_special_tokens=False) + [eos] for r in replies]
        longest = max(map(len, rendered), default=0)
        if longest + max(map(len, ids), default=0) > self.context:
            raise context_error(longest, max_new_tokens=max(map(len, ids)), context=self.context)
        if not ids or not rendered:
            return [[] for _ in rendered]
        return await asyncio.to_thread(self.score_batch, rendered, ids)

    def score_batch(self, prompts: list[list[int]], replies: list[list[int]]) -> list[list[float]]:
        """Blocking: summed log-probs of each (non-empty) reply after each prompt, [prompt][reply].

        The prompts' shared prefix fills a KV cache once. After it, one packed row holds each prompt's own tokens
        followed by every reply under it, each token at the position it would have alone, under a mask that lets
        a prompt's tokens see the prefix and their own earlier tokens, and a reply's see the prefix, its prompt
        and its own earlier tokens: the same sums as one prompt and one reply a row (to ~1e-4 nats in float32),
        without padding, a copy of the cache a row, or the shared page twice. Only the rows that predict a
        reply's token go through the output head (`logits_to_keep`): a reply's last token (EOS) predicts
        nothing scored, and a prompt's tokens but its last predict nothing at all.
        """
        import torch
        from transformers.cache_utils import DynamicCache

        from conductor.models import past_key_values_accepted

        shared = shared_prefix(prompts)
        row = packed_row(prompts, replies, shared)
        dtype = next(self.model.parameters()).dtype
        with torch.inference_mode(), past_key_values_accepted():
            cache = DynamicCache(config=self.model.config)
            if shared:
                self.model(
                    input_ids=torch.tensor([prompts[0][:shared]], device=self.device),
                    past_key_values=cache,
                    use_cache=True,
                    logits_to_keep=1,
                )
            logits = self.model(
                input_ids=row.tokens[None].to(self.device),
                position_ids=row.positions[None].to(self.device),
                past_key_values=cache,
                attention_mask=row.mask(shared, dtype).to(self.device),
                logits_to_keep=row.kept.to(self.device),
            ).logits[0]  # [K, vocab]
            # Each row's normaliser in float32, a few rows at a time: [K, vocab] in float32 whole is ~600 MB for
            # the ~1,000 rows of 96 candidates under three prompts, and the peak stays in the process's heap.
            norm = torch.cat(
                [torch.logsumexp(rows.float(), -1) for rows in logits.split(NORMALISER_ROWS)]
            )  # [K]
            token_logp = (logits[row.source, row.target].float() - norm[row.source]).cpu()  # [N]
            totals = torch.zeros(len(prompts) * len(replies)).index_add(0, row.owner, token_logp)
        return totals.view(len(prompts), len(replies)).tolist()

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    async def aclose(self) -> None:
        await self.batcher.aclose()


def shared_prefix(prompts: list[list[int]]) -> int:
    """How many first tokens every prompt shares, leaving each prompt at least its last token of its own (whose
    logits predict every reply's first token under it)."""
    first, limit = prompts[0], min(map(len, prompts)) - 1
    return next((i for i in range(limit) if any(p[i] != first[i] for p in prompts[1:])), limit)


@dataclass(frozen=True)
class PackedRow:
    """Every prompt's own tokens after their shared prefix, each followed by every reply, as one row
    (`TransformersLLM.score_batch`); T tokens in the row, K of them read through the output head, N scored."""

    tokens: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]: where each token would sit alone after its prompt
    segment: torch.Tensor  # [T]: which prompt's own tokens, or which reply, it belongs to
    context: torch.Tensor  # [T]: for a reply's token the segment of its prompt's tokens; -1 for a prompt's
    kept: torch.Tensor  # [K]: places whose logits are read
    source: torch.Tensor  # [N]: for each scored token, the row of `kept` that predicts it
    target: torch.Tensor  # [N]: the token scored
    owner: torch.Tensor  # [N]: prompt x len(replies) + reply

    def mask(self, prefix: int, dtype: torch.dtype) -> torch.Tensor:
        """The additive attention mask [1, 1, T, prefix + T]: every token sees the shared prefix and its own
        segment's earlier tokens; a reply's tokens also see all of their prompt's own tokens."""
        import torch

        place = torch.arange(len(self.tokens))
        own = (self.segment[:, None] == self.segment[None, :]) & (place[None, :] <= place[:, None])
        seen = own | (self.context[:, None] == self.segment[None, :])  # [T, T]
        seen = torch.cat([torch.ones(len(place), prefix, dtype=torch.bool), seen], 1)
        return torch.zeros(seen.shape, dtype=dtype).masked_fill(~seen, torch.finfo(dtype).min)[None, None]


def packed_row(prompts: list[list[int]], replies: list[list[int]], shared: int) -> PackedRow:
    """The packed row of `prompts` after their first `shared` tokens, each prompt's tokens then every reply."""
    import torch

    cols: dict[str, list[int]] = {k: [] for k in ("tokens", "positions", "segment", "context")}
    kept: dict[int, int] = {}  # place -> its row among the kept, in the order first read
    scored: dict[str, list[int]] = {"source": [], "target": [], "owner": []}

    def put(tokens: list[int], start: int, segment: int, context: int) -> int:
        for j, token in enumerate(tokens):
            for key, value in zip(cols, (token, start + j, segment, context), strict=True):
                cols[key].append(value)
        return len(cols["tokens"]) - 1  # the place of its last token

    def score(place: int, target: int, owner: int) -> None:
        row = kept.setdefault(place, len(kept))
        for key, value in zip(scored, (row, target, owner), strict=True):
            scored[key].append(value)

    segments = itertools.count()
    for k, prompt in enumerate(prompts):
        own = next(segments)
        last = put(prompt[shared:], shared, own, -1)
        for r, reply in enumerate(replies):
            place = put(reply, len(prompt), next(segments), own) - len(reply) + 1
            for j, token in enumerate(
                reply
            ):  # token j predicted at its reply's token j - 1, the first at `last`
                score(last if j == 0 else place + j - 1, token, k * len(replies) + r)
    tensors = {key: torch.tensor(values) for key, values in (cols | scored).items()}
    return PackedRow(kept=torch.tensor(list(kept)), **tensors)
