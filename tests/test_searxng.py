"""search's SearXNG backend over real loopback HTTP: a tiny server speaking SearXNG's JSON API (no mocks of httpx),
whose hits point at a loopback page server that page_qa then opens through the tool server's SSRF-guarded fetcher.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from app.ask import AskError, AskOptions, validate
from conductor.settings import ConfigError
from subagents import search
from subagents.common import Runtime
from subagents.fetch import FetchConfig
from tests.tool_server_fakes import FakeFactory, make_config, page_server, running, serving_handler
from tool_server.app import create_app
from tool_server.config import parse_config
from tool_server.embedded import embedded_config


@contextmanager
def searxng(results: list[dict], *, statuses: tuple[int, ...] = ()) -> Iterator[tuple[str, list[dict]]]:
    """A loopback server answering GET /search?format=json like SearXNG with `results`; the first requests are
    answered with `statuses` instead (e.g. 503, or 403 for a disabled json format). Yields its URL and the
    query parameters of every request it received."""
    seen: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            query = {k: v[0] for k, v in parse_qs(urlsplit(self.path).query).items()}
            seen.append(query)
            status = statuses[len(seen) - 1] if len(seen) <= len(statuses) else 200
            if urlsplit(self.path).path != "/search" or query.get("format") != "json":
                status = 404
            body = json.dumps({"query": query.get("q"), "number_of_results": 0, "results": results}).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # keep test output clean
            pass

    with serving_handler(Handler) as url:
        yield url, seen


def results_for(page_url: str) -> list[dict]:
    """SearXNG-shaped results: a page with a score, a non-web URL (dropped), one without a score."""
    return [
        {"url": f"{page_url}/ada", "title": "Ada Lovelace", "content": "English mathematician " * 20,
         "engine": "wikipedia", "score": 4.5},
        {"url": "magnet:?xt=urn:btih:abc", "title": "A torrent", "content": "x", "engine": "piratebay"},
        {"url": f"{page_url}/engine", "title": "Analytical Engine", "content": "Babbage's machine",
         "engine": "duckduckgo"},
    ]  # fmt: skip


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def runtime() -> Runtime:
    return Runtime(llm=None, fetcher=None, state=None)  # type: ignore[arg-type]


async def test_searxng_results_become_hits_in_its_order() -> None:
    """The backend sends the query with format=json and returns SearXNG's http(s) results in order: title, URL,
    content cut to snippet_chars, SearXNG's score when given, else 1/rank."""
    with searxng(results_for("http://127.0.0.1:9")) as (url, seen):
        cfg = search.Config(backend="searxng", searxng_url=url, snippet_chars=40)
        response = await search.run(search.Request(query="ada lovelace", k=5), cfg, runtime())
    assert response.ok, response.observation()
    assert seen == [{"q": "ada lovelace", "format": "json"}]
    assert [hit.title for hit in response.hits] == ["Ada Lovelace", "Analytical Engine"]
    assert response.hits[0].score == 4.5 and response.hits[1].score == pytest.approx(1 / 3)
    assert len(response.hits[0].snippet) <= 41 and response.hits[0].snippet.endswith("…")
    assert response.tokens_returned > 0


async def test_k_bounds_the_web_hits() -> None:
    """`k` is honoured for web results as for the corpus."""
    with searxng(results_for("http://127.0.0.1:9")) as (url, _):
        cfg = search.Config(backend="searxng", searxng_url=url)
        response = await search.run(search.Request(query="ada", k=1), cfg, runtime())
    assert [hit.title for hit in response.hits] == ["Ada Lovelace"]


async def test_a_transient_503_is_retried_once_and_only_once() -> None:
    """One 503 is retried and the search succeeds; two in a row give a retryable backend_error (2 requests)."""
    with searxng(results_for("http://127.0.0.1:9"), statuses=(503,)) as (url, seen):
        cfg = search.Config(backend="searxng", searxng_url=url)
        response = await search.run(search.Request(query="ada"), cfg, runtime())
    assert response.ok and len(seen) == 2
    with searxng(results_for("http://127.0.0.1:9"), statuses=(503, 503, 503)) as (url, seen):
        cfg = search.Config(backend="searxng", searxng_url=url)
        response = await search.run(search.Request(query="ada"), cfg, runtime())
    assert response.error is not None and len(seen) == 2
    assert response.error.kind == "backend_error" and response.error.retryable


