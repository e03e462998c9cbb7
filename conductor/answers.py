"""Comparing a short answer with another: SQuAD v1.1's normalisation, exact match and token F1.

One definition for everyone who compares answers: the rewards (training/rewards.py), the reader's span
alignment (subagents/spans.py) and the benchmarks. `overlap_f1` is the F1 of two word lists however they were
normalised; `token_f1` and `exact_match` normalise answers the SQuAD way first (lower case, ASCII punctuation
deleted, the articles a/an/the dropped, whitespace collapsed), so that figures compare with published ones.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence

ARTICLES = frozenset({"a", "an", "the"})
PUNCTUATION = frozenset(string.punctuation)
_ARTICLE_WORDS = re.compile(r"\b(a|an|the)\b")


def normalize_answer(s: str) -> str:
    """Lowercase, drop ASCII punctuation and the articles a/an/the, collapse whitespace (the SQuAD v1.1 rule)."""
    no_punct = "".join(ch for ch in s.lower() if ch not in PUNCTUATION)
    return " ".join(_ARTICLE_WORDS.sub(" ", no_punct).split())


def overlap_f1(pred: Sequence[str], gold: Sequence[str]) -> float:
    """F1 of the words two lists share, counted with multiplicity (0.0 when they share none or one is empty)."""
    same = sum((Counter(pred) & Counter(gold)).values())
    if not same:
        return 0.0
    precision, recall = same / len(pred), same / len(gold)
    return 2 * precision * recall / (precision + recall)


def exact_match(pred: str, gold: str) -> float:
    """1.0 when the normalised prediction equals the normalised gold answer, else 0.0."""
    return float(normalize_answer(pred) == normalize_answer(gold))


def token_f1(pred: str, gold: str) -> float:
    """SQuAD token F1 between normalised answers; when either side is empty, 1.0 only if both are."""
    pred_words, gold_words = normalize_answer(pred).split(), normalize_answer(gold).split()
    if not pred_words or not gold_words:
        return float(pred_words == gold_words)
    return overlap_f1(pred_words, gold_words)
