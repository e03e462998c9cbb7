"""page_qa: extraction, chunking, ranking, the verbatim quote, error mapping; then real pages over loopback.

Unit tests use a scripted LLM and a dictionary fetcher. Integration tests serve real saved pages
(../shared/data/pages) from a loopback HTTP server to the real SSRF-safe Fetcher, and one runs SmolLM2.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gzip
import io
import json
import threading
from collections.abc import Iterator
from functools import partial
from http.server import BaseHTTPRequestHandler, SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import lxml.html
import pydantic
import pypdf
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from conductor.settings import ConfigError
from subagents import documents, page_qa, spans, workers
from subagents.common import Runtime, ToolFailure, approx_tokens
from subagents.fetch import FetchConfig, FetchedPage, Fetcher
from subagents.llm import BackendError, Generation, Message, cannot_score_error
from tests.pdf import damaged_pdf, minimal_pdf
from tests.tool_server_fakes import serving_handler
from training.tasks import multihop

FILLER = [
    "The museum opens at nine in the morning and closes at six in the evening.",
    "Tickets can be bought online or at the entrance, and children under twelve enter for free.",
    "The gardens behind the building were redesigned by a local architect last spring.",
    "Guided tours in several languages leave from the main hall every hour.",
    "A small cafe on the ground floor serves coffee, sandwiches and cakes.",
]
ANSWER_PARAGRAPH = "The Eiffel Tower is 330 metres tall and was completed in 1889 for the World's Fair."
HTML = f"""<!DOCTYPE html><html><head><meta charset="utf-8"><title>Visiting Paris</title></head>
<body><nav><a href="/">Home</a> <a href="/about">About</a></nav><article><h1>Visiting Paris</h1>
{"".join(f"<p>{p} {p}</p>" for p in FILLER)}<p>{ANSWER_PARAGRAPH}</p>
{"".join(f"<p>{p}</p>" for p in reversed(FILLER))}</article><footer>Copyright 2024</footer></body></html>"""


class ScriptedLLM:
    """An LLM that replies with a fixed text (or raises) and records the prompts it was given."""

    model_id = "scripted"
    multimodal = False
    scores = False  # like an endpoint: page_qa's "extract" needs ScoringLLM

    def __init__(self, reply: str | BackendError) -> None:
        self.reply = reply
        self.calls: list[list[Message]] = []

    async def generate(self, messages: list[Message], *, max_new_tokens: int) -> Generation:
        self.calls.append(messages)
        if isinstance(self.reply, BackendError):
            raise self.reply
        prompt_tokens = sum(approx_tokens(m.content) for m in messages)
        return Generation(
            text=self.reply, prompt_tokens=prompt_tokens, completion_tokens=approx_tokens(self.reply)
        )

    async def score(self, prompts: list[list[Message]], replies: list[str]) -> list[list[float]]:
        raise cannot_score_error(self.model_id)

    def count_tokens(self, text: str) -> int:
        return approx_tokens(text)

    async def aclose(self) -> None:
        return None


class DictFetcher:
    """A fetcher that serves pages (or raises failures) from a dictionary keyed by URL."""

    def __init__(self, pages: dict[str, FetchedPage | ToolFailure]) -> None:
        self.pages = pages

    async def fetch(self, url: str) -> FetchedPage:
        outcome = self.pages[url]
        if isinstance(outcome, ToolFailure):
            raise outcome
        return outcome


def page(
    body: bytes | str, content_type: str = "text/html; charset=utf-8", url: str = "http://a.test/p"
) -> FetchedPage:
    data = body.encode() if isinstance(body, str) else body
    return FetchedPage(url=url, final_url=url + "?final", status=200, content_type=content_type, body=data)


def runtime(llm: ScriptedLLM, pages: dict[str, FetchedPage | ToolFailure]) -> Runtime:
    return Runtime(llm=llm, fetcher=DictFetcher(pages), state=None)  # type: ignore[arg-type]


async def ask(
    reply: str | BackendError,
    outcome: FetchedPage | ToolFailure,
    question: str = "How tall is the Eiffel Tower?",
):
    llm = ScriptedLLM(reply)
    request = page_qa.Request(url="http://a.test/p", question=question)
    response = await page_qa.run(request, page_qa.Config(), runtime(llm, {"http://a.test/p": outcome}))
    return response, llm


# ---------------------------------------------------------------- unit: extraction, chunks, ranking


def test_extract_html_keeps_article_drops_navigation() -> None:
    """trafilatura's main text holds the article paragraphs and the <title>, not the nav or footer."""
    extracted = documents.extract_page(HTML.encode(), "text/html; charset=utf-8")
    assert extracted.title == "Visiting Paris"
    assert ANSWER_PARAGRAPH in extracted.text
    assert "About" not in extracted.text and "Copyright" not in extracted.text


