"""page_qa: read one web page and answer a question about it, with a quote that occurs verbatim on the page.

    fetch (rt.fetcher, SSRF-safe) -> main text (documents.extract_page: trafilatura; pypdf for PDFs)
    -> paragraph-aware chunks
    -> BM25 over the chunks (bm25s, one tiny index per page) -> the frozen model answers from the top chunks
    -> the quote, chosen here and never by the model (a 135M model paraphrases and invents): the sentence of
       those chunks holding the answer (or sharing most words with it), from the page

How the answer is made (`Config.answer_mode`; spans.py has the span rules):
- "auto" (the default): "extract" where the model scores, else "free" (`chosen_mode`): a reader behind an
  endpoint answers in its own words ("align" snapped SmolLM2's sentence answers served by vLLM to "not in the page").
- "free": the model's own words (first line, cleaned), unjudged.
- "align": the model answers freely, then the answer snaps to the page span with the best token F1 with it;
  below `align_min_f1` the reply is "not in the page".
- "extract": candidate spans of the top chunks (names, numbers and dates, short phrases near the question's
  words) and "not in the page" are scored by the model's log-probability of each as its whole reply; the best
  wins. Needs a model that scores (`LLM.scores`, the transformers backend): `check_model` refuses others.
`supported` (align, extract): the answer is on the page in a sentence sharing a content word with the question;
false for more of the wrong pages than of the right. The policy reads "(unsupported)" after such an answer.

Limits: no JavaScript (pages rendered client-side extract as empty), text in images or iframes is not seen,
text beyond `max_page_chars` is dropped, and the answer is only as good as the small model behind it.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from conductor.settings import ConfigError
from subagents import spans, workers
from subagents.common import Runtime, ToolFailure, ToolResponse, bm25_terms, guarded, truncate
from subagents.documents import extract_page
from subagents.llm import LLM, BackendError, Message

logger = logging.getLogger(__name__)

NAME = "page_qa"
CACHEABLE = True  # an answer depends only on the page, the question and the frozen model
DESCRIPTION = (
    "Read one web page and answer a question about it: a short answer plus a verbatim supporting quote."
)

SYSTEM_PROMPT = (
    "Answer the question using only the page text. Reply with a short answer of a few words. "
    "If the page text does not say, reply: not in the page."
)
# Whitespace after . ! ? possibly followed by a closing quote or bracket, or a citation mark such as [12].
_SENTENCE_END = re.compile(r"(?:(?<=[.!?])|(?<=[.!?][\"')\]”’])|(?<=[.!?]\[\d\])|(?<=[.!?]\[\d\d\]))\s+")
# A full stop that ends an initial or a title, not a sentence: "K.", "U.S.", "Dr.", "St." (the piece's last word).
_NOT_AN_END = re.compile(rf"(?:^|[\s(]){spans.ABBREVIATIONS}\.$")
NOT_FOUND = "not in the page"  # the reply when the page does not say (the prompt asks for these words)
_SAYS_NOT_FOUND = re.compile(
    r"not (in|on) the (page|text)|(does|do) not (say|mention|state)|not mentioned|no (answer|information)",
    re.IGNORECASE,
)
_ANSWER_PREFIX = re.compile(r"^((the\s+)?(short\s+)?answer(\s+is)?\s*:\s*)+", re.IGNORECASE)


class Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # strict, like the other sub-agents: no coercion
    url: str = Field(
        min_length=1,
        max_length=2048,
        description="the page's id (d_...) from search or the task, or an http(s) URL",
        json_schema_extra={"handle": "page"},  # the server resolves a handle before the call (and the cache)
    )
    question: str = Field(min_length=2, max_length=400, description="what to find out from the page")


class Response(ToolResponse):
    answer: str = ""
    quote: str = ""
    supported: bool | None = None  # on the page in a sentence sharing a question word; None: "free", unjudged
    url: str = ""
    title: str = ""
    chunks: list[str] = Field(
        default_factory=list, description="the page chunks the model saw (trace viewer)"
    )

    def summary(self) -> str:
        """Answer, quote and the page's title: never its URL, which for a file is a path on the server (the
        policy knows which page it asked; `url` stays in the payload for traces and citations)."""
        source = self.title or "untitled page"
        if self.supported is None:  # "free": not judged
            return f'answer: {self.answer} | quote: "{self.quote}" | source: {source}'
        if self.answer == NOT_FOUND:
            return f"answer: {NOT_FOUND} | source: {source}"
        flag = "" if self.supported else " (unsupported)"
        return f'answer: {self.answer}{flag} | quote: "{self.quote}" | source: {source}'


@dataclass(frozen=True)
class Config:
    chunk_chars: int = 600
    """Target chunk size (~150 tokens): `top_k` chunks plus the question keep the prompt under 400 tokens."""
    top_k: int = 2
    """Chunks shown to the model, best BM25 match first. SmolLM2-135M answered 7 of 11 test questions with 2
    chunks, 4 with 1 (the answer was often in the second) and 3 with 3 (more text distracts it)."""
    max_page_chars: int = 100_000
    """Extracted text beyond this is dropped; a long article is ~30k characters. Bounds ranking work per call."""
    max_new_tokens: int = 64
    """The answer is a few words; 64 tokens allow a sentence but stop a small model from rambling."""
    max_answer_chars: int = 300
    """Answers are cut (with a visible marker) past this: the policy's context is the scarce resource."""
    max_quote_chars: int = 300
    """Longer supporting sentences are cut at a word boundary; the cut quote is still verbatim."""
    answer_mode: Literal["auto", "free", "align", "extract"] = "auto"
    """How the answer is made (module docstring; benchmarks/studies/reader/bench.py). "auto": "extract" where
    the model scores (measured best: EM 0.320 vs free's 0.007 on bench_reader's 150 single-hop questions),
    else "free" (an endpoint generates but cannot score; "align" grounds its answer in a page span, set it for
    readers that answer in a few words: a sentence answer falls below `align_min_f1` and reads "not in the
    page")."""
    extract: spans.Choice = field(default_factory=spans.Choice)
    """"extract": how many spans are scored and how the answer is picked among them (`[page_qa.extract]`)."""
    align_min_f1: float = 0.5
    """"align": the least token F1 between the model's answer and a page span for the span to be the answer."""


