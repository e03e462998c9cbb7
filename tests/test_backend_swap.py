"""Swapping the model behind one sub-agent by configuration, exercised for real over loopback HTTP.

The tool server is built from a TOML file (`load_config` + `create_app`) and served by uvicorn; the real
page_qa reads a loopback page and asks its model through the real `openai` backend, which talks to the
OpenAI-compatible fake endpoint of tests/fake_openai_server.py. Models that are not `openai` come from the
fake factory, so no weights are needed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from conductor.models import DEFAULT_READER
from conductor.settings import ConfigError
from subagents import SUBAGENTS
from subagents.backends import build_llm
from subagents.llm import LLM, BackendConfig
from tests.fake_openai_server import create_openai_app, serve, unused_port
from tests.tool_server_fakes import PAGE, FakeFactory, FakeLLM, page_server, serving
from tool_server.app import create_app
from tool_server.config import load_config
from tool_server.host import ToolHost

ENDPOINT_ANSWER = "10 December 1815"
QUESTION = "When was Ada Lovelace born?"
TOKEN_ENV = "CONDUCTOR_BACKEND_SWAP_TEST_TOKEN"
TOKEN = "swap-test-token"


class EndpointOrFake:
    """The real `build_llm` for `openai` configs (a real HTTP client); a FakeLLM for anything else."""

    def __init__(self) -> None:
        self.fakes = FakeFactory()

    def __call__(self, cfg: BackendConfig) -> LLM:
        if cfg.backend == "openai":
            return build_llm(cfg)
        return self.fakes(cfg)


@pytest.fixture
def endpoint() -> Iterator[tuple[str, list[dict[str, object]]]]:
    """A loopback OpenAI-compatible endpoint whose model answers ENDPOINT_ANSWER; (base URL, its requests)."""
    app = create_openai_app(FakeLLM("endpoint-model", answer=ENDPOINT_ANSWER))
    with serve(app) as base_url:
        yield base_url, app.state.requests


@pytest.fixture
def page_url() -> Iterator[str]:
    with page_server() as url:
        yield f"{url}/ada"


def write_config(tmp_path: Path, page_qa_model: str, *, extra: str = "") -> Path:
    """A server TOML: loopback pages allowed, a one-document search corpus, page_qa's model as given."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "engine.txt").write_text("The Analytical Engine was designed by Charles Babbage.")
    path = tmp_path / "server.toml"
    path.write_text(
        f'[server]\ntoken_env = "{TOKEN_ENV}"\n'
        '[fetch]\nallow_private_cidrs = ["127.0.0.0/8"]\n'
        f'[search]\ncorpus_dir = "{corpus}"\n'
        f"[page_qa.model]\n{page_qa_model}\n{extra}"
    )
    return path


def openai_section(base_url: str, *, model: str = "served-model", max_retries: int = 2) -> str:
    return f'backend = "openai"\nbase_url = "{base_url}"\nmodel = "{model}"\nmax_retries = {max_retries}'


def ask(client: httpx.Client, page_url: str) -> dict[str, object]:
    reply = client.post("/v1/tools/page_qa", json={"url": page_url, "question": QUESTION})
    assert reply.status_code == 200, reply.text
    body: dict[str, object] = reply.json()
    return body


def test_toml_points_page_qa_at_an_openai_endpoint(
    tmp_path: Path, endpoint: tuple[str, list[dict[str, object]]], page_url: str
) -> None:
    """`[page_qa.model] backend = "openai"` in the file makes page_qa ask that endpoint (with the served
    model name and the page's question), while the other tools keep their own backend and still work."""
    base_url, received = endpoint
    factory = EndpointOrFake()
    cfg = load_config(write_config(tmp_path, openai_section(base_url)))
    with (
        serving(create_app(cfg, llm_factory=factory)) as url,
        httpx.Client(base_url=url, timeout=30) as client,
    ):
        body = ask(client, page_url)
        search = client.post("/v1/tools/search", json={"query": "Analytical Engine"}).json()
        models = client.get("/health").json()["models"]
    assert body["ok"] is True and body["answer"] == ENDPOINT_ANSWER, body
    assert "1815" in str(body["quote"]) and str(body["quote"]) in " ".join(PAGE.split())
    assert len(received) == 1 and received[0]["model"] == "served-model"
    assert QUESTION in str(received[0]["messages"])
    assert search["ok"] is True and search["hits"][0]["url"].endswith("engine.txt"), search
    assert models["page_qa"] == "openai:served-model"
    assert {models[name] for name in ("image_ops", "video_summary", "search")} == {f"fake:{DEFAULT_READER}"}
    assert [llm.prompts for llm in factory.fakes.built] == [[]]  # the in-process model answered nothing


