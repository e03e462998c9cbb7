"""A reader endpoint that misbehaves, for real, on loopback: every reply shape the reader client must survive.

    with misbehaving_reader() as reader:
        OpenAILLM(BackendConfig(backend="openai", base_url=reader.url("not_json"), ...))
        reader.requests                      # the paths of every request received, in order
        reader.sent["huge"]                  # body bytes written before the client went away

Each shape has its own base URL (`http://127.0.0.1:<port>/<shape>/v1`), so one server serves them all. The
server is the standard library's threading HTTP server writing raw bytes: no framework between the test and the
wire, so a reply can be anything (not UTF-8, a wrong Content-Length, a gzip bomb, one byte every few seconds).
`SHAPES` are fixed replies; `huge`, `huge_declared`, `gzip_bomb`, `trickle`, `redirect` and `loop` are made per
request (`Reader.redirect_to` says where `redirect` points).
"""

from __future__ import annotations

import functools
import json
import threading
import time
import zlib
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

JSON = "application/json"


def completion(content: object, **extra: object) -> bytes:
    """A chat completion whose one choice's message content is `content` (any JSON value)."""
    return json.dumps(
        {"choices": [{"index": 0, "message": {"role": "assistant", "content": content}}], **extra}
    ).encode()


@dataclass(frozen=True)
class Fixed:
    """One fixed reply: status, headers and body, written as given (Content-Length added unless `length`)."""

    status: int
    content_type: str
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()
    length: int | None = None
    """The Content-Length to declare; None: the body's own length."""


# What the attack of issue 41 sent, and more: every one must end as a BackendError, never another exception.
SHAPES: dict[str, Fixed] = {
    "not_json": Fixed(200, JSON, b"not json{"),
    "not_utf8": Fixed(200, JSON, b'{"choices": [{"message": {"content": "\xff\xfe\xfd"}}]}'),
    "html": Fixed(200, "text/html", b"<!doctype html><html><body><h1>Sign in</h1></body></html>"),
    "content_number": Fixed(200, JSON, completion(123)),
    "content_list": Fixed(200, JSON, completion([{"type": "text", "text": "hi"}])),
    "choices_string": Fixed(200, JSON, b'{"choices": "x"}'),
    "choice_null": Fixed(200, JSON, b'{"choices": [null]}'),
    "message_null": Fixed(200, JSON, b'{"choices": [{"message": null}]}'),
    "message_missing": Fixed(200, JSON, b'{"choices": [{"index": 0}]}'),
    "list": Fixed(200, JSON, b"[]"),
    "object_empty": Fixed(200, JSON, b"{}"),
    "string": Fixed(200, JSON, b'"an answer"'),
    "empty_body": Fixed(200, JSON, b""),
    "usage_string": Fixed(200, JSON, completion("ok", usage="x")),
    "usage_negative": Fixed(200, JSON, completion("ok", usage={"prompt_tokens": -5, "completion_tokens": 1})),
    "nan": Fixed(
        200, JSON, b'{"choices": [{"message": {"content": "ok"}}], "usage": {"prompt_tokens": NaN}}'
    ),
    "deep": Fixed(200, JSON, b"[" * 100_000 + b"]" * 100_000),
    "bad_gzip": Fixed(200, JSON, b"this is not gzip", (("Content-Encoding", "gzip"),)),
    "brotli": Fixed(200, JSON, b"\x1b\x03\x00\xf8", (("Content-Encoding", "br"),)),
    "truncated": Fixed(200, JSON, completion("ok")[:10], length=1000),
    "see_other": Fixed(303, "text/html", b"", (("Location", "/login"),)),
    "status_204": Fixed(204, JSON, b""),
    "status_401_html": Fixed(401, "text/html", b"<html><body>Unauthorized</body></html>"),
    "status_404_binary": Fixed(404, "application/octet-stream", bytes(range(256))),
    # Issue 66: a token count no reply can have, and a retryable status whose wait is a digit float() refuses.
    "usage_huge": Fixed(200, JSON, completion("ok", usage={"prompt_tokens": 10**30, "completion_tokens": 1})),
    "retry_after_superscript": Fixed(503, JSON, b'{"error": "busy"}', (("Retry-After", "\u00b2"),)),
    "retry_after_ms_superscript": Fixed(503, JSON, b'{"error": "busy"}', (("retry-after-ms", "\u00b2"),)),
}
LOGIN_PAGE = Fixed(200, "text/html", b"<!doctype html><html><body><form>Password</form></body></html>")


