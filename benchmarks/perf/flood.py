"""Whole tool calls that never end, against the tool server: how much of a well-behaved client is still served.

    python -m benchmarks.perf.flood [--attackers 200 280 400 800] [--rounds 30]
                                    [--out benchmarks/results/perf/flood/summary.json]

The attack: N sockets, each sending a whole `POST /v1/tools/page_qa` about a page of examples/corpus (a question
of its own, so no two share one cached run) whose reader stays silent: the sub-agents' model never answers, so a
call that gets one of page_qa's 8 slots holds it until the call deadline (150 s, past the benchmark). Each socket
is reopened with its next call as soon as the server answers or closes it, all from 127.0.0.1 (on loopback every
client is one peer: the per-peer caps are the ones they meet). The server is the real app (tool_server/app.py)
under `uvicorn_config` at the shipped [server] settings, only its port a free one and no token, in a process of
its own (`--serve`) so that its RSS is its own; search runs over examples/corpus (it asks no model). Once the
attack has run ATTACK_WARMUP_S, a well-behaved client makes `--rounds` rounds, PAUSE_S apart, of: a search call
through a ToolClient as the rollout uses it (its retries included, a CLIENT_DEADLINE_S deadline), a bare single
attempt on a fresh connection, and GET /health on a fresh connection.

Per attack size the table shows the share of each answered ok, the ToolClient calls' p50 and p95 latency, how
the attacking requests were answered (HTTP status, or `closed` unanswered) and the server's RSS before the
attack, at its peak (sampled every RSS_EVERY_S) and AFTER_S after it ended. Numbers from a machine busy with
other work are not comparable.

Measured on 2 shared cores (results/perf/flood/summary.json): before the queue bounds, unread connections kept and waiting
ones reclaimable (tool_server/gates.py, connections.py), 280 attackers left 12% of ToolClient calls, 0% of single
attempts and 88% of /health probes answered (8 rounds; the attack's requests were answered 503 by the thousand,
its calls waiting out the 20 s queue deadline holding the address's whole share); now all three are 100% at
200, 280, 400 and 800 attackers (p95 under 0.4 s), the attack answered 429 at once, RSS 129 MB before and at
most 194 MB at the peak, which stays (freed memory is not given back to the system).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import selectors
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from rich.console import Console
from rich.table import Table

from benchmarks import ROOT
from benchmarks.common.records import summary_path, write_summary
from benchmarks.perf.slow_body import QUERIES, Background, StubModel, server_config, single_attempt
from subagents.llm import Generation, Message
from tool_server.app import check_fd_limit, create_app, uvicorn_config
from tool_server.client import ToolClient, ToolServerError
from tool_server.limits import percentile

OUT = summary_path("perf", "flood")
ATTACK_WARMUP_S = 3.0  # every attacking socket has sent its call and the queue has filled
PAUSE_S = 0.2  # between two rounds of the client: a policy's calls are seconds apart, this is busier
CLIENT_DEADLINE_S = 30.0  # the ToolClient's whole-call budget (the rollout's 240 s: too long here)
HEALTH_TIMEOUT_S = 10.0  # a probe unanswered this long counts as not answered (a liveness probe's bound)
TICK_S = 0.05  # the attacking thread looks for answered or closed sockets this often
RSS_EVERY_S = 0.2  # the server's RSS is sampled this often for its peak
AFTER_S = 5.0  # after the attack, before the server's RSS is read again
START_S = 60.0  # the server process answers /health within this (imports and the corpus index take seconds)
PAGE = ROOT / "examples" / "corpus" / "grpo.html"


class SilentModel(StubModel):
    """A reader that never answers: a page_qa call holds its slot until the call deadline."""

    async def generate(self, messages: list[Message], *, max_new_tokens: int) -> Generation:
        await asyncio.Event().wait()
        raise AssertionError("a silent reader never answers")


def serve() -> None:
    """The server side (`--serve`): the app at the shipped settings on a free loopback port, printed first."""
    cfg = server_config()
    check_fd_limit(cfg)  # what `conductor serve` does: one descriptor per connection
    app = create_app(cfg, llm_factory=lambda model: SilentModel())
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    print(sock.getsockname()[1], flush=True)
    uvicorn.Server(uvicorn_config(cfg, app, log_level="error")).run(sockets=[sock])


@contextmanager
def server_process() -> Iterator[tuple[int, int]]:
    """The server in a process of its own (`--serve`), killed at the end; yields its port and pid."""
    command = [sys.executable, "-m", "benchmarks.perf.flood", "--serve"]
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        deadline = time.monotonic() + START_S
        while not healthy(port):
            assert proc.poll() is None and time.monotonic() < deadline, "the tool server did not start"
            time.sleep(0.2)
        yield port, proc.pid
    finally:
        proc.kill()
        proc.wait(timeout=30)


def healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def rss_mb(pid: int) -> float:
    """The process's resident set size now, from /proc (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise ValueError(f"no VmRSS for process {pid}")


