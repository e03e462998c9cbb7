"""The SSRF-safe fetcher: every refused URL opens no socket; pinned, capped, deadline-bound fetches.

Unit tests inject a scripted resolver and an `httpx.MockTransport` that records each request (a request
reaching the transport is a socket the real transport would have opened). Integration tests run real HTTP and
HTTPS servers on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import os
import socket
import ssl
import threading
import time
import tracemalloc
import zlib
from collections.abc import AsyncIterator, Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from subagents.common import ToolFailure
from subagents.fetch import FetchConfig, Fetcher, check_address, resolve_host, validate_url

PUBLIC = "93.184.216.34"
DEFAULTS = FetchConfig()
Handler = Callable[[httpx.Request], httpx.Response]


def ok(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, headers={"Content-Type": "text/html"}, content=b"<p>hello</p>")


class Net:
    """A scripted resolver and a recording transport around one Fetcher.

    `dns` maps a name to its successive answers (the last one repeats); unknown names answer PUBLIC."""

    def __init__(
        self,
        handler: Handler = ok,
        *,
        dns: dict[str, list[list[str]]] | None = None,
        cfg: FetchConfig = DEFAULTS,
        roots: tuple[str, ...] = (),
    ) -> None:
        self.lookups: list[str] = []
        self.requests: list[httpx.Request] = []
        self._dns = dns or {}
        self._handler = handler
        transport = httpx.MockTransport(self._send)
        self.fetcher = Fetcher(cfg, roots=roots, resolver=self._resolve, transport=transport)

    async def _resolve(self, host: str, port: int) -> list[str]:
        self.lookups.append(host)
        answers = self._dns.get(host, [[PUBLIC]])
        return answers[min(self.lookups.count(host), len(answers)) - 1]

    def _send(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        return self._handler(request)


async def failure(net: Net, url: str) -> str:
    with pytest.raises(ToolFailure) as info:
        await net.fetcher.fetch(url)
    return info.value.error.kind


def redirect_to(location: str) -> Handler:
    return lambda request: httpx.Response(302, headers={"Location": location})


LOOPBACK_SPELLINGS = [
    "http://127.0.0.1/",
    "http://2130706433/",
    "http://0x7f000001/",
    "http://0X7F000001/",
    "http://127.1/",
    "http://0177.1/",
    "http://0/",
    "http://127.0.0.1./",
    "http://localhost/",
    "http://localhost./",
    "http://LocalHost:8080/",
    "http://api.localhost/",
    "http://[::1]/",
    "http://[::ffff:127.0.0.1]/",
    "http://[::ffff:7f00:1]/",
    "http://[::127.0.0.1]/",
    "http://[64:ff9b::7f00:1]/",
    "http://[2002:7f00:1::1]/",
    "http://[::]/",
]


@pytest.mark.parametrize("url", LOOPBACK_SPELLINGS)
async def test_every_loopback_spelling_is_blocked_before_any_lookup_or_socket(url: str) -> None:
    """Legacy IPv4 forms, localhost names and IPv6 wrappers of loopback are all refused, offline."""
    net = Net()
    assert await failure(net, url) == "blocked_url"
    assert net.lookups == [] and net.requests == []


async def test_dotted_octal_is_refused_by_the_url_parser() -> None:
    """httpx rejects four-part octal quads outright: still refused with no lookup and no socket."""
    net = Net()
    assert await failure(net, "http://0177.0.0.1/") == "invalid_args"
    assert net.lookups == [] and net.requests == []


@pytest.mark.parametrize(
    "url",
    [
        "http://169.254.169.254/latest/meta-data/",
        "http://[fd00:ec2::254]/",
        "http://100.100.100.200/",
        "http://168.63.129.16/machine",
        "http://[::ffff:169.254.169.254]/",
        "http://2852039166/",
    ],
)
async def test_metadata_addresses_are_blocked_even_inside_allowed_networks(url: str) -> None:
    """allow_private_cidrs never opens cloud metadata endpoints, in any spelling."""
    allow = ("169.254.0.0/16", "fd00::/8", "100.64.0.0/10", "168.63.0.0/16", "::ffff:0:0/96")
    net = Net(cfg=FetchConfig(allow_private_cidrs=allow))
    assert await failure(net, url) == "blocked_url"
    assert net.requests == []


async def test_an_allowed_address_port_opens_that_port_only() -> None:
    """The attack fetched a listener on :6379 of the one allowed address. An "address:port" entry opens that
    port alone: other ports of the address are blocked_url, directly or through a redirect; a network entry
    still opens every port; a malformed entry fails at start-up."""
    only = FetchConfig(allow_private_cidrs=("10.0.0.5:8080", "[fd00::5]:443"))
    net = Net(redirect_to("http://10.0.0.5:6379/"), cfg=only)
    assert await failure(net, "http://10.0.0.5:6379/") == "blocked_url"
    assert await failure(net, "http://10.0.0.6:8080/") == "blocked_url"
    assert await failure(net, "https://[fd00::5]:8443/") == "blocked_url"
    assert await failure(net, "http://10.0.0.5:8080/go") == "blocked_url"  # its redirect to :6379
    assert [str(r.url) for r in net.requests] == ["http://10.0.0.5:8080/go"]
    assert (await Net(cfg=only).fetcher.fetch("https://[fd00::5]/")).status == 200
    everywhere = Net(cfg=FetchConfig(allow_private_cidrs=("10.0.0.0/8",)))
    assert (await everywhere.fetcher.fetch("http://10.0.0.5:6379/")).status == 200
    with pytest.raises(ValueError, match="address:port"):
        Fetcher(FetchConfig(allow_private_cidrs=("10.0.0.5:http",)))


@pytest.mark.parametrize(
    "address",
    [
        "10.1.2.3",
        "172.16.0.1",
        "192.168.1.1",
        "169.254.1.1",
        "100.64.0.1",
        "224.0.0.1",
        "240.0.0.1",
        "0.0.0.0",
        "255.255.255.255",
        "::",
        "::1",
        "fe80::1",
        "fc00::1",
        "fec0::1",
        "ff02::1",
        "::ffff:8.8.8.8",
        "64:ff9b::808:808",
        "64:ff9b:1::1",
        "2002:a00:1::1",
        "2001:0:4136:e378:8000:63bf:3fff:fdd2",
        "192.0.0.192",
        "169.254.170.2",
    ],
)
def test_check_address_refuses_non_global_and_transition_addresses(address: str) -> None:
    """Private, special-purpose and IPv4-carrying IPv6 prefixes are refused (6to4 by its embedded IPv4)."""
    with pytest.raises(ToolFailure) as info:
        check_address(ipaddress.ip_address(address), ())
    assert info.value.error.kind == "blocked_url"


@pytest.mark.parametrize("address", ["8.8.8.8", PUBLIC, "2606:4700:4700::1111", "2002:808:808::1"])
def test_check_address_accepts_public_addresses(address: str) -> None:
    """Global unicast addresses, and 6to4 wrapping a public IPv4 address, pass."""
    check_address(ipaddress.ip_address(address), ())


def test_allow_list_opens_only_the_listed_network() -> None:
    """An allowed network passes; its neighbours stay blocked."""
    allow = (ipaddress.ip_network("10.0.0.0/24"),)
    check_address(ipaddress.ip_address("10.0.0.7"), allow)
    with pytest.raises(ToolFailure):
        check_address(ipaddress.ip_address("10.0.1.7"), allow)


async def test_a_name_is_blocked_if_any_of_its_addresses_is_private() -> None:
    """One private address among public ones is enough to refuse (the OS may pick any of them)."""
    net = Net(dns={"mixed.test": [[PUBLIC, "10.0.0.5"]]})
    assert await failure(net, "http://mixed.test/") == "blocked_url"
    assert net.requests == []


@pytest.mark.parametrize(
    "url",
    [
        "http://user@example.com/",
        "http://good.com@169.254.169.254/",
        "https://a:b@example.com/",
        "http://example.com\\@169.254.169.254/",
    ],
)
async def test_userinfo_urls_are_refused(url: str) -> None:
    """`user@host` confusion cannot hide the real host: any userinfo is refused."""
    net = Net()
    assert await failure(net, url) == "blocked_url"
    assert net.lookups == [] and net.requests == []


@pytest.mark.parametrize(
    ("url", "kind"),
    [
        ("ftp://example.com/", "blocked_url"),
        ("gopher://example.com/", "blocked_url"),
        ("file:///etc/passwd", "blocked_url"),
        ("example.com/page", "invalid_args"),
        ("http://1.2.3.999/", "invalid_args"),
        ("http://exa%20mple.com/", "invalid_args"),
    ],
)
async def test_bad_schemes_and_hosts_are_refused(url: str, kind: str) -> None:
    """Only http(s) by default; malformed hosts are the caller's error."""
    net = Net()
    assert await failure(net, url) == kind
    assert net.requests == []


