"""Slow request bodies against the tool server: how many of a well-behaved client's calls still succeed.

    python -m benchmarks.perf.slow_body [--attackers 0 100 300 600] [--calls 45]
                                        [--out benchmarks/results/perf/slow_body/summary.json]

The attack: sockets that send the headers of `POST /v1/tools/search` with `Content-Length: 100000`, then one byte
of the body a second, each reopened as soon as the server closes or answers it, all from 127.0.0.1 (on loopback
every client is one peer, so the per-peer cap, 256, is the one they fill). The server is the real app
(tool_server/app.py) under `uvicorn_config` at the shipped [server] settings, only its port a free one and no
token (an attacker holding the token gets past auth anyway), in a thread of this process; search runs over
examples/corpus and the sub-agents' model is a stub (search asks none). Once the attack has run ATTACK_WARMUP_S,
a well-behaved client makes `--calls` rounds, PAUSE_S apart, of two calls: one through a ToolClient as the
rollout uses it (its retries included) and one bare single attempt on a fresh connection (a 503 shows directly).

Per attack size the table shows the share of each kind that succeeded, the ToolClient calls' p50 and p95
latency, how often the attackers had to reconnect and how long the server let an attacking connection live
(median). Numbers from a machine busy with other work are not comparable.

Measured on 2 shared cores (results/perf/slow_body/summary.json): with a connection receiving its body counted as busy
(before the body rate and eviction rules of tool_server/connections.py), 300 attackers left 9% of ToolClient calls
and 7% of single attempts served (p50 2.2 s, every attacking request past the share a 503) and 600 left 11% and 2%;
now both are 100% at 100, 300 and 600 attackers, and an attacking connection lives 2 s (the body rate's grace)
while the share has room, under a second once it is full.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import selectors
import socket
import statistics
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Self

import httpx
import uvicorn
from rich.console import Console
from rich.table import Table

from benchmarks import ROOT
from benchmarks.common.records import summary_path, write_summary
from subagents.llm import Generation, Message
from tool_server.app import check_fd_limit, create_app, uvicorn_config
from tool_server.client import ToolClient, ToolServerError
from tool_server.config import ServerConfig
from tool_server.embedded import embedded_config
from tool_server.limits import percentile

OUT = summary_path("perf", "slow_body")
ATTACK_WARMUP_S = 3.0  # every attacking socket has sent its headers and the churn has settled
PAUSE_S = (
    0.2  # between two rounds of the well-behaved client: a policy's calls are seconds apart, this is busier
)
TICK_S = 0.05  # the attacking thread looks for closed sockets this often
DECLARED_BODY = 100_000  # bytes the attackers announce; they send one a second
QUERIES = ("GRPO advantage", "licence plates", "BM25 ranking", "tool server", "SmolLM2 training", "ffmpeg")


class StubModel:
    """The sub-agents' model where none is asked (the benchmarks that call search or image_ops only): start-up
    builds one per tool, so it must exist."""

    model_id, multimodal, scores = "stub", False, False

    async def generate(self, messages: list[Message], *, max_new_tokens: int) -> Generation:
        raise AssertionError("this benchmark calls no model")

    async def score(self, prompts: list[list[Message]], replies: list[str]) -> list[list[float]]:
        raise AssertionError("this benchmark calls no model")

    def count_tokens(self, text: str) -> int:
        return len(text.split())

    async def aclose(self) -> None:
        pass


def server_config() -> ServerConfig:
    """The shipped [server] settings, on a free port, searching examples/corpus; no token."""
    return embedded_config(
        ServerConfig(port=0, token_env="CONDUCTOR_BENCH_NO_TOKEN"), corpus=ROOT / "examples" / "corpus"
    )


@contextmanager
def tool_server(cfg: ServerConfig) -> Iterator[int]:
    """The real app under the shipped uvicorn settings in a thread; yields its port."""
    check_fd_limit(cfg)  # what `conductor serve` does: one descriptor per connection
    app = create_app(cfg, llm_factory=lambda model: StubModel())
    server = uvicorn.Server(uvicorn_config(cfg, app, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60  # the corpus index takes about a second
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the tool server did not start"
        time.sleep(0.05)
    try:
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(timeout=60)


class Background:
    """A loop (`_run`, until `_stop` is set) in a daemon thread from `with` to its end: the attackers and samplers
    of the benchmarks on loopback."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        raise NotImplementedError


