"""search: building a corpus from a folder, BM25 ranking, snippets, URLs page_qa can open, run() results.

Unit tests index small temporary folders and the project's examples/corpus; the retrieval-quality test
indexes real HotpotQA paragraphs from ../shared/data (skipped when absent).
"""

from __future__ import annotations

import io
import json
import logging
import random
import re
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import urlparse
from urllib.request import url2pathname

import httpx
import pydantic
import pypdf
import pytest

from subagents import SUBAGENTS, documents, page_qa, pdf, search
from subagents.common import Files, Ref, Runtime, ToolFailure, approx_tokens
from subagents.fetch import FetchConfig, Fetcher
from subagents.handles import handle_for
from subagents.llm import Generation, Message
from subagents.pdf import PdfBudget, UnreadablePdf, pdf_text
from tests.pdf import damaged_pdf, form_pdf, minimal_pdf, pages_pdf
from tests.tool_server_fakes import FakeFactory, make_config, serving
from tool_server.app import create_app
from tool_server.config import default_tools

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "corpus"


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


HTML = """<!DOCTYPE html><html><head><title>Volcanoes of Iceland</title></head><body><nav>Home · Maps</nav>
<article><h1>Volcanoes of Iceland</h1><p>Iceland sits on the Mid-Atlantic Ridge, where two tectonic plates pull
apart, so it has many active volcanoes.</p><p>Eyjafjallajokull erupted in 2010 and its ash cloud closed much of
European airspace for several days.</p><p>Hekla has erupted more than twenty times since the year 874.</p>
</article></body></html>"""


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    write(tmp_path, "iceland.html", HTML)
    write(
        tmp_path,
        "notes/bread.md",
        "# Baking bread\n\nSourdough needs a starter of flour and water.\nBake hot.",
    )
    write(tmp_path, "tea.txt", "Green tea is steamed or pan-fired soon after picking, which stops oxidation.")
    write(tmp_path, "ignored.json", '{"volcano": "not indexed"}')
    write(tmp_path, "empty.html", "<html><body><script>x()</script></body></html>")
    return tmp_path


def runtime(corpus: search.Corpus | None) -> Runtime:
    return Runtime(llm=None, fetcher=None, state=corpus)  # type: ignore[arg-type]


def test_build_reads_html_markdown_and_text(folder: Path) -> None:
    """HTML gets trafilatura text and <title>, Markdown its heading, text files their name; other suffixes
    and files without text are skipped."""
    corpus = search.Corpus.build(folder, max_docs=100)
    titles = sorted(doc.title for doc in corpus.documents)
    assert titles == ["Baking bread", "Volcanoes of Iceland", "tea"]
    iceland = next(doc for doc in corpus.documents if doc.title.startswith("Volcanoes"))
    assert "Hekla" in iceland.text and "Maps" not in iceland.text


def test_file_urls_point_at_the_indexed_files(folder: Path) -> None:
    """Without base_url every hit URL is an absolute file:// URL of a file inside the corpus folder."""
    corpus = search.Corpus.build(folder, max_docs=100)
    for doc in corpus.documents:
        parsed = urlparse(doc.url)
        path = Path(url2pathname(parsed.path))
        assert parsed.scheme == "file" and path.is_file() and path.is_relative_to(folder.resolve())


def test_base_url_replaces_file_urls(folder: Path) -> None:
    """With base_url, URLs are the base plus the quoted relative path (for a loopback static server)."""
    corpus = search.Corpus.build(folder, max_docs=100, base_url="http://127.0.0.1:8123/docs/")
    urls = sorted(doc.url for doc in corpus.documents)
    assert urls[0] == "http://127.0.0.1:8123/docs/iceland.html"
    assert "http://127.0.0.1:8123/docs/notes/bread.md" in urls


def test_max_docs_caps_the_index(folder: Path) -> None:
    """Only the first max_docs files in path order are indexed."""
    assert len(search.Corpus.build(folder, max_docs=2)) == 1  # empty.html is first and has no text


def test_missing_folder_fails_fast(tmp_path: Path) -> None:
    """A misconfigured corpus folder stops server start-up instead of serving an empty index."""
    with pytest.raises(FileNotFoundError):
        search.Corpus.build(tmp_path / "nope", max_docs=10)


