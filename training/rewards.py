"""Final and per-turn rewards as plain functions; every component is returned separately so it can be logged.

Final rewards lie in [0, 1]: `exact_match` and `token_f1` (SQuAD-style answer normalisation, conductor/answers.py) for text answers,
`plate_match` for licence plates and `plate_similarity`, its graded form (1 - normalised edit distance). Turn rewards are small shaping terms (a few hundredths per turn) for well-formed
calls, malformed or repeated calls, and newly found evidence, and (off by default) the turn's information gain
(IGPO, computed by the trained model in training/info_gain.py); `turn_reward` reports each part and their total.

Evidence recall (David-GRPO, arXiv 2601.21699): the share of a task's supporting pages that a page_qa call of the
episode read and came back ok (`evidence_recall`, None for a task with no supporting pages: photos, clips), and
`with_evidence`, the convex mix (1 - w) answer + w recall that `TrainConfig.evidence_weight` trains on.

Nothing here catches exceptions: a reward that cannot be computed is a bug, never a silent 0.0.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

# the answer comparisons every task's reward uses, defined once below every package
from conductor.answers import exact_match as exact_match
from conductor.answers import normalize_answer as normalize_answer
from conductor.answers import token_f1 as token_f1
from conductor.plates import normalize_plate as normalize_plate
from main_agent.types import Episode

if TYPE_CHECKING:  # training.tasks imports this module (its families' rewards): a runtime import would cycle
    from training.tasks.task import Task


def plate_match(pred: str, gold: str) -> float:
    """1.0 when the normalised plates are equal; a gold plate that normalises to nothing is a data bug and raises."""
    gold_plate = normalize_plate(gold)
    if not gold_plate:
        raise ValueError(f"gold plate {gold!r} has no letters or digits")
    return float(normalize_plate(pred) == gold_plate)


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance: the fewest single-character insertions, deletions and substitutions from a to b.
    The textbook dynamic programme, one row at a time (O(len(a) x len(b)) time; plates are <= 10 characters)."""
    previous = list(range(len(b) + 1))  # distances from a[:0] to every prefix of b
    for i, ca in enumerate(a, start=1):
        current = [i]
        for j, cb in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def plate_similarity(pred: str, gold: str) -> float:
    """1 - edit_distance / max(length) over the normalised plates: 1.0 exactly when `plate_match` is, partial credit
    for a plate read with a few characters wrong, 0.0 for an empty reading. A gold plate that normalises to
    nothing raises, as in `plate_match`."""
    gold_plate = normalize_plate(gold)
    if not gold_plate:
        raise ValueError(f"gold plate {gold!r} has no letters or digits")
    pred_plate = normalize_plate(pred)
    return 1.0 - edit_distance(pred_plate, gold_plate) / max(len(pred_plate), len(gold_plate))