def test_charset_from_content_type_is_used() -> None:
    """A Latin-1 body declared as such decodes correctly (no mojibake)."""
    body = "Le café est ouvert.\nLa crème brûlée coûte six euros.".encode("latin-1")
    assert "crème brûlée" in documents.extract_page(body, "text/plain; charset=ISO-8859-1").text


MARKDOWN = """# Visiting **Paris**

The [Eiffel Tower](https://example.org/eiffel) is *330 metres* tall.

## Getting there
* Metro line `6`
+ Bus 42
"""
MARKDOWN_AS_HTML = """<html><head><title>Visiting Paris</title></head><body><article><h1>Visiting <b>Paris</b></h1>
<p>The <a href="https://example.org/eiffel">Eiffel Tower</a> is <em>330 metres</em> tall.</p>
<h2>Getting there</h2><ul><li>Metro line <code>6</code></li><li>Bus 42</li></ul></article></body></html>"""


def test_markdown_reads_as_the_same_page_in_html() -> None:
    """A Markdown page loses its marks (headings, emphasis, links, code, bullets as "- ") and its leading
    heading is its title, so it reads exactly as the same page written in HTML."""
    md = documents.extract_page(MARKDOWN.encode(), "text/markdown; charset=utf-8")
    html = documents.extract_page(MARKDOWN_AS_HTML.encode(), "text/html")
    assert md.title == html.title == "Visiting Paris"
    assert page_qa.split_chunks(md.text, 600) == page_qa.split_chunks(html.text, 600)


def test_plain_text_is_used_as_is() -> None:
    """text/plain pages skip HTML extraction: every line survives, markup-like text included."""
    text = "Line one <b>not html</b>.\nLine two."
    assert documents.extract_page(text.encode(), "text/plain").text == text


@pytest.mark.parametrize(
    ("body", "content_type"),
    [
        (b"<html><head><script>app()</script></head><body></body></html>", "text/html"),
        (b"\x89PNG....", "image/png"),
    ],
)
def test_no_readable_text_is_unsupported_media(body: bytes, content_type: str) -> None:
    """An empty (JavaScript-only) page and a non-text body fail with unsupported_media, not an empty answer."""
    with pytest.raises(ToolFailure) as info:
        documents.extract_page(body, content_type)
    assert info.value.error.kind == "unsupported_media"


def test_chunks_are_paragraph_aware_and_bounded() -> None:
    """Short paragraphs are packed whole, long ones split at sentences; no chunk exceeds chunk_chars."""
    long_paragraph = " ".join(FILLER * 3)
    text = "\n".join([FILLER[0], FILLER[1], long_paragraph, FILLER[2]])
    chunks = page_qa.split_chunks(text, 200)
    assert chunks[0] == [FILLER[0], FILLER[1]]
    assert all(len("\n".join(chunk)) <= 200 for chunk in chunks)
    pieces = [piece for chunk in chunks for piece in chunk]
    assert " ".join(pieces).split() == text.split()
    assert FILLER[3] in pieces  # a sentence of the long paragraph became its own piece


def test_ranking_picks_the_chunk_with_the_answer() -> None:
    """BM25 over the page's chunks puts the one that answers the question first."""
    chunks = [*FILLER, ANSWER_PARAGRAPH, *FILLER]
    assert page_qa.rank_chunks(chunks, "How tall is the Eiffel Tower?", top_k=3)[0] == len(FILLER)


def test_ranking_without_shared_terms_keeps_page_order() -> None:
    """A question sharing no term with the page (or a single chunk) falls back to the page's first chunks."""
    assert page_qa.rank_chunks(FILLER, "zebra quantum?", top_k=2) == [0, 1]
    assert page_qa.rank_chunks(FILLER, "what is it?", top_k=2) == [0, 1]  # stopwords only
    assert page_qa.rank_chunks([FILLER[0]], "museum", top_k=3) == [0]


def test_answer_cleaning() -> None:
    """The first non-empty line, without an echoed label; an empty reply says so instead of being blank."""
    assert page_qa.clean_answer("\n Answer: 330 metres\nThe tower is tall.", 300) == "330 metres"
    assert page_qa.clean_answer("The answer is: 330 metres", 300) == "330 metres"
    assert page_qa.clean_answer("   \n", 300) == "(the model gave no answer)"
    assert len(page_qa.clean_answer("x" * 1000, 50)) < 100


