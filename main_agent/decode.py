"""Fixed-shape decoding for the in-process policy: a preallocated KV cache and a hand-written decode loop.

`static_decode(model, prompts, max_new, ...)` samples a batch as `model.generate` does (the same left padding,
positions, shared prefix, temperature and top-p warpers, the same random draws in the same order), but every
step has the same shapes: the keys and values of `prompt + max_new` positions are allocated once (transformers'
`StaticCache`, written in place instead of concatenated a step at a time) and the attention mask is built once.
On a CPU that alone samples 1.08-1.12x generate's tokens/s (no cache copied each step; the rest of a step is
the weights' matrix products, which no loop changes), so `[sampling] decoder = "auto"` picks it there; fixed
shapes are also what a compiled step or a CUDA graph needs (`compile_step`: no gain on a CPU, unmeasured on a
GPU). benchmarks/perf/decode.py measures, docs/training.md has the table.

Log-probs are log-softmax(logits / temperature) of the sampled token, from the very logits it was drawn from;
greedy decoding (temperature 0) takes the argmax of the raw logits, as generate does. Tests:
tests/test_decode.py. Limit: the cache is allocated for the whole limit up front (the 135M policy: 46 KB a
token, 0.2 GB for 8 rows of 400 + 128), where generate grows to that only when some row runs to the limit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from conductor.batching import left_pad
from conductor.models import past_key_values_accepted

if TYPE_CHECKING:
    import torch

# A compiled step is compiled once per shape (rows x cache length) and torch gives up compiling a function after
# 8 shapes (torch._dynamo.config.recompile_limit): cache lengths rounded up to this are shared by batches whose
# prompts differ by up to this many tokens, for a few masked columns more per step.
COMPILED_BUCKET = 256

Step = Callable[..., "torch.Tensor"]
"""One decode step: (ids [B, 1], position ids [B, 1]) -> next-token logits [B, V]."""


def static_decode(
    model,
    prompts: list[list[int]],
    max_new: int,
    *,
    temperature: float,
    top_p: float,
    eos_token_id: int,
    shared: int = 0,
    compile_step: bool = False,
) -> list[tuple[list[int], list[float]]]:
    """Each prompt's `max_new` new ids (EOS repeated after the row's first) and their log-probs. The first
    `shared` ids, the same in every prompt, run once for one row and are copied to all. `compile_step`: the
    decode step through torch.compile (the first batch of a shape compiles it, COMPILED_BUCKET)."""
    import torch

    rows = len(prompts)
    rests, rest_mask = left_pad([p[shared:] for p in prompts], pad_id=eos_token_id)
    width = shared + rests.shape[1]  # P: prompt columns; the cache holds P + max_new, or its bucket
    length = -(-(width + max_new) // COMPILED_BUCKET) * COMPILED_BUCKET if compile_step else width + max_new
    device = model.device
    mask = torch.ones(rows, length, dtype=torch.long, device=device)  # [B, L]: 0 = left padding
    mask[:, shared:width] = rest_mask
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, L], as generate counts them
    cache = _static_cache(model, prompts[0][:shared], rows=rows, length=length)
    with past_key_values_accepted():
        out = model(
            input_ids=rests.to(device),
            attention_mask=mask,
            position_ids=positions[:, shared:width],
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
    step = _step(model, cache, mask)
    if compile_step:  # on a GPU through CUDA graphs: a small model's step is mostly kernel launches there
        step = torch.compile(step, dynamic=False, mode="reduce-overhead" if device.type == "cuda" else None)
    choose = _chooser(temperature, top_p)
    new_positions = positions[:, width : width + max_new]  # [B, N]
    ids, logprobs = _loop(step, out.logits[:, -1], new_positions, choose, temperature, eos_token_id)
    return [(ids[i].tolist(), logprobs[i].tolist()) for i in range(rows)]


def _loop(step: Step, logits, positions, choose, temperature: float, eos: int):
    """The decode loop: choose, record, stop when every row has written EOS, else step. [B, N] ids, log-probs."""
    import torch

    rows, max_new = positions.shape
    ids = torch.full((rows, max_new), eos, dtype=torch.long, device=logits.device)
    logprobs = torch.zeros(rows, max_new, dtype=torch.float32, device=logits.device)
    live = torch.ones(rows, dtype=torch.bool, device=logits.device)
    for t in range(max_new):
        logits = logits.float()
        chosen = torch.where(live, choose(logits), eos)  # a finished row writes EOS, as generate pads it
        ids[:, t] = chosen
        scaled = torch.log_softmax(logits / max(temperature, 1e-5), dim=-1)  # as TransformersPolicy reports
        logprobs[:, t] = scaled.gather(-1, chosen[:, None]).squeeze(1)
        live &= chosen != eos
        if t + 1 == max_new or not bool(live.any()):
            break
        logits = step(chosen[:, None], positions[:, t : t + 1])
    return ids, logprobs


def _step(model, cache, mask) -> Step:
    """The decode step over the preallocated cache; the mask covers every column, so its shape never changes
    (columns not yet written are hidden by causality)."""

    def step(ids, positions):
        with past_key_values_accepted():
            out = model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
            )
        return out.logits[:, -1]

    return step


def _static_cache(model, prefix: list[int], *, rows: int, length: int):
    """A StaticCache of `rows` x `length` positions holding `prefix`'s keys and values in every row (computed
    once, for one row)."""
    import torch
    from transformers.cache_utils import DynamicCache, StaticCache

    cache = StaticCache(config=model.config, max_cache_len=length)
    if not prefix:
        return cache
    once = DynamicCache(config=model.config)
    with past_key_values_accepted():
        model(input_ids=torch.tensor([prefix], device=model.device), past_key_values=once, use_cache=True)
    where = {"cache_position": torch.arange(len(prefix), device=model.device)}  # transformers < 5.24 reads it
    for index, layer in enumerate(once.layers):
        keys, values = (x.expand(rows, -1, -1, -1) for x in (layer.keys, layer.values))  # [B, H, S, D]
        cache.update(keys, values, index, where)
    return cache


def _chooser(temperature: float, top_p: float) -> Callable:
    """Logits [B, V] -> chosen ids [B]: argmax at temperature 0, else generate's own warpers and one
    multinomial draw (the same random numbers generate takes)."""
    import torch
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

    if temperature <= 0:
        return lambda logits: logits.argmax(-1)
    warpers = [TemperatureLogitsWarper(temperature)] + ([TopPLogitsWarper(top_p)] if top_p < 1 else [])

    def choose(logits):
        for warp in warpers:
            logits = warp(None, logits)
        return torch.multinomial(torch.softmax(logits, dim=-1), num_samples=1).squeeze(1)

    return choose