def _normalise_argument(value: object) -> object:
    """Strip and lowercase strings, recursing into lists and objects; other JSON values pass unchanged."""
    if isinstance(value, str):
        return value.strip().lower()
    if isinstance(value, list | tuple):
        return [_normalise_argument(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _normalise_argument(v) for k, v in value.items()}
    return value


def call_key(name: str, arguments: Mapping[str, object]) -> str:
    """A canonical string for a tool call: compact JSON with sorted keys and stripped, lowercased string values.

    Two calls with the same key ask the same thing (`{"q": " Paris "}` == `{"q": "paris"}`), so it detects
    repeated calls and serves as the anchor for turn-level credit. Non-JSON values raise `TypeError`.
    """
    payload = {"name": name, "arguments": _normalise_argument(arguments)}
    return json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def contains_evidence(observation: str, gold: str) -> bool:
    """Whether the normalised gold answer occurs in the normalised observation as whole tokens.

    Whole tokens so that gold "1" is not found inside "1999". A gold answer that normalises to nothing
    (e.g. "The") is never evidence. Plates are compared with `normalize_answer`, not `normalize_plate`.
    """
    needle = normalize_answer(gold)
    if not needle:
        return False
    return f" {needle} " in f" {normalize_answer(observation)} "


# ---------------------------------------------------------------- evidence: the supporting pages read


def supporting_pages(task: Task) -> list[str]:
    """The file names of the task's supporting pages, hop 1 first: the pages of MuSiQue's decomposed hops in hop
    order, else HotpotQA's supporting titles in the order its supporting facts name them; empty for a task that
    marks none (photos, clips, research_corpus's one unmarked source)."""
    names = [path.rsplit("/", 1)[-1] for path in task.meta.page_paths]
    if task.meta.hops:
        return [names[page] for _, page in task.meta.hops]
    by_title = dict(zip(task.meta.page_titles, names, strict=True))
    return [by_title[title] for title in task.meta.supporting_titles if title in by_title]


def ending_with(urls: Sequence[str], pages: Sequence[str]) -> set[str]:
    """The pages of `pages` (file names) that some URL ends with, as "/<file name>" (so "XAnswer.md" is not
    "Answer.md")."""
    return {page for page in pages if any(url.endswith("/" + page) for url in urls)}


def pages_read(episode: Episode, pages: Sequence[str]) -> set[str]:
    """The pages of `pages` that a page_qa call of the episode opened and came back ok on (a failed read read
    nothing), matched by the URL the tool reports it opened."""
    results = (r for turn in episode.turns for r in turn.results if r.name == "page_qa" and r.ok)
    return ending_with([str((r.payload or {}).get("url", "")) for r in results], pages)


def evidence_recall(task: Task, episode: Episode) -> float | None:
    """The share of the task's supporting pages the episode read (`pages_read`), in [0, 1]; None when the task
    has no supporting page (its family cannot say what evidence is). A page two hops share counts once."""
    support = list(dict.fromkeys(supporting_pages(task)))
    if not support:
        return None
    return len(pages_read(episode, support)) / len(support)


def with_evidence(answer: float, recall: float | None, weight: float) -> float:
    """(1 - weight) answer + weight recall: the final reward with evidence recall mixed in, in [0, 1] as both
    parts are. Weight 0 returns `answer` itself (bit for bit, whatever `recall`); a weight > 0 with no recall
    (a task without supporting pages) is an error, not a silent fall-back to the answer alone."""
    if not 0.0 <= weight <= 1.0:
        raise ValueError(f"evidence weight must be in [0, 1], got {weight}")
    if weight == 0.0:
        return answer
    if recall is None:
        raise ValueError(f"evidence weight {weight} needs a task with supporting pages")
    return (1.0 - weight) * answer + weight * recall


@dataclass(frozen=True)
class TurnRewardWeights:
    """Per-turn shaping weights. Kept to a few hundredths so that over a handful of turns their sum stays well
    below the final reward in [0, 1]: shaping should break ties, never replace answering correctly."""

    valid_call: float = 0.05
    """Paid once per turn that makes at least one well-formed, new call (more calls in a turn earn nothing more,
    so splitting work into parallel calls cannot farm it)."""
    malformed_call: float = -0.05
    """Per call that failed to parse or whose arguments were rejected as invalid."""
    repeated_call: float = -0.05
    """Per call whose `call_key` equals a call made earlier in the same episode."""
    new_evidence: float = 0.1
    """Paid when this turn's observation contains the gold answer and no earlier observation did."""
    recorded_item: float = 0.5
    """Item tasks: paid when an item is first recorded, times its item score, divided by the number of items (a
    whole ledger recorded right earns this much in all). The per-item progress of a long episode, paid at the
    turn that earned it; the final reward pays the whole ledger again at the end."""
    info_gain: float = 0.0
    """Times the turn's information gain (IGPO, training/info_gain.py): how much the turn raised the policy's own
    teacher-forced probability of the gold answer, P(answer | context after the turn's observation) - P(answer |
    context before the turn), each P the per-token geometric mean, so r_t lies in [-1, 1] and the gains of an
    episode telescope. Why: dense, ground-truth-aware credit for a small policy whose groups mostly score alike;
    the gain needs no extra model, only forwards of the trained one (up to T + 1 forwards of an episode of T
    turns past its prompt, no backward). 1.0 is the paper's unscaled form; 0 (the default): off, nothing
    computed, turn rewards bit for bit as without it."""


@dataclass(frozen=True)
class TurnFacts:
    """What happened in one turn. Each call of the turn counts in exactly one of the three call counts."""

    n_valid_calls: int
    """Well-formed calls whose key was not seen before in the episode."""
    n_malformed: int
    """Calls that failed to parse or had invalid arguments."""
    n_repeated: int
    """Well-formed calls whose key was already seen in the episode."""
    new_evidence: bool
    """The observation holds the gold answer for the first time in the episode (see `contains_evidence`)."""
    recorded_score: float = 0.0
    """Item tasks: the summed item scores of the items this turn recorded for the first time, divided by the
    number of items (in [0, 1])."""
    info_gain: float = 0.0
    """The turn's information gain r_t in [-1, 1] (training/info_gain.py); 0 when not computed."""

    def __post_init__(self) -> None:
        counts = (self.n_valid_calls, self.n_malformed, self.n_repeated)
        if min(counts) < 0:
            raise ValueError(f"call counts must be >= 0, got {counts}")


@dataclass(frozen=True)
class TurnRewardParts:
    """The components of one turn's reward, each logged on its own, and their total."""

    valid_call: float
    malformed_call: float
    repeated_call: float
    new_evidence: float
    recorded_item: float = 0.0
    info_gain: float = 0.0

    @property
    def total(self) -> float:
        return (
            self.valid_call
            + self.malformed_call
            + self.repeated_call
            + self.new_evidence
            + self.recorded_item
            + self.info_gain
        )

    def metrics(self, prefix: str = "turn_reward/") -> dict[str, float]:
        """Flat name -> value mapping for the metrics log, the total included."""
        parts = {
            "valid_call": self.valid_call,
            "malformed_call": self.malformed_call,
            "repeated_call": self.repeated_call,
            "new_evidence": self.new_evidence,
            "recorded_item": self.recorded_item,
            "info_gain": self.info_gain,
            "total": self.total,
        }
        return {prefix + name: value for name, value in parts.items()}


def turn_reward(facts: TurnFacts, w: TurnRewardWeights) -> TurnRewardParts:
    """Score one turn: once-per-turn bonus for a valid new call, per-call penalties, bonus for new evidence,
    progress on recorded items, the information gain (its weight 0: exactly 0.0, whatever the fact)."""
    return TurnRewardParts(
        valid_call=w.valid_call if facts.n_valid_calls > 0 else 0.0,
        malformed_call=w.malformed_call * facts.n_malformed,
        repeated_call=w.repeated_call * facts.n_repeated,
        new_evidence=w.new_evidence if facts.new_evidence else 0.0,
        recorded_item=w.recorded_item * facts.recorded_score,
        info_gain=w.info_gain * facts.info_gain if w.info_gain else 0.0,
    )
