"""What protects the tool server: Host/Origin checks, bearer-token auth, a body-size cap; per-tool metrics.

Host/Origin rules (HostGuardMiddleware, every route and /mcp): see its docstring; 421 / 403 otherwise.

Auth rules (AuthMiddleware):
- A token comes from `$<token_env>` or the first line of `token_file`. Binding anything but loopback
  without one is refused at startup (`require_token_off_loopback`).
- Once a token is configured it guards every route except GET /health (liveness probes carry no secret).
  Missing or wrong: 401 with `WWW-Authenticate: Bearer`. Compared with `hmac.compare_digest`.
- /admin/* always needs the token, loopback or not; with no token configured admin is disabled (403).
- Two Authorization headers are 400 on every route, whatever they say: which one counts would be a guess (a
  proxy may read the other), and the first won before.

Connection rules (request deadline, keep-alive, response lifetime, connection caps per peer and in all, a
reserve for /health): tool_server/connections.py.

Overload rules (per-tool gates, queue bounds): tool_server/gates.py.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import math
import os
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tool_server.config import ServerConfig

# Latencies kept per tool for p50/p95: a thousand recent calls give stable percentiles in bounded memory.
LATENCY_WINDOW = 1000
OPEN_PATHS = frozenset({"/health"})
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")  # the Host names a loopback server is reached by


def load_token(cfg: ServerConfig) -> str | None:
    """The bearer token: `$<token_env>` if set and non-empty, else the first line of `token_file`, else None."""
    token = os.environ.get(cfg.token_env, "").strip()
    if not token and cfg.token_file is not None:
        lines = cfg.token_file.read_text(encoding="utf-8").splitlines()
        token = lines[0].strip() if lines else ""
    return token or None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name other than localhost: may resolve anywhere
        return False


class UnsafeBind(RuntimeError):
    """The configuration would serve the tools beyond this machine without a token."""


def require_token_off_loopback(cfg: ServerConfig, token: str | None) -> None:
    """Refuse to serve beyond this machine without a token: the tools fetch URLs and run models."""
    if token is None and not is_loopback(cfg.host):
        raise UnsafeBind(
            f"refusing to bind {cfg.host}: not loopback and no token; set ${cfg.token_env} or token_file"
        )


async def _send_json(send: Send, status: int, body: dict[str, object], headers: dict[str, str]) -> None:
    raw = json.dumps(body).encode()
    pairs = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    pairs += [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": pairs})
    await send({"type": "http.response.body", "body": raw})


def _error(kind: str, message: str) -> dict[str, object]:
    return {"error": {"kind": kind, "message": message}}


class HostGuardMiddleware:
    """One Host/Origin policy for every route, /mcp included: the DNS-rebinding guard.

    A web page the operator opens can point its own name at 127.0.0.1 and drive the tools through the
    operator's browser, which then sends that name as Host and the page's origin as Origin. So:
    - Host must be 127.0.0.1:<port>, localhost:<port> or [::1]:<port> (case-insensitive; <port> is the port
      the connection arrived on, so a server bound to port 0 takes whichever port it got, and the bare names
      on port 80), or one of `allowed_hosts`; else 421.
    - Origin, when present, must be http:// plus one of those Host values, or one of `allowed_origins`;
      else 403. Two Origin headers are 403 whatever they say (which one counts would be a guess).
    A name's trailing root dot is dropped before comparing (`localhost.:8700` is `localhost:8700`).
    In-process calls (httpx.ASGITransport, Starlette's TestClient) have no socket, so no browser behind
    them: their ASGI `server` holds the client's base-URL host ("embedded", "testserver") where a socket
    server puts the IP address it listens on, and the policy is skipped for them. A scope with no `server`
    at all (a unix socket) gets the policy, with the configured port.
    """

    def __init__(
        self, app: ASGIApp, *, port: int, allowed_hosts: Sequence[str], allowed_origins: Sequence[str]
    ) -> None:
        self.app = app
        self._port = port
        self._hosts = frozenset(_absolute_dot_dropped(host.lower()) for host in allowed_hosts)
        self._origins = frozenset(origin.lower() for origin in allowed_origins)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or _in_process(scope):
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        hosts = self._hosts_for(scope)
        host_values, origins = headers.getlist("host"), headers.getlist("origin")
        host = _absolute_dot_dropped(host_values[0].lower()) if len(host_values) == 1 else ""
        if host not in hosts:
            message = f"Host {host[:100]!r} is not this server (see allowed_hosts)"
            await _send_json(send, 421, _error("bad_host", message), {})
        elif len(origins) > 1:  # which one a browser, a proxy or this check reads would differ: refuse both
            await _send_json(send, 403, _error("bad_origin", "more than one Origin header"), {})
        elif origins and not self._origin_allowed(origins[0].lower(), hosts):
            message = f"Origin {origins[0][:100]!r} may not call this server (see allowed_origins)"
            await _send_json(send, 403, _error("bad_origin", message), {})
        else:
            await self.app(scope, receive, send)

    def _hosts_for(self, scope: Scope) -> frozenset[str]:
        """The Host values this request may carry: the loopback names at its port, plus `allowed_hosts`."""
        server = scope.get("server")
        port = server[1] if server and server[1] is not None else self._port
        named = [f"{name}:{port}" for name in LOOPBACK_NAMES]
        if port == (443 if scope.get("scheme") == "https" else 80):  # a default port may be left out
            named += LOOPBACK_NAMES
        return self._hosts.union(named)

    def _origin_allowed(self, origin: str, hosts: frozenset[str]) -> bool:
        if origin in self._origins:
            return True
        return origin.startswith("http://") and _absolute_dot_dropped(origin[len("http://") :]) in hosts


def _absolute_dot_dropped(host: str) -> str:
    """`localhost.:8700` -> `localhost:8700`: a name with its root's trailing dot is the same name (RFC 1034),
    which clients may send; an attacker's rebinding name stays foreign either way."""
    name, colon, port = host.rpartition(":")  # an IPv6 literal ends in "]" either way: nothing to drop
    return f"{name.removesuffix('.')}:{port}" if colon else host.removesuffix(".")


def _in_process(scope: Scope) -> bool:
    """Whether the request came through no socket: ASGI `server` names a host instead of an IP address."""
    server = scope.get("server")
    if not server:
        return False
    try:
        ipaddress.ip_address(server[0])
    except ValueError:
        return True
    return False


class AuthMiddleware:
    """Bearer-token check in front of every route (see the module docstring for the rules)."""

    def __init__(self, app: ASGIApp, *, token: str | None) -> None:
        self.app = app
        self._token = token.encode() if token is not None else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
        elif len(Headers(scope=scope).getlist("authorization")) > 1:  # which one counts would be a guess
            await _send_json(send, 400, _error("bad_request", "more than one Authorization header"), {})
        elif scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
        elif self._token is None and scope["path"].startswith("/admin"):
            message = "admin endpoints are disabled: the server has no token configured"
            await _send_json(send, 403, _error("forbidden", message), {})
        elif self._token is not None and not self._authorised(Headers(scope=scope)):
            message = "missing or wrong bearer token"
            await _send_json(send, 401, _error("unauthorized", message), {"WWW-Authenticate": "Bearer"})
        else:
            await self.app(scope, receive, send)

    def _authorised(self, headers: Headers) -> bool:
        assert self._token is not None
        scheme, _, given = headers.get("authorization", "").partition(" ")
        # compare_digest: the time taken does not reveal how many leading bytes matched.
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self._token)