class RssPeak(Background):
    """The highest RSS of process `pid` sampled every RSS_EVERY_S while inside."""

    def __init__(self, pid: int) -> None:
        super().__init__()
        self.pid, self.peak = pid, rss_mb(pid)

    def _run(self) -> None:
        while not self._stop.wait(RSS_EVERY_S):
            self.peak = max(self.peak, rss_mb(self.pid))


def page_qa_call(port: int) -> Callable[[int], bytes]:
    """The attacking request, numbered: a whole page_qa call with a question of its own."""

    def request(i: int) -> bytes:
        body = json.dumps({"url": PAGE.as_uri(), "question": f"what does section {i} say?"}).encode()
        head = f"POST /v1/tools/page_qa HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        return f"{head}Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body

    return request


class WholeCalls(Background):
    """`count` connections, each holding a whole request (`request(i)`, its number), each reopened with the next
    as soon as the server answers or closes it; one thread drives them all."""

    def __init__(self, port: int, count: int, request: Callable[[int], bytes]) -> None:
        super().__init__()
        self.port, self.count, self.request = port, count, request
        self.sent = 0
        self.answers: Counter[str] = Counter()
        """How the attacking requests ended: the HTTP status they were answered, or `closed` unanswered."""
        self._selector = selectors.DefaultSelector()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                while len(self._selector.get_map()) < self.count and self._open():
                    pass
                for key, _ in self._selector.select(timeout=TICK_S):
                    self._ended(key.fileobj)  # type: ignore[arg-type]
        finally:
            for key in list(self._selector.get_map().values()):
                self._forget(key.fileobj)  # type: ignore[arg-type]

    def _open(self) -> bool:
        try:
            sock = socket.create_connection(("127.0.0.1", self.port), timeout=1)
            sock.sendall(self.request(self.sent))
        except OSError:  # refused, reset or timed out: try again next tick
            return False
        sock.setblocking(False)
        self._selector.register(sock, selectors.EVENT_READ)
        self.sent += 1
        return True

    def _ended(self, sock: socket.socket) -> None:
        """The server answered on `sock` or closed it: note how, and let it be reopened."""
        try:
            answer = sock.recv(64)
        except OSError:  # reset: closed unread
            answer = b""
        self.answers[answer.split(b" ", 2)[1].decode(errors="replace") if answer else "closed"] += 1
        self._forget(sock)

    def _forget(self, sock: socket.socket) -> None:
        self._selector.unregister(sock)
        sock.close()


async def health_ok(url: str) -> bool:
    """GET /health on a fresh connection: whether it answered 200 within HEALTH_TIMEOUT_S."""
    try:
        async with httpx.AsyncClient(base_url=url, timeout=HEALTH_TIMEOUT_S) as client:
            return (await client.get("/health")).status_code == 200
    except httpx.HTTPError:
        return False


