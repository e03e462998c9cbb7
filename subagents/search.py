"""search: keyword search over a local folder of documents, returning titles, URLs page_qa can open, and snippets.

The corpus is built once at server start-up (`Corpus.build`, blocking: the server calls it in a thread) from the
*.html, *.htm, *.txt and *.md files under a folder; it is read-only afterwards, so concurrent searches share it
without locks. Ranking is whole-document BM25 (bm25s) over title + text; the snippet is the sentence that shares
most query terms, followed by its neighbours up to `snippet_chars`.

URLs are `file://` absolute paths (the tool server lets page_qa's fetcher read that root), or, when the folder
is also served over HTTP (a loopback static server), `base_url` + the file's relative path.

Limits: lexical matching only (no stemming or synonyms: "cars" does not match "car"); English stopwords; files
past `max_docs` or `MAX_FILE_BYTES` are not indexed (a warning is logged); re-indexing needs a restart.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import numpy as np
import trafilatura
from pydantic import BaseModel, ConfigDict, Field
from trafilatura.settings import Document as Extracted

from subagents.common import Runtime, ToolFailure, ToolResponse, bm25_terms, guarded

logger = logging.getLogger(__name__)

NAME = "search"
CACHEABLE = True  # hits depend only on the query and the index, which is read-only while the server runs
DESCRIPTION = "Search the server's document collection by keywords; returns titles, URLs to read with page_qa, and snippets."

SUFFIXES = frozenset({".html", ".htm", ".txt", ".md"})
HTML_SUFFIXES = frozenset({".html", ".htm"})
MAX_FILE_BYTES = 5_000_000  # a saved news page is ~0.3 MB; bigger files are dumps, not documents to read
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


class Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # strict: "3" is not a number of documents
    query: str = Field(min_length=1, max_length=300, description="keywords to look for")
    k: int = Field(default=5, ge=1, le=10, description="how many documents to return")


class Hit(BaseModel):
    model_config = ConfigDict(frozen=True)
    title: str
    url: str
    snippet: str
    score: float


class Response(ToolResponse):
    query: str = ""
    hits: list[Hit] = Field(default_factory=list)

    def summary(self) -> str:
        if not self.hits:
            return f"no documents match {self.query!r}"
        return "\n".join(
            f"{i}. {hit.title} — {hit.url} — {hit.snippet}" for i, hit in enumerate(self.hits, 1)
        )


@dataclass(frozen=True)
class Config:
    corpus_dir: str | None = None
    """Folder indexed at start-up; None leaves the tool without a corpus (calls return not_found)."""
    base_url: str | None = None
    """URL under which that folder is also served over HTTP; None gives file:// URLs."""
    max_docs: int = 10_000
    """Most files indexed (in path order): bounds start-up time (~50 ms per HTML page on one core) and memory."""
    snippet_chars: int = 120
    """Snippet length: 5 hits with title, URL and snippet stay under the 1,200-character observation cap."""


@dataclass(frozen=True)
class Document:
    """One indexed file: its title, the URL page_qa opens it with, and its readable text."""

    title: str
    url: str
    text: str


class Corpus:
    """A read-only BM25 index over documents."""

    def __init__(self, documents: list[Document]) -> None:
        self.documents = documents
        doc_terms = bm25_terms([f"{doc.title}\n{doc.text}" for doc in documents])
        frequency = Counter(term for words in doc_terms for term in set(words))
        # Lucene's BM25 idf (what bm25s scores with): rare terms pick the snippet sentence.
        self._idf = {t: math.log(1 + (len(documents) - n + 0.5) / (n + 0.5)) for t, n in frequency.items()}
        import bm25s  # lazily: see common.bm25_terms

        self._bm25 = bm25s.BM25()
        if self._idf:  # bm25s cannot index a corpus without a single term
            self._bm25.index(doc_terms, show_progress=False)

    @classmethod
    def build(cls, folder: Path, *, max_docs: int, base_url: str | None = None) -> Corpus:
        """Index the documents under `folder` (blocking). Raises FileNotFoundError for a missing folder."""
        if not folder.is_dir():
            raise FileNotFoundError(f"search corpus folder not found: {folder}")
        documents = []
        for path in _document_paths(folder, max_docs):
            document = read_document(path, url=document_url(path, folder, base_url=base_url))
            if document is not None:
                documents.append(document)
        logger.info("search corpus: %d documents from %s", len(documents), folder)
        return cls(documents)

    def __len__(self) -> int:
        return len(self.documents)

    def search(self, query: str, k: int, *, snippet_chars: int = 120) -> list[Hit]:
        """The `k` best documents for `query`, best first; documents sharing no query term are left out."""
        query_terms = [term for term in bm25_terms([query])[0] if term in self._idf]
        if not query_terms:
            return []
        scores = self._bm25.get_scores(query_terms)
        order = [int(i) for i in np.argsort(-scores, kind="stable")[:k] if scores[i] > 0]
        weights = {term: self._idf[term] for term in query_terms}
        docs = [(self.documents[i], float(scores[i])) for i in order]
        return [
            Hit(title=d.title, url=d.url, snippet=snippet(d.text, weights, limit=snippet_chars), score=score)
            for d, score in docs
        ]


