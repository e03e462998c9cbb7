"""Episode → training tensors. Observation tokens are always masked out of the loss.

An episode's sequence is the concatenation of the ids the policy saw and produced, in order:

    prompt_ids | completion_0 | observation_0 | completion_1 | observation_1 | ...

`loss_mask` is 1 exactly on completion ids (what the policy sampled), except a turn marked untrained (a
demonstration's deliberate mistake, `Turn.trained`: the context its recovery needs, never a target);
`old_logprobs` holds the sampler's log-probs there; `advantages` holds each turn's advantage on that turn's
completion ids. Elsewhere all three are 0. Nothing is re-tokenised. A folded episode (main_agent.types) gives
one such sequence per segment, each starting with its own prompt; its turns keep their own advantages, so the
segments share the episode's credit. An expert's episode mixed into a group (training/expert_mix.py) is laid out
the same way and marked `off_policy`: no sampler drew it, so its `old_logprobs` are stand-ins the loss replaces.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from main_agent.types import Episode, Turn


@dataclass(frozen=True)
class TrainSequence:
    """One episode laid out per token; all four lists have the same length."""

    input_ids: list[int]
    loss_mask: list[int]
    old_logprobs: list[float]
    advantages: list[float]
    off_policy: bool = False
    """No sampler of the policy drew these ids (an expert's episode, training/expert_mix.py): `old_logprobs` are
    stand-ins, and the loss takes the trained policy's own log-probs, detached, as old (ratio 1,
    training/update.py)."""

    def __post_init__(self) -> None:
        n = len(self.input_ids)
        lengths = (len(self.loss_mask), len(self.old_logprobs), len(self.advantages))
        assert lengths == (n, n, n), f"misaligned sequence: ids {n}, mask/logprobs/advantages {lengths}"


def segment_ids(episode: Episode) -> list[list[int]]:
    """Each segment's token stream, exactly as the policy saw and produced it (one list when never folded)."""
    return [_stream(prompt, turns) for prompt, turns in episode.segments]


def _stream(prompt: Sequence[int], turns: Sequence[Turn]) -> list[int]:
    ids = list(prompt)
    for turn in turns:
        ids += turn.completion_ids + turn.observation_ids
    return ids


def to_sequences(episode: Episode, turn_advantages: Sequence[float]) -> list[TrainSequence]:
    """Lay out one episode with one advantage per turn: one sequence per segment, in order."""
    assert len(turn_advantages) == len(episode.turns), (
        f"{len(turn_advantages)} advantages for {len(episode.turns)} turns"
    )
    sequences, start = [], 0
    for prompt, turns in episode.segments:
        sequences.append(_lay_out(prompt, turns, turn_advantages[start : start + len(turns)]))
        start += len(turns)
    return sequences


def _lay_out(prompt: Sequence[int], turns: Sequence[Turn], turn_advantages: Sequence[float]) -> TrainSequence:
    ids, mask = list(prompt), [0] * len(prompt)
    logprobs, advantages = [0.0] * len(prompt), [0.0] * len(prompt)
    for turn, advantage in zip(turns, turn_advantages, strict=True):
        n_c, n_o = len(turn.completion_ids), len(turn.observation_ids)
        ids += turn.completion_ids + turn.observation_ids
        mask += [int(turn.trained)] * n_c + [0] * n_o
        logprobs += list(turn.completion_logprobs) + [0.0] * n_o
        advantages += [advantage] * n_c + [0.0] * n_o
    return TrainSequence(ids, mask, logprobs, advantages)


@dataclass(frozen=True)
class Batch:
    """One micro-batch: the prefix its sequences share ([P] ids, P may be 0) and each sequence's rest after it,
    right-padded to [B, T]. Position j of every [B, T] field is the j-th token after the prefix; the prefix holds
    no trained token (`shared_prefix_length`), so the loss reads the rest alone."""

    prefix_ids: object  # torch.LongTensor [P]
    input_ids: object  # torch.LongTensor [B, T]
    attention_mask: object  # torch.LongTensor [B, T]
    loss_mask: object  # torch.FloatTensor [B, T]
    old_logprobs: object  # torch.FloatTensor [B, T]
    advantages: object  # torch.FloatTensor [B, T]
    off_policy: object = None  # torch.BoolTensor [B]: rows whose old log-probs are stand-ins (None: none are)