def test_search_ranks_and_snippets(folder: Path) -> None:
    """The matching document comes first with a short snippet around the matching sentence; k is honoured;
    documents sharing no query term are not returned."""
    corpus = search.Corpus.build(folder, max_docs=100)
    hits = corpus.search("ash cloud airspace", 5, snippet_chars=60)
    assert [hit.title for hit in hits] == ["Volcanoes of Iceland"]
    assert hits[0].snippet.startswith("Eyjafjallajokull erupted in 2010") and len(hits[0].snippet) <= 61
    assert len(corpus.search("volcanoes tea bread sourdough", 2)) == 2


@pytest.mark.parametrize("query", ["zebra quantum", "what is the", "!!!"])
def test_queries_without_known_terms_return_nothing(folder: Path, query: str) -> None:
    """Unknown words, stopwords only or punctuation: an empty list, not an error or random documents."""
    assert search.Corpus.build(folder, max_docs=100).search(query, 5) == []


def test_empty_corpus_searches_without_error(tmp_path: Path) -> None:
    """A folder with no documents builds and answers every query with no hits."""
    assert search.Corpus.build(tmp_path, max_docs=10).search("anything", 3) == []


async def test_run_returns_hits_by_handle(folder: Path) -> None:
    """run() formats hits as `handle title — snippet` lines, never the file:// URL (a server path), the handle
    derived from the file's place in the corpus; it counts tokens both ways and registers the handles."""
    corpus = search.Corpus.build(folder, max_docs=100)
    response = await search.run(
        search.Request(query="Hekla eruptions", k=3), search.Config(), runtime(corpus)
    )
    assert response.ok and [hit.title for hit in response.hits] == ["Volcanoes of Iceland"]
    hit = response.hits[0]
    assert hit.id == handle_for("page", "corpus/iceland.html") and hit.url.startswith("file:///")
    assert response.summary() == f"{hit.id} Volcanoes of Iceland — {hit.snippet}"
    assert response.refs() == [(hit.id, Ref("page", hit.url, "Volcanoes of Iceland"))]
    assert response.tokens_returned == approx_tokens(response.summary()) and response.tokens_read > 0


async def test_run_without_hits_is_ok_and_says_so(folder: Path) -> None:
    """No match is a successful call whose observation says nothing matched."""
    corpus = search.Corpus.build(folder, max_docs=100)
    response = await search.run(search.Request(query="zebra"), search.Config(), runtime(corpus))
    assert response.ok and response.hits == []
    assert response.observation() == "no documents match 'zebra'"


async def test_run_without_corpus_is_not_found() -> None:
    """A server started without corpus_dir answers with a structured not_found error."""
    response = await search.run(search.Request(query="anything"), search.Config(), runtime(None))
    assert response.error is not None and response.error.kind == "not_found"
    assert "no search corpus" in response.observation()


@pytest.mark.parametrize("k", [0, 11])
def test_k_is_bounded(k: int) -> None:
    """k outside 1..10 is rejected at the boundary."""
    with pytest.raises(pydantic.ValidationError):
        search.Request(query="x", k=k)


@pytest.mark.parametrize("k", ['"3"', "3.0", "true"])
def test_k_must_be_a_json_integer(k: str) -> None:
    """k is strict: a string, a float or a boolean is a type mistake the policy sees, not coerced to 3."""
    with pytest.raises(pydantic.ValidationError):
        search.Request.model_validate_json(f'{{"query": "x", "k": {k}}}')
    assert search.Request.model_validate_json('{"query": "x", "k": 3}').k == 3


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("BM25 saturation parameter k1", "bm25.html"),
        ("SmolLM2 attention heads vocabulary", "smollm2.html"),
        ("group relative policy optimization critic", "grpo.html"),
        ("number plate recognition OCR", "licence-plates.html"),
        ("ffprobe extract frames", "ffmpeg.html"),
        ("tool server observation cut marker", "tool-server.html"),
    ],
)
def test_example_corpus(query: str, expected: str) -> None:
    """Every page of examples/corpus indexes with its title and is the top hit for a query on its topic;
    five hits with snippets fit the observation cap."""
    corpus = search.Corpus.build(EXAMPLES, max_docs=100)
    assert len(corpus) == len(list(EXAMPLES.glob("*.html")))
    assert all(doc.title and len(doc.text) > 500 for doc in corpus.documents)
    hits = corpus.search(query, 5)
    assert hits[0].url.endswith("/" + expected)
    response = search.Response(query=query, hits=corpus.search("the model", 5))
    assert "truncated" not in response.observation()


