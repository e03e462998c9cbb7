"""A tiny OpenAI-compatible chat-completions endpoint for tests, served on loopback for real HTTP.

    app = create_openai_app(Script(mode="echo"))     # scripted replies
    app = create_openai_app(llm)                     # a real backend (e.g. TransformersLLM) answers
    with serve(app) as base_url:                     # "http://127.0.0.1:<port>/v1"
        ...
    app.state.requests                               # every request body received (dicts, in order)
    app.state.headers                                # their headers

Only POST /v1/chat/completions and GET /v1/models exist. The script's `mode` may be changed between
requests; `delay_s` sleeps before any reply (for timeouts).
"""

from __future__ import annotations

import asyncio
import base64
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from subagents.common import approx_tokens
from subagents.llm import LLM, BackendError, Message

Mode = Literal["echo", "no_usage", "error_500", "error_422", "context_400", "empty_choices", "null_content"]

CONTEXT_MESSAGE = (
    "This model's maximum context length is 8192 tokens. However, you requested 9000 tokens "
    "(8904 in the messages, 96 in the completion). Please reduce the length of the messages or completion."
)


@dataclass
class Script:
    """What the fake endpoint answers. `echo` replies with the last message's text, or with `reply` when set."""

    mode: Mode = "echo"
    reply: str | None = None
    delay_s: float = 0.0
    retry_after_ms: int = 5
    """Sent with 5xx replies so client retries in tests wait milliseconds, not the default backoff."""


def _completion(text: str | None, *, model: str, usage: tuple[int, int] | None) -> dict[str, object]:
    body: dict[str, object] = {
        "id": "chatcmpl-test",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
    }
    if usage is not None:
        body["usage"] = {"prompt_tokens": usage[0], "completion_tokens": usage[1], "total_tokens": sum(usage)}
    return body


def _error(status: int, message: str, **headers: str) -> JSONResponse:
    body = {"object": "error", "message": message, "type": "BadRequestError", "code": status}
    return JSONResponse({"error": body}, status_code=status, headers=headers)


class _ImageUrl(BaseModel):
    url: str


class _Part(BaseModel):
    type: Literal["text", "image_url"]
    text: str = ""
    image_url: _ImageUrl | None = None


class _WireMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str | list[_Part]

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return " ".join(part.text for part in self.content if part.type == "text")

    def to_message(self) -> Message:
        parts = [] if isinstance(self.content, str) else self.content
        urls = [part.image_url.url for part in parts if part.image_url is not None]
        images = tuple(base64.b64decode(url.split(",", 1)[1]) for url in urls)
        return Message(role=self.role, content=self.text, images=images)


class _ChatRequest(BaseModel):
    model: str
    messages: list[_WireMessage]
    max_tokens: int = 96


def _scripted(script: Script, body: _ChatRequest) -> JSONResponse:
    text = body.messages[-1].text if script.reply is None else script.reply
    usage = (sum(approx_tokens(m.text) for m in body.messages), approx_tokens(text))
    if script.mode == "error_500":
        return _error(500, "internal error", **{"retry-after-ms": str(script.retry_after_ms)})
    if script.mode == "error_422":
        return _error(422, "unprocessable request")
    if script.mode == "context_400":
        return _error(400, CONTEXT_MESSAGE)
    if script.mode == "empty_choices":
        return JSONResponse({**_completion(text, model=body.model, usage=usage), "choices": []})
    if script.mode == "null_content":
        return JSONResponse(_completion(None, model=body.model, usage=usage))
    return JSONResponse(
        _completion(text, model=body.model, usage=None if script.mode == "no_usage" else usage)
    )


async def _answered(llm: LLM, body: _ChatRequest) -> JSONResponse:
    messages = [m.to_message() for m in body.messages]
    try:
        answer = await llm.generate(messages, max_new_tokens=body.max_tokens)
    except BackendError as exc:
        return _error(500 if exc.retryable else 400, str(exc))
    usage = (answer.prompt_tokens, answer.completion_tokens)
    return JSONResponse(_completion(answer.text, model=body.model, usage=usage))


def create_openai_app(llm_or_script: LLM | Script) -> FastAPI:
    """An OpenAI-compatible app answering from a real backend or from a `Script`."""
    app = FastAPI()
    app.state.requests = []
    app.state.headers = []

    @app.get("/v1/models")
    async def models() -> dict[str, object]:
        return {"object": "list", "data": [{"id": "fake", "object": "model", "owned_by": "tests"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> JSONResponse:
        raw = await request.json()
        app.state.requests.append(raw)
        app.state.headers.append(dict(request.headers))
        body = _ChatRequest.model_validate(raw)
        if isinstance(llm_or_script, Script):
            await asyncio.sleep(llm_or_script.delay_s)
            return _scripted(llm_or_script, body)
        return await _answered(llm_or_script, body)

    return app


@contextmanager
def serve(app: FastAPI) -> Iterator[str]:
    """Run `app` with uvicorn in a thread on 127.0.0.1 (a free port); yields the /v1 base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10  # startup takes milliseconds; 10 s only guards a hung test run
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "fake OpenAI server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def unused_port() -> int:
    """A loopback port nothing listens on (bound then released: a connection to it is refused)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
