"""ToolClient: every infrastructure failure is a ToolServerError; transient ones are retried (tenacity),
within the bounds and the whole-call deadline. A MockTransport plays the server; one test real uvicorn."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable

import httpx
import pytest
import tenacity

from tests.fakes import ok_result
from tests.tool_server_fakes import FakeFactory, fake_subagents, make_config, serving
from tool_server import client as client_module
from tool_server.app import create_app
from tool_server.client import MAX_RETRIES, ToolClient, ToolServerError

Reply = Callable[[int], httpx.Response]
"""attempt number (1-based) -> the server's answer, or raise to play a transport failure."""


class Server:
    """A MockTransport counting attempts; `reply(n)` answers (or raises on) the n-th attempt."""

    def __init__(self, reply: Reply) -> None:
        self.attempts = 0
        self.reply = reply
        self.transport = httpx.MockTransport(self._handle)

    def _handle(self, request: httpx.Request) -> httpx.Response:
        self.attempts += 1
        return self.reply(self.attempts)


def answer(status: int = 200, **headers: str) -> httpx.Response:
    body = ok_result("fine") if status == 200 else {"error": {"kind": "x", "message": "no"}}
    return httpx.Response(status, json=body, headers=headers)


@pytest.fixture(autouse=True)
def no_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """Retries without the jittered backoff (the policy is what is tested, not the sleeping)."""
    monkeypatch.setattr(client_module, "_backoff", tenacity.wait_none())


async def call(server: Server, *, deadline_s: float = 5.0) -> object:
    async with ToolClient("http://tools", transport=server.transport, deadline_s=deadline_s) as tools:
        return await tools.call("search", {"query": "q"})


RETRIED = [httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout, httpx.ReadError, httpx.WriteError,
           httpx.CloseError, httpx.RemoteProtocolError]  # fmt: skip
NOT_RETRIED = [httpx.ReadTimeout, httpx.WriteTimeout, httpx.LocalProtocolError, httpx.UnsupportedProtocol,
               httpx.ProxyError, httpx.DecodingError]  # fmt: skip


@pytest.mark.parametrize("error", [*RETRIED, *NOT_RETRIED])
async def test_every_transport_error_is_a_tool_server_error(error: type[httpx.HTTPError]) -> None:
    """No httpx exception escapes: a transport error that never clears is a ToolServerError, after
    MAX_RETRIES retries for transient ones, at once for the rest (a read timeout: the call may have run)."""

    def fail(attempt: int) -> httpx.Response:
        raise error("broken")

    server = Server(fail)
    with pytest.raises(ToolServerError, match=error.__name__):
        await call(server)
    assert server.attempts == (MAX_RETRIES + 1 if error in RETRIED else 1)


async def test_a_dropped_connection_is_retried_and_the_call_answers() -> None:
    """A ReadError (a kept-alive connection the server closed, as uvicorn does after a 500) is retried."""

    def drop_first(attempt: int) -> httpx.Response:
        if attempt == 1:
            raise httpx.ReadError("connection reset by peer")
        return answer()

    server = Server(drop_first)
    result = await call(server)
    assert getattr(result, "ok", None) is True and server.attempts == 2


@pytest.mark.parametrize(("status", "attempts"), [(502, 3), (503, 3), (504, 3), (500, 1), (401, 1), (413, 1)])
async def test_only_transient_statuses_are_retried(status: int, attempts: int) -> None:
    """502/503/504 are retried (then a ToolServerError naming the status); 500 and other 4xx are not."""
    server = Server(lambda attempt: answer(status))
    with pytest.raises(ToolServerError, match=f"HTTP {status}"):
        await call(server)
    assert server.attempts == attempts


async def test_a_plain_text_500_from_a_proxy_is_retried_and_the_call_answers() -> None:
    """A 500 the tool server did not write (plain text: Ray Serve's proxy for a replica that died mid-call) is
    retried and the repeat answers; the server's own 500s (JSON, a bug) are not (test above)."""

    def proxy_first(attempt: int) -> httpx.Response:
        if attempt == 1:
            return httpx.Response(500, text="Internal Server Error", headers={"content-type": "text/plain"})
        return answer()

    server = Server(proxy_first)
    result = await call(server)
    assert getattr(result, "ok", None) is True and server.attempts == 2


