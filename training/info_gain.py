"""Information-gain turn rewards (IGPO, Wang et al., ICLR 2026, arXiv 2510.14967): how much a turn raised the
policy's own confidence in the gold answer.

For an episode with turns t = 0 .. T-1 and the gold answer a = (a_1 .. a_L), the ids of `<answer>{reference}
</answer>` as the policy would write them (`tasks.answer_text`, the one text this module tokenises), teacher-forced
after a context c:

    P(c)  = exp( (1/L) sum_j log pi(a_j | c, a_<j) )      the per-token geometric mean probability (IGPO's form)
    r_t   = P(c_{t+1}) - P(c_t)                           IGPO's information gain of turn t, in [-1, 1]

where c_t is the context turn t was sampled from (its segment's prompt and the turns before it there, ending with
the assistant header) and c_{t+1} the context after turn t's observation (the next turn's context). The gains
telescope: sum_t r_t = P(c_T) - P(c_0). IGPO pays the gain on every turn but the answer's, which earns the
outcome reward instead; here a turn with no context after it (the answering turn, whose observation is empty,
or a turn after which the episode folded and stopped) gets 0. pi is the trained model at the sampler's
temperature, as the loss reads it (training/loss.py), run without gradients.

Every context is exactly the ids the policy saw (`main_agent.tokens.segment_ids`'s prefixes): nothing of the
episode is re-tokenised. `TurnRewardWeights.info_gain` scales r_t into the turn reward (training/rewards.py).

Cost: one row per turn boundary (T + 1 per episode, the answer appended), run in micro-batches of
`micro_batch_tokens` whose shared prompt runs once (`share_prefix`, training/loss.py `batch_logprobs`), without a
backward and with the output head only on answer positions. Rows hold each boundary's whole context and are
padded to a micro-batch's longest, so an episode of T turns costs up to ~ prompt + (T + 1) x (its turns' tokens +
L) tokens: about T + 1 forwards of the episode past its prompt, against the update's forward and backward (~3
forwards) of it; for the 2-4 turns of a multihop episode, one to two times the update's compute.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from main_agent.tokens import TrainSequence, collate, micro_batches
from main_agent.types import Episode
from training.config import TrainConfig, device_sizes
from training.loss import batch_logprobs
from training.tasks import Task
from training.tasks.task import answer_text


def gold_ids(tokenizer, reference: str) -> list[int]:
    """The ids of the gold answer as the policy writes it, `<answer>{reference}</answer>` (no end-of-turn id)."""
    ids = list(tokenizer.encode(answer_text(reference), add_special_tokens=False))
    assert ids, f"gold answer {reference!r} has no tokens"
    return ids


def boundary_contexts(episode: Episode) -> list[list[int] | None]:
    """The T + 1 contexts around an episode's T turns: [t] is the ids turn t was sampled from (t < T), [T] the
    ids after the last turn's observation, None when it has none (it answered, or the episode folded there).

    Each is a prefix of its segment's stream (`main_agent.tokens.segment_ids`); a turn that opens a segment was
    sampled from that segment's prompt, which is also the context after the turn before it."""
    contexts: list[list[int] | None] = []
    for prompt, turns in episode.segments:
        ids = list(prompt)
        for turn in turns:
            contexts.append(list(ids))
            ids += turn.completion_ids + turn.observation_ids
    last = episode.turns[-1] if episode.turns else None
    contexts.append(list(ids) if last is not None and last.observation_ids else None)
    return contexts if episode.turns else []


def gains(probs: Sequence[float | None]) -> list[float]:
    """r_t = P(c_{t+1}) - P(c_t) from the T + 1 boundary probabilities; 0 where c_{t+1} is None (only the last
    may be)."""
    before = [p for p in probs[:-1] if p is not None]
    assert len(before) == len(probs) - 1, f"only the context after the last turn may be missing: {probs}"
    return [0.0 if after is None else after - b for b, after in zip(before, probs[1:], strict=True)]