@dataclass(frozen=True)
class Prepared:
    """A page ready for the model: title, text and its best chunks (each a list of verbatim pieces)."""

    title: str
    text: str
    top: list[list[str]]


def start(cfg: Config, roots: tuple[str, ...]) -> None:
    """Nothing to keep between calls: pages are fetched per call (the result cache keeps the answers)."""
    return None


async def run(request: Request, cfg: Config, rt: Runtime[None]) -> Response:
    return await guarded(Response, lambda: _answer(request, cfg, rt))


def check_model(cfg: Config, llm: LLM) -> None:
    """ConfigError where `cfg` cannot run on `llm`: the tool server asks at start-up and before a hot swap."""
    if cfg.answer_mode == "extract" and not llm.scores:  # "auto" picks what the model can do
        raise ConfigError(
            f'[page_qa] answer_mode = "extract" scores page spans with the model, which {llm.model_id} cannot '
            'do (only backend = "transformers" scores): use answer_mode "auto", "align" or "free", or that backend'
        )


@dataclass(frozen=True)
class Reply:
    """What an answer mode made: the answer, its quote ("" for "not in the page"), whether the page supports
    it (None: not judged, "free") and the tokens the model read (its prompt; "extract": also what it scored)."""

    answer: str
    quote: str
    supported: bool | None
    prompt_tokens: int


async def _answer(request: Request, cfg: Config, rt: Runtime[None]) -> Response:
    page = await rt.fetcher.fetch(request.url)
    # Extraction and ranking are CPU-bound (tens of ms on a large page, seconds on a PDF made to be slow): in
    # the documents pool, where work that outlives this call's deadline cannot pile up (subagents/workers.py).
    work = functools.partial(prepare, question=request.question, cfg=cfg)
    prep = await workers.run("documents", work, page.body, page.content_type)
    chunks = ["\n".join(chunk) for chunk in prep.top]
    try:
        reply = await _reply(prep, request.question, cfg=cfg, rt=rt)
    except BackendError as exc:
        raise ToolFailure("backend_error", str(exc), retryable=exc.retryable) from exc
    response = Response(
        answer=reply.answer,
        quote=reply.quote,
        supported=reply.supported,
        url=page.final_url,
        title=prep.title,
        chunks=chunks,
    )
    response.tokens_read = rt.count_tokens(prep.text) + reply.prompt_tokens
    response.tokens_returned = rt.count_tokens(response.summary())
    return response


