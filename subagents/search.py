"""search: keyword search over a local folder of documents, or the web through a SearXNG instance; returns
a handle (d_3fa9c1) page_qa takes for each hit, titles and snippets (subagents/handles.py).

Two backends behind the same Request and Response (`[search] backend`):

- "corpus" (default): BM25 over a folder. The corpus is built once at server start-up (`Corpus.build`,
  blocking: the server calls it in a thread) from the *.html, *.htm, *.txt, *.md and *.pdf files under a folder
  (subagents/documents.py); it is read-only afterwards, so concurrent searches share it without locks. Ranking
  is whole-document BM25 (bm25s) over title + text; the snippet is the sentence that shares most query terms,
  followed by its neighbours up to `snippet_chars`. URLs are `file://` absolute paths (the tool server lets
  page_qa's fetcher read that root), or, when the folder is also served over HTTP (a loopback static server),
  `base_url` + the file's relative path. With `persist_index` the extracted text is kept under
  $CONDUCTOR_HOME/indexes/ and reused at the next start while no file changed.
- "searxng": `GET {searxng_url}/search?q=...&format=json` on a SearXNG metasearch instance (its JSON API must
  be enabled: `search: formats: [html, json]` in its settings.yml). Hits are the http(s) results in its order;
  page_qa opens them through its SSRF-guarded fetcher like any URL the policy writes.

Limits: lexical matching only for the corpus (no stemming or synonyms: "cars" does not match "car"); English
stopwords; files past `max_docs` or documents.MAX_FILE_BYTES are not indexed (a warning is logged), nor are
damaged files (each named in a warning and in `Corpus.summary`, which the server logs); re-indexing needs a
restart. Web results are whatever SearXNG's engines return; the snippet is theirs, cut to length.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import httpx
import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from conductor.models import conductor_home
from subagents.common import Runtime, ToolFailure, ToolResponse, bm25_terms, guarded
from subagents.documents import Document, Progress, Skipped, document_paths, read_folder, skipped_files
from subagents.handles import Ref, handle_for
from subagents.llm import LLM

logger = logging.getLogger(__name__)

NAME = "search"
# Corpus hits depend only on the query and the index, which is read-only while the server runs. Web hits change
# over time, yet stay cached too (the flag is per module, the key includes the settings, so corpus and SearXNG
# entries never mix): within a server's life every episode asking the same query sees the same hits, which a
# group of RL episodes compared against each other needs, and page_qa's answers on those pages are cached the
# same way. Fresh web results need a restart (memory cache) or deleting `[cache] directory` (disk cache).
CACHEABLE = True
DESCRIPTION = (
    "Search the server's document collection by keywords; returns page ids (d_...) to read with page_qa, "
    "titles and snippets."
)

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
# SearXNG queries its engines with `outgoing.request_timeout` (2-3 s by default) and never waits longer than
# `max_request_timeout` (10 s by default): 15 s lets its slowest configured engine finish; a healthy instance on
# this machine or the LAN accepts a connection in milliseconds, so 3 s to connect means it is not there.
SEARXNG_TIMEOUT = httpx.Timeout(15.0, connect=3.0)
SEARXNG_RETRY_PAUSE_S = 0.5  # one retry only: a restarting container or a proxy hiccup, not an outage
SEARXNG_TRANSIENT = frozenset({502, 503, 504})  # the proxy in front of SearXNG, or SearXNG starting up
SEARXNG_START = (
    'start it with `docker run -d -p 127.0.0.1:8888:8080 -v "$PWD/searxng:/etc/searxng" searxng/searxng` '
    "with `search: formats: [html, json]` in ./searxng/settings.yml (docs/research-assistant.md: Search backends)"
)


class Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # strict: "3" is not a number of documents
    query: str = Field(min_length=1, max_length=300, description="keywords to look for")
    k: int = Field(default=5, ge=1, le=10, description="how many documents to return")


class Hit(BaseModel):
    """One document found: its handle (what the policy passes to page_qa), title, the URL page_qa opens (for
    traces and citations; never shown to the policy), the site of a web hit, a snippet and the score."""

    model_config = ConfigDict(frozen=True)
    id: str
    title: str
    url: str
    snippet: str
    score: float
    site: str = ""


class Response(ToolResponse):
    query: str = ""
    hits: list[Hit] = Field(default_factory=list)

    def summary(self) -> str:
        if not self.hits:
            return f"no documents match {self.query!r}"
        return "\n".join(
            f"{hit.id} {hit.title}" + (f" ({hit.site})" if hit.site else "") + f" — {hit.snippet}"
            for hit in self.hits
        )

    def refs(self) -> list[tuple[str, Ref]]:
        return [(hit.id, Ref("page", hit.url, hit.title)) for hit in self.hits]


@dataclass(frozen=True)
class Config:
    backend: Literal["corpus", "searxng"] = "corpus"
    """Where hits come from: "corpus" (BM25 over `corpus_dir`) or "searxng" (the web, through `searxng_url`)."""
    searxng_url: str | None = None
    """Base URL of a SearXNG instance with its JSON format enabled, e.g. "http://127.0.0.1:8888"; required by,
    and only allowed with, backend = "searxng"."""
    corpus_dir: str | None = None
    """Folder indexed at start-up; None leaves the tool without a corpus (calls return not_found). Unused with
    backend = "searxng"."""
    base_url: str | None = None
    """URL under which that folder is also served over HTTP; None gives file:// URLs."""
    max_docs: int = 10_000
    """Most files indexed (in path order): bounds start-up time (~50 ms per HTML page on one core) and memory."""
    persist_index: bool = False
    """Keep the text extracted from `corpus_dir` under $CONDUCTOR_HOME/indexes/ and reuse it at the next start
    while no file changed (size, mtime). Off by default, so servers and tests over temporary folders leave
    nothing behind; `conductor ask` turns it on for its corpus."""
    snippet_chars: int = 120
    """Snippet length: 5 hits with title, URL and snippet stay under the 1,200-character observation cap."""

    def __post_init__(self) -> None:
        if self.backend == "searxng" and not self.searxng_url:
            raise ValueError('backend = "searxng" needs searxng_url, e.g. "http://127.0.0.1:8888"')
        if self.backend != "searxng" and self.searxng_url:
            raise ValueError(f'searxng_url is set but backend is "{self.backend}": add backend = "searxng"')
        if self.searxng_url and urlsplit(self.searxng_url).scheme not in ("http", "https"):
            raise ValueError(f"searxng_url must be an http(s) URL, got {self.searxng_url!r}")


