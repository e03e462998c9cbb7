"""The reader endpoint is untrusted input: whatever it sends, page_qa answers with an observation.

Every test talks over real loopback HTTP to tests/misbehaving_reader.py, a server that sends each bad reply for
real (not UTF-8, a wrong length, a redirect, a gzip bomb, one byte at a time): the reader client
(subagents/openai_llm.py) must turn each into a BackendError, which page_qa reports as `backend_error`.
"""

from __future__ import annotations

import asyncio
import time
import tracemalloc
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from conductor.http import MAX_REPLY_BYTES
from subagents.backends import build_llm
from subagents.common import Files
from subagents.llm import BackendConfig, BackendError, Message
from subagents.openai_llm import OpenAILLM
from tests.fake_openai_server import Script, create_openai_app, serve
from tests.misbehaving_reader import SHAPES, Reader, gzip_bomb, misbehaving_reader
from tests.tool_server_fakes import PAGE, FakeLLM, make_config, running
from tool_server.app import create_app
from tool_server.config import default_tools

USER = [Message(role="user", content="When was Ada Lovelace born?")]


@pytest.fixture
def reader() -> Iterator[Reader]:
    with misbehaving_reader() as served:
        yield served


def reader_config(url: str, **changes: Any) -> BackendConfig:
    """page_qa's model behind `url`, retrying nothing unless told (a malformed reply is never retried anyway)."""
    return BackendConfig(backend="openai", base_url=url, model="reader", **{"max_retries": 0, **changes})


async def generate(cfg: BackendConfig) -> BackendError:
    """The BackendError one generate call against `cfg` raises (the test fails on any other outcome)."""
    llm = OpenAILLM(cfg)
    try:
        with pytest.raises(BackendError) as caught:
            await llm.generate(USER, max_new_tokens=8)
    finally:
        await llm.aclose()
    return caught.value


# ---------------------------------------------------------------- malformed replies


@pytest.mark.parametrize("shape", sorted(SHAPES))
async def test_whatever_the_reader_sends_is_a_backend_error(reader: Reader, shape: str) -> None:
    """A 200 that is not JSON, not UTF-8, an HTML page, a list, a completion with the wrong types or none of
    its fields, NaN, nesting past any parser's depth, a broken or unknown compression, a body cut short, a 303
    to a login page, a 204, error statuses with HTML or binary bodies: each is a BackendError saying what came
    back in a few hundred characters (the body itself is never echoed), never another exception (before: 11
    such shapes escaped page_qa as HTTP 500)."""
    error = await generate(reader_config(reader.url(shape)))
    assert len(str(error)) < 500, str(error)
    assert "\ufffd" not in str(error) and "<html" not in str(error).lower()


def page_app(tmp_path: Path, base_url: str) -> Any:
    """The real app and page_qa, its model behind `base_url`, reading `PAGE` from a file under its roots; the
    other tools on fake models."""
    (tmp_path / "ada.html").write_text(PAGE)
    tools = default_tools()
    tools["page_qa"] = replace(tools["page_qa"], model=reader_config(base_url))
    cfg = make_config(files=Files(roots=(str(tmp_path),)), tools=tools)
    factory = lambda model: build_llm(model) if model.backend == "openai" else FakeLLM("fake")  # noqa: E731
    return create_app(cfg, llm_factory=factory)


async def test_page_qa_answers_every_malformed_reply_with_a_backend_error_observation(
    reader: Reader, tmp_path: Path
) -> None:
    """Through the real tool server: for every shape, POST /v1/tools/page_qa answers 200 with ok false and
    kind backend_error (the policy reads what went wrong; the episode is not an infrastructure failure), and
    the server stays healthy."""
    app = page_app(tmp_path, reader.url("not_json"))
    question = {"url": (tmp_path / "ada.html").as_uri(), "question": "When was Ada Lovelace born?"}
    async with running(app) as client:
        host = app.state.host
        for shape in sorted(SHAPES):
            await host.swap_backend("page_qa", reader_config(reader.url(shape)))
            reply = await client.post("/v1/tools/page_qa", json=question)
            assert reply.status_code == 200, (shape, reply.text[:200])
            assert reply.json()["error"]["kind"] == "backend_error", (shape, reply.json())
        assert (await client.get("/health")).status_code == 200