async def test_retry_after_is_honoured_up_to_its_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 429 waits its Retry-After (0.3 s here) before the retry; an hour-long Retry-After is cut to
    MAX_RETRY_AFTER_S."""
    short = Server(lambda attempt: answer(429, **{"Retry-After": "0.3"}) if attempt == 1 else answer())
    started = time.monotonic()
    assert getattr(await call(short), "ok", None) is True
    assert 0.3 <= time.monotonic() - started < 2 and short.attempts == 2
    monkeypatch.setattr(client_module, "MAX_RETRY_AFTER_S", 0.1)
    hour = Server(lambda attempt: answer(429, **{"Retry-After": "3600"}) if attempt == 1 else answer())
    started = time.monotonic()
    assert getattr(await call(hour), "ok", None) is True
    assert time.monotonic() - started < 2 and hour.attempts == 2


async def test_a_retry_after_that_is_no_plain_number_falls_back_to_backoff() -> None:
    """A 429 whose Retry-After is a Unicode digit ("²", which `str.isdigit()` accepts and `float()` refuses) or an
    HTTP date is retried after the usual backoff: the header is untrusted input, never a crash of the retry."""
    for value in ("²".encode("latin-1"), b"Wed, 21 Oct 2015 07:28:00 GMT", b"1e3", b"-1"):  # as on the wire
        server = Server(
            lambda attempt, value=value: answer(429, **{"Retry-After": value}) if attempt == 1 else answer()
        )
        assert getattr(await call(server), "ok", None) is True and server.attempts == 2, value


async def test_the_deadline_bounds_the_retries() -> None:
    """Retries and their waits stay inside the whole-call deadline: a 10 s Retry-After ends at 0.3 s."""
    server = Server(lambda attempt: answer(503, **{"Retry-After": "10"}))
    started = time.monotonic()
    with pytest.raises(ToolServerError, match="deadline"):
        await call(server, deadline_s=0.3)
    assert time.monotonic() - started < 2 and server.attempts == 1


async def test_concurrent_calls_retry_independently() -> None:
    """Each call has its own retry state: ten calls that each lose their first attempt all answer."""
    failed: Counter[str] = Counter()

    def handler(request: httpx.Request) -> httpx.Response:
        key = request.headers["X-Conductor-Session"]
        failed[key] += 1
        if failed[key] == 1:
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
        return answer()

    transport = httpx.MockTransport(handler)
    async with ToolClient("http://tools", transport=transport, deadline_s=5.0) as tools:
        results = await asyncio.gather(*(tools.call("search", {"q": 1}, session=f"s{i}") for i in range(10)))
    assert all(r.ok for r in results) and set(failed.values()) == {2}


async def test_an_answer_that_is_not_json_is_a_tool_server_error() -> None:
    """A 200 whose body is not the protocol (a proxy's HTML, a JSON list) is infrastructure, not a result."""
    for body in (b"<html>gateway</html>", b"[1, 2]"):
        with pytest.raises(ToolServerError):
            await call(Server(lambda attempt, body=body: httpx.Response(200, content=body)))


def test_after_a_500_the_next_call_over_real_http_answers() -> None:
    """Against real uvicorn, which closes the connection after a 500: the 500 is a ToolServerError and the
    call right after it answers (the stale pooled connection's ReadError is retried, never raised raw)."""
    app = create_app(make_config(), subagents=fake_subagents(Counter()), llm_factory=FakeFactory())

    async def crash_then_call(url: str) -> list[bool]:
        oks = []
        async with ToolClient(url, deadline_s=10.0) as tools:
            for i in range(20):
                with pytest.raises(ToolServerError, match="HTTP 500"):
                    await tools.call("search", {"text": "x", "crash": True})
                oks.append((await tools.call("search", {"text": str(i)})).ok)
        return oks

    with serving(app) as url:
        assert asyncio.run(crash_then_call(url)) == [True] * 20