class SlowBodies(Background):
    """`count` connections each sending its request body a byte every `every_s`, each reopened as soon as the
    server closes or answers it; one thread drives them all."""

    def __init__(self, port: int, count: int, *, every_s: float = 1.0) -> None:
        super().__init__()
        self.port, self.count, self.every_s = port, count, every_s
        self.opened = 0
        self.lifetimes: list[float] = []
        """Seconds from each connection's opening to its end (the server closed or answered it)."""
        self.answers: Counter[str] = Counter()
        """The status lines the server answered attacking requests with (a 503 when no room was left)."""
        self._head = (
            f"POST /v1/tools/search HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {DECLARED_BODY}\r\n\r\n{{"
        ).encode()
        self._selector = selectors.DefaultSelector()
        self._due: dict[socket.socket, float] = {}  # when each sends its next byte
        self._born: dict[socket.socket, float] = {}

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                while len(self._due) < self.count and self._open():
                    pass
                for key, _ in self._selector.select(timeout=TICK_S):
                    self._ended(key.fileobj)  # type: ignore[arg-type]
                now = time.monotonic()
                for sock in [s for s, at in self._due.items() if at <= now]:
                    try:
                        sock.send(b" ")  # JSON allows whitespace: the body stays valid, only slow
                        self._due[sock] = now + self.every_s
                    except OSError:
                        self._ended(sock)
        finally:
            for sock in list(self._due):
                self._forget(sock)

    def _open(self) -> bool:
        try:
            sock = socket.create_connection(("127.0.0.1", self.port), timeout=1)
            sock.sendall(self._head)
        except OSError:  # refused or timed out: try again next tick
            return False
        sock.setblocking(False)
        self._selector.register(sock, selectors.EVENT_READ)
        self._due[sock], self._born[sock] = time.monotonic() + self.every_s, time.monotonic()
        self.opened += 1
        return True

    def _ended(self, sock: socket.socket) -> None:
        """The server closed `sock` or answered on it: note how, and let it be reopened."""
        try:
            answer = sock.recv(200)
        except OSError:  # reset, or nothing to read after all
            answer = b""
        if answer:
            self.answers[answer.split(b"\r\n", 1)[0].decode(errors="replace")] += 1
        self.lifetimes.append(time.monotonic() - self._born[sock])
        self._forget(sock)

    def _forget(self, sock: socket.socket) -> None:
        self._selector.unregister(sock)
        del self._due[sock], self._born[sock]
        sock.close()


async def well_behaved(url: str, calls: int) -> dict[str, Any]:
    """`calls` rounds of a ToolClient call and a bare single-attempt call, PAUSE_S apart."""
    client_ok = bare_ok = 0
    latencies: list[float] = []
    async with ToolClient(url) as tools:
        for i in range(calls):
            arguments = {"query": QUERIES[i % len(QUERIES)]}
            started = time.perf_counter()
            try:
                client_ok += (await tools.call("search", arguments)).ok
            except ToolServerError:
                pass
            latencies.append((time.perf_counter() - started) * 1000)
            bare_ok += await single_attempt(url, arguments)
            await asyncio.sleep(PAUSE_S)
    return {
        "tool_client_ok": client_ok / calls,
        "single_attempt_ok": bare_ok / calls,
        "p50_ms": percentile(latencies, 0.5),
        "p95_ms": percentile(latencies, 0.95),
    }


async def single_attempt(url: str, arguments: dict[str, str]) -> bool:
    """One POST on a fresh connection, no retry: whether it answered an ok result."""
    try:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            reply = await client.post("/v1/tools/search", json=arguments)
    except httpx.HTTPError:
        return False
    return reply.status_code == 200 and bool(reply.json().get("ok"))


def measure(attackers: int, calls: int) -> dict[str, Any]:
    """One attack size against a fresh server: the well-behaved client's numbers and the attack's own."""
    with tool_server(server_config()) as port, SlowBodies(port, attackers) as attack:
        time.sleep(ATTACK_WARMUP_S if attackers else 0)
        started = time.monotonic()
        client = asyncio.run(well_behaved(f"http://127.0.0.1:{port}", calls))
        seconds = time.monotonic() - started
        opened, lifetimes, answers = attack.opened, list(attack.lifetimes), dict(attack.answers)
    return {
        "attackers": attackers,
        "calls": calls,
        **client,
        "attack_connections": opened,
        "reconnects_per_s": (opened - attackers) / (seconds + ATTACK_WARMUP_S) if attackers else 0.0,
        "median_lifetime_s": statistics.median(lifetimes) if lifetimes else None,
        "attack_answers": answers,
        "seconds": seconds,
    }


def report(rows: list[dict[str, Any]]) -> Table:
    table = Table(
        title="slow request bodies vs a well-behaved client (shipped \\[server] settings, loopback)"
    )
    columns = (
        "attackers",
        "ToolClient ok",
        "single attempt ok",
        "p50 ms",
        "p95 ms",
        "reconnects/s",
        "lifetime s",
    )
    for column in columns:
        table.add_column(column, justify="right")
    for row in rows:
        lifetime = row["median_lifetime_s"]
        table.add_row(
            str(row["attackers"]), f"{row['tool_client_ok']:.0%}", f"{row['single_attempt_ok']:.0%}",
            f"{row['p50_ms']:.0f}", f"{row['p95_ms']:.0f}", f"{row['reconnects_per_s']:.0f}",
            "-" if lifetime is None else f"{lifetime:.1f}",
        )  # fmt: skip
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--attackers", type=int, nargs="+", default=[0, 100, 300, 600])
    parser.add_argument("--calls", type=int, default=45, help="rounds of the well-behaved client per size")
    parser.add_argument("--out", type=Path, default=OUT, help="JSON result path")
    args = parser.parse_args()
    rows = [measure(attackers, args.calls) for attackers in args.attackers]
    Console(width=120).print(report(rows))
    machine = {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_avg_at_end": os.getloadavg(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_summary(args.out, {"machine": machine, "rows": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