async def test_json_format_disabled_names_the_settings_fix() -> None:
    """SearXNG's 403 for format=json (its default settings) is a non-retryable failure saying to add `json` to
    `search: formats` in settings.yml; it is not retried."""
    with searxng([], statuses=(403,)) as (url, seen):
        cfg = search.Config(backend="searxng", searxng_url=url)
        response = await search.run(search.Request(query="ada"), cfg, runtime())
    assert response.error is not None and not response.error.retryable and len(seen) == 1
    assert url in response.error.message and "search: formats" in response.error.message


async def test_an_unreachable_searxng_names_the_url_and_how_to_start_it() -> None:
    """Nobody on the port: a backend_error naming the URL and the docker command that starts SearXNG."""
    url = f"http://127.0.0.1:{free_port()}"
    cfg = search.Config(backend="searxng", searxng_url=url)
    response = await search.run(search.Request(query="ada"), cfg, runtime())
    assert response.error is not None and response.error.kind == "backend_error"
    assert url in response.error.message and "docker run" in response.error.message


def test_config_rejects_searxng_without_url_and_url_without_searxng() -> None:
    """[search] backend = "searxng" needs searxng_url; a searxng_url with the corpus backend is a forgotten
    backend line; both are ConfigErrors naming the fix, raised when the TOML is read."""
    with pytest.raises(ConfigError, match="needs searxng_url"):
        parse_config({"search": {"backend": "searxng"}})
    with pytest.raises(ConfigError, match='add backend = "searxng"'):
        parse_config({"search": {"searxng_url": "http://127.0.0.1:8888"}})
    with pytest.raises(ConfigError, match="http"):
        parse_config({"search": {"backend": "searxng", "searxng_url": "127.0.0.1:8888"}})
    cfg = parse_config({"search": {"backend": "searxng", "searxng_url": "http://127.0.0.1:8888"}})
    assert cfg.tools["search"].config.searxng_url == "http://127.0.0.1:8888"


async def test_page_qa_opens_a_web_hit_through_the_tool_server() -> None:
    """End to end on loopback: the tool server's search returns SearXNG's hits, and page_qa opens the first
    through the server's SSRF-guarded fetcher (127.0.0.0/8 allowed, as for the multihop tasks)."""
    with page_server() as pages, searxng(results_for(pages)) as (url, _):
        base = make_config(fetch=FetchConfig(allow_private_cidrs=("127.0.0.0/8",)))
        app = create_app(embedded_config(base, search_url=url), llm_factory=FakeFactory(answer="1815"))
        async with running(app) as client:
            found = (await client.post("/v1/tools/search", json={"query": "ada lovelace"})).json()
            hit = found["hits"][0]
            body = {"url": hit["url"], "question": "When was Ada Lovelace born?"}
            answer = (await client.post("/v1/tools/page_qa", json=body)).json()
    assert found["ok"] and hit["url"] == f"{pages}/ada"
    assert answer["ok"], answer
    assert answer["title"] == "Ada Lovelace" and "10 December 1815" in answer["quote"]


def test_ask_fails_fast_on_a_search_url_that_does_not_answer(tmp_path: Path) -> None:
    """`ask --search-url` checks SearXNG before anything loads: nobody there, or json disabled, is a one-line
    AskError with the fix; a working one passes and replaces the corpus; --corpus with it is refused."""
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(AskError, match="did not answer.*docker run"):
        validate(AskOptions("q", search_url=url))
    with searxng([], statuses=(403,)) as (url, _), pytest.raises(AskError, match="search: formats"):
        validate(AskOptions("q", search_url=url))
    with searxng(results_for("http://127.0.0.1:9")) as (url, _):
        assert validate(AskOptions("q", search_url=url)).corpus is None
        with pytest.raises(AskError, match="give one of them"):
            validate(AskOptions("q", search_url=url, corpus=tmp_path))
