"""spans: the answer candidates page_qa scores, the alignment of a free answer, and the quote around a span.

Pure functions on text: no model, no network.
"""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from subagents import spans

JOURNAL = (
    "The Journal of Psychotherapy Integration is a peer-reviewed academic journal published by the American "
    "Psychological Association on behalf of the Society for the Exploration of Psychotherapy Integration."
)
DATES = "Vivien Leigh (5 November 1913 - 8 July 1967) was an actress, and she was 53 years old in 1967."


def texts(found: list[spans.Span] | list[spans.Candidate]) -> list[str]:
    return [x.span.text if isinstance(x, spans.Candidate) else x.text for x in found]


def test_names_join_connectors_and_stop_at_punctuation() -> None:
    """A capitalised run takes "of"/"for the" inside it (and offers its part before them too), drops a leading
    stopword, goes on past an initial's full stop, never runs past "and", a comma or a bracket, and is joined
    to the name before it across a comma ("Franconia, New Hampshire")."""
    assert texts(list(spans.names(JOURNAL))) == [
        "Journal of Psychotherapy Integration",
        "Journal",
        "American Psychological Association",
        "Society for the Exploration of Psychotherapy Integration",
        "Society",
    ]
    assert texts(list(spans.names("On Monday Paris, France (Europe) and Asia met."))) == [
        "Monday Paris",
        "France",
        "Monday Paris, France",
        "Europe",
        "Asia",
    ]
    assert texts(list(spans.names("We met James K. Polk of the U.S. Army in Franconia, New Hampshire."))) == [
        "We",
        "James K. Polk of the U.S. Army",
        "James K. Polk",
        "Franconia",
        "New Hampshire",
        "Franconia, New Hampshire",
    ]


def test_name_parts_are_the_shorter_names_inside_a_name() -> None:
    """The names inside a name start and end with a capitalised word, longest first; a possessive is dropped
    first ("Bank of America" of "Charlotte-based Bank of America", "Alachua" of "Alachua County")."""
    sentence = "It was bought by Charlotte-based Bank of America and Bob Dylan's band."
    found = {s.text: s for s in spans.names(sentence)}
    bank, dylan = found["Charlotte-based Bank of America"], found["Bob Dylan's"]
    assert texts(list(spans.name_parts(bank))) == [
        "Bank of America",
        "Charlotte-based Bank",
        "Charlotte-based",
        "Bank",
        "America",
    ]
    assert texts(list(spans.name_parts(dylan))) == ["Bob Dylan", "Bob", "Dylan"]


def test_numbers_and_dates_with_and_without_their_unit() -> None:
    """Dates come whole ("5 November 1913"), numbers and number words with and without the word after them
    ("53 years", "53"; "nine years", "nine"), and a stopword after a number is not a unit ("1967" not "1967 and")."""
    found = texts(list(spans.numbers(DATES)))
    assert {"5 November 1913", "8 July 1967", "53 years", "53", "1967"} <= set(found)
    assert not any(text.endswith(" and") for text in found)
    assert {"nine years", "nine"} <= set(texts(list(spans.numbers("He starred for nine years."))))


def test_candidates_leave_out_the_question_and_repeats() -> None:
    """Candidates skip spans made only of the question's words or stopwords, appear once per normalised
    text, respect the limit, come first from the sentence closest to the question (rank 0), and say their kind:
    names and numbers of every sentence, then the names inside names, then phrases."""
    sentences = ["The weather was fine that day.", JOURNAL]
    found = spans.candidates(
        sentences, "What company published Journal of Psychotherapy Integration?", limit=50
    )
    keys = [tuple(spans.normal_words(c.span.text)) for c in found]
    assert found[0] == spans.Candidate(found[0].span, "name", 0)
    assert found[0].span.text == "American Psychological Association"  # the journal sentence comes first
    assert "Journal of Psychotherapy Integration" not in texts(found)
    assert "It" not in texts(found) and len(keys) == len(set(keys))
    weather = next(c for c in found if c.span.text == "weather")  # the other sentence's phrases come later
    assert (weather.kind, weather.rank) == ("phrase", 1)
    kinds = [c.kind for c in found]
    assert kinds.index("part") > max(i for i, k in enumerate(kinds) if k in ("name", "number"))
    assert kinds.index("phrase") > max(i for i, k in enumerate(kinds) if k == "part")
    assert len(spans.candidates(sentences, "Who?", limit=3)) == 3
    assert spans.candidates(sentences, "Who?", limit=0) == []


