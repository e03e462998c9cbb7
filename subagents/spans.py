"""Answer spans of a page: candidates to score, alignment of a free answer, and the quote around a span.

page_qa's grounded modes answer with a span of the page's own text, never with words the model made up:

- `candidates(sentences, question)`: the spans a short answer usually is (names, numbers and dates, short
  phrases near the question's words), for the model to score as the answer ("extract" mode).
- `align(sentences, answer, question)`: the span of the page that best matches a generated answer by token F1
  ("align" mode: generate, then snap to the page).
- `quote_around(span, max_chars)`: the sentence holding the span, cut to a window that keeps the span.

Every `Span` is a substring of its sentence at `sentence[start:end]`, and sentences are substrings of the page,
so an answer built here can always be found on the page word for word. Words are whitespace-separated tokens
with their edge punctuation dropped. Limits: the candidate rules are English-centred heuristics (capitalised
runs, month names), so a lower-case answer longer than `max_phrase_words` far from the question's words is
never a candidate. Imports only conductor/answers.py (SQuAD normalisation and word-overlap F1).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

from conductor.answers import ARTICLES, PUNCTUATION, overlap_f1

_EDGE = "\"'()[]{},.;:!?“”‘’«»*"
_WORD = re.compile(r"\S+")
# SQuAD's marks and the typographic ones pages use; a mark splits words here (a span is cut at word edges)
_PUNCTUATION = PUNCTUATION | frozenset("“”‘’«»–—")
# Words that may join the capitalised words of one name: "University of Copenhagen", "Charles de Gaulle".
_CONNECTORS = frozenset({"of", "for", "the", "de", "del", "der", "da", "di", "du", "von", "van", "la", "le"})
# Words a short answer neither starts nor ends with (SQuAD-style answers are noun phrases, numbers, names).
STOPWORDS = frozenset(
    "a an the and or but of in on at to for from by with as is was are were be been being it its this that these "
    "those he she they his her their them him we you i which who whom whose what when where why how not no than "
    "then also has have had do does did will would can could may might into over under about after before "
    "during since until while there here such so very more most".split()
)
_MONTHS = (
    "January|February|March|April|May|June|July|August|September|October|November|December|"
    "Jan\\.?|Feb\\.?|Mar\\.?|Apr\\.?|Jun\\.?|Jul\\.?|Aug\\.?|Sept?\\.?|Oct\\.?|Nov\\.?|Dec\\.?"
)
_NUMBER_WORDS = (
    "one|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|thirteen|fourteen|fifteen|sixteen|seventeen|"
    "eighteen|nineteen|twenty|thirty|forty|fifty|sixty|seventy|eighty|ninety|hundred|dozen"
)
# Dates ("8 July 1967", "July 8, 1967", "July 1967"), numbers and number words ("nine") with an optional unit
# word ("330 metres").
_NUMERIC = re.compile(
    rf"\b(?:\d{{1,2}}\s+(?:{_MONTHS})(?:\s+\d{{3,4}})?|(?:{_MONTHS})\s+\d{{1,2}},?\s+\d{{3,4}}|(?:{_MONTHS})\s+\d{{4}}"
    rf"|\d[\d,.]*\d(?:s\b)?|\d|(?i:{_NUMBER_WORDS})\b)(?:\s*%|\s+[a-z]+)?"
)
# A word a name goes on after although a full stop follows it: an initial ("James K. Polk"), a dotted
# abbreviation ("U.S. Army") or a title ("St. Louis").
ABBREVIATIONS = r"(?:[A-Z]|(?:[A-Za-z]\.)+[A-Za-z]|Mr|Mrs|Ms|Dr|Prof|St|Jr|Sr|Mt|Ft|vs)"
"""Words a full stop follows without ending a name or a sentence (page_qa's sentence split uses it too)."""
_ABBREVIATION = re.compile(rf"^{ABBREVIATIONS}$")


@dataclass(frozen=True)
class Span:
    """`sentence[start:end]`: a piece of one sentence of the page, as the answer."""

    sentence: str
    start: int
    end: int

    @property
    def text(self) -> str:
        return self.sentence[self.start : self.end]


def normal_words(text: str) -> list[str]:
    """SQuAD-normalised words: lower case, ASCII and typographic punctuation dropped, no articles."""
    clean = "".join(" " if ch in _PUNCTUATION else ch for ch in text.lower())
    return [w for w in clean.split() if w not in ARTICLES]


def words(sentence: str) -> list[tuple[int, int]]:
    """(start, end) of each word of `sentence` without its edge punctuation; punctuation-only tokens dropped."""
    spans = []
    for match in _WORD.finditer(sentence):
        token = match.group()
        left = len(token) - len(token.lstrip(_EDGE))
        right = len(token.rstrip(_EDGE))
        if right > left:
            spans.append((match.start() + left, match.start() + right))
    return spans


def ngrams(sentence: str, max_words: int) -> Iterator[Span]:
    """Every run of 1..`max_words` consecutive words of `sentence`, in sentence order."""
    bounds = words(sentence)
    for i in range(len(bounds)):
        for j in range(i, min(i + max_words, len(bounds))):
            yield Span(sentence, bounds[i][0], bounds[j][1])


def _is_name_word(word: str) -> bool:
    return word[:1].isupper() or word[:1].isdigit()


def names(sentence: str) -> Iterator[Span]:
    """Maximal runs of capitalised words (joined by up to two connectors: "Society for the Exploration"),
    without a leading stopword, never past a comma, bracket or full stop (but an initial's); a run with
    connectors is followed by its part before the first one, and a run after another one and a comma by both
    ("Franconia, New Hampshire")."""
    bounds = words(sentence)
    i, before = 0, None  # `before`: the start and last word of the previous name
    while i < len(bounds):
        if not _is_name_word(sentence[slice(*bounds[i])]):
            i += 1
            continue
        j = i
        while (nxt := _next_name_word(sentence, bounds, j)) is not None:
            j = nxt
        first = i
        while first < j and sentence[slice(*bounds[first])].lower() in STOPWORDS:  # "The", "On" at the start
            first += 1
        yield Span(sentence, bounds[first][0], bounds[j][1])
        inner = [k for k in range(first + 1, j) if sentence[slice(*bounds[k])].lower() in _CONNECTORS]
        if inner:  # "Winnie Kiiza of the Forum for Democratic Change": "Winnie Kiiza" too
            yield Span(sentence, bounds[first][0], bounds[inner[0] - 1][1])
        if before is not None and sentence[bounds[before[1]][1] : bounds[first][0]] == ", ":
            yield Span(sentence, before[0], bounds[j][1])
        before, i = (bounds[first][0], j), j + 1


def name_parts(name: Span) -> Iterator[Span]:
    """The shorter names inside a name, longest first: every run of its words that starts and ends with a
    capitalised word ("Bank of America" in "Charlotte-based Bank of America", "Alachua" in "Alachua County"),
    and the name without a last possessive ("Bob Dylan" of "Bob Dylan's")."""
    if name.text.endswith(("'s", "’s")):
        name = Span(name.sentence, name.start, name.end - 2)
        yield name
    run = [(name.start + a, name.start + b) for a, b in words(name.text)]
    keep = {k for k, b in enumerate(run) if _is_name_word(name.sentence[slice(*b)])}
    for size in range(len(run) - 1, 0, -1):
        for a in range(len(run) - size + 1):
            if a in keep and a + size - 1 in keep:
                yield Span(name.sentence, run[a][0], run[a + size - 1][1])


def _next_name_word(sentence: str, bounds: list[tuple[int, int]], j: int) -> int | None:
    """The index of the capitalised word continuing the name that ends at word `j` (None: the name ends)."""
    for k in range(j + 1, min(j + 4, len(bounds))):
        gap = sentence[bounds[k - 1][1] : bounds[k][0]].strip()
        if gap and not (gap == "." and _ABBREVIATION.match(sentence[slice(*bounds[k - 1])])):
            return None  # punctuation between the words, other than an initial's full stop
        word = sentence[slice(*bounds[k])]
        if _is_name_word(word):
            return k
        if word.lower() not in _CONNECTORS:
            return None
    return None


def numbers(sentence: str) -> Iterator[Span]:
    """Dates, numbers and number words, each with and without the word after it ("330 metres" and "330")."""
    for match in _NUMERIC.finditer(sentence):
        text = match.group()
        if len(text.split()) > 1 and text.split()[-1] in STOPWORDS:  # "1991 and": no unit after the number
            text = text.rsplit(maxsplit=1)[0]
        yield Span(sentence, match.start(), match.start() + len(text))
        first = text.split()[0].rstrip(_EDGE)
        bare = first if text[:1].isdigit() or first.lower() in _NUMBER_WORDS.split("|") else ""
        if bare and bare != text:
            yield Span(sentence, match.start(), match.start() + len(bare))


def _phrase(span: Span) -> bool:
    """A plausible short answer: neither starts nor ends with a stopword, no punctuation between its words."""
    raw = span.text.lower().split()
    inner_punctuation = any(ch in span.text for ch in ",;:()[]")
    return (
        not inner_punctuation
        and raw[0].strip(_EDGE) not in STOPWORDS
        and raw[-1].strip(_EDGE) not in STOPWORDS
    )


@dataclass(frozen=True)
class Candidate:
    """A span to score as the answer: what kind of span it is, and how close its sentence is to the question."""

    span: Span
    kind: Literal["name", "number", "part", "phrase"]
    """"name" (a capitalised run), "number" (and dates), "part" (a shorter name inside a name), "phrase"."""
    rank: int
    """Its sentence's place among the sentences ordered by the words they share with the question (0: most)."""


def candidates(
    sentences: Sequence[str], question: str, *, limit: int, max_phrase_words: int = 3
) -> list[Candidate]:
    """Up to `limit` distinct answer candidates, from the sentences sharing most words with the question first.

    First the names, numbers and dates of every sentence, then the shorter names inside those names, then short
    phrases (1..`max_phrase_words` words, no
    stopword at either end, not all capitalised: a part of a name, "Organisation" of "Rank Organisation", is no
    answer): the phrases of one long sentence would otherwise crowd out the names of the next.
    A span whose words all occur in the question is left out (an answer rarely repeats the question; but a
    name is kept when the question offers a choice, "X or Y?"), and so is one normalising to the same words as
    an earlier candidate.
    """
    asked = set(normal_words(question))
    options = " or " in f" {question.lower()} "
    order = sorted(range(len(sentences)), key=lambda i: -len(asked.intersection(normal_words(sentences[i]))))
    entities = [
        Candidate(span, kind, rank)
        for rank, i in enumerate(order)
        for kind, found in (("name", names(sentences[i])), ("number", numbers(sentences[i])))
        for span in found
    ]
    parts = (
        Candidate(part, "part", c.rank) for c in entities if c.kind == "name" for part in name_parts(c.span)
    )
    phrases = (
        Candidate(span, "phrase", rank)
        for rank, i in enumerate(order)
        for span in ngrams(sentences[i], max_phrase_words)
        if _phrase(span) and not all(_is_name_word(w) for w in span.text.split())
    )
    seen: set[tuple[str, ...]] = set()
    kept: list[Candidate] = []
    for candidate in itertools.chain(entities, parts, phrases):
        if len(kept) >= limit:
            break
        key = tuple(normal_words(candidate.span.text))
        repeats_question = set(key) <= asked | STOPWORDS and not (options and candidate.kind == "name")
        if not key or key in seen or set(key) <= STOPWORDS or repeats_question:
            continue
        seen.add(key)
        kept.append(candidate)
    return kept


# ---------------------------------------------------------------- choosing among scored candidates

_WH = re.compile(r"\b(who|whom|whose|when|where|what|which|how)\b")
_WHEN_WORDS = re.compile(r"\b(year|date|day|month|century|decade|time|era|period|born|inception)\b")
_WHERE_WORDS = re.compile(
    r"\b(city|country|state|county|place|continent|town|region|location|located|capital|province|district)\b"
)
EXPECTED_KIND = {"who": "name", "where": "name", "when": "number", "how many": "number"}
"""The kind of candidate a question type wants (`question_type`); "what" wants any."""


def question_type(question: str) -> str:
    """who / when / where / how many / what, by the question's first wh-word and, after "what" or "which", the
    six words that follow it ("In what year", "What city did", "What is the place of death of X?")."""
    q = question.lower()
    if re.search(r"\bhow (many|much)\b", q):
        return "how many"
    first = _WH.search(q)
    word = first.group(1) if first else ""
    if word in ("who", "whom", "whose", "when", "where"):
        return {"whom": "who", "whose": "who"}.get(word, word)
    asked = " ".join(q[first.end() :].split()[:6]) if first else ""
    if _WHEN_WORDS.search(asked):
        return "when"
    if _WHERE_WORDS.search(asked):
        return "where"
    return "what"


@dataclass(frozen=True)
class Choice:
    """How page_qa's "extract" picks its answer among the scored candidates (`choose`). The defaults are the rule
    chosen for the default reader (conductor/models.py DEFAULT_READER) on bench_reader's tune split
    (benchmarks/studies/reader/rules.py: the grid, the objective, each term's ablation;
    benchmarks/results/reader/rules_qwen/summary.json); RULES holds each built-in reader's own. `Choice(max_candidates=48,
    pmi_weight=0, kind_weight=0, rank_weight=0, length_weight=0)` is the log-prob alone, the rule before."""

    max_candidates: int = 48
    """Candidates scored (plus "not in the page"), in `candidates`' order."""
    pmi_weight: float = 0.0
    """Weight of the prior subtracted from a reply's log-prob (PMI-style: how much the question, not the page or
    the reply's own commonness, makes it likely); 0: no prior is scored (a second forward of the replies)."""
    prior: Literal["page", "none"] = "page"
    """The prior's prompt: the page without the question, or the system prompt alone."""
    kind_weight: float = 1.0
    """Added to a candidate of the kind its question wants (EXPECTED_KIND: a "who" question wants a name)."""
    rank_weight: float = 0.5
    """Taken from a candidate per place of its sentence in the order of closeness to the question."""
    length_weight: float = 0.5
    """Added to a candidate per word: a log-prob favours the shortest reply, an answer is often a longer name."""
    null_margin: float = 1.0
    """The best candidate answers only when it beats "not in the page" by this much (in nats)."""

    def __post_init__(self) -> None:
        if self.max_candidates < 1:
            raise ValueError(f"max_candidates must be at least 1, not {self.max_candidates}")


RULES: dict[str, Choice] = {
    # SmolLM2-135M-Instruct, chosen on tune in float32 (benchmarks/results/reader/rules/summary.json)
    "smollm2-135m-instruct": Choice(
        max_candidates=32,
        pmi_weight=0.25,
        kind_weight=4.0,
        rank_weight=2.0,
        length_weight=0.5,
        null_margin=0.0,
    ),
    # Qwen2.5-Coder-0.5B-Instruct, chosen on tune in bfloat16 (benchmarks/results/reader/rules_qwen/summary.json)
    "qwen2.5-coder-0.5b-instruct": Choice(),
}
"""Each built-in reader's own rule, by its name: `--reader-model NAME` sets it with the model (tool_server/config.py)."""


def choose(
    found: Sequence[Candidate],
    scores: Sequence[float],
    prior: Sequence[float] | None,
    question: str,
    rule: Choice,
) -> int | None:
    """The index of the answer among `found`, or None for "not in the page".

    `scores` and `prior` hold the log-probs of each candidate and, last, of "not in the page" (under the
    question's prompt and the prior's). A reply's value is its score minus `pmi_weight` times its prior; a
    candidate adds `kind_weight` if it is of the kind the question wants and `length_weight` per word, and loses
    `rank_weight` per place of its sentence. The best candidate (the first of equals) answers if it beats "not
    in the page" by `null_margin`."""
    assert len(scores) == len(found) + 1, (len(scores), len(found))
    weights = prior if prior is not None and rule.pmi_weight else [0.0] * len(scores)
    value = [s - rule.pmi_weight * p for s, p in zip(scores, weights, strict=True)]
    wanted = EXPECTED_KIND.get(question_type(question))
    kinds = {wanted, "part"} if wanted == "name" else {wanted}
    bonus = [
        rule.kind_weight * (c.kind in kinds)
        - rule.rank_weight * c.rank
        + rule.length_weight * len(c.span.text.split())
        for c in found
    ]
    if not found:
        return None
    totals = [v + b for v, b in zip(value, bonus, strict=False)]
    best = totals.index(max(totals))
    return best if totals[best] >= value[-1] + rule.null_margin else None


def align(
    sentences: Sequence[str], answer: str, question: str, *, extra_words: int = 2
) -> tuple[Span | None, float]:
    """The span of `sentences` with the highest token F1 against `answer`, and that F1 (None, 0.0 if no overlap).

    F1 is over content words (no stopwords), and the answer's words that also occur in the question are ignored
    when any others remain: a small model often restates the question ("the continent of Don is a region in
    Europe") and the new words are the answer. Spans neither start nor end with a stopword and are up to
    `extra_words` longer than the answer; ties go to the shorter span, then the earlier one.
    """
    asked = set(normal_words(question))
    said = [w for w in normal_words(answer) if w not in STOPWORDS]
    target = [w for w in said if w not in asked] or said
    if not target:
        return None, 0.0
    best: tuple[float, int, Span] | None = None
    for sentence in sentences:
        for span in ngrams(sentence, len(target) + extra_words):
            if not _phrase(span):
                continue
            score = overlap_f1([w for w in normal_words(span.text) if w not in STOPWORDS], target)
            if score > 0 and (best is None or (score, -len(span.text)) > (best[0], best[1])):
                best = (score, -len(span.text), span)
    return (best[2], best[0]) if best else (None, 0.0)


def mentions(sentence: str, question: str) -> bool:
    """`sentence` shares a content word (not a stopword) with `question`."""
    asked = set(normal_words(question)) - STOPWORDS
    return not asked.isdisjoint(normal_words(sentence))


def quote_around(span: Span, max_chars: int) -> str:
    """The span's sentence, or a window of it of at most `max_chars` cut at spaces, holding the span
    (the span alone, cut, if it is longer than `max_chars`)."""
    sentence = span.sentence
    if len(sentence) <= max_chars:
        return sentence
    if span.end - span.start >= max_chars:
        return span.text[:max_chars]
    room = max_chars - (span.end - span.start)
    left = max(0, span.start - room // 2)
    right = min(len(sentence), left + max_chars)
    left = max(0, right - max_chars)
    if left > 0 and (cut := sentence.find(" ", left, span.start)) >= 0:
        left = cut + 1
    if right < len(sentence) and (cut := sentence.rfind(" ", span.end, right)) >= 0:
        right = cut
    return sentence[left:right].strip()
