"""Episode → training tensors. Observation tokens are always masked out of the loss.

An episode's sequence is the concatenation of the ids the policy saw and produced, in order:

    prompt_ids | completion_0 | observation_0 | completion_1 | observation_1 | ...

`loss_mask` is 1 exactly on completion ids (what the policy sampled); `old_logprobs` holds the sampler's
log-probs there; `advantages` holds each turn's advantage on that turn's completion ids. Elsewhere all three
are 0. Nothing is re-tokenised.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from main_agent.types import Episode


@dataclass(frozen=True)
class TrainSequence:
    """One episode laid out per token; all four lists have the same length."""

    input_ids: list[int]
    loss_mask: list[int]
    old_logprobs: list[float]
    advantages: list[float]

    def __post_init__(self) -> None:
        n = len(self.input_ids)
        lengths = (len(self.loss_mask), len(self.old_logprobs), len(self.advantages))
        assert lengths == (n, n, n), f"misaligned sequence: ids {n}, mask/logprobs/advantages {lengths}"


def episode_ids(episode: Episode) -> list[int]:
    """The whole token stream of an episode, exactly as the policy saw and produced it."""
    ids = list(episode.prompt_ids)
    for turn in episode.turns:
        ids += turn.completion_ids + turn.observation_ids
    return ids


def to_sequence(episode: Episode, turn_advantages: Sequence[float]) -> TrainSequence:
    """Lay out one episode with one advantage per turn."""
    assert len(turn_advantages) == len(episode.turns), (
        f"{len(turn_advantages)} advantages for {len(episode.turns)} turns"
    )
    n_prompt = len(episode.prompt_ids)
    ids, mask = list(episode.prompt_ids), [0] * n_prompt
    logprobs, advantages = [0.0] * n_prompt, [0.0] * n_prompt
    for turn, advantage in zip(episode.turns, turn_advantages, strict=True):
        n_c, n_o = len(turn.completion_ids), len(turn.observation_ids)
        ids += turn.completion_ids + turn.observation_ids
        mask += [1] * n_c + [0] * n_o
        logprobs += list(turn.completion_logprobs) + [0.0] * n_o
        advantages += [advantage] * n_c + [0.0] * n_o
    return TrainSequence(ids, mask, logprobs, advantages)


@dataclass(frozen=True)
class Batch:
    """Right-padded tensors for one micro-batch: every field is [B, T]."""

    input_ids: object  # torch.LongTensor
    attention_mask: object  # torch.LongTensor
    loss_mask: object  # torch.FloatTensor
    old_logprobs: object  # torch.FloatTensor
    advantages: object  # torch.FloatTensor


def collate(sequences: Sequence[TrainSequence], *, pad_id: int, device: str = "cpu") -> Batch:
    """Right-pad a micro-batch (the loss's `token_logprobs` expects right padding), on the model's `device`."""
    import torch

    width = max(len(s.input_ids) for s in sequences)

    def pad(rows: list[list], value, dtype) -> torch.Tensor:
        return torch.tensor([r + [value] * (width - len(r)) for r in rows], dtype=dtype, device=device)

    return Batch(
        input_ids=pad([s.input_ids for s in sequences], pad_id, torch.long),
        attention_mask=pad([[1] * len(s.input_ids) for s in sequences], 0, torch.long),
        loss_mask=pad([s.loss_mask for s in sequences], 0, torch.float32),
        old_logprobs=pad([s.old_logprobs for s in sequences], 0.0, torch.float32),
        advantages=pad([s.advantages for s in sequences], 0.0, torch.float32),
    )


def micro_batches(sequences: Sequence[TrainSequence], *, max_tokens: int) -> list[list[TrainSequence]]:
    """Sort by length and cut into micro-batches of at most `max_tokens` padded tokens each.

    Sorting keeps sequences of similar length together, so padding (pure waste on CPU) stays small.
    A sequence longer than `max_tokens` gets a micro-batch of its own.
    """
    batches: list[list[TrainSequence]] = []
    current: list[TrainSequence] = []
    for seq in sorted(sequences, key=lambda s: len(s.input_ids)):
        width = len(seq.input_ids)  # sorted ascending: the newest is the widest
        if current and width * (len(current) + 1) > max_tokens:
            batches.append(current)
            current = []
        current.append(seq)
    if current:
        batches.append(current)
    return batches