async def well_behaved(url: str, rounds: int) -> dict[str, Any]:
    """`rounds` rounds of a ToolClient search, a bare single attempt and a /health probe, PAUSE_S apart."""
    client_ok = bare_ok = probes_ok = 0
    latencies: list[float] = []
    async with ToolClient(url, deadline_s=CLIENT_DEADLINE_S) as tools:
        for i in range(rounds):
            arguments = {"query": QUERIES[i % len(QUERIES)]}
            started = time.perf_counter()
            try:
                client_ok += (await tools.call("search", arguments)).ok
            except ToolServerError:
                pass
            latencies.append((time.perf_counter() - started) * 1000)
            bare_ok += await single_attempt(url, arguments)
            probes_ok += await health_ok(url)
            await asyncio.sleep(PAUSE_S)
    return {
        "tool_client_ok": client_ok / rounds,
        "single_attempt_ok": bare_ok / rounds,
        "health_ok": probes_ok / rounds,
        "p50_ms": percentile(latencies, 0.5),
        "p95_ms": percentile(latencies, 0.95),
    }


def measure(attackers: int, rounds: int) -> dict[str, Any]:
    """One attack size against a fresh server: the well-behaved client's shares, the attack's answers, RSS."""
    with server_process() as (port, pid):
        url = f"http://127.0.0.1:{port}"
        asyncio.run(well_behaved(url, 1))  # the first search loads the corpus index's pages: not attack cost
        before = rss_mb(pid)
        started = time.monotonic()
        with RssPeak(pid) as peak, WholeCalls(port, attackers, page_qa_call(port)) as attack:
            time.sleep(ATTACK_WARMUP_S)
            client = asyncio.run(well_behaved(url, rounds))
        seconds = time.monotonic() - started
        time.sleep(AFTER_S)
        after = rss_mb(pid)
    rss = {"before": before, "peak": max(peak.peak, after), "after": after}
    return {"attackers": attackers, "rounds": rounds, **client, "attack_answers": dict(attack.answers),
            "attack_sent": attack.sent, "rss_mb": rss, "seconds": seconds}  # fmt: skip


def report(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="whole page_qa calls, silent reader, vs a well-behaved client (shipped \\[server])")
    columns = ("attackers", "ToolClient ok", "single ok", "/health ok", "p50 ms", "p95 ms", "attack answered",
               "RSS MB before / peak / after")  # fmt: skip
    for column in columns:
        table.add_column(column, justify="right")
    for row in rows:
        answers = ", ".join(f"{status} {n}" for status, n in sorted(row["attack_answers"].items()))
        rss = row["rss_mb"]
        table.add_row(
            str(row["attackers"]), f"{row['tool_client_ok']:.0%}", f"{row['single_attempt_ok']:.0%}",
            f"{row['health_ok']:.0%}", f"{row['p50_ms']:.0f}", f"{row['p95_ms']:.0f}", answers,
            f"{rss['before']:.0f} / {rss['peak']:.0f} / {rss['after']:.0f}",
        )  # fmt: skip
    return table


def raise_fd_limit(needed: int) -> None:
    """This process holds every attacking socket: raise the soft open-file limit to `needed` where allowed."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        allowed = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (allowed, hard))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--attackers", type=int, nargs="+", default=[200, 280, 400, 800])
    parser.add_argument("--rounds", type=int, default=30, help="rounds of the well-behaved client per size")
    parser.add_argument("--out", type=Path, default=OUT, help="JSON result path")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the server process
    args = parser.parse_args()
    if args.serve:
        serve()
        return
    raise_fd_limit(max(args.attackers) + 512)  # the attack's sockets and the client's, and spares
    rows = [measure(attackers, args.rounds) for attackers in args.attackers]
    Console(width=150).print(report(rows))
    machine = {"python": platform.python_version(), "cpus": os.cpu_count(), "load_avg": os.getloadavg()}
    write_summary(args.out, {"machine": machine, "rows": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