def test_a_choice_between_names_of_the_question_keeps_them() -> None:
    """ "Who is older, X or Y?": the answer is one of the question's names, so they stay candidates; without a
    choice a name made of the question's words is left out."""
    sentences = ["Carrie Akre was born in 1968 and Shifty Shellshock in 1974."]
    asked = spans.candidates(sentences, "Who is older, Carrie Akre or Shifty Shellshock?", limit=20)
    assert {"Carrie Akre", "Shifty Shellshock"} <= set(texts(asked))
    plain = spans.candidates(sentences, "When was Carrie Akre born?", limit=20)
    assert "Carrie Akre" not in texts(plain) and "1968" in texts(plain)


def test_question_types_and_the_kind_they_want() -> None:
    """Questions sort into who / when / where / how many / what by their words."""
    assert spans.question_type("Who wrote The Canon of Medicine?") == "who"
    assert spans.question_type("In what year did the war end?") == "when"
    assert spans.question_type("when did Roman Empire reach its greatest extent") == "when"
    assert spans.question_type("Which city hosted the games?") == "where"
    assert spans.question_type("How many seats does it have?") == "how many"
    assert spans.question_type("What company published it?") == "what"
    assert (
        spans.question_type("What city did Hank Snow live in when he died?") == "where"
    )  # the first wh-word
    assert spans.question_type("What is the place of death of Henry Worrall?") == "where"
    assert (spans.EXPECTED_KIND["who"], spans.EXPECTED_KIND["when"], spans.EXPECTED_KIND.get("what")) == (
        "name",
        "number",
        None,
    )


def _scored(*kinds: str) -> list[spans.Candidate]:
    return [spans.Candidate(spans.Span(k, 0, len(k)), k, rank) for rank, k in enumerate(kinds)]  # type: ignore[arg-type]


PLAIN = spans.Choice(max_candidates=48, pmi_weight=0.0, kind_weight=0.0, rank_weight=0.0, length_weight=0.0)


def test_choose_weighs_prior_kind_rank_length_and_margin() -> None:
    """`choose` takes the best log-prob (the first of equals) and, as set, subtracts the weighted prior, adds
    the kind bonus for the kind the question wants and the length bonus per word, takes the rank penalty, and
    answers "not in the page" (None) unless the best beats it by the margin."""
    found = _scored("phrase", "name")
    scores = [-2.0, -3.0, -4.0]  # phrase, name, "not in the page"
    who = "Who founded it?"
    assert spans.choose(found, scores, None, who, PLAIN) == 0
    assert spans.choose(found, [-2.0, -2.0, -4.0], None, who, PLAIN) == 0
    with_prior = dataclasses.replace(PLAIN, pmi_weight=1.0)
    assert spans.choose(found, scores, [-1.0, -5.0, -4.0], who, with_prior) == 1
    assert spans.choose(found, scores, None, who, dataclasses.replace(PLAIN, kind_weight=1.5)) == 1
    assert spans.choose(found, scores, None, "What is it?", dataclasses.replace(PLAIN, kind_weight=1.5)) == 0
    ranked = dataclasses.replace(PLAIN, rank_weight=1.0)
    assert spans.choose(_scored("name", "name"), [-2.0, -1.5, -9.0], None, who, ranked) == 0
    long = [spans.Candidate(spans.Span(t, 0, len(t)), "name", 0) for t in ("Bank", "Bank of America")]
    assert (
        spans.choose(long, [-2.0, -2.5, -9.0], None, who, dataclasses.replace(PLAIN, length_weight=0.5)) == 1
    )
    assert spans.choose(found, scores, None, who, dataclasses.replace(PLAIN, null_margin=2.0)) == 0
    assert spans.choose(found, scores, None, who, dataclasses.replace(PLAIN, null_margin=2.5)) is None
    assert spans.choose([], [-1.0], None, who, PLAIN) is None


