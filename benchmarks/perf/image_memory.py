"""image_ops' memory under a burst of large images: the server's RSS before, at peak and after.

    python -m benchmarks.perf.image_memory [--clients 8] [--side 7000] [--out benchmarks/results/perf/image_memory/summary.json]

The burst of issue 66: `--clients` clients at once, each in a session of its own, load a `--side` x `--side` PNG
(49 Mpx at 7000, under image_ops' 50 Mpx input cap; each client its own picture, flat colour with lines of text)
from the server's files root and run find_text on it. The server is the real app (tool_server/app.py) under
`uvicorn_config` at the shipped settings, only its port a free one, no token, and a stub text model (image_ops
asks none), in a thread of this process: this process's RSS is the server's. The PNGs are written by a child
process, so their making never counts. Before the burst the server has answered one small find_text (the OCR
engine is built) and the heap is trimmed; the peak is VmHWM, reset just before the burst (/proc/self/clear_refs);
after is RSS once every client has its answer and SETTLE_S later.

The image store keeps what its own budget allows (max_total_pixels 200 Mpx: four such images, 800 MB as Pillow
keeps RGB), so the table shows it apart: `after - store` is what image work left behind.

Measured on 2 shared cores (results/perf/image_memory/summary.json), 8 clients x 7000x7000, every call ok, MB:

    image code                                   before   peak   after   store   after - store   seconds
    before issue 66 (asyncio.to_thread, no trim)    203   3810    2622     748          +823 %        22
    image pool, working budget, trims               203   2482     956     748            +3 %        53

The issue saw 3.5 -> 5.55 GB with 4.8 GB staying on a server holding real models. The budget costs time: with
one large image in work at a time the burst took 45-53 s (two runs); a budget the pool's 2 threads never reach ran it in 31 s
at a 2597 MB peak (subagents/pixels.py: WORKING_PIXELS).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from PIL import Image, ImageDraw, ImageFont
from rich.console import Console
from rich.table import Table

from benchmarks.common.records import summary_path, write_summary
from benchmarks.perf.slow_body import StubModel
from conductor.heap import trim_heap
from subagents.common import Files
from tool_server.app import create_app, uvicorn_config
from tool_server.config import ServerConfig

OUT = summary_path("perf", "image_memory")
SETTLE_S = 2.0  # after the last answer: anything the server frees late is freed by then
CALL_TIMEOUT_S = 300.0  # a call's HTTP timeout: 8 calls of ~10 s on 2 busy cores, queued, fit inside
SESSION_HEADER = "X-Conductor-Session"


def write_png(path: Path, side: int, seed: int) -> None:
    """A `side` x `side` PNG of flat colour with six lines of text, different per `seed` (so a different id)."""
    image = Image.new("RGB", (side, side), (150 + 10 * seed % 100, 200, 220))
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=max(12, side // 40))
    for line in range(6):
        where = (side // 10, side // 8 * (line + 1))
        draw.text(where, f"PLATE {seed}{line} ABC{line}23", fill="black", font=font)
    image.save(path, format="PNG")


def write_pngs(folder: Path, clients: int, side: int) -> list[str]:
    """The clients' PNGs, written by a child process; their file names."""
    names = [f"burst_{side}_{n}.png" for n in range(clients)]
    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
        list(pool.map(write_png, [folder / name for name in names], [side] * clients, range(clients)))
    Image.new("RGB", (320, 120), "white").save(folder / "warm.png")
    return names


def status_mb(field: str) -> float:
    """A `Vm...` line of /proc/self/status, in MB."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1]) / 1024


@contextmanager
def tool_server(folder: Path) -> Iterator[tuple[int, Any]]:
    """The real app with `folder` as its files root, in a thread; yields its port and the image store."""
    cfg = ServerConfig(port=0, token_env="CONDUCTOR_BENCH_NO_TOKEN", files=Files(roots=(str(folder),)))
    app = create_app(cfg, llm_factory=lambda model: StubModel())
    server = uvicorn.Server(uvicorn_config(cfg, app, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the tool server did not start"
        time.sleep(0.05)
    try:
        yield server.servers[0].sockets[0].getsockname()[1], app.state.host.states["image_ops"]
    finally:
        server.should_exit = True
        thread.join(timeout=60)


async def find_text(client: httpx.AsyncClient, name: str, session: str) -> list[str]:
    """load then find_text in `session`: each call's outcome (`ok` or its error kind)."""
    headers = {SESSION_HEADER: session}
    loaded = (
        await client.post("/v1/tools/image_ops", json={"op": "load", "image": name}, headers=headers)
    ).json()
    if not loaded.get("ok"):
        return [loaded.get("error", {}).get("kind", "http")]
    found = {"op": "find_text", "image": loaded["image_id"]}
    reply = (await client.post("/v1/tools/image_ops", json=found, headers=headers)).json()
    return ["ok", "ok" if reply.get("ok") else reply.get("error", {}).get("kind", "http")]


async def burst(port: int, names: list[str]) -> tuple[float, Counter[str]]:
    """RSS (MB) just before every client's load and find_text at once, and the calls' outcomes counted."""
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=CALL_TIMEOUT_S) as client:
        await find_text(client, "warm.png", "warm")
        trim_heap()
        reset_peak()
        start_mb = status_mb("VmRSS")
        runs = await asyncio.gather(*(find_text(client, name, f"client-{n}") for n, name in enumerate(names)))
    return start_mb, Counter(outcome for run in runs for outcome in run)


def reset_peak() -> None:
    """Reset VmHWM to the current RSS (Linux: writing 5 to /proc/self/clear_refs)."""
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")


def measure(clients: int, side: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="image_memory_") as tmp:
        folder = Path(tmp)
        names = write_pngs(folder, clients, side)
        with tool_server(folder) as (port, store):
            started = time.monotonic()
            before, outcomes = asyncio.run(burst(port, names))
            seconds = time.monotonic() - started
            peak, right_after = status_mb("VmHWM"), status_mb("VmRSS")
            time.sleep(SETTLE_S)
            after, store_mb = status_mb("VmRSS"), store.pixels_held * 4 / 2**20  # Pillow: 4 bytes a pixel
    return {
        "clients": clients, "side": side, "before_mb": round(before), "peak_mb": round(peak),
        "right_after_mb": round(right_after), "after_mb": round(after), "store_mb": round(store_mb),
        "after_minus_store_vs_before": (after - store_mb) / before - 1, "outcomes": dict(outcomes),
        "seconds": round(seconds, 1),
    }  # fmt: skip


def report(row: dict[str, Any]) -> Table:
    table = Table(
        title=f"{row['clients']} clients x find_text on {row['side']}x{row['side']} PNGs (server RSS)"
    )
    for column in ("before MB", "peak MB", "after MB", "store MB", "after - store vs before", "calls", "s"):
        table.add_column(column, justify="right")
    calls = ", ".join(f"{kind} {count}" for kind, count in sorted(row["outcomes"].items()))
    table.add_row(
        str(row["before_mb"]), str(row["peak_mb"]), str(row["after_mb"]), str(row["store_mb"]),
        f"{row['after_minus_store_vs_before']:+.0%}", calls, f"{row['seconds']:.0f}",
    )  # fmt: skip
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--side", type=int, default=7000, help="the PNGs' width and height")
    parser.add_argument("--out", type=Path, default=OUT, help="JSON result path")
    args = parser.parse_args()
    row = measure(args.clients, args.side)
    Console(width=120).print(report(row))
    machine = {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_avg_at_end": os.getloadavg(),
    }
    write_summary(args.out, {"machine": machine, "rows": [row]})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