def test_validate_url_normalises_legacy_ipv4_literals() -> None:
    """A numeric host is read as the OS reads it, so the checked address is the one a socket would use."""
    target = validate_url("http://0x7f000001:8080/a?b=1")
    assert (str(target.ip), target.port, str(target.url)) == (
        "127.0.0.1",
        8080,
        "http://127.0.0.1:8080/a?b=1",
    )


async def test_dns_rebinding_gets_no_second_lookup() -> None:
    """The request goes to the address that was checked; a later loopback answer is never asked for."""
    net = Net(dns={"rebind.test": [[PUBLIC], ["127.0.0.1"]]})
    page = await net.fetcher.fetch("http://rebind.test/x")
    assert net.lookups == ["rebind.test"]
    assert [(r.url.host, r.headers["host"]) for r in net.requests] == [(PUBLIC, "rebind.test")]
    assert (page.final_url, page.status, page.body) == ("http://rebind.test/x", 200, b"<p>hello</p>")
    # The next call looks up afresh, sees the rebound loopback answer and refuses it without a request.
    assert await failure(net, "http://rebind.test/x") == "blocked_url"
    assert (net.lookups, len(net.requests)) == (["rebind.test"] * 2, 1)


@pytest.mark.parametrize("address", [PUBLIC, "2606:4700:4700::1111"])
async def test_https_is_pinned_with_sni_and_host_header(address: str) -> None:
    """For https the socket targets the checked IP (v4 or v6) while SNI/cert check and Host use the name."""
    net = Net(dns={"example.com": [[address]]})
    await net.fetcher.fetch("https://Example.COM:8443/p")
    (request,) = net.requests
    assert (request.url.scheme, request.url.host, request.url.port) == ("https", address, 8443)
    assert request.headers["host"] == "example.com:8443"
    assert request.extensions["sni_hostname"] == "example.com"