def test_admin_hot_swap_moves_page_qa_to_the_endpoint(
    tmp_path: Path,
    endpoint: tuple[str, list[dict[str, object]]],
    page_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """POST /admin/backends/page_qa (token from the configured env var) moves page_qa from backend A to
    the endpoint at run time: the same question is asked again (a new cache key), answered by the
    endpoint, and A is closed."""
    base_url, received = endpoint
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    factory = EndpointOrFake()
    free = '[page_qa]\nanswer_mode = "free"'  # the fake model's "fake answer" comes back as it said it
    cfg = load_config(write_config(tmp_path, 'model = "A"', extra=free))
    headers = {"Authorization": f"Bearer {TOKEN}"}
    swap_body = {"backend": "openai", "base_url": base_url, "model": "served-model"}
    with (
        serving(create_app(cfg, llm_factory=factory)) as url,
        httpx.Client(base_url=url, timeout=30, headers=headers) as client,
    ):
        before = ask(client, page_url)
        unauthorised = httpx.post(f"{url}/admin/backends/page_qa", json=swap_body, timeout=30)
        swap = client.post("/admin/backends/page_qa", json=swap_body)
        after = ask(client, page_url)
        models = client.get("/health").json()["models"]
    (model_a,) = [llm for llm in factory.fakes.built if llm.model_id == "fake:A"]
    assert before["ok"] is True and before["answer"] == "fake answer" and len(model_a.prompts) == 1
    assert unauthorised.status_code == 401
    assert swap.status_code == 200 and swap.json() == {"tool": "page_qa", "model_id": "openai:served-model"}
    assert after["ok"] is True and after["answer"] == ENDPOINT_ANSWER and after["cached"] is False, after
    assert len(received) == 1 and QUESTION in str(received[0]["messages"])
    assert model_a.closed and len(model_a.prompts) == 1
    assert models["page_qa"] == "openai:served-model" and models["search"] == f"fake:{DEFAULT_READER}"


def test_refused_endpoint_is_a_backend_error_result(tmp_path: Path, page_url: str) -> None:
    """An endpoint nobody listens on gives page_qa a structured, retryable `backend_error` (HTTP 200),
    not a 500, and the failure is not cached: the next identical call tries the endpoint again."""
    dead = f"http://127.0.0.1:{unused_port()}/v1"
    cfg = load_config(write_config(tmp_path, openai_section(dead, max_retries=0)))  # fail in milliseconds
    with (
        serving(create_app(cfg, llm_factory=EndpointOrFake())) as url,
        httpx.Client(base_url=url, timeout=30) as client,
    ):
        first = ask(client, page_url)
        second = ask(client, page_url)
        page_qa = client.get("/metrics").json()["tools"]["page_qa"]
    error = first["error"]
    assert first["ok"] is False and isinstance(error, dict), first
    assert (error["kind"], error["retryable"]) == ("backend_error", True)
    assert "cannot reach endpoint" in error["message"]
    assert second["ok"] is False and second["cached"] is False
    assert page_qa["errors_by_kind"] == {"backend_error": 2} and page_qa["cache"]["hits"] == 0


class ScoringWhereTransformers(FakeFactory):
    """FakeLLMs that score where the config names the transformers backend, as the real backends do."""

    def __call__(self, cfg: BackendConfig) -> FakeLLM:
        llm = super().__call__(cfg)
        llm.scores = cfg.backend == "transformers"
        return llm


def test_extract_on_a_model_that_cannot_score_fails_start_up_and_swap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`[page_qa] answer_mode = "extract"` needs a model that scores: with an endpoint behind page_qa the server
    does not start (a ConfigError naming the setting; every model built is closed again), and a hot swap to
    an endpoint is refused with 422 `invalid_config` while the old model keeps answering."""
    extract = '[page_qa]\nanswer_mode = "extract"'
    dead = f"http://127.0.0.1:{unused_port()}/v1"
    factory = ScoringWhereTransformers()
    (tmp_path / "endpoint").mkdir()
    cfg = load_config(write_config(tmp_path / "endpoint", openai_section(dead), extra=extract))
    with pytest.raises(ConfigError, match='answer_mode = "extract".*fake:served-model cannot do'):
        asyncio.run(ToolHost.start(cfg, subagents=SUBAGENTS, llm_factory=factory))
    assert len(factory.built) == 2 and all(llm.closed for llm in factory.built)
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    (tmp_path / "local").mkdir()
    cfg = load_config(write_config(tmp_path / "local", 'model = "A"', extra=extract))
    swap_body = {"backend": "openai", "base_url": dead, "model": "served-model"}
    with (
        serving(create_app(cfg, llm_factory=factory)) as url,
        httpx.Client(base_url=url, timeout=30, headers={"Authorization": f"Bearer {TOKEN}"}) as client,
    ):
        swap = client.post("/admin/backends/page_qa", json=swap_body)
        models = client.get("/health").json()["models"]
    assert swap.status_code == 422 and swap.json()["error"]["kind"] == "invalid_config", swap.text
    assert models["page_qa"] == "fake:A"
    assert factory.built[-1].model_id == "fake:served-model" and factory.built[-1].closed


# ---------------------------------------------------------------- what a swap may name (issue 66)

BAD_BASE_URLS = {
    "carriage return": "http://127.0.0.1:8000/v1\r",
    "space": "http://127.0.0.1:8000/v 1",
    "ftp": "ftp://127.0.0.1/v1",
    "no host": "http:///v1",
    "port past 65535": "http://127.0.0.1:99999/v1",
    "no IDNA host": "http://\u2603.example/v1",
}


def test_an_admin_swap_to_a_bad_base_url_is_a_clear_422(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A swap whose base_url holds a `\\r` or a space, has the ftp:// scheme, no host, a port past 65535 or a host
    that is no IDNA name is answered 422 with a message naming base_url, and page_qa keeps its model (before:
    `\\r` and the IDNA host gave HTTP 500, ftp:// was accepted)."""
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    cfg = load_config(write_config(tmp_path, 'model = "A"'))
    with (
        serving(create_app(cfg, llm_factory=EndpointOrFake())) as url,
        httpx.Client(base_url=url, timeout=30, headers={"Authorization": f"Bearer {TOKEN}"}) as client,
    ):
        replies = {
            name: client.post(
                "/admin/backends/page_qa", json={"backend": "openai", "base_url": bad, "model": "m"}
            )
            for name, bad in BAD_BASE_URLS.items()
        }
        models = client.get("/health").json()["models"]
    for name, reply in replies.items():
        assert reply.status_code == 422, (name, reply.status_code, reply.text[:200])
        assert "base_url" in reply.json()["error"]["message"], (name, reply.text[:200])
    assert models["page_qa"] == "fake:A"


def test_an_admin_swap_may_name_only_the_listed_key_variables(
    tmp_path: Path, page_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A swap whose api_key_env names a variable `[server] allowed_api_key_envs` does not list is refused with 422
    and the endpoint hears nothing, so that variable's secret is never sent; a listed variable (here one of the
    default list) works and is the bearer token the endpoint receives (before: any variable's value went to
    whatever base_url the swap gave)."""
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    monkeypatch.setenv("CONDUCTOR_TEST_SECRET", "not-for-the-reader")
    monkeypatch.setenv("CONDUCTOR_READER_API_KEY", "reader-key")
    cfg = load_config(write_config(tmp_path, 'model = "A"', extra='[page_qa]\nanswer_mode = "free"'))
    endpoint = create_openai_app(FakeLLM("endpoint-model", answer=ENDPOINT_ANSWER))
    with (
        serve(endpoint) as base_url,
        serving(create_app(cfg, llm_factory=EndpointOrFake())) as url,
        httpx.Client(base_url=url, timeout=30, headers={"Authorization": f"Bearer {TOKEN}"}) as client,
    ):
        swap = {"backend": "openai", "base_url": base_url, "model": "served-model"}
        refused = client.post(
            "/admin/backends/page_qa", json={**swap, "api_key_env": "CONDUCTOR_TEST_SECRET"}
        )
        before = ask(client, page_url)
        allowed = client.post(
            "/admin/backends/page_qa", json={**swap, "api_key_env": "CONDUCTOR_READER_API_KEY"}
        )
        after = ask(client, page_url)
    assert refused.status_code == 422, refused.text
    assert "allowed_api_key_envs" in refused.json()["error"]["message"], refused.text
    assert before["answer"] == "fake answer" and allowed.status_code == 200, allowed.text
    assert after["answer"] == ENDPOINT_ANSWER, after
    assert [h["authorization"] for h in endpoint.state.headers] == ["Bearer reader-key"]