def test_quote_prefers_the_sentence_with_the_answer() -> None:
    """The quote is the sentence sharing the answer's words, not merely the question's."""
    chunks = [["The Eiffel Tower is a famous landmark in Paris. Its height is 330 metres."]]
    quote = page_qa.pick_quote(chunks, "330 metres", question="How tall is the Eiffel Tower?", max_chars=300)
    assert quote == "Its height is 330 metres."


_word = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=12)
_sentence = st.builds(
    lambda words, gap, end: gap.join(words) + end,
    st.lists(_word, min_size=1, max_size=40),
    st.sampled_from([" ", "  ", "\t", " \u00a0"]),
    st.sampled_from(["", ".", "!", "?", "..."]),
)
_paragraph = st.lists(_sentence, min_size=1, max_size=8).map(" ".join) | st.text(max_size=400)
_page = st.builds(
    lambda ps, sep: sep.join(ps),
    st.lists(_paragraph, min_size=1, max_size=10),
    st.sampled_from(["\n", "\n\n", "\r\n", "\n \n"]),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    text=_page,
    answer=st.text(max_size=60),
    question=st.text(min_size=2, max_size=80),
    chunk_chars=st.integers(20, 700),
    max_quote=st.integers(10, 300),
)
def test_quote_is_always_verbatim_page_text(
    text: str, answer: str, question: str, chunk_chars: int, max_quote: int
) -> None:
    """Whatever the page and whatever the model says, the quote is a non-empty substring of the page text."""
    assume(text.strip())
    cfg = page_qa.Config(chunk_chars=chunk_chars, max_quote_chars=max_quote)
    prep = page_qa.prepare(text.encode(), "text/plain; charset=utf-8", question=question, cfg=cfg)
    quote = page_qa.pick_quote(prep.top, answer, question=question, max_chars=max_quote)
    assert quote and quote in text
    assert len(quote) <= max_quote
    assert all(len("\n".join(chunk)) <= chunk_chars for chunk in prep.top)


# ---------------------------------------------------------------- unit: run() with fakes


async def test_run_answers_from_the_best_chunks() -> None:
    """A full call: the prompt holds the answering chunk, the answer is cleaned, the quote is verbatim,
    the summary names the source and leaves the chunks out, and tokens read exceed tokens returned."""
    response, llm = await ask("Answer: 330 metres", page(HTML))
    assert response.ok and response.error is None
    assert response.answer == "330 metres"
    assert response.quote in documents.extract_page(HTML.encode(), "text/html").text
    assert "330 metres" in response.quote
    assert ANSWER_PARAGRAPH in llm.calls[0][-1].content and "How tall" in llm.calls[0][-1].content
    assert response.url == "http://a.test/p?final" and response.title == "Visiting Paris"
    assert response.chunks and ANSWER_PARAGRAPH in response.chunks[0]
    summary = response.summary()
    assert summary.startswith('answer: 330 metres | quote: "') and summary.endswith(
        "| source: Visiting Paris"
    )
    assert "http" not in summary  # the URL stays in the payload: for a file it would be a server path
    assert FILLER[4] not in summary
    assert response.tokens_read > response.tokens_returned > 0


@pytest.mark.parametrize("retryable", [True, False])
async def test_backend_error_becomes_a_structured_result(retryable: bool) -> None:
    """A failing model gives backend_error with the backend's retryable flag, never an exception."""
    response, _ = await ask(BackendError("connection refused", retryable=retryable), page(HTML))
    assert not response.ok and response.error is not None
    assert (response.error.kind, response.error.retryable) == ("backend_error", retryable)
    assert "connection refused" in response.observation()


@pytest.mark.parametrize("kind", ["blocked_url", "fetch_failed", "too_large", "timeout", "not_found"])
async def test_fetch_failures_pass_through_without_calling_the_model(kind: str) -> None:
    """The fetcher's error kind reaches the caller unchanged and the model is not asked."""
    response, llm = await ask("unused", ToolFailure(kind, "nope"))  # type: ignore[arg-type]
    assert response.error is not None and response.error.kind == kind
    assert llm.calls == []


async def test_empty_page_is_reported_not_answered() -> None:
    """A page with no readable text returns unsupported_media and never reaches the model."""
    response, llm = await ask("unused", page("<html><body><script>x()</script></body></html>"))
    assert response.error is not None and response.error.kind == "unsupported_media"
    assert llm.calls == []