class Corpus:
    """A read-only BM25 index over documents, and the files of its folder it could not index (`skipped`)."""

    def __init__(
        self, documents: list[Document], *, root_url: str = "", skipped: Sequence[Skipped] = ()
    ) -> None:
        self.documents = documents
        self.skipped = tuple(skipped)
        # A hit's handle derives from the document's place in the corpus, its URL less `root_url` (the folder's
        # file:// URL or its base_url): the same in every checkout and on every server of the same folder.
        self._keys = [f"corpus/{d.url.removeprefix(root_url)}" if root_url else d.url for d in documents]
        doc_terms = bm25_terms([f"{doc.title}\n{doc.text}" for doc in documents])
        frequency = Counter(term for words in doc_terms for term in set(words))
        # Lucene's BM25 idf (what bm25s scores with): rare terms pick the snippet sentence.
        self._idf = {t: math.log(1 + (len(documents) - n + 0.5) / (n + 0.5)) for t, n in frequency.items()}
        import bm25s  # lazily: see common.bm25_terms

        self._bm25 = bm25s.BM25()
        if self._idf:  # bm25s cannot index a corpus without a single term
            self._bm25.index(doc_terms, show_progress=False)

    @classmethod
    def build(
        cls,
        folder: Path,
        *,
        max_docs: int,
        base_url: str | None = None,
        cache_dir: Path | None = None,
        progress: Progress | None = None,
        roots: tuple[str, ...] = (),
    ) -> Corpus:
        """Index the documents under `folder` (blocking): their text from `cache_dir` while the folder is
        unchanged (`index_dir` gives the usual place), else extracted, reporting `progress(done, total)` per file.
        Files linked from outside `folder` and `roots` are not indexed (documents.document_paths).
        Raises FileNotFoundError for a missing folder, PermissionError for one that cannot be listed."""
        if not folder.is_dir():
            raise FileNotFoundError(f"search corpus folder not found: {folder}")
        paths = document_paths(folder, max_docs, roots=roots)
        documents, skipped = read_folder(
            folder, paths, base_url=base_url, cache_dir=cache_dir, progress=progress
        )
        root_url = base_url.rstrip("/") + "/" if base_url else folder.resolve().as_uri() + "/"
        corpus = cls(documents, root_url=root_url, skipped=skipped)
        level = logging.WARNING if skipped else logging.INFO  # a skipped file is the user's to fix
        logger.log(level, "search corpus %s: %s", folder, corpus.summary())
        return corpus

    def __len__(self) -> int:
        return len(self.documents)

    def summary(self) -> str:
        """What the index holds, in a line: "12 documents; 1 file skipped: bad.pdf (damaged PDF)"."""
        held = f"{len(self.documents)} document" + "s" * (len(self.documents) != 1)
        return f"{held}; {skipped_files(self.skipped)}" if self.skipped else held

    def search(self, query: str, k: int, *, snippet_chars: int = 120) -> list[Hit]:
        """The `k` best documents for `query`, best first; documents sharing no query term are left out."""
        query_terms = [term for term in bm25_terms([query])[0] if term in self._idf]
        if not query_terms:
            return []
        scores = self._bm25.get_scores(query_terms)
        order = [int(i) for i in np.argsort(-scores, kind="stable")[:k] if scores[i] > 0]
        weights = {term: self._idf[term] for term in query_terms}
        return [self._hit(i, float(scores[i]), weights, snippet_chars) for i in order]

    def _hit(self, i: int, score: float, weights: dict[str, float], snippet_chars: int) -> Hit:
        doc = self.documents[i]
        text = snippet(doc.text, weights, limit=snippet_chars)
        return Hit(
            id=handle_for("page", self._keys[i]), title=doc.title, url=doc.url, snippet=text, score=score
        )