@pytest.mark.parametrize(
    "location",
    [
        "http://169.254.169.254/latest/meta-data/iam/",
        "http://[fd00:ec2::254]/",
        "file:///etc/passwd",
        "http://internal.test/",
        "http://user@example.com/",
        "gopher://example.com/",
    ],
)
async def test_redirect_targets_are_revalidated(location: str, tmp_path: Path) -> None:
    """A public page cannot redirect into metadata, private names or local files (even with file roots set)."""
    dns = {"internal.test": [["10.0.0.1"]]}
    net = Net(redirect_to(location), dns=dns, roots=("/",))
    assert await failure(net, "http://example.com/") == "blocked_url"
    assert len(net.requests) == 1


@pytest.mark.parametrize(
    ("location", "kind"),
    [
        ("mailto:x@y", "blocked_url"),
        ("javascript:alert(1)", "blocked_url"),
        ("data:text/html,hi", "blocked_url"),
        ("http:127.0.0.1:8080/x", "fetch_failed"),
        ("HTTP:127.0.0.1:8080/x", "fetch_failed"),
        ("http://[::1", "fetch_failed"),
    ],
)
async def test_unusable_redirect_locations_are_tool_failures(location: str, kind: str) -> None:
    """A Location httpx cannot build a request from (no host, a non-web scheme, malformed) is a structured
    failure, not an httpx.InvalidURL escaping the fetcher; nothing is requested after the redirect."""
    net = Net(redirect_to(location))
    assert await failure(net, "http://example.com/") == kind
    assert len(net.requests) == 1