def test_request_limits() -> None:
    """Over-long questions and unknown fields are rejected at the boundary."""
    with pytest.raises(pydantic.ValidationError):
        page_qa.Request(url="http://a.test", question="x" * 401)
    with pytest.raises(pydantic.ValidationError):
        page_qa.Request.model_validate({"url": "http://a.test", "question": "why?", "extra": 1})


class ScoringLLM(ScriptedLLM):
    """A ScriptedLLM that also scores replies ("extract" mode): listed replies get their score, others -100."""

    scores = True

    def __init__(self, table: dict[str, float]) -> None:
        super().__init__("unused")
        self.table = table
        self.scored: list[list[str]] = []

    async def score(self, prompts: list[list[Message]], replies: list[str]) -> list[list[float]]:
        return [self.score_one(messages, replies) for messages in prompts]

    def score_one(self, messages: list[Message], replies: list[str]) -> list[float]:
        self.calls.append(messages)
        self.scored.append(replies)
        return [self.table.get(reply, -100.0) for reply in replies]


# The log-prob alone: the unit tests of "extract"'s mechanics score with scripted tables, so they choose plainly.
PLAIN = spans.Choice(max_candidates=48, pmi_weight=0.0, kind_weight=0.0, rank_weight=0.0, length_weight=0.0)


class PromptScoringLLM(ScoringLLM):
    """A ScoringLLM with one table for prompts that ask a question and another for those that do not."""

    def __init__(self, *, question: dict[str, float], prior: dict[str, float]) -> None:
        super().__init__(question)
        self.prior = prior

    def score_one(self, messages: list[Message], replies: list[str]) -> list[float]:
        table = self.table if "Question:" in messages[-1].content else self.prior
        self.calls.append(messages)
        self.scored.append(replies)
        return [table.get(reply, -100.0) for reply in replies]


async def ask_in(
    mode: str, llm: ScriptedLLM, body: str | bytes = HTML, *, content_type: str = "text/html; charset=utf-8"
) -> page_qa.Response:
    request = page_qa.Request(url="http://a.test/p", question="How tall is the Eiffel Tower?")
    cfg = page_qa.Config(answer_mode=mode, extract=PLAIN)  # type: ignore[arg-type]
    return await page_qa.run(request, cfg, runtime(llm, {"http://a.test/p": page(body, content_type)}))


async def test_extract_answers_with_the_best_scored_span_of_the_page() -> None:
    """ "extract" scores page spans and "not in the page" with the model; the best span is the answer, found on
    the page, inside its quote, flagged supported, and the summary keeps its short shape."""
    llm = ScoringLLM({"330 metres": -2.0, "330": -3.0, page_qa.NOT_FOUND: -5.0})
    response = await ask_in("extract", llm)
    assert response.answer == "330 metres" and response.supported
    assert "330 metres" in llm.scored[0] and llm.scored[0][-1] == page_qa.NOT_FOUND
    text = documents.extract_page(HTML.encode(), "text/html").text
    assert response.answer in response.quote and response.quote in text
    assert response.summary() == f'answer: 330 metres | quote: "{ANSWER_PARAGRAPH}" | source: Visiting Paris'


async def test_extract_with_a_prior_scores_the_page_without_the_question() -> None:
    """With a PMI weight "extract" scores every reply twice, under the question's prompt and under the page's
    without the question, and the answer is the span the question makes likeliest over that prior."""
    llm = PromptScoringLLM(
        question={"330 metres": -2.0, "1889": -2.5, page_qa.NOT_FOUND: -9.0},
        prior={"330 metres": -1.0, "1889": -6.0, page_qa.NOT_FOUND: -9.0},
    )
    request = page_qa.Request(url="http://a.test/p", question="How tall is the Eiffel Tower?")
    prior = dataclasses.replace(PLAIN, pmi_weight=1.0, null_margin=-100.0)
    cfg = page_qa.Config(answer_mode="extract", extract=prior)
    response = await page_qa.run(request, cfg, runtime(llm, {"http://a.test/p": page(HTML)}))
    assert response.answer == "1889"
    question, prior = llm.calls
    assert "Eiffel Tower?" in question[-1].content and "Question:" not in prior[-1].content
    assert llm.scored[0] == llm.scored[1]
    plain = page_qa.Config(answer_mode="extract", extract=dataclasses.replace(PLAIN, null_margin=-100.0))
    llm.calls.clear()
    assert (
        await page_qa.run(request, plain, runtime(llm, {"http://a.test/p": page(HTML)}))
    ).answer == "330 metres"
    assert len(llm.calls) == 1