def start(cfg: Config, roots: tuple[str, ...]) -> Corpus | None:
    """The index of `corpus_dir` (None without one), built once (blocking: ~50 ms per HTML page on one core).

    Hits are file:// URLs for page_qa, which opens only files under the server's `[files] roots`: a corpus
    outside them is indexed, with a warning that its hits cannot be read."""
    if cfg.corpus_dir is None:
        return None
    folder = Path(cfg.corpus_dir)
    inside = any(folder.resolve().is_relative_to(Path(root).resolve()) for root in roots)
    if cfg.base_url is None and not inside:
        logger.warning("search corpus %s is outside [files] roots: page_qa cannot open its hits", folder)
    return Corpus.build(folder, max_docs=cfg.max_docs, base_url=cfg.base_url)


async def run(request: Request, cfg: Config, rt: Runtime[Corpus | None]) -> Response:
    return await guarded(Response, lambda: _search(request, cfg, rt))


async def _search(request: Request, cfg: Config, rt: Runtime[Corpus | None]) -> Response:
    if rt.state is None:
        raise ToolFailure("not_found", "no search corpus is configured on this server")
    # Scoring touches every document's postings: off the event loop for large corpora.
    hits = await asyncio.to_thread(rt.state.search, request.query, request.k, snippet_chars=cfg.snippet_chars)
    response = Response(query=request.query, hits=hits)
    # What the sub-agent read for the caller: the query and the hit passages it chose, not the whole index.
    response.tokens_read = rt.count_tokens(request.query) + sum(
        rt.count_tokens(f"{hit.title} {hit.snippet}") for hit in hits
    )
    response.tokens_returned = rt.count_tokens(response.summary())
    return response


def _document_paths(folder: Path, max_docs: int) -> list[Path]:
    paths = sorted(p for p in folder.rglob("*") if p.suffix.lower() in SUFFIXES and p.is_file())
    if len(paths) > max_docs:
        logger.warning("search corpus: indexing the first %d of %d files in %s", max_docs, len(paths), folder)
    return paths[:max_docs]


def document_url(path: Path, folder: Path, *, base_url: str | None) -> str:
    """`base_url/relative/path` when the folder is served over HTTP, else the file's absolute file:// URL."""
    if base_url is None:
        return path.resolve().as_uri()
    return base_url.rstrip("/") + "/" + quote(path.relative_to(folder).as_posix())


def read_document(path: Path, *, url: str) -> Document | None:
    """Title and text of one file; None (with a warning) for a file too big, unreadable or without text."""
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            logger.warning("search corpus: skipping %s (over %d bytes)", path, MAX_FILE_BYTES)
            return None
        raw = path.read_bytes()
    except OSError as exc:
        logger.warning("search corpus: skipping %s (%s)", path, exc)
        return None
    title, text = _html_text(raw) if path.suffix.lower() in HTML_SUFFIXES else _plain_text(raw)
    if not text:
        logger.warning("search corpus: skipping %s (no readable text)", path)
        return None
    return Document(title=title or path.stem.replace("_", " "), url=url, text=text)


def _html_text(raw: bytes) -> tuple[str, str]:
    doc = trafilatura.bare_extraction(raw, output_format="python", include_comments=False, with_metadata=True)
    if doc is None:
        return "", ""
    assert isinstance(doc, Extracted), type(doc)  # as_dict=False returns the Document object
    return doc.title or "", (doc.text or "").strip()


def _plain_text(raw: bytes) -> tuple[str, str]:
    """Text files as they are; a Markdown file's leading `# Heading` is its title."""
    text = raw.decode("utf-8", errors="replace").strip()
    first, _, rest = text.partition("\n")
    if first.startswith("# "):
        return first[2:].strip(), rest.strip()
    return "", text


def snippet(text: str, weights: dict[str, float], *, limit: int) -> str:
    """The sentence with the most query-term weight (the first on ties) and what follows, cut to `limit` chars."""
    parts = [s for line in text.splitlines() for s in _SENTENCE_END.split(line.strip()) if s]
    overlaps = (
        [sum(weights.get(t, 0.0) for t in set(words)) for words in bm25_terms(parts)] if parts else [0.0]
    )
    picked: list[str] = []
    for part in parts[overlaps.index(max(overlaps)) :]:
        picked.append(part)
        if sum(len(p) + 1 for p in picked) > limit:
            break
    window = " ".join(" ".join(picked).split())
    if len(window) <= limit:
        return window
    cut = window.rfind(" ", 0, limit)
    return window[: cut if cut > limit // 2 else limit] + "…"