def test_each_readers_rule_is_the_one_chosen_for_it_on_the_tune_split() -> None:
    """page_qa's default rule is the one chosen on tune for the default reader, and each built-in reader's rule in
    RULES is the one its record (benchmarks/results/reader/rules*/summary.json) names as chosen for that model."""
    import json
    from pathlib import Path

    from conductor.models import DEFAULT_READER

    root = Path(__file__).parents[1]
    records = {
        "smollm2-135m-instruct": "benchmarks/results/reader/rules/summary.json",
        "qwen2.5-coder-0.5b-instruct": "benchmarks/results/reader/rules_qwen/summary.json",
    }
    assert set(records) == set(spans.RULES)
    for model, name in records.items():
        recorded = json.loads((root / name).read_text())
        assert recorded.get("model", "smollm2-135m-instruct") == model
        assert dataclasses.asdict(spans.RULES[model]) == recorded["chosen"], model
    assert spans.Choice() == spans.RULES[DEFAULT_READER]


def test_align_snaps_a_restated_answer_to_its_new_words() -> None:
    """A small model restates the question; alignment ignores the question's words and finds the page's span
    of the rest. An answer sharing no content word with the page aligns to nothing."""
    sentences = ["Don is a river of Russia and flows into Europe's Sea of Azov."]
    span, score = spans.align(sentences, "The Don is in Russia.", "What country is the Don in?")
    assert span is not None and span.text == "Russia" and score == 1.0
    assert spans.align(sentences, "It is in Canada.", "Where is the Don?") == (None, 0.0)


def test_align_prefers_the_shorter_span_on_a_tie() -> None:
    """Of spans with the same F1, the shorter is the answer (no trailing words the model did not say)."""
    span, _ = spans.align(["He was born in Leeds in 1950."], "Leeds", "Where was he born?")
    assert span is not None and span.text == "Leeds"


def test_mentions_needs_a_content_word_of_the_question() -> None:
    """A sentence mentions a question when they share a word other than a stopword."""
    assert spans.mentions(DATES, "When was Vivien Leigh born?")
    assert not spans.mentions(DATES, "What is the capital of France?")


def test_quote_around_keeps_the_span_inside_the_limit() -> None:
    """A long sentence is cut to a window at spaces that still holds the span; a short one is kept whole."""
    long = " ".join(["word"] * 80) + " the answer is Zanzibar " + " ".join(["word"] * 80)
    start = long.index("Zanzibar")
    quote = spans.quote_around(spans.Span(long, start, start + len("Zanzibar")), 60)
    assert "Zanzibar" in quote and quote in long and len(quote) <= 60
    short = spans.Span(DATES, 0, 12)
    assert spans.quote_around(short, 300) == DATES


_words = st.text(alphabet=st.sampled_from("abcXYZ19 ,.()-'’ \u00a0"), max_size=120)


@settings(max_examples=200, deadline=None)
@given(sentence=_words, question=_words, answer=_words, limit=st.integers(1, 40), room=st.integers(1, 80))
def test_every_span_is_verbatim_text(
    sentence: str, question: str, answer: str, limit: int, room: int
) -> None:
    """Whatever the text, every candidate, alignment and quote is a substring of its sentence: the grounded
    answer can always be found on the page word for word."""
    for candidate in spans.candidates([sentence], question, limit=limit):
        span = candidate.span
        assert span.text and span.text == sentence[span.start : span.end]
    aligned, _ = spans.align([sentence], answer, question)
    if aligned is not None:
        assert aligned.text and aligned.text in sentence
        quote = spans.quote_around(aligned, room)
        assert quote in sentence and len(quote) <= room