def index_dir(folder: Path, base_url: str | None) -> Path:
    """Where the persistent index of `folder` (as served under `base_url`) lives:
    $CONDUCTOR_HOME/indexes/<sha1 of the resolved folder path and base_url>."""
    key = hashlib.sha1(f"{folder.resolve()}\n{base_url or ''}".encode()).hexdigest()
    return conductor_home() / "indexes" / key


def start(cfg: Config, roots: tuple[str, ...]) -> Corpus | None:
    """The index of `corpus_dir` (None without one, or with SearXNG), built once (blocking: ~50 ms per HTML
    page on one core, a JSON read with a persistent index of an unchanged folder).

    Hits are file:// URLs for page_qa, which opens only files under the server's `[files] roots`: a corpus
    outside them is indexed, with a warning that its hits cannot be read."""
    if cfg.backend == "searxng" or cfg.corpus_dir is None:
        return None
    folder = Path(cfg.corpus_dir)
    inside = any(folder.resolve().is_relative_to(Path(root).resolve()) for root in roots)
    if cfg.base_url is None and not inside:
        logger.warning("search corpus %s is outside [files] roots: page_qa cannot open its hits", folder)
    cache_dir = index_dir(folder, cfg.base_url) if cfg.persist_index else None
    return Corpus.build(
        folder, max_docs=cfg.max_docs, base_url=cfg.base_url, cache_dir=cache_dir, roots=roots
    )


def check_model(cfg: Config, llm: LLM) -> None:
    """Any model serves: search asks none."""


async def run(request: Request, cfg: Config, rt: Runtime[Corpus | None]) -> Response:
    return await guarded(Response, lambda: _search(request, cfg, rt))


async def _search(request: Request, cfg: Config, rt: Runtime[Corpus | None]) -> Response:
    if cfg.backend == "searxng":
        assert cfg.searxng_url is not None  # Config.__post_init__
        hits = await web_search(cfg.searxng_url, request.query, k=request.k, snippet_chars=cfg.snippet_chars)
    elif rt.state is None:
        raise ToolFailure("not_found", "no search corpus is configured on this server")
    else:  # scoring touches every document's postings: off the event loop for large corpora
        hits = await asyncio.to_thread(
            rt.state.search, request.query, request.k, snippet_chars=cfg.snippet_chars
        )
    response = Response(query=request.query, hits=hits)
    # What the sub-agent read for the caller: the query and the hit passages it chose, not the whole index.
    response.tokens_read = rt.count_tokens(request.query) + sum(
        rt.count_tokens(f"{hit.title} {hit.snippet}") for hit in hits
    )
    response.tokens_returned = rt.count_tokens(response.summary())
    return response


async def web_search(searxng_url: str, query: str, *, k: int, snippet_chars: int) -> list[Hit]:
    """The first `k` http(s) results SearXNG at `searxng_url` gives for `query`, as Hits.

    One retry, after SEARXNG_RETRY_PAUSE_S, on transient errors only (a refused connection, HTTP 502/503/504);
    every failure is a ToolFailure whose message names the URL and the fix. A client per call: searches are a
    few per episode, and a connection to a local instance costs well under a millisecond."""
    # trust_env=False: the configured URL is reached directly; proxy variables are for SearXNG's own requests.
    async with httpx.AsyncClient(timeout=SEARXNG_TIMEOUT, trust_env=False) as client:
        for attempt in range(2):
            try:
                response = await client.get(_searxng_endpoint(searxng_url), params=_searxng_params(query))
            except httpx.ConnectError as exc:
                if attempt == 1:
                    raise _unreachable(searxng_url, exc) from exc
            except httpx.TransportError as exc:
                raise _transport_failure(searxng_url, exc) from exc
            else:
                if response.status_code not in SEARXNG_TRANSIENT or attempt == 1:
                    break
            logger.info("SearXNG at %s: transient failure, retrying once", searxng_url)
            await asyncio.sleep(SEARXNG_RETRY_PAUSE_S)
    return searxng_hits(_searxng_json(searxng_url, response), k=k, snippet_chars=snippet_chars)