def shared_prefix_length(sequences: Sequence[TrainSequence]) -> int:
    """How many leading ids every sequence shares, stopping before the first trained id of any of them and
    leaving each at least one id: the part a micro-batch can run once for all its sequences."""
    first = min(min((i for i, m in enumerate(s.loss_mask) if m), default=len(s.input_ids)) for s in sequences)
    return common_prefix([s.input_ids for s in sequences], limit=first)


def common_prefix(rows: Sequence[Sequence[int]], *, limit: int) -> int:
    """How many leading ids every row shares, at most `limit`, leaving each row at least one id of its own."""
    limit = min(limit, *(len(row) - 1 for row in rows))
    n = 0
    while n < limit and all(row[n] == rows[0][n] for row in rows):
        n += 1
    return n


def collate(
    sequences: Sequence[TrainSequence], *, pad_id: int, device: str = "cpu", share_prefix: bool = False
) -> Batch:
    """Right-pad a micro-batch (the loss's log-probs expect right padding) on the model's `device`; with
    `share_prefix` the ids all sequences share (`shared_prefix_length`) become the batch's prefix."""
    import torch

    n = shared_prefix_length(sequences) if share_prefix else 0
    width = max(len(s.input_ids) for s in sequences) - n

    def pad(rows: list[list], value, dtype) -> torch.Tensor:
        rows = [r[n:] for r in rows]
        return torch.tensor([r + [value] * (width - len(r)) for r in rows], dtype=dtype, device=device)

    return Batch(
        prefix_ids=torch.tensor(sequences[0].input_ids[:n], dtype=torch.long, device=device),
        input_ids=pad([s.input_ids for s in sequences], pad_id, torch.long),
        attention_mask=pad([[1] * len(s.input_ids) for s in sequences], 0, torch.long),
        loss_mask=pad([s.loss_mask for s in sequences], 0, torch.float32),
        old_logprobs=pad([s.old_logprobs for s in sequences], 0.0, torch.float32),
        advantages=pad([s.advantages for s in sequences], 0.0, torch.float32),
        off_policy=torch.tensor([s.off_policy for s in sequences], dtype=torch.bool, device=device),
    )


def micro_batches(
    sequences: Sequence[TrainSequence], *, max_tokens: int, share_prefix: bool = False
) -> list[list[TrainSequence]]:
    """Cut the sequences into micro-batches of at most `max_tokens` computed tokens each.

    Without sharing, sequences are sorted by length (padding, pure waste on CPU, stays small) and a micro-batch
    costs B x its longest sequence. With `share_prefix` they are sorted by their untrained leading ids, then
    length, so the episodes of one task (one prompt) sit together, and a micro-batch costs its shared prefix once
    plus B x its longest rest (for ids sorted this way the prefix all share is the one the first and the last
    share). A sequence over `max_tokens` gets a micro-batch of its own.
    """
    if share_prefix:
        ordered = sorted(sequences, key=lambda s: (_untrained_head(s), len(s.input_ids)))
    else:
        ordered = sorted(sequences, key=lambda s: len(s.input_ids))
    batches: list[list[TrainSequence]] = []
    current: list[TrainSequence] = []
    for seq in ordered:
        if current and _cost([*current, seq], share_prefix) > max_tokens:
            batches.append(current)
            current = []
        current.append(seq)
    if current:
        batches.append(current)
    return batches


def _untrained_head(seq: TrainSequence) -> tuple[int, ...]:
    first = next((i for i, m in enumerate(seq.loss_mask) if m), len(seq.input_ids))
    return tuple(seq.input_ids[:first])


def _cost(chunk: Sequence[TrainSequence], share_prefix: bool) -> int:
    """Tokens a micro-batch computes: B x the longest, less (B - 1) x the shared prefix when it is shared."""
    longest = max(len(s.input_ids) for s in chunk)
    if not share_prefix:
        return longest * len(chunk)
    shared = shared_prefix_length([chunk[0], chunk[-1]])
    return shared + len(chunk) * (longest - shared)
