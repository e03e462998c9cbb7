"""spans: the answer candidates page_qa scores, the alignment of a free answer, and the quote around a span.

Pure functions on text: no model, no network.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from subagents import spans

JOURNAL = (
    "The Journal of Psychotherapy Integration is a peer-reviewed academic journal published by the American "
    "Psychological Association on behalf of the Society for the Exploration of Psychotherapy Integration."
)
DATES = "Vivien Leigh (5 November 1913 - 8 July 1967) was an actress, and she was 53 years old in 1967."


def texts(found: list[spans.Span]) -> list[str]:
    return [span.text for span in found]


def test_names_join_connectors_and_stop_at_punctuation() -> None:
    """A capitalised run takes "of"/"for the" inside it (and offers its part before them too), drops a leading
    stopword, and never runs past "and", a comma or a bracket."""
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
        "Europe",
        "Asia",
    ]


def test_numbers_and_dates_with_and_without_their_unit() -> None:
    """Dates come whole ("5 November 1913"), numbers with and without the word after them ("53 years", "53"),
    and a stopword after a number is not a unit ("1967" not "1967 and")."""
    found = texts(list(spans.numbers(DATES)))
    assert {"5 November 1913", "8 July 1967", "53 years", "53", "1967"} <= set(found)
    assert not any(text.endswith(" and") for text in found)


def test_candidates_leave_out_the_question_and_repeats() -> None:
    """Candidates skip spans made only of the question's words or stopwords, appear once per normalised
    text, respect the limit, and come first from the sentence closest to the question."""
    sentences = ["The weather was fine that day.", JOURNAL]
    found = spans.candidates(
        sentences, "What company published Journal of Psychotherapy Integration?", limit=50
    )
    keys = [tuple(spans.normal_words(t)) for t in texts(found)]
    assert texts(found)[0] == "American Psychological Association"  # the journal sentence comes first
    assert "Journal of Psychotherapy Integration" not in texts(found)
    assert "It" not in texts(found) and len(keys) == len(set(keys))
    assert "weather" in texts(found)  # the other sentence's phrases come later
    assert len(spans.candidates(sentences, "Who?", limit=3)) == 3
    assert spans.candidates(sentences, "Who?", limit=0) == []


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
    for span in spans.candidates([sentence], question, limit=limit):
        assert span.text and span.text == sentence[span.start : span.end]
    aligned, _ = spans.align([sentence], answer, question)
    if aligned is not None:
        assert aligned.text and aligned.text in sentence
        quote = spans.quote_around(aligned, room)
        assert quote in sentence and len(quote) <= room