async def test_schemes_are_case_insensitive() -> None:
    """`HTTP://` and `HTTPS://` are http and https (RFC 3986), for the first URL and for a redirect."""

    def upper_case_redirect(request: httpx.Request) -> httpx.Response:
        return ok(request) if request.url.path == "/b" else redirect_to("HTTPS://Example.com/b")(request)

    net = Net(upper_case_redirect)
    page = await net.fetcher.fetch("HTTP://example.com/a")
    assert page.final_url == "https://example.com/b"
    assert [str(r.url) for r in net.requests] == [f"http://{PUBLIC}/a", f"https://{PUBLIC}/b"]


def chain(request: httpx.Request) -> httpx.Response:
    """/r/N redirects to /r/N-1 (relative); /r/0 is the page."""
    hops = int(request.url.path.rsplit("/", 1)[-1])
    return ok(request) if hops == 0 else httpx.Response(301, headers={"Location": str(hops - 1)})


async def test_redirects_are_capped() -> None:
    """max_redirects hops are followed; one more is a failure that did not request the final hop."""
    net = Net(chain, cfg=FetchConfig(max_redirects=5))
    page = await net.fetcher.fetch("http://example.com/r/5")
    assert (page.final_url, len(net.requests)) == ("http://example.com/r/0", 6)
    net = Net(chain, cfg=FetchConfig(max_redirects=5))
    assert await failure(net, "http://example.com/r/6") == "fetch_failed"
    assert len(net.requests) == 6


class Chunks(httpx.AsyncByteStream):
    """A response body that records how many of its chunks were read."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks
        self.read = 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            self.read += 1
            yield chunk


def gzip_chunks(total: int, *, chunk: int, piece: int = 1 << 20) -> list[bytes]:
    """`total` zero bytes, gzip-compressed (about 1000:1), cut into `chunk`-byte pieces."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, zlib.MAX_WBITS | 16)
    data = b"".join(compressor.compress(bytes(piece)) for _ in range(total // piece)) + compressor.flush()
    return [data[i : i + chunk] for i in range(0, len(data), chunk)]


def streamed(body: Chunks, headers: dict[str, str]) -> Handler:
    return lambda request: httpx.Response(200, headers=headers, stream=body)


async def test_gzip_bomb_stops_at_the_decoded_cap() -> None:
    """128 MB of zeros in ~128 KB of gzip is refused early, never holding much more than max_bytes decoded.

    The chunks are 64 KiB, as httpcore reads them: one of them inflates to ~64 MB, so the memory bound
    fails unless the decoder itself stops at the cap."""
    bomb = Chunks(gzip_chunks(128 << 20, chunk=1 << 16))
    net = Net(streamed(bomb, {"Content-Encoding": "gzip"}), cfg=FetchConfig(max_bytes=1_000_000))
    tracemalloc.start()
    try:
        assert await failure(net, "http://example.com/") == "too_large"
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert bomb.read == 1 < len(bomb.chunks)
    assert peak < 8_000_000


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "identity"])
async def test_encoded_bodies_within_the_cap_are_decoded(encoding: str) -> None:
    """gzip and deflate bodies come back decoded; the cap counts decoded bytes."""
    text = b"page text " * 1000
    wbits = {"gzip": zlib.MAX_WBITS | 16, "deflate": zlib.MAX_WBITS}.get(encoding)
    encoded = text if wbits is None else zlib.compress(text, wbits=wbits)
    headers = {"Content-Encoding": encoding}
    net = Net(streamed(Chunks([encoded[:50], encoded[50:]]), headers))
    assert (await net.fetcher.fetch("http://example.com/")).body == text
    capped = Net(streamed(Chunks([encoded]), headers), cfg=FetchConfig(max_bytes=len(text) - 1))
    assert await failure(capped, "http://example.com/") == "too_large"


async def test_declared_oversize_is_refused_before_reading() -> None:
    """A Content-Length over the cap fails without reading a byte of the body."""
    body = Chunks([b"x" * 100])
    net = Net(streamed(body, {"Content-Length": "5000001"}))
    assert await failure(net, "http://example.com/") == "too_large"
    assert body.read == 0


@pytest.mark.parametrize("encoding", ["br", "zstd", "compress", "gzip, gzip", "x-custom"])
async def test_content_encodings_we_cannot_cap_are_refused(encoding: str) -> None:
    """Only identity, gzip and deflate are decoded (with a hard cap); anything else fails unread."""
    body = Chunks([b"\x00" * 10])
    net = Net(streamed(body, {"Content-Encoding": encoding}))
    assert await failure(net, "http://example.com/") == "fetch_failed"
    assert body.read == 0