@pytest.mark.parametrize("fmt", ["md", "txt", "pdf"])
async def test_one_page_in_any_format_gets_the_same_answer(fmt: str) -> None:
    """The same page as HTML, Markdown, plain text or PDF gives the reader the same candidates and the same
    answer and quote."""
    # No apostrophe: a PDF's standard encoding shows ' as ’, which pypdf then reads back.
    title, lines = "Visiting Paris", [FILLER[0], ANSWER_PARAGRAPH.replace("'", ""), FILLER[1]]
    bodies = {
        "html": (multihop.page_html((title, [" ".join(lines)])).encode(), "text/html"),
        "md": (f"# {title}\n\n{' '.join(lines)}\n".encode(), "text/markdown"),
        "txt": (f"{title}\n\n{' '.join(lines)}\n".encode(), "text/plain"),
        "pdf": (minimal_pdf([title, " ".join(lines)]), "application/pdf"),
    }
    answers = []
    for name in ("html", fmt):
        llm = ScoringLLM({"330 metres": -2.0, "1889": -3.0, page_qa.NOT_FOUND: -5.0})
        body, media = bodies[name]
        response = await ask_in("extract", llm, body, content_type=media)
        answers.append((response.answer, response.quote, llm.scored))
    assert answers[0] == answers[1] and answers[0][0] == "330 metres"


async def test_extract_says_not_found_when_that_scores_best() -> None:
    """When "not in the page" outscores every span the reply says so, unsupported and without a quote."""
    response = await ask_in("extract", ScoringLLM({page_qa.NOT_FOUND: -1.0}))
    assert (response.answer, response.quote, response.supported) == (page_qa.NOT_FOUND, "", False)
    assert response.summary() == "answer: not in the page | source: Visiting Paris"


def test_extract_on_a_model_that_cannot_score_is_a_config_error() -> None:
    """`check_model` (asked by the tool server at start-up and before a hot swap) refuses "extract" on a model
    that cannot score, naming the setting and the way out; "free" and "align" run on any model."""
    with pytest.raises(ConfigError, match='answer_mode = "extract".*scripted cannot do.*"align" or "free"'):
        page_qa.check_model(page_qa.Config(answer_mode="extract"), ScriptedLLM("x"))
    page_qa.check_model(page_qa.Config(answer_mode="extract"), ScoringLLM({}))
    for mode in ("free", "align"):
        page_qa.check_model(page_qa.Config(answer_mode=mode), ScriptedLLM("x"))  # type: ignore[arg-type]


async def test_extract_never_falls_back_to_free() -> None:
    """Run anyway (page_qa.run alone, no server to check), "extract" on a model that cannot score is a
    `backend_error` saying so, never the model's own words in its place."""
    response = await ask_in("extract", ScriptedLLM("The Eiffel Tower is 330 metres high."))
    assert not response.ok and response.error is not None and response.error.kind == "backend_error"
    assert "cannot score" in response.error.message and not response.error.retryable


async def test_align_snaps_a_sentence_to_the_page_span() -> None:
    """ "align" turns the model's sentence into the page's span that best matches it, supported."""
    aligned = await ask_in("align", ScriptedLLM("The Eiffel Tower is 330 metres high."))
    assert (aligned.answer, aligned.supported) == ("330 metres", True)


@pytest.mark.parametrize(
    ("reply", "answer"),
    [("Not in the page.", page_qa.NOT_FOUND), ("It is made of cheese.", page_qa.NOT_FOUND)],
)
async def test_align_says_not_found_for_refusals_and_words_not_on_the_page(reply: str, answer: str) -> None:
    """ "align" turns the model's refusal, and an answer whose words the page does not hold, into the explicit
    "not in the page" rather than passing on invented text."""
    response = await ask_in("align", ScriptedLLM(reply))
    assert (response.answer, response.supported) == (answer, False)


def test_auto_extracts_where_the_model_scores_and_answers_freely_elsewhere() -> None:
    """The default mode "auto" is "extract" with a model that scores (the in-process reader) and "free" with one
    that only generates (an endpoint), so swapping the reader by config never stops the server."""
    assert page_qa.Config().answer_mode == "auto"
    assert page_qa.chosen_mode(page_qa.Config(), ScoringLLM({})) == "extract"
    assert page_qa.chosen_mode(page_qa.Config(), ScriptedLLM("x")) == "free"
    assert page_qa.chosen_mode(page_qa.Config(answer_mode="free"), ScoringLLM({})) == "free"
    page_qa.check_model(page_qa.Config(), ScriptedLLM("x"))


