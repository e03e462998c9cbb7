"""The SSRF-safe fetcher: validate, resolve once, check, pin the address, redirect by hand, cap the body.

URLs come from the policy, so they are untrusted input that must not reach the machine's own network. Per hop:
1. `validate_url`: http/https only (file:// only under configured roots), no `user@host`, and numeric hosts
   read as the OS reads them (`2130706433`, `0x7f000001`, `127.1`, `0` are IPv4 literals, not names).
2. One lookup; `check_address` refuses the hop if ANY address is not global (loopback, private, link-local,
   CGNAT, multicast, reserved, IPv6 prefixes carrying IPv4) or is a cloud metadata endpoint.
   `allow_private_cidrs` opens listed networks (or one port of an address), never metadata addresses.
3. The socket goes to the checked IP (URL rewritten; Host header, TLS SNI and certificate check keep the
   name), so DNS rebinding has no second lookup to win. Redirects are followed by hand, each hop re-checked.
4. The body is decoded here with a hard cap on decoded bytes, so a gzip bomb stops at `max_bytes`.

Failures raise `ToolFailure` (blocked_url, invalid_args, fetch_failed, too_large, timeout, not_found).
Limits: only the first address is tried; brotli is not accepted (its decoder cannot bound one call's
output); a symlink swapped in between a file:// path check and the read is not caught.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import mimetypes
import re
import socket
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from conductor.http import ACCEPT_ENCODING, CappedDecoder, ReplyRefused
from subagents.addresses import IPAddress, allowed_network, check_address
from subagents.common import FetchedPage, ToolFailure, local_file, shown_path

log = logging.getLogger(__name__)

Resolver = Callable[[str, int], Awaitable[list[str]]]
"""`(host, port) -> addresses as strings`; injected in tests to script DNS answers."""
_LOOPBACK_V4 = ipaddress.IPv4Address("127.0.0.1")
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_WEB_SCHEMES = ("http", "https")
_HOSTNAME = re.compile(r"[a-z0-9_-]+(\.[a-z0-9_-]+)*")
_NUMERIC_LABEL = re.compile(r"[0-9]+|0x[0-9a-f]*")  # WHATWG URL: a host ending in a number is IPv4


@dataclass(frozen=True)
class FetchConfig:
    """Limits and exceptions for `Fetcher`."""

    allow_private_cidrs: tuple[str, ...] = ()
    """Networks reachable despite not being global, on every port ("127.0.0.0/8" for a loopback test server), or
    one address and port ("10.0.0.5:8080", "[fd00::5]:8080"): then its other services (a :6379) stay closed."""
    max_bytes: int = 5_000_000
    """Cap on decoded body bytes: 5 MB holds any article page; more is a media file or an attack."""
    max_redirects: int = 5
    """Redirect hops per call: real sites need 1-3 (http->https, www, trailing slash); loops are cut early."""
    connect_timeout_s: float = 5.0
    """TCP+TLS connect budget: a healthy server answers in well under a second; a silent one is gone."""
    read_timeout_s: float = 10.0
    """Longest wait for the next bytes of a response; slow dynamic pages take a few seconds."""
    total_timeout_s: float = 20.0
    """Deadline for the whole call, all hops included; httpx timeouts are per phase, so a trickling server
    could otherwise hold a call for redirects x reads x read_timeout_s."""
    user_agent: str = "conductor-fetch/0.1"
    """Sent with every request so site operators can identify the traffic."""


@dataclass(frozen=True)
class ParsedTarget:
    """A syntactically valid URL, not yet resolved. `url` is normalised (lower-case host, no trailing dot,
    IPv4 literals as dotted quads); `host` is its ASCII (IDNA) host and `port` the explicit or default port
    ('' and 0 for file://); `ip` is the address when the host is an IP literal in any spelling."""

    url: httpx.URL
    host: str
    port: int
    ip: IPAddress | None


def validate_url(url: str) -> ParsedTarget:
    """Syntax checks: scheme, no `user@` part, a well-formed host. Raises ToolFailure."""
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as exc:
        raise ToolFailure("invalid_args", f"malformed URL {url!r}: {exc}") from exc
    if not parsed.scheme:
        raise ToolFailure("invalid_args", f"not an absolute URL: {url!r}")
    if parsed.scheme not in (*_WEB_SCHEMES, "file"):
        raise ToolFailure("blocked_url", f"scheme {parsed.scheme!r} is not allowed (http and https only)")
    if parsed.userinfo:
        raise ToolFailure("blocked_url", "URLs with a user@ part are refused: they disguise the real host")
    if parsed.scheme == "file":
        if parsed.raw_host not in (b"", b"localhost") or "\x00" in parsed.path:
            raise ToolFailure("invalid_args", f"file URLs must be file:///absolute/path, got {url!r}")
        return ParsedTarget(url=parsed, host="", port=0, ip=None)
    host, ip = _parse_host(parsed.raw_host.decode("ascii"))
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    return ParsedTarget(url=parsed.copy_with(host=host), host=host, port=port, ip=ip)


def _parse_host(raw: str) -> tuple[str, IPAddress | None]:
    """Normalise a URL host; decode IP literals, including legacy IPv4 forms the OS accepts (inet_aton)."""
    host = raw.lower().removesuffix(".")
    if ":" in host:  # httpx has stripped the brackets of an IPv6 literal
        try:
            ip6 = ipaddress.IPv6Address(host)
        except ValueError as exc:
            raise ToolFailure("invalid_args", f"bad IPv6 literal {raw!r}") from exc
        return str(ip6), ip6
    if len(host) > 253 or not _HOSTNAME.fullmatch(host):
        raise ToolFailure("invalid_args", f"bad host name {raw!r}")
    if not _NUMERIC_LABEL.fullmatch(host.rsplit(".", 1)[-1]):
        return host, None
    try:  # decimal, octal, hex and short forms, exactly as getaddrinfo would read them
        ip4 = ipaddress.IPv4Address(socket.inet_aton(host))
    except OSError as exc:
        raise ToolFailure("invalid_args", f"host {raw!r} looks like an IPv4 address but is not one") from exc
    return str(ip4), ip4


async def resolve_host(host: str, port: int) -> list[str]:
    """The default resolver: the system's getaddrinfo through the event loop."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


@contextlib.contextmanager
def _transport_errors(url: httpx.URL) -> Iterator[None]:
    """Turn httpx's network errors and a refused body into ToolFailure."""
    try:
        yield
    except httpx.TimeoutException as exc:
        raise ToolFailure("timeout", f"{url}: {type(exc).__name__}") from exc
    except httpx.TransportError as exc:
        raise ToolFailure("fetch_failed", f"{url}: {type(exc).__name__}: {exc}") from exc
    except ReplyRefused as exc:  # past the cap, or an encoding no cap can bound (conductor/http.py)
        if exc.too_large:
            raise ToolFailure("too_large", f"{url}: the body is {exc}") from exc
        raise ToolFailure("fetch_failed", f"{url}: {exc}", retryable=False) from exc


def _check_status(response: httpx.Response, url: httpx.URL) -> None:
    status = response.status_code
    if status in (404, 410):
        raise ToolFailure("not_found", f"{url}: HTTP {status}")
    if status >= 300:  # a 3xx here has no Location: nothing to follow
        retryable = status >= 500 or status == 429
        raise ToolFailure("fetch_failed", f"{url}: HTTP {status}", retryable=retryable)


def _default_transport() -> httpx.AsyncHTTPTransport:
    # No keep-alive: connections are pooled by (scheme, IP, port), so a pooled TLS connection opened with
    # one host's SNI would otherwise carry requests for another host on the same IP.
    limits = httpx.Limits(max_keepalive_connections=0)
    return httpx.AsyncHTTPTransport(limits=limits, trust_env=False, retries=0)


class Fetcher:
    """Fetches http(s) pages (and file:// under allowed roots) under the checks in the module docstring."""

    def __init__(
        self,
        cfg: FetchConfig,
        *,
        roots: tuple[str, ...] = (),
        resolver: Resolver | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.cfg = cfg
        self._resolver = resolver or resolve_host
        self._allow = tuple(map(allowed_network, cfg.allow_private_cidrs))
        self._roots = roots  # what file:// URLs may read ([files] roots)
        self._timeout = httpx.Timeout(cfg.read_timeout_s, connect=cfg.connect_timeout_s).as_dict()
        # Straight to the transport, no httpx.AsyncClient: a client builds the next request of every 3xx even
        # when not following it, raising InvalidURL on a Location like `mailto:x@y` before `_redirect_target`
        # can judge it, and keeps a cookie jar across fetches. No env proxy or .netrc: trust_env=False.
        self._transport = transport or _default_transport()

    async def fetch(self, url: str) -> FetchedPage:
        """GET `url` within `total_timeout_s`; raises ToolFailure on any failure, including HTTP >= 400."""
        try:
            async with asyncio.timeout(self.cfg.total_timeout_s):
                return await self._fetch(url)
        except TimeoutError as exc:
            raise ToolFailure("timeout", f"{url}: no result within {self.cfg.total_timeout_s} s") from exc
        except ToolFailure as exc:
            if exc.error.kind == "blocked_url":
                log.warning("blocked %s: %s", url, exc.error.message)
            raise

    async def aclose(self) -> None:
        await self._transport.aclose()

    async def _fetch(self, url: str) -> FetchedPage:
        target = validate_url(url)
        if target.url.scheme == "file":
            return await self._fetch_file(url, target)
        for _ in range(self.cfg.max_redirects + 1):
            ip = await self._pin(target)
            with _transport_errors(target.url):
                response = await self._send(target, ip)
                try:
                    location = response.headers.get("location")
                    if response.status_code not in _REDIRECTS or location is None:
                        return await self._page(url, target, response)
                finally:
                    await response.aclose()
            target = _redirect_target(target, location)
        raise ToolFailure("fetch_failed", f"{url}: over {self.cfg.max_redirects} redirects", retryable=False)

    async def _pin(self, target: ParsedTarget) -> IPAddress:
        """Resolve once and check every address; the first one is where the request will go."""
        if target.ip is not None:
            addresses: list[IPAddress] = [target.ip]
        elif target.host == "localhost" or target.host.endswith(".localhost"):
            addresses = [_LOOPBACK_V4]  # RFC 6761: these names are loopback whatever DNS says
        else:
            try:
                found = await self._resolver(target.host, target.port)
            except socket.gaierror as exc:
                raise ToolFailure("fetch_failed", f"cannot resolve {target.host}: {exc.strerror}") from exc
            addresses = [ipaddress.ip_address(a) for a in found]
        if not addresses:
            raise ToolFailure("fetch_failed", f"{target.host} has no addresses")
        allow = [network for network, port in self._allow if port in (None, target.port)]
        for address in addresses:
            check_address(address, allow)
        return addresses[0]

    async def _send(self, target: ParsedTarget, ip: IPAddress) -> httpx.Response:
        headers = {
            "Host": target.url.netloc.decode("ascii"),
            "User-Agent": self.cfg.user_agent,
            "Accept": "*/*",
            "Accept-Encoding": ACCEPT_ENCODING,
        }
        # SNI and certificate verification use the name; the socket goes to the checked address.
        sni = {"sni_hostname": target.host} if target.ip is None and target.url.scheme == "https" else {}
        pinned = target.url.copy_with(host=str(ip))
        request = httpx.Request("GET", pinned, headers=headers, extensions={"timeout": self._timeout, **sni})
        log.debug("GET %s via %s", target.url, ip)
        response = await self._transport.handle_async_request(request)
        response.request = request
        return response

    async def _page(self, url: str, target: ParsedTarget, response: httpx.Response) -> FetchedPage:
        _check_status(response, target.url)
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.cfg.max_bytes:
            raise ToolFailure("too_large", f"Content-Length {declared} exceeds {self.cfg.max_bytes} bytes")
        if response.is_stream_consumed:  # built in memory (a test's MockTransport): httpx already decoded it
            body = CappedDecoder("identity", self.cfg.max_bytes).feed(response.content)
        else:
            decoder = CappedDecoder(response.headers.get("content-encoding", ""), self.cfg.max_bytes)
            chunks = [decoder.feed(chunk) async for chunk in response.aiter_raw()]
            body = b"".join(chunks) + decoder.flush()
        return FetchedPage(
            url=url,
            final_url=str(target.url),
            status=response.status_code,
            content_type=response.headers.get("content-type", ""),
            body=body,
        )

    async def _fetch_file(self, url: str, target: ParsedTarget) -> FetchedPage:
        if not self._roots:
            raise ToolFailure("blocked_url", "file:// is disabled (the server's [files] roots is empty)")
        # A link out of the roots is blocked_url, a FIFO refused; errors name no root and no symlink's target.
        path, _ = local_file(target.url.path, self._roots, what="page", outside="blocked_url")
        shown = shown_path(target.url.path, self._roots)
        body = await asyncio.to_thread(_read_file, path, self.cfg.max_bytes, shown=shown)
        content_type = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
        return FetchedPage(url=url, final_url=path.as_uri(), status=200, content_type=content_type, body=body)


def _redirect_target(current: ParsedTarget, location: str) -> ParsedTarget:
    """The next hop: re-validated, never a non-web scheme (a remote server must not open local files), and
    never `http:127.0.0.1:8080/x` (a scheme but no host: browsers read a path there, other clients a host)."""
    shown = location[:200]
    try:
        given = httpx.URL(location)
        joined = current.url.join(given)
    except httpx.InvalidURL as exc:
        raise ToolFailure("fetch_failed", f"bad redirect Location {shown!r}", retryable=False) from exc
    if given.scheme and given.scheme not in _WEB_SCHEMES:
        raise ToolFailure("blocked_url", f"redirect to a {given.scheme}: URL refused (http and https only)")
    if given.scheme and not given.host:
        raise ToolFailure("fetch_failed", f"redirect Location {shown!r} has no host", retryable=False)
    return validate_url(str(joined))


def _read_file(path: Path, cap: int, *, shown: str) -> bytes:
    try:
        with path.open("rb") as handle:
            body = handle.read(cap + 1)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as exc:
        raise ToolFailure("not_found", f"no such file: {shown!r}") from exc
    except OSError as exc:
        raise ToolFailure("fetch_failed", f"cannot read {shown!r}: {exc.strerror}", retryable=False) from exc
    if len(body) > cap:
        raise ToolFailure("too_large", f"{shown!r} exceeds {cap} bytes")
    return body