class FixedLLM:
    """Always answers "Fabrice Bellard" (enough to check the plumbing)."""

    model_id = "fixed"
    multimodal = False

    async def generate(self, messages: list[Message], *, max_new_tokens: int) -> Generation:
        return Generation(
            text="Fabrice Bellard", prompt_tokens=approx_tokens(messages[-1].content), completion_tokens=4
        )

    def count_tokens(self, text: str) -> int:
        return approx_tokens(text)

    async def aclose(self) -> None:
        return None


async def test_hit_urls_open_in_page_qa_through_the_real_fetcher() -> None:
    """A search hit's file:// URL is readable by page_qa when the fetcher allows the corpus root, and the
    page it reads is the one the hit named."""
    corpus = search.Corpus.build(EXAMPLES, max_docs=100)
    hit = corpus.search("Fabrice Bellard", 1)[0]
    fetcher = Fetcher(FetchConfig(), roots=(str(EXAMPLES),))
    rt = Runtime(llm=FixedLLM(), fetcher=fetcher, state=None)  # type: ignore[arg-type]
    request = page_qa.Request(url=hit.url, question="Who started FFmpeg?")
    try:
        response = await page_qa.run(
            request, page_qa.Config(answer_mode="free"), rt
        )  # any answer: the fetch is tested
    finally:
        await fetcher.aclose()
    assert response.ok, response.observation()
    assert response.title == hit.title and response.url == hit.url
    assert response.quote.startswith("Fabrice Bellard started the project in 2000")


def hotpot_folder(shared: Path, folder: Path, n_questions: int) -> list[dict]:
    """Write every context paragraph of the first `n_questions` HotpotQA dev questions as `# title` Markdown."""
    lines = (shared / "multihop/hotpotqa_dev.jsonl").read_text(encoding="utf-8").splitlines()
    rows = [json.loads(line) for line in lines[:n_questions]]
    for row in rows:
        for title, sentences in zip(row["context"]["title"], row["context"]["sentences"], strict=True):
            name = re.sub(r"\W+", "_", title)[:80] + ".md"
            write(folder, name, f"# {title}\n\n{''.join(sentences)}")
    return rows


def test_hotpotqa_supporting_paragraphs_rank_in_top_5(shared_data: Path, tmp_path: Path) -> None:
    """Over 20 questions' 200 paragraphs (each question's 8 distractors were chosen to look relevant), a
    supporting paragraph is in the top 5 for at least 90% of questions (measured 19/20; 289/300 over the
    whole dev file) and both are for at least half (13/20)."""
    rows = hotpot_folder(shared_data, tmp_path, 20)
    corpus = search.Corpus.build(tmp_path, max_docs=1000)
    assert len(corpus) >= 190
    found_any = found_both = 0
    for row in rows:
        top = {hit.title for hit in corpus.search(row["question"], 5)}
        supporting = set(row["supporting_facts"]["title"])
        found_any += bool(supporting & top)
        found_both += supporting <= top
    assert found_any >= 18 and found_both >= 10, (found_any, found_both)


PDF_LINES = ["Basalt columns form when thick lava cools slowly.", "Giants Causeway has about 40000 of them."]


@pytest.fixture
def mixed(folder: Path) -> Path:
    """The folder fixture plus a real PDF with a metadata title and one without."""
    (folder / "basalt.pdf").write_bytes(minimal_pdf(PDF_LINES, title="Columnar basalt"))
    (folder / "notes" / "untitled_scan.pdf").write_bytes(minimal_pdf(["Obsidian is volcanic glass."]))
    return folder


def test_the_hand_written_pdf_is_read_by_pypdf() -> None:
    """The test PDF is valid: pypdf returns its metadata title and both lines of its text."""
    title, text = documents.pdf_text(minimal_pdf(PDF_LINES, title="Columnar basalt"))
    assert title == "Columnar basalt"
    assert all(line in text for line in PDF_LINES), text


def test_build_reads_html_markdown_text_and_pdf(mixed: Path) -> None:
    """All four kinds are indexed; a PDF is titled by its metadata, else by its file name, and is searchable."""
    corpus = search.Corpus.build(mixed, max_docs=100)
    titles = sorted(doc.title for doc in corpus.documents)
    assert titles == ["Baking bread", "Columnar basalt", "Volcanoes of Iceland", "tea", "untitled scan"]
    assert corpus.search("basalt lava columns", 1)[0].url == (mixed / "basalt.pdf").resolve().as_uri()