@functools.cache
def gzip_bomb(inflated: int) -> bytes:
    """A gzip body that inflates to a chat completion of `inflated` bytes (about 1,000 times its own size)."""
    packer = zlib.compressobj(9, zlib.DEFLATED, zlib.MAX_WBITS | 16)
    head, tail = b'{"choices": [{"message": {"content": "', b'"}}]}'
    block = b"x" * (1 << 20)
    parts = [packer.compress(head)]
    parts += [packer.compress(block) for _ in range(inflated >> 20)]
    return b"".join([*parts, packer.compress(tail), packer.flush()])


@dataclass
class Reader:
    """The server's record and knobs (shared with its handler threads)."""

    base: str = ""
    requests: list[str] = field(default_factory=list)
    sent: Counter[str] = field(default_factory=Counter)
    redirect_to: str = ""
    """Where `redirect` sends the client (a 307, which repeats the POST with its body)."""
    huge_bytes: int = 300 << 20
    """What `huge` and `gzip_bomb` would send (inflated, for the bomb) if the client read it all."""
    trickle_every_s: float = 0.3
    """`trickle`: one byte of the reply this often."""

    def url(self, shape: str) -> str:
        return f"{self.base}/{shape}/v1"


def _handler(reader: Reader) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:  # noqa: N802 (the stdlib's name)
            self.rfile.read(int(self.headers.get("Content-Length", "0")))  # the whole request first
            reader.requests.append(self.path)
            shape = self.path.split("/")[1]
            try:
                self._reply(shape)
            except (BrokenPipeError, ConnectionResetError):  # the client went away: what the cap tests expect
                pass

        def do_GET(self) -> None:  # noqa: N802  (a 303 makes the client GET its Location)
            reader.requests.append(self.path)
            self._write(LOGIN_PAGE)

        def _reply(self, shape: str) -> None:
            if shape in SHAPES:
                self._write(SHAPES[shape])
            elif shape == "redirect":
                self._write(Fixed(307, JSON, b"", (("Location", reader.redirect_to),)))
            elif shape == "loop":
                self._write(Fixed(307, JSON, b"", (("Location", self.path),)))
            elif shape == "huge_declared":
                self._head(200, JSON, length=reader.huge_bytes)
            elif shape == "huge":
                self._stream(shape, [b'{"choices": [{"message": {"content": "'], b"x" * (1 << 20))
            elif shape == "gzip_bomb":
                bomb = gzip_bomb(reader.huge_bytes)
                self._head(200, JSON, length=len(bomb), headers=(("Content-Encoding", "gzip"),))
                self.wfile.write(bomb)
            elif shape == "trickle":
                self._trickle(b" " * 40 + completion("slow answer"))
            else:
                raise AssertionError(f"unknown shape {shape!r}")

        def _head(self, status: int, content_type: str, *, length: int | None, headers=()) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            if length is not None:
                self.send_header("Content-Length", str(length))
            for name, value in headers:
                self.send_header(name, value)
            self.send_header("Connection", "close")  # one request per connection: no reuse to reason about
            self.end_headers()

        def _write(self, reply: Fixed) -> None:
            length = len(reply.body) if reply.length is None else reply.length
            self._head(reply.status, reply.content_type, length=length, headers=reply.headers)
            self.wfile.write(reply.body)
            self.wfile.flush()

        def _stream(self, shape: str, head: list[bytes], block: bytes) -> None:
            """No Content-Length (the body ends when the connection does): blocks until the client stops."""
            self._head(200, JSON, length=None)
            for chunk in head:
                self.wfile.write(chunk)
            while reader.sent[shape] < reader.huge_bytes:
                self.wfile.write(block)
                reader.sent[shape] += len(block)

        def _trickle(self, body: bytes) -> None:
            self._head(200, JSON, length=len(body))
            for i in range(len(body)):
                self.wfile.write(body[i : i + 1])
                self.wfile.flush()
                reader.sent["trickle"] += 1
                time.sleep(reader.trickle_every_s)

        def log_message(self, format: str, *args: object) -> None:  # keep test output clean
            pass

    return Handler


@contextmanager
def misbehaving_reader() -> Iterator[Reader]:
    """The server on a free loopback port, in daemon threads; yields its `Reader`."""
    reader = Reader()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(reader))
    server.daemon_threads = True  # a trickle still writing when the test ends must not hold the process
    reader.base = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield reader
    finally:
        server.shutdown()
        server.server_close()