async def test_free_reads_as_before() -> None:
    """ "free" gives the model's own words, refusals and inventions included, unjudged, with the sentence sharing
    most words as the quote: the observation is the one page_qa gave before answer modes existed."""
    on_page = await ask_in("free", ScriptedLLM("330 Metres"))
    assert (on_page.answer, on_page.supported) == ("330 Metres", None)
    assert on_page.summary() == f'answer: 330 Metres | quote: "{ANSWER_PARAGRAPH}" | source: Visiting Paris'
    for said in ("About 1000 feet", "Not in the page."):
        response = await ask_in("free", ScriptedLLM(said))
        assert (response.answer, response.supported) == (said, None)
        assert response.summary().startswith(f'answer: {said} | quote: "') and response.quote


async def test_a_span_from_a_sentence_off_the_question_is_unsupported() -> None:
    """An answer from a sentence sharing no content word with the question is kept but flagged unsupported:
    the page does not tie it to what was asked (most answers the model picks on a wrong page are like this)."""
    response = await ask_in("extract", ScoringLLM({"small cafe": -1.0}))
    assert response.answer == "small cafe" and response.quote == FILLER[4]
    assert not response.supported and response.summary().startswith(
        "answer: small cafe (unsupported) | quote:"
    )


# ---------------------------------------------------------------- integration: real pages over loopback

# Deterministic picks: real English articles of different sites and layouts.
READABILITY_PAGES = ["bbc-1", "guardian-1", "nytimes-1", "wikipedia", "ars-1"]
SCRAPINGHUB_PAGES = 3  # the first N English pages of ground-truth.json in id order


def normalise(text: str) -> str:
    return " ".join(text.split())


def opening(text: str, chars: int = 80) -> str:
    """The first `chars` characters of whitespace-normalised text: what extraction must contain."""
    return normalise(text)[:chars]


def expected_opening(expected_html: str) -> str:
    """The opening of the first paragraph of 80+ characters of Readability's expected article.

    Its first text is often a photo caption or a byline, which a main-text extractor rightly drops.
    """
    tree = lxml.html.fromstring(expected_html)
    paragraphs = (normalise(p.text_content()) for p in tree.iter("p"))
    return opening(next((p for p in paragraphs if len(p) >= 80), tree.text_content()))


def is_english(text: str) -> bool:
    """Mostly ASCII: the benchmark's English pages (curly quotes and dashes allowed), not pt/ru/ko pages."""
    return sum(c.isascii() for c in text) > 0.97 * len(text)


class QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        return None