def probe_searxng(searxng_url: str) -> None:
    """Check (blocking, no retry) that SearXNG at `searxng_url` answers a JSON search; a ToolFailure naming the
    fix otherwise. For entry points that must fail before loading anything (`conductor ask --search-url`)."""
    try:
        with httpx.Client(timeout=SEARXNG_TIMEOUT, trust_env=False) as client:
            response = client.get(_searxng_endpoint(searxng_url), params=_searxng_params("test"))
    except httpx.TransportError as exc:
        raise _transport_failure(searxng_url, exc) from exc
    _searxng_json(searxng_url, response)


def _searxng_endpoint(searxng_url: str) -> str:
    return searxng_url.rstrip("/") + "/search"


def _searxng_params(query: str) -> dict[str, str]:
    return {"q": query, "format": "json"}


def _transport_failure(searxng_url: str, exc: httpx.TransportError) -> ToolFailure:
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
        return _unreachable(searxng_url, exc)
    if isinstance(exc, httpx.TimeoutException):
        return ToolFailure(
            "timeout", f"SearXNG at {searxng_url} gave no results within {SEARXNG_TIMEOUT.read:g} s"
        )
    return ToolFailure("backend_error", f"SearXNG at {searxng_url} failed: {type(exc).__name__}: {exc}")


def _unreachable(searxng_url: str, exc: Exception) -> ToolFailure:
    reason = str(exc) or type(exc).__name__
    return ToolFailure(
        "backend_error", f"SearXNG at {searxng_url} did not answer ({reason}): {SEARXNG_START}"
    )


def _searxng_json(searxng_url: str, response: httpx.Response) -> Mapping[str, Any]:
    """The decoded body of a 200 answer; a ToolFailure naming the fix for the refusals SearXNG is known for."""
    status = response.status_code
    if status == 403:  # SearXNG's answer to format=json when its settings allow only html (its default)
        raise ToolFailure(
            "backend_error",
            f"SearXNG at {searxng_url} refused format=json (HTTP 403): add `json` to `search: formats` "
            "in its settings.yml and restart it",
            retryable=False,
        )
    if status == 429:  # its bot limiter, meant for public instances
        raise ToolFailure(
            "backend_error",
            f"SearXNG at {searxng_url} rate-limited this client (HTTP 429): set `server: limiter: false` "
            "in its settings.yml for a private instance",
        )
    if status != 200:
        raise ToolFailure("backend_error", f"SearXNG at {searxng_url} answered HTTP {status}")
    try:
        payload = response.json()
    except ValueError as exc:
        raise ToolFailure("backend_error", f"SearXNG at {searxng_url} sent no JSON: {exc}") from exc
    if not isinstance(payload, dict) or not isinstance(payload.get("results"), list):
        raise ToolFailure("backend_error", f"SearXNG at {searxng_url} sent JSON without a results list")
    return payload


def searxng_hits(payload: Mapping[str, Any], *, k: int, snippet_chars: int) -> list[Hit]:
    """The first `k` results with an http(s) URL, in SearXNG's order. Score: SearXNG's own `score` when it
    sends one (engines' positions and weights merged), else 1/rank; snippet: its `content`, cut to length."""
    hits: list[Hit] = []
    for rank, result in enumerate(payload["results"], 1):
        url = result.get("url") if isinstance(result, dict) else None
        if not isinstance(url, str) or urlsplit(url).scheme not in ("http", "https"):
            continue  # page_qa opens only web pages; SearXNG may list magnet links, images' data URLs ...
        score = result.get("score")
        hits.append(Hit(
            id=handle_for("page", url),
            title=clip(str(result.get("title") or url), 200),
            url=url,
            snippet=clip(str(result.get("content") or ""), snippet_chars),
            score=float(score) if isinstance(score, int | float) else 1.0 / rank,
            site=urlsplit(url).hostname or "",
        ))  # fmt: skip
        if len(hits) == k:
            break
    return hits


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
    return clip(" ".join(picked), limit)


def clip(text: str, limit: int) -> str:
    """`text` with its whitespace collapsed, cut at a word boundary to `limit` characters plus "…" when longer."""
    window = " ".join(text.split())
    if len(window) <= limit:
        return window
    cut = window.rfind(" ", 0, limit)
    return window[: cut if cut > limit // 2 else limit] + "…"
