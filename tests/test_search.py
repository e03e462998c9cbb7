"""search: building a corpus from a folder, BM25 ranking, snippets, URLs page_qa can open, run() results.

Unit tests index small temporary folders and the project's examples/corpus; the retrieval-quality test
indexes real HotpotQA paragraphs from ../shared/data (skipped when absent).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from urllib.parse import urlparse
from urllib.request import url2pathname

import pydantic
import pytest

from subagents import page_qa, search
from subagents.backends import Generation, Message
from subagents.common import Runtime, approx_tokens
from subagents.fetch import FetchConfig, Fetcher

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


async def test_run_returns_numbered_hits(folder: Path) -> None:
    """run() formats hits as numbered `title — url — snippet` lines and counts tokens both ways."""
    corpus = search.Corpus.build(folder, max_docs=100)
    response = await search.run(
        search.Request(query="Hekla eruptions", k=3), search.Config(), runtime(corpus)
    )
    assert response.ok and [hit.title for hit in response.hits] == ["Volcanoes of Iceland"]
    hit = response.hits[0]
    assert response.summary() == f"1. Volcanoes of Iceland — {hit.url} — {hit.snippet}"
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
        response = await page_qa.run(request, page_qa.Config(), rt)
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