@pytest.fixture(scope="module")
def loopback(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A ThreadingHTTPServer on 127.0.0.1:<free port> serving a temporary folder."""
    root = tmp_path_factory.mktemp("site")
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(QuietHandler, directory=str(root)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", root
    server.shutdown()
    server.server_close()


async def fetch_and_extract(base: str, name: str) -> documents.PageText:
    fetcher = Fetcher(FetchConfig(allow_private_cidrs=("127.0.0.0/8",)))
    try:
        fetched = await fetcher.fetch(f"{base}/{name}")
    finally:
        await fetcher.aclose()
    return await asyncio.to_thread(documents.extract_page, fetched.body, fetched.content_type)


def scrapinghub_english(shared: Path, n: int) -> list[tuple[str, str]]:
    """(id, article body) of the first `n` pages, in id order, whose ground truth is English."""
    truth = json.loads((shared / "pages/scrapinghub/ground-truth.json").read_text(encoding="utf-8"))
    english = [(k, v["articleBody"]) for k, v in sorted(truth.items()) if is_english(v["articleBody"])]
    return english[:n]


@pytest.mark.slow
@pytest.mark.parametrize("name", READABILITY_PAGES)
async def test_readability_page_extracts_the_article_opening(name: str, shared_data: Path, loopback) -> None:
    """Served over loopback and fetched for real, the extraction contains the expected article's opening."""
    base, root = loopback
    folder = shared_data / "pages/readability" / name
    (root / f"{name}.html").write_bytes((folder / "source.html").read_bytes())
    expected = expected_opening((folder / "expected.html").read_text(encoding="utf-8"))
    extracted = await fetch_and_extract(base, f"{name}.html")
    assert expected in normalise(extracted.text)


@pytest.mark.slow
async def test_scrapinghub_pages_extract_the_article_opening(shared_data: Path, loopback) -> None:
    """The same property on gzipped news pages with human-checked article text."""
    base, root = loopback
    for page_id, body in scrapinghub_english(shared_data, SCRAPINGHUB_PAGES):
        raw = gzip.decompress((shared_data / f"pages/scrapinghub/html/{page_id}.html.gz").read_bytes())
        (root / f"{page_id}.html").write_bytes(raw)
        extracted = await fetch_and_extract(base, f"{page_id}.html")
        assert opening(body) in normalise(extracted.text), page_id


@pytest.mark.slow
async def test_real_smollm2_answers_from_a_real_page(shared_data: Path, smollm2_path: Path, loopback) -> None:
    """End to end with the real model: a saved NYT article over loopback and the real fetcher; the answer
    names the country, the quote is the page's own sentence about it, and the caller reads far less than
    the sub-agent did."""
    from subagents.backends import build_llm
    from subagents.llm import BackendConfig

    base, root = loopback
    source = (shared_data / "pages/readability/nytimes-1/source.html").read_bytes()
    (root / "sudan.html").write_bytes(source)
    llm = build_llm(BackendConfig())
    fetcher = Fetcher(FetchConfig(allow_private_cidrs=("127.0.0.0/8",)))
    rt = Runtime(llm=llm, fetcher=fetcher, state=None, count_tokens=llm.count_tokens)  # type: ignore[arg-type]
    question = "Which country will the United States lift sanctions on?"
    request = page_qa.Request(url=f"{base}/sudan.html", question=question)
    try:
        response = await page_qa.run(request, page_qa.Config(), rt)
    finally:
        await fetcher.aclose()
        await llm.aclose()
    assert response.ok, response.observation()
    assert "sudan" in response.answer.lower(), response.answer
    assert response.quote in documents.extract_page(source, "text/html").text
    assert "Sudan" in response.quote and response.title == "United States to Lift Sudan Sanctions"
    assert response.tokens_read > 10 * response.tokens_returned


@pytest.mark.slow
async def test_real_smollm2_extracts_a_grounded_span(shared_data: Path, smollm2_path: Path, loopback) -> None:
    """ "extract" with the real model on a real MuSiQue paragraph over loopback: the answer is the gold span
    (the free answer names the city he died in), supported, inside a quote from the page; on a paragraph
    that does not hold it, the answer is still the page's own words or "not in the page", never invented."""
    from subagents.backends import build_llm
    from subagents.llm import BackendConfig

    base, root = loopback
    rows = json.loads((shared_data / "multihop/hipporag_musique_train.json").read_text(encoding="utf-8"))
    paragraphs = next(r for r in rows if r["id"] == "3hop1__144142_643936_36283")["paragraphs"]
    texts = {}
    for idx in (12, 0):  # the hop's supporting paragraph, and one about another subject
        html = multihop.page_html((paragraphs[idx]["title"], [paragraphs[idx]["paragraph_text"]]))
        (root / f"musique-{idx}.html").write_text(html, encoding="utf-8")
        texts[idx] = documents.extract_page(html.encode(), "text/html").text  # the page as page_qa reads it
    llm = build_llm(BackendConfig())
    fetcher = Fetcher(FetchConfig(allow_private_cidrs=("127.0.0.0/8",)))
    rt = Runtime(llm=llm, fetcher=fetcher, state=None, count_tokens=llm.count_tokens)  # type: ignore[arg-type]
    question = "In what city was Steven Blankaart born?"
    extract = page_qa.Config(answer_mode="extract")
    try:
        gold, other = [
            await page_qa.run(page_qa.Request(url=f"{base}/musique-{i}.html", question=question), extract, rt)
            for i in (12, 0)
        ]
    finally:
        await fetcher.aclose()
        await llm.aclose()
    assert gold.ok and other.ok, (gold.observation(), other.observation())
    assert (gold.answer, gold.supported) == ("Middelburg", True), gold.answer
    assert gold.answer in gold.quote and gold.quote in texts[12]
    assert other.answer == page_qa.NOT_FOUND or (other.supported and other.answer in texts[0]), other.answer


# ---------------------------------------------------------------- attacks: charsets, damaged PDFs, the pool

SHORT_PAGE = [FILLER[0], f"{ANSWER_PARAGRAPH} The café nearby sells crème brûlée."]
SHORT_BODIES = {
    "text/html": "<html><head><title>Paris</title></head><body><article>"
    + "".join(f"<p>{p}</p>" for p in SHORT_PAGE) + "</article></body></html>",
    "text/plain": "\n\n".join(SHORT_PAGE),
    "text/markdown": "# Paris\n\n" + "\n\n".join(SHORT_PAGE),
}  # fmt: skip


@contextlib.contextmanager
def typed_pages(pages: dict[str, tuple[str, bytes]]) -> Iterator[str]:
    """A loopback HTTP server answering GET /<name> with `pages[name]`: (Content-Type, body); yields its URL."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            content_type, body = pages[self.path.lstrip("/")]
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # keep test output clean
            pass

    with serving_handler(Handler) as url:
        yield url


async def ask_over_loopback(url: str) -> page_qa.Response:
    """page_qa on `url` through the real SSRF-safe fetcher (loopback allowed) and a scripted model."""
    fetcher = Fetcher(FetchConfig(allow_private_cidrs=("127.0.0.0/8",)))
    rt = Runtime(llm=ScriptedLLM("330 metres"), fetcher=fetcher, state=None)  # type: ignore[arg-type]
    request = page_qa.Request(url=url, question="How tall is the Eiffel Tower?")
    try:
        return await page_qa.run(request, page_qa.Config(), rt)
    finally:
        await fetcher.aclose()


@pytest.mark.parametrize("charset", ["undefined", "idna", "punycode", "unicode_escape", "rot13"])
@pytest.mark.parametrize("media", ["text/html", "text/plain", "text/markdown"])
async def test_a_charset_that_names_no_page_encoding_is_read_as_utf8(media: str, charset: str) -> None:
    """The attack: a page served over HTTP with `charset=undefined` or `charset=idna` (HTML, text or Markdown)
    made the decoder raise UnicodeError, an HTTP 500. A charset naming no encoding a page is written in (those,
    punycode, the escape codecs, bytes-to-bytes codecs like rot13) is read as UTF-8, accents included."""
    body = SHORT_BODIES[media].encode()
    with typed_pages({"page": (f"{media}; charset={charset}", body)}) as base:
        response = await ask_over_loopback(f"{base}/page")
    assert response.ok, response.observation()
    assert "crème brûlée" in " ".join(response.chunks), response.chunks


def test_only_text_encodings_decode_a_page() -> None:
    """Bytes-to-bytes codecs (base64, zip, hex) and unknown names read as UTF-8; a real charset still decodes."""
    body = "Crème brûlée".encode()
    for charset in ("base64", "zip", "hex", "no-such-charset"):
        assert documents.extract_page(body, f"text/plain; charset={charset}").text == "Crème brûlée"
    assert documents.extract_page(body, "text/plain; charset=latin-1").text == body.decode("latin-1")


async def test_a_damaged_pdf_is_unsupported_media_not_a_crash() -> None:
    """The attack: a PDF with 4 bytes of its trailer changed, served over HTTP, made pypdf raise AttributeError
    (real pypdf, checked here), which escaped page_qa as an HTTP 500. It is unsupported_media, saying why."""
    damaged = damaged_pdf()
    with pytest.raises(AttributeError):
        pypdf.PdfReader(io.BytesIO(damaged))
    with typed_pages({"bad.pdf": ("application/pdf", damaged)}) as base:
        response = await ask_over_loopback(f"{base}/bad.pdf")
    assert not response.ok and response.error is not None
    assert response.error.kind == "unsupported_media" and "damaged PDF" in response.error.message


async def test_page_qa_extracts_in_the_bounded_documents_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """page_qa's extraction runs in workers' documents pool: while that pool and its queue are held (here by
    work whose caller went away), a new call is refused at once as overloaded and retryable, not queued."""
    monkeypatch.setitem(workers.POOLS, "documents", workers.Pool(threads=1, queue=0))
    monkeypatch.setattr(workers, "_executors", {})  # a pool of the size above, not one an earlier test made
    monkeypatch.setattr(workers, "_busy", {})
    release = threading.Event()
    held = asyncio.ensure_future(workers.run("documents", release.wait))
    try:
        while workers.busy("documents") < 1:
            await asyncio.sleep(0.01)
        response, llm = await ask("330 metres", page(HTML))
    finally:
        release.set()
        await held
        workers._executors["documents"].shutdown()
    assert response.error is not None and response.error.kind == "overloaded" and response.error.retryable
    assert llm.calls == []