async def _reply(prep: Prepared, question: str, *, cfg: Config, rt: Runtime[None]) -> Reply:
    """The answer in `cfg.answer_mode` (module docstring)."""
    chunks = ["\n".join(chunk) for chunk in prep.top]
    messages = build_prompt(chunks, question)
    sentences = page_sentences(prep.top)
    mode = chosen_mode(cfg, rt.llm)
    if mode == "extract":
        return await _extract(sentences, chunks, question, messages, cfg=cfg, rt=rt)
    generation = await rt.llm.generate(messages, max_new_tokens=cfg.max_new_tokens)
    said, read = clean_answer(generation.text, cfg.max_answer_chars), generation.prompt_tokens
    if mode == "free":
        quote = pick_quote(prep.top, said, question=question, max_chars=cfg.max_quote_chars)
        return Reply(said, quote, None, read)
    span, score = (None, 0.0) if _SAYS_NOT_FOUND.search(said) else spans.align(sentences, said, question)
    if span is None or score < cfg.align_min_f1:
        return Reply(NOT_FOUND, "", False, read)
    return _on_page(span, question, cfg=cfg, prompt_tokens=read)


async def _extract(
    sentences: list[str],
    chunks: list[str],
    question: str,
    messages: list[Message],
    *,
    cfg: Config,
    rt: Runtime[None],
) -> Reply:
    """ "extract": the candidate spans of the shown `sentences` and "not in the page" scored by the model (and,
    with a PMI weight, under the prior's prompt of the same `chunks` too), the answer picked by `spans.choose`."""
    rule = cfg.extract
    found = spans.candidates(sentences, question, limit=rule.max_candidates)
    replies = [c.span.text for c in found] + [NOT_FOUND]
    prompts = [messages]
    if rule.pmi_weight:
        prompts.append(prior_prompt(chunks) if rule.prior == "page" else bare_prompt())
    scores = await rt.llm.score(prompts, replies)  # both prompts open with the page: the model reads it once
    best = spans.choose(found, scores[0], scores[1] if rule.pmi_weight else None, question, rule)
    fed = [m.content for prompt in prompts for m in prompt] + replies * len(prompts)
    read = sum(rt.count_tokens(text) for text in fed)  # everything the model was given
    if best is None:
        return Reply(NOT_FOUND, "", False, read)
    return _on_page(found[best].span, question, cfg=cfg, prompt_tokens=read)


def chosen_mode(cfg: Config, llm: LLM) -> Literal["free", "align", "extract"]:
    """The answer mode `cfg` asks for, with "auto" resolved for `llm`."""
    if cfg.answer_mode != "auto":
        return cfg.answer_mode
    return "extract" if llm.scores else "free"


def _on_page(span: spans.Span, question: str, *, cfg: Config, prompt_tokens: int) -> Reply:
    """A span of the page as the answer, supported when its sentence shares a content word with the question."""
    quote = spans.quote_around(span, cfg.max_quote_chars)
    return Reply(span.text, quote, spans.mentions(span.sentence, question), prompt_tokens)


def page_sentences(chunks: list[list[str]]) -> list[str]:
    """The sentences of the chunks shown to the model, best chunk first; each a substring of the page text."""
    return [s for chunk in chunks for piece in chunk for s in sentences(piece)]


def prepare(body: bytes, content_type: str, *, question: str, cfg: Config) -> Prepared:
    """Extract, chunk and rank a fetched page (blocking)."""
    page = extract_page(body, content_type)
    text = page.text[: cfg.max_page_chars]
    chunks = split_chunks(text, cfg.chunk_chars)
    order = rank_chunks(["\n".join(chunk) for chunk in chunks], question, top_k=cfg.top_k)
    logger.debug("page %r: %d chars, %d chunks, showing %s", page.title, len(text), len(chunks), order)
    return Prepared(title=page.title, text=text, top=[chunks[i] for i in order])


def split_chunks(text: str, chunk_chars: int) -> list[list[str]]:
    """Consecutive pieces of `text` packed into chunks of at most ~`chunk_chars` characters.

    A piece is a paragraph (one line of the extracted text), or a sentence of a paragraph longer than
    `chunk_chars`, or a word-boundary cut of a sentence longer still. Every piece occurs verbatim in `text`.
    """
    chunks: list[list[str]] = []
    current: list[str] = []
    size = 0
    for piece in _pieces(text, chunk_chars):
        if current and size + len(piece) > chunk_chars:
            chunks.append(current)
            current, size = [], 0
        current.append(piece)
        size += len(piece) + 1
    if current:
        chunks.append(current)
    return chunks