def test_the_persistent_index_is_reused_until_a_file_changes(
    mixed: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second build of an unchanged folder extracts nothing (read_document is not called) and finds the
    same documents; editing a file (size or mtime) re-extracts, and the edit is searchable."""
    cache = tmp_path_factory.mktemp("index")
    first = search.Corpus.build(mixed, max_docs=100, cache_dir=cache)

    def no_extraction(path: Path, *, url: str) -> None:
        raise AssertionError(f"extracted {path} although the folder is unchanged")

    with monkeypatch.context() as patched:
        patched.setattr(documents, "read_document", no_extraction)
        again = search.Corpus.build(mixed, max_docs=100, cache_dir=cache)
    assert again.documents == first.documents
    (mixed / "tea.txt").write_text("Oolong tea is partly oxidised.", encoding="utf-8")
    changed = search.Corpus.build(mixed, max_docs=100, cache_dir=cache)
    assert changed.search("oolong", 1)[0].title == "tea"


def test_progress_reports_each_extracted_file_and_nothing_on_a_cache_hit(
    mixed: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """`progress(done, total)` is called once per candidate file while extracting, and never when the
    persistent index is reused (so `conductor ask` shows no bar for a cached folder)."""
    reports: list[tuple[int, int]] = []
    cache = tmp_path_factory.mktemp("index")
    search.Corpus.build(mixed, max_docs=100, cache_dir=cache, progress=lambda d, t: reports.append((d, t)))
    assert reports == [(i, 6) for i in range(1, 7)]  # 6 candidates, 5 with text
    search.Corpus.build(mixed, max_docs=100, cache_dir=cache, progress=lambda d, t: reports.append((d, t)))
    assert len(reports) == 6


def test_a_torn_index_file_is_rebuilt_not_trusted(
    mixed: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """An unreadable documents.json (a crash of an older writer, an edit by hand) is ignored and rewritten."""
    cache = tmp_path_factory.mktemp("index")
    (cache / "documents.json").write_text('{"format": 1, "fingerp', encoding="utf-8")
    assert len(search.Corpus.build(mixed, max_docs=100, cache_dir=cache)) == 5
    assert json.loads((cache / "documents.json").read_text(encoding="utf-8"))["format"] == documents.FORMAT


def test_index_dir_is_per_folder_and_base_url_under_conductor_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The persistent index lives under $CONDUCTOR_HOME/indexes, one folder per (resolved folder, base_url)."""
    monkeypatch.setenv("CONDUCTOR_HOME", str(tmp_path / "home"))
    plain = search.index_dir(tmp_path, None)
    assert plain.parent == tmp_path / "home" / "indexes"
    assert search.index_dir(tmp_path / "sub" / "..", None) == plain
    assert search.index_dir(tmp_path, "http://127.0.0.1:1/") != plain


def test_page_qa_reads_a_pdf_as_a_fetched_page_and_from_its_file_url(mixed: Path) -> None:
    """page_qa's extraction reads application/pdf bodies (what a server sends and what file://*.pdf is guessed
    as), so a PDF search hit can be opened and quoted; a damaged PDF is unsupported_media, not a crash."""
    page = documents.extract_page((mixed / "basalt.pdf").read_bytes(), "application/pdf")
    assert page.title == "Columnar basalt" and PDF_LINES[1] in page.text
    with pytest.raises(ToolFailure) as failure:
        documents.extract_page(b"%PDF-1.4\nnot really", "application/pdf")
    assert failure.value.error.kind == "unsupported_media"


async def test_a_pdf_hit_opens_in_page_qa_through_the_real_fetcher(mixed: Path) -> None:
    """A PDF hit's file:// URL goes through the fetcher (content type guessed from the name) into page_qa,
    whose quote is a sentence of the PDF."""
    hit = search.Corpus.build(mixed, max_docs=100).search("Giants Causeway basalt", 1)[0]
    fetcher = Fetcher(FetchConfig(), roots=(str(mixed),))
    rt = Runtime(llm=FixedLLM(), fetcher=fetcher, state=None)  # type: ignore[arg-type]
    request = page_qa.Request(url=hit.url, question="How many columns?")
    try:
        response = await page_qa.run(
            request, page_qa.Config(answer_mode="free"), rt
        )  # any answer: the fetch is tested
    finally:
        await fetcher.aclose()
    assert response.ok, response.observation()
    assert response.title == "Columnar basalt" and response.quote in " ".join(PDF_LINES)


def test_links_to_files_outside_the_roots_are_not_indexed(tmp_path: Path) -> None:
    """The attack: a `leak.txt` link in the corpus to a file outside every root was indexed and quoted in
    snippets (page_qa then refused to open it). Indexing applies the reading check: a link out of the corpus
    and every root is skipped, a link to a file in another root is indexed, and so is a link inside the corpus."""
    corpus, other_root, outside = tmp_path / "corpus", tmp_path / "other", tmp_path / "outside"
    write(corpus, "tea.txt", "Green tea is steamed soon after picking.")
    write(other_root, "coffee.txt", "Coffee beans are roasted before brewing.")
    secret = write(outside, "secret.txt", "The launch password is swordfish.")
    (corpus / "leak.txt").symlink_to(secret)
    (corpus / "beans.txt").symlink_to(other_root / "coffee.txt")
    (corpus / "same.txt").symlink_to(corpus / "tea.txt")
    cfg = search.Config(corpus_dir=str(corpus))
    built = search.start(cfg, (str(corpus), str(other_root)))
    assert built is not None
    assert sorted(Path(urlparse(d.url).path).name for d in built.documents) == [
        "coffee.txt",
        "tea.txt",
        "tea.txt",
    ]
    assert built.search("launch password swordfish", 5) == []
    assert [h.title for h in built.search("roasted coffee beans", 5)] == ["beans"]
    alone = search.Corpus.build(corpus, max_docs=10)  # no roots (conductor ask): the corpus folder itself
    assert sorted(d.title for d in alone.documents) == ["same", "tea"]


# ---------------------------------------------------------------- damaged and slow PDFs


def test_a_damaged_pdf_costs_only_that_file_and_is_named(
    mixed: Path, tmp_path_factory: pytest.TempPathFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """The attack: a PDF with 4 bytes of its trailer changed made pypdf raise AttributeError (real pypdf, checked
    here), which stopped the index build. The file is skipped, named in a warning and in the index's summary
    (with the other file skipped), the rest indexed; a reused persistent index still names it."""
    (mixed / "bad.pdf").write_bytes(damaged_pdf())
    with pytest.raises(AttributeError):
        pypdf.PdfReader(io.BytesIO(damaged_pdf()))
    cache = tmp_path_factory.mktemp("index")
    with caplog.at_level(logging.WARNING, logger="subagents"):
        corpus = search.Corpus.build(mixed, max_docs=100, cache_dir=cache)
    assert len(corpus) == 5 and corpus.skipped == (
        documents.Skipped("bad.pdf", "damaged PDF"),
        documents.Skipped("empty.html", "no readable text"),
    )
    expected = "5 documents; 2 files skipped: bad.pdf (damaged PDF), empty.html (no readable text)"
    assert corpus.summary() == expected
    assert any("bad.pdf (damaged PDF (AttributeError" in record.getMessage() for record in caplog.records)
    assert search.Corpus.build(mixed, max_docs=100, cache_dir=cache).summary() == expected


def test_the_server_starts_over_a_corpus_with_a_damaged_pdf(mixed: Path) -> None:
    """The attack: that damaged PDF in [search] corpus_dir failed the server's start-up ("Application startup
    failed"). Over real loopback HTTP the server starts, searches the other files, and its search state names
    the skipped file."""
    (mixed / "bad.pdf").write_bytes(damaged_pdf())
    tools = default_tools()
    tools["search"] = replace(tools["search"], config=replace(tools["search"].config, corpus_dir=str(mixed)))
    app = create_app(
        make_config(tools=tools, files=Files(roots=(str(mixed),))),
        subagents=SUBAGENTS,
        llm_factory=FakeFactory(),
    )
    with serving(app) as url:
        reply = httpx.post(f"{url}/v1/tools/search", json={"query": "basalt lava columns"}, timeout=30)
        state = app.state.host.states["search"]
    assert reply.status_code == 200 and reply.json()["hits"][0]["title"] == "Columnar basalt"
    assert "bad.pdf (damaged PDF)" in state.summary()


def mutated_pdf(seed: int) -> bytes:
    """One of two valid PDFs with 1-6 bytes changed, cut out or put in (PDF syntax characters), by `seed`."""
    rng = random.Random(seed)
    sources = [minimal_pdf(PDF_LINES, title="Basalt"), pages_pdf([PDF_LINES] * 3, title="Basalt")]
    data = bytearray(rng.choice(sources))
    for _ in range(rng.randint(1, 6)):
        at, edit = rng.randrange(len(data)), rng.random()
        if edit < 0.6:
            data[at] = rng.choice(b"0123456789 []<>()/R%\nobjendstreamxref")
        elif edit < 0.8:
            del data[at : at + rng.randint(1, 10)]
        else:
            data[at:at] = bytes(rng.choice(b"[]<>()/R 0") for _ in range(rng.randint(1, 5)))
    return bytes(data)


def test_no_damage_escapes_pdf_text_but_unreadable_pdf() -> None:
    """Fuzzed: 100 seeded mutations of valid PDFs each give text (a title that is a string) or UnreadablePdf,
    never another exception. The seeds include two on which pypdf 7 raises AttributeError (603) and TypeError
    (660), which escaped the old extraction."""
    outcomes = []
    for seed in range(600, 700):
        try:
            title, _ = pdf_text(mutated_pdf(seed))
        except UnreadablePdf as exc:
            outcomes.append(type(exc.__cause__).__name__)
        else:
            assert isinstance(title, str), (seed, title)
            outcomes.append("read")
    assert "read" in outcomes and len(set(outcomes)) > 2, sorted(set(outcomes))


LAVA = "Basalt columns form when thick lava cools slowly and contracts into prisms"


def test_pdf_text_stops_at_its_page_and_character_budgets(caplog: pytest.LogCaptureFixture) -> None:
    """A 60-page text-heavy PDF is read up to its page budget, then its character budget; the text read so far is
    kept and the cut logged."""
    book = pages_pdf([[f"{LAVA} on page {page} line {line}." for line in range(40)] for page in range(60)])
    with caplog.at_level(logging.WARNING, logger="subagents.pdf"):
        _, first = pdf_text(book, budget=PdfBudget(pages=5))
    assert "on page 4 line 39." in first and "on page 5 " not in first
    assert "cut before page 6 of 60: its budget of 5 pages is read" in caplog.text
    _, some = pdf_text(book, budget=PdfBudget(chars=10_000))
    assert len(some) == 10_000 and some.startswith(f"{LAVA} on page 0 line 0.")


def test_a_page_made_slow_to_read_is_cut_at_the_time_budget(caplog: pytest.LogCaptureFixture) -> None:
    """One page of 20,000 text lines (2 MB; whole, 3-5 s of pypdf here, growing with the square of its lines: the
    attack's 4 MB took 10 s) stops at the time budget, checked between its operators, and the cut is logged:
    the thread is free after the budget plus the page's parse (~0.6-1.3 s here)."""
    page = pages_pdf([[f"{LAVA}, line {line}." for line in range(20_000)]])
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="subagents.pdf"):
        _, text = pdf_text(page, budget=PdfBudget(seconds=0.2))
    elapsed = time.monotonic() - started
    assert "line 19999." not in text and "cut in page 1 of 1: its budget of 0.2 s is spent" in caplog.text
    assert elapsed < 3.0, elapsed  # the parse, the budget and a loaded machine's slack


def test_the_time_budget_keeps_the_text_read_before_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a clock that moves 1 ms a look (so the test does not hang on the machine's speed): a page cut between
    its operators keeps the lines it had shown, in order, also when they are drawn by a form XObject (which
    pypdf reads inside `except Exception`); a book cut between pages keeps its whole pages."""
    ticks = iter(range(10**9))
    monkeypatch.setattr(pdf, "time", SimpleNamespace(monotonic=lambda: next(ticks) / 1000))
    lines = [f"{LAVA}, line {line}." for line in range(2_000)]
    for made in (pages_pdf([lines]), form_pdf(lines)):
        shown = pdf_text(made, budget=PdfBudget(seconds=0.5))[1].splitlines()
        assert 100 < len(shown) < 300 and shown == lines[: len(shown)]
    book = pages_pdf([[f"{LAVA}, page {page}."] for page in range(100)])
    pages = pdf_text(book, budget=PdfBudget(seconds=0.5))[1].split("\n\n")
    assert 10 < len(pages) < 100 and pages[:10] == [f"{LAVA}, page {page}." for page in range(10)]


def test_a_page_whose_content_is_over_its_budget_is_not_parsed() -> None:
    """A page whose (decompressed) content stream is past the budget's bytes is not parsed: parsing cannot be
    stopped midway (100 kB of zlib inflate to 30 MB, 9 s). Reading stops there; earlier pages are kept."""
    book = pages_pdf([[f"{LAVA}, short."], [f"{LAVA}, line {line}." for line in range(100)]])
    _, text = pdf_text(book, budget=PdfBudget(content_bytes=2_000))
    assert text == f"{LAVA}, short."