class BodyLimitMiddleware:
    """HTTP 413 for bodies over `max_bytes`: Content-Length is checked first, then streamed bytes are
    counted (a chunked body has no Content-Length). The body is buffered (it is at most `max_bytes`) and
    replayed to the app, so the app never sees a partial body it has started acting on."""

    def __init__(self, app: ASGIApp, *, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(send)
            return
        messages = await self._read_body(receive)
        if messages is None:
            await self._refuse(send)
            return

        async def replay() -> Message:
            return messages.popleft() if messages else await receive()

        await self.app(scope, replay, send)

    async def _read_body(self, receive: Receive) -> deque[Message] | None:
        """The request's messages up to the end of the body; None once more than `max_bytes` arrived."""
        messages: deque[Message] = deque()
        size = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                return messages
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                return None
            if not message.get("more_body", False):
                return messages

    async def _refuse(self, send: Send) -> None:
        message = f"request body over the {self.max_bytes}-byte limit"
        await _send_json(send, 413, _error("too_large", message), {"Connection": "close"})


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 1]); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


@dataclass
class ToolMetrics:
    """Counts and recent latencies of one tool. An error is any call that did not return ok, including
    invalid arguments, overload refusals and internal failures (`errors_by_kind` separates them)."""

    calls: int = 0
    errors: int = 0
    errors_by_kind: Counter[str] = field(default_factory=Counter)
    latencies_ms: deque[float] = field(default_factory=lambda: deque(maxlen=LATENCY_WINDOW))

    def record(self, *, seconds: float, error: str | None) -> None:
        self.calls += 1
        self.latencies_ms.append(seconds * 1000)
        if error is not None:
            self.errors += 1
            self.errors_by_kind[error] += 1

    def snapshot(self) -> dict[str, object]:
        window = list(self.latencies_ms)
        return {
            "calls": self.calls,
            "errors": self.errors,
            "errors_by_kind": dict(self.errors_by_kind),
            "latency_ms": {
                "p50": percentile(window, 0.5),
                "p95": percentile(window, 0.95),
                "window": len(window),
            },
        }