def _pieces(text: str, limit: int) -> Iterator[str]:
    for line in text.splitlines():
        paragraph = line.strip()
        if not paragraph:
            continue
        if len(paragraph) <= limit:
            yield paragraph
            continue
        for sentence in sentences(paragraph):
            yield from _cut_words(sentence, limit)


def sentences(paragraph: str) -> list[str]:
    """Sentences of one paragraph, split after . ! ? followed by whitespace, but not after an initial or a title
    ("James K. Polk", "Dr. Smith", "U.S. Army"); each is a substring of it."""
    pieces, start = [], 0
    for end in _SENTENCE_END.finditer(paragraph):
        if not _NOT_AN_END.search(paragraph, start, end.start()):
            pieces.append(paragraph[start : end.start()])
            start = end.end()
    pieces.append(paragraph[start:])
    return [s.strip() for s in pieces if s.strip()]


def _cut_words(text: str, limit: int) -> Iterator[str]:
    while len(text) > limit:
        cut = text.rfind(" ", 0, limit + 1)
        cut = cut if cut > limit // 2 else limit  # no space in reach: cut inside the word
        yield text[:cut].rstrip()
        text = text[cut:].lstrip()
    if text:
        yield text


def rank_chunks(chunks: list[str], question: str, *, top_k: int) -> list[int]:
    """Indices of the `top_k` chunks that best match `question` by BM25, best first; ties keep page order.

    With no question term on the page the first chunks are returned: an article's lead is the best guess.
    """
    chunk_terms = bm25_terms(chunks)
    vocabulary = {term for doc in chunk_terms for term in doc}
    query = [term for term in bm25_terms([question])[0] if term in vocabulary]
    if len(chunks) <= 1 or not query:
        return list(range(min(top_k, len(chunks))))
    import bm25s  # lazily: see common.bm25_terms

    retriever = bm25s.BM25()
    retriever.index(chunk_terms, show_progress=False)
    scores = retriever.get_scores(query)
    return [int(i) for i in np.argsort(-scores, kind="stable")[:top_k]]


def build_prompt(chunks: list[str], question: str) -> list[Message]:
    """A short, strict prompt a 135M instruction model can follow."""
    context = "\n\n".join(chunks)
    user = f"Page text:\n{context}\n\nQuestion: {question}\nShort answer:"
    return [Message(role="system", content=SYSTEM_PROMPT), Message(role="user", content=user)]


def bare_prompt() -> list[Message]:
    """Neither page nor question ("extract": how likely a span is as a short answer to anything)."""
    return [Message(role="system", content=SYSTEM_PROMPT), Message(role="user", content="Short answer:")]


def prior_prompt(chunks: list[str]) -> list[Message]:
    """The prompt without its question ("extract": how likely a span is as a reply to the page alone)."""
    context = "\n\n".join(chunks)
    user = f"Page text:\n{context}\n\nShort answer:"
    return [Message(role="system", content=SYSTEM_PROMPT), Message(role="user", content=user)]


def clean_answer(text: str, limit: int) -> str:
    """The first non-empty line of the model's reply, without an echoed "Answer:" label, cut to `limit`."""
    for line in text.splitlines():
        answer = _ANSWER_PREFIX.sub("", line.strip()).strip()
        if answer:
            return truncate(answer, limit)
    return "(the model gave no answer)"


def pick_quote(chunks: list[list[str]], answer: str, *, question: str, max_chars: int) -> str:
    """The sentence of `chunks` that shares most terms with the answer (double weight) and the question.

    Ties go to the earlier sentence of the better-ranked chunk. The result is a substring of the page text
    (pieces are verbatim, sentences are substrings of pieces, the cut keeps a prefix); "" when `chunks` is empty.
    """
    candidates = page_sentences(chunks)
    if not candidates:
        return ""
    answer_terms = set(bm25_terms([answer])[0])
    question_terms = set(bm25_terms([question])[0])
    scores = [
        2 * len(answer_terms.intersection(words)) + len(question_terms.intersection(words))
        for words in bm25_terms(candidates)
    ]
    best = candidates[scores.index(max(scores))]
    return next(_cut_words(best, max_chars))
