"""Test doubles for the tool-server tests: fake sub-agent modules, a fake model factory, and runners that
serve an app in-process (ASGI transport) or over real loopback HTTP (uvicorn in a thread)."""

from __future__ import annotations

import asyncio
import os
import threading
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import uvicorn
from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from subagents import SUBAGENTS
from subagents.common import Runtime, ToolResponse, fail
from subagents.llm import BackendConfig, Generation, Message, cannot_score_error
from tool_server.config import ServerConfig, ToolLimits, ToolsConfig, default_tools

BASE_URL = "http://127.0.0.1:8700"


class FakeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: str = Field(min_length=1, description="what to echo")
    delay_s: float = Field(default=0.0, ge=0, le=30, description="how long the fake works")
    fail: bool = False
    crash: bool = False


class FakeResponse(ToolResponse):
    echo: str = ""
    model: str = ""
    session: str = ""

    def summary(self) -> str:
        return f"{self.echo} (by {self.model})"


@dataclass(frozen=True)
class FakeConfig:
    pass


def fake_subagents(calls: Counter[str]) -> dict[str, Any]:
    """One fake module per real tool name: echoes `text` after `delay_s`, naming the model that answered.
    `calls[name]` counts the runs that actually executed (cache hits do not run)."""

    def make(name: str) -> SimpleNamespace:
        async def run(request: FakeRequest, cfg: object, rt: Runtime[None]) -> FakeResponse:
            calls[name] += 1
            model = rt.llm.model_id  # captured at the start, like a real sub-agent's first generate
            await asyncio.sleep(request.delay_s)
            if request.crash:
                raise RuntimeError("a bug in the fake sub-agent")
            if request.fail:
                return fail(FakeResponse, "fetch_failed", "the fake page did not load")
            return FakeResponse(echo=request.text, model=model, session=rt.session)

        return SimpleNamespace(
            NAME=name,
            DESCRIPTION=f"Fake {name}.",
            CACHEABLE=name != "image_ops",  # as the real ones
            start=lambda cfg, roots: None,
            check_model=lambda cfg, llm: None,
            Request=FakeRequest,
            Response=FakeResponse,
            Config=FakeConfig,
            run=run,
        )

    return {name: make(name) for name in SUBAGENTS}


def pid_subagents(calls: Counter[str]) -> dict[str, Any]:
    """`fake_subagents` whose answers name the process that ran them: `echo` is "<text>@<pid>" (on Ray Serve,
    which replica answered; a cached answer names the one that computed it)."""
    modules = fake_subagents(calls)
    for module in modules.values():
        module.run = _with_pid(module.run)
    return modules


def _with_pid(run: Any) -> Any:
    async def run_and_sign(request: FakeRequest, cfg: object, rt: Runtime[None]) -> FakeResponse:
        response: FakeResponse = await run(request, cfg, rt)
        return response.model_copy(update={"echo": f"{response.echo}@{os.getpid()}"})

    return run_and_sign


class FakeLLM:
    """Answers every prompt with `answer`; remembers the prompts and whether it was closed."""

    def __init__(self, model_id: str, *, answer: str = "fake answer") -> None:
        self.model_id = model_id
        self.multimodal = False
        self.scores = False
        self.closed = False
        self.answer = answer
        self.prompts: list[list[Message]] = []

    async def generate(self, messages: list[Message], *, max_new_tokens: int) -> Generation:
        self.prompts.append(messages)
        return Generation(
            text=self.answer, prompt_tokens=sum(len(m.content) for m in messages), completion_tokens=2
        )

    async def score(self, prompts: list[list[Message]], replies: list[str]) -> list[list[float]]:
        raise cannot_score_error(self.model_id)

    def count_tokens(self, text: str) -> int:
        return len(text.split())

    async def aclose(self) -> None:
        self.closed = True


class FakeFactory:
    """Builds a FakeLLM named after the config's model; remembers every model it built."""

    def __init__(self, *, answer: str = "fake answer") -> None:
        self.built: list[FakeLLM] = []
        self.answer = answer

    def __call__(self, cfg: BackendConfig) -> FakeLLM:
        llm = FakeLLM(f"fake:{cfg.model}", answer=self.answer)
        self.built.append(llm)
        return llm


def make_config(**changes: Any) -> ServerConfig:
    """A ServerConfig whose token variable is unset unless the test sets it (never the developer's own)."""
    changes.setdefault("token_env", f"CONDUCTOR_TEST_TOKEN_{uuid.uuid4().hex[:8]}")
    return ServerConfig(**changes)


def with_limits(**limits: ToolLimits) -> ToolsConfig:
    """Default tool settings except the given per-tool limits."""
    tools = default_tools()
    for name, value in limits.items():
        tools[name] = replace(tools[name], limits=value)
    return tools


@asynccontextmanager
async def running(app: FastAPI, *, headers: dict[str, str] | None = None) -> AsyncIterator[httpx.AsyncClient]:
    """The app with its lifespan entered, and a client talking to it in-process."""
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url=BASE_URL, headers=headers) as client:
            yield client


@contextmanager
def serving(app: FastAPI, *, config: uvicorn.Config | None = None) -> Iterator[str]:
    """The app behind real uvicorn on 127.0.0.1 and a free port (or as `config` says), in a thread; yields
    the base URL."""
    config = config or uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30  # lifespan with fake models takes well under a second
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


PAGE = """<!doctype html><html><head><title>Ada Lovelace</title></head><body><article>
<h1>Ada Lovelace</h1>
<p>Augusta Ada King, Countess of Lovelace, was an English mathematician and writer. She is chiefly known
for her work on Charles Babbage's proposed mechanical general-purpose computer, the Analytical Engine.</p>
<p>Lovelace was born in London on 10 December 1815. She was the only legitimate child of the poet Lord Byron
and the reformer Anne Isabella Milbanke.</p>
<p>Her notes on the engine include what is recognised as the first algorithm intended to be carried out by
such a machine, which computed Bernoulli numbers.</p>
</article></body></html>"""


@contextmanager
def serving_handler(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """`handler` served on a free loopback port from a daemon thread; yields the base URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def redirect_server() -> Iterator[str]:
    """A loopback HTTP server answering GET /go?to=<location> with a 302 to that (unchecked) Location."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            location = parse_qs(urlsplit(self.path).query).get("to", ["/"])[0]
            self.send_response(302)
            self.send_header("Location", location)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:  # keep test output clean
            pass

    with serving_handler(Handler) as url:
        yield url


@contextmanager
def page_server(html: str = PAGE) -> Iterator[str]:
    """A loopback HTTP server answering every GET with `html`; yields its base URL."""
    body = html.encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # keep test output clean
            pass

    with serving_handler(Handler) as url:
        yield url