@pytest.mark.parametrize(
    ("status", "kind", "retryable"),
    [
        (404, "not_found", False),
        (403, "fetch_failed", False),
        (503, "fetch_failed", True),
        (429, "fetch_failed", True),
    ],
)
async def test_http_errors_become_tool_failures(status: int, kind: str, retryable: bool) -> None:
    """Error statuses raise with a kind the policy can act on; only transient ones are retryable."""
    net = Net(lambda request: httpx.Response(status))
    with pytest.raises(ToolFailure) as info:
        await net.fetcher.fetch("http://example.com/")
    assert (info.value.error.kind, info.value.error.retryable) == (kind, retryable)


async def test_total_deadline_covers_a_slow_server() -> None:
    """A server slower than total_timeout_s yields `timeout` at the deadline, whatever the phase timeouts."""

    async def slow(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(5)
        return ok(request)

    net = Net(slow, cfg=FetchConfig(total_timeout_s=0.2))  # type: ignore[arg-type]
    start = time.monotonic()
    assert await failure(net, "http://example.com/") == "timeout"
    assert time.monotonic() - start < 2


async def test_file_urls_only_under_allowed_roots(tmp_path: Path) -> None:
    """file:// reads inside a root; a symlink or .. out of it, or a missing file, fails."""
    root, outside = tmp_path / "corpus", tmp_path / "secret.txt"
    root.mkdir()
    (root / "doc.html").write_text("<p>doc</p>")
    outside.write_text("secret")
    (root / "link.txt").symlink_to(outside)
    net = Net(roots=(str(root),))
    page = await net.fetcher.fetch((root / "doc.html").as_uri())
    assert (page.body, page.content_type, page.status) == (b"<p>doc</p>", "text/html", 200)
    assert await failure(net, (root / "link.txt").as_uri()) == "blocked_url"
    assert await failure(net, f"file://{root}/../secret.txt") == "blocked_url"
    assert await failure(net, (root / "missing.html").as_uri()) == "not_found"
    assert net.requests == []


async def test_file_url_errors_are_results_that_name_no_server_path(tmp_path: Path) -> None:
    """A symlink loop inside a root is invalid_args (pathlib raised RuntimeError: a 500 from page_qa), so is a
    FIFO (reading it blocked a thread), and no file:// failure names where a symlink points."""
    root, secret = tmp_path / "corpus", tmp_path / "elsewhere" / "secret.txt"
    root.mkdir()
    secret.parent.mkdir()
    secret.write_text("secret")
    (root / "loop.html").symlink_to(root / "loop.html")
    (root / "a").symlink_to(root / "b")
    (root / "b").symlink_to(root / "a")
    (root / "link.txt").symlink_to(secret)
    os.mkfifo(root / "pipe.html")  # opening it would block a worker thread until a writer came
    net = Net(roots=(str(root),))
    cases = {"loop.html": "invalid_args", "a/x.html": "invalid_args", "link.txt": "blocked_url"}
    cases["pipe.html"] = "invalid_args"
    for name, kind in cases.items():
        with pytest.raises(ToolFailure) as info:
            await net.fetcher.fetch((root / name).as_uri())
        assert info.value.error.kind == kind, (name, info.value.error)
        assert "outside the allowed file roots" in info.value.error.message or kind != "blocked_url"
        assert str(secret.parent) not in info.value.error.message, info.value.error.message


# --- integration: real servers on loopback ---------------------------------------------------------------


class PageHandler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        if self.path == "/moved":
            self.send_response(302)
            self.send_header("Location", "/page")
            self.end_headers()
            return
        body = b"<html><body>loopback page</body></html>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@contextlib.contextmanager
def serve(context: ssl.SSLContext | None = None) -> Iterator[int]:
    """An HTTP(S) server on an ephemeral 127.0.0.1 port, in a thread."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), PageHandler)
    if context is not None:
        server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def http_port() -> Iterator[int]:
    with serve() as port:
        yield port


async def test_real_loopback_server_needs_an_explicit_allow(http_port: int) -> None:
    """Over real sockets: allowed loopback fetches (with a redirect); the default config refuses."""
    allowed = Fetcher(FetchConfig(allow_private_cidrs=("127.0.0.0/8",)))
    try:
        page = await allowed.fetch(f"http://127.0.0.1:{http_port}/moved")
    finally:
        await allowed.aclose()
    assert page.final_url == f"http://127.0.0.1:{http_port}/page"
    assert (page.status, page.content_type, page.body) == (
        200,
        "text/html; charset=utf-8",
        b"<html><body>loopback page</body></html>",
    )
    default = Fetcher(FetchConfig())
    with pytest.raises(ToolFailure) as info:
        await default.fetch(f"http://localhost:{http_port}/page")
    await default.aclose()
    assert info.value.error.kind == "blocked_url"


class IPv6Server(ThreadingHTTPServer):
    address_family = socket.AF_INET6


async def test_ipv6_loopback_is_fetched_when_allowed_and_named_for_what_it_is_when_not() -> None:
    """Over a real [::1] socket: allowing ::1/128 fetches the IPv6 literal; without it the refusal says
    "loopback" (not "embeds an IPv4 address": ::1 lies in ::/96 but carries none), and :: says unspecified."""
    try:
        server = IPv6Server(("::1", 0), PageHandler)
    except OSError as exc:
        pytest.skip(f"no IPv6 loopback here: {exc}")
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    url = f"http://[::1]:{server.server_address[1]}/page"
    allowed, default = Fetcher(FetchConfig(allow_private_cidrs=("::1/128",))), Fetcher(FetchConfig())
    try:
        page = await allowed.fetch(url)
        with pytest.raises(ToolFailure) as info:
            await default.fetch(url)
    finally:
        await allowed.aclose()
        await default.aclose()
        server.shutdown()
        server.server_close()
    assert (page.status, page.final_url) == (200, url)
    assert (info.value.error.kind, info.value.error.message) == (
        "blocked_url",
        "::1 is not a public address (loopback)",
    )
    with pytest.raises(ToolFailure, match=r"^blocked_url: :: is not a public address \(unspecified\)$"):
        check_address(ipaddress.ip_address("::"), ())


def self_signed(name: str) -> tuple[bytes, bytes]:
    """A certificate and key for `name` (test CA and leaf in one)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


async def test_real_tls_is_pinned_to_the_ip_and_verified_for_the_name(tmp_path: Path) -> None:
    """Over real TLS: the socket goes to the resolved IP while the certificate is checked against the name."""
    pytest.importorskip("cryptography")
    cert, key = self_signed("pinned.test")
    (tmp_path / "cert.pem").write_bytes(cert)
    (tmp_path / "key.pem").write_bytes(key)
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")
    client_ctx = ssl.create_default_context(cadata=cert.decode())

    async def resolver(host: str, port: int) -> list[str]:
        return ["127.0.0.1"]

    with serve(server_ctx) as port:
        transport = httpx.AsyncHTTPTransport(verify=client_ctx)
        fetcher = Fetcher(
            FetchConfig(allow_private_cidrs=("127.0.0.0/8",)), resolver=resolver, transport=transport
        )
        try:
            page = await fetcher.fetch(f"https://pinned.test:{port}/page")
            with pytest.raises(ToolFailure) as info:
                await fetcher.fetch(f"https://other.test:{port}/page")
        finally:
            await fetcher.aclose()
    assert page.body == b"<html><body>loopback page</body></html>"
    assert info.value.error.kind == "fetch_failed" and "ConnectError" in info.value.error.message


async def test_default_resolver_and_lookup_failures() -> None:
    """The system resolver answers for localhost; a failed lookup is a retryable fetch_failed, not a crash."""
    assert {ipaddress.ip_address(a).is_loopback for a in await resolve_host("localhost", 80)} == {True}

    async def broken(host: str, port: int) -> list[str]:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    fetcher = Fetcher(DEFAULTS, resolver=broken, transport=httpx.MockTransport(ok))
    with pytest.raises(ToolFailure) as info:
        await fetcher.fetch("http://no-such-host.test/")
    assert (info.value.error.kind, info.value.error.retryable) == ("fetch_failed", True)