# ---------------------------------------------------------------- redirects


async def test_the_reader_client_follows_no_redirect(reader: Reader) -> None:
    """A 307 to another loopback port (one the fetch guard keeps closed) is a BackendError, and that port hears
    nothing: the prompt, page text included, goes only where it was configured to, and no other server's reply
    becomes the answer. A redirect loop costs one request, not 63; neither is retried."""
    elsewhere = create_openai_app(Script(reply="an answer from elsewhere"))
    with serve(elsewhere) as other_url:
        reader.redirect_to = f"{other_url}/chat/completions"
        moved = await generate(reader_config(reader.url("redirect"), max_retries=2))
        looped = await generate(reader_config(reader.url("loop"), max_retries=2))
    assert elsewhere.state.requests == []
    assert "redirect" in str(moved) and not moved.retryable and not looped.retryable
    assert reader.requests == ["/redirect/v1/chat/completions", "/loop/v1/chat/completions"]


# ---------------------------------------------------------------- size


@pytest.mark.parametrize("shape", ["huge_declared", "huge", "gzip_bomb"])
async def test_a_reply_past_the_cap_is_refused_without_holding_it(reader: Reader, shape: str) -> None:
    """A 100 MB reply, declared by its Content-Length or streamed with none, and a 100 KB gzip bomb that
    inflates to 100 MB, each end as a BackendError that says the reply is too large, while the memory Python
    allocates during the call stays within a few caps (before: the whole body, decoded, ~860 MB at 300 MB)."""
    reader.huge_bytes = 100 << 20
    gzip_bomb(reader.huge_bytes)  # built before measuring
    tracemalloc.start()
    try:
        error = await generate(reader_config(reader.url(shape)))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "too large" in str(error) and not error.retryable, str(error)
    assert peak < 8 * MAX_REPLY_BYTES, f"peak {peak / 1e6:.1f} MB"


# ---------------------------------------------------------------- time


async def test_a_trickling_reply_ends_at_the_request_budget(reader: Reader) -> None:
    """A reader that sends its reply one byte every 0.3 s ends the call at `request_timeout_s` (1 s here) with
    a retryable timeout, though no single read waited that long (before: every byte started the read timeout
    afresh, so the call lasted until the call deadline)."""
    started = time.monotonic()
    async with asyncio.timeout(10):
        error = await generate(reader_config(reader.url("trickle"), request_timeout_s=1.0))
    assert "timed out" in str(error) and error.retryable
    assert time.monotonic() - started < 2.5


# ---------------------------------------------------------------- headers and counts (issue 66)


@pytest.mark.parametrize("shape", ["retry_after_superscript", "retry_after_ms_superscript"])
async def test_an_unparseable_retry_after_is_treated_as_absent(reader: Reader, shape: str) -> None:
    """A 503 whose `Retry-After` or `retry-after-ms` is "²" (a digit to `str.isdigit()`, none to `float()`) is
    retried after the client's own backoff, as if the header were absent, and ends as a retryable BackendError
    naming the 503 (before: a ValueError, HTTP 500 from page_qa)."""
    started = time.monotonic()
    error = await generate(reader_config(reader.url(shape), max_retries=1))
    assert "503" in str(error) and error.retryable, str(error)
    assert reader.requests == [f"/{shape}/v1/chat/completions"] * 2
    assert time.monotonic() - started < 3.0  # the backoff of retry 1 is at most 1 s


async def test_a_reader_reporting_impossible_token_counts_is_a_backend_error(reader: Reader) -> None:
    """A completion whose usage.prompt_tokens is 10^30 is refused as a BackendError naming the field (the count
    is bounded by MAX_USAGE_TOKENS), so no such number reaches tokens_read or the metrics (before: accepted)."""
    error = await generate(reader_config(reader.url("usage_huge")))
    assert "usage.prompt_tokens" in str(error) and not error.retryable, str(error)