def answer_probs(
    model: nn.Module, rows: Sequence[tuple[list[int], list[int]]], cfg: TrainConfig
) -> list[float]:
    """P(answer | context) for each (context ids, answer ids) row: exp of the mean teacher-forced log-prob of the
    answer's ids, in micro-batches of `cfg.micro_batch_tokens`, the shared prompt run once with `cfg.share_prefix`,
    at the sampler's temperature, under bf16 autocast when `cfg.precision` is bf16. No gradients."""
    if not rows:
        return []
    sequences = [_row(context, answer) for context, answer in rows]
    index = {id(s): i for i, s in enumerate(sequences)}
    device = str(next(model.parameters()).device)
    tokens = cfg.micro_batch_tokens or device_sizes(device).micro_batch_tokens
    probs = [math.nan] * len(sequences)
    was_training = model.training
    model.eval()
    try:
        for chunk in micro_batches(sequences, max_tokens=tokens, share_prefix=cfg.share_prefix):
            for seq, p in zip(chunk, _chunk_probs(model, chunk, cfg, device), strict=True):
                probs[index[id(seq)]] = p
    finally:
        model.train(was_training)
    return probs


def _row(context: list[int], answer: list[int]) -> TrainSequence:
    """A row of the scorer: the context untrained, the answer's ids the only masked-in ones."""
    n, m = len(context), len(answer)
    assert n > 0, "a context has at least the prompt"
    return TrainSequence(context + answer, [0] * n + [1] * m, [0.0] * (n + m), [0.0] * (n + m))


def _chunk_probs(model: nn.Module, chunk: list[TrainSequence], cfg: TrainConfig, device: str) -> list[float]:
    batch = collate(chunk, pad_id=0, device=device, share_prefix=cfg.share_prefix)
    with (
        torch.inference_mode(),
        torch.autocast(device.split(":")[0], dtype=torch.bfloat16, enabled=cfg.precision == "bf16"),
    ):
        logp = batch_logprobs(model, batch, temperature=cfg.sampling.temperature)  # [B, T] after the prefix
    mask = torch.as_tensor(batch.loss_mask)  # [B, T]: 1 on the answer's ids
    mean = (logp * mask).sum(dim=1) / mask.sum(dim=1)  # [B]
    return torch.exp(mean).tolist()


def information_gains(
    model: nn.Module, tokenizer, episodes: Sequence[Episode], references: Sequence[str], cfg: TrainConfig
) -> list[list[float]]:
    """r_t of every turn of every episode (`references[i]`: episode i's gold answer), all boundaries of all
    episodes scored together (a group's episodes share their prompt). An infra-failed episode gets 0 per turn."""
    contexts = [boundary_contexts(e) if e.stop_reason != "infra_failed" else [] for e in episodes]
    answers = [gold_ids(tokenizer, ref) for ref in references]
    rows = [(c, a) for cs, a in zip(contexts, answers, strict=True) for c in cs if c is not None]
    scored = iter(answer_probs(model, rows, cfg))
    out = []
    for episode, cs in zip(episodes, contexts, strict=True):
        probs = [next(scored) if c is not None else None for c in cs]
        out.append(gains(probs) if cs else [0.0] * len(episode.turns))
    return out


def group_gains(
    model: nn.Module, tokenizer, groups: Sequence[list[Episode]], tasks: Sequence[Task], cfg: TrainConfig
) -> list[list[list[float]]]:
    """`information_gains` of a step's groups, per group, per episode, per turn; each episode's gold answer is its
    task's reference (`tasks` holds every task of the groups)."""
    reference = {t.task_id: t.reference for t in tasks}
    episodes = [e for g in groups for e in g]
    flat = iter(information_gains(model, tokenizer, episodes, [reference[e.task_id] for e in episodes], cfg))
    return [[next(flat) for _ in g] for g in groups]
