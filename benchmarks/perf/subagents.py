"""Tool-server sub-agent benchmark: real SmolLM2, real pages, real plate photos, real loopback HTTP.

    python -m benchmarks.perf.subagents [--out benchmarks/results/perf/subagents/summary.json] [--quick]

Starts the tool server (`create_app` with the default transformers backend: one SmolLM2-135M-Instruct shared
by all tools, micro-batched) under uvicorn in a thread on 127.0.0.1, and a loopback page server for
English pages of the shared readability set. In one run it measures:

1. page_qa throughput: N different pages/questions at once vs the same N one after another (wall time each
   and the speed-up). Each phase adds its own `?run=` query to the URLs, so no call is a cache hit.
2. page_qa cache: one request twice (miss, then hit): latency of each, and the cache counters of /metrics.
3. image_ops latency p50/p95 at concurrency 1, 8 and 64 for a cheap op mix (crop and zoom of a 1280x720
   plate photo around the plate, rotate/flip/autocontrast of that plate crop), and `read` (OCR) of the
   plate crop at 1 and 8. Every worker has its own image session; its load and first crop are setup, not
   measured. HTTP 429s (a tool's concurrency cap and queue deadline hit) are counted and shown, never
   retried; the server runs the shipped per-tool limits (see the table title).

Prints a table and writes JSON (machine info, settings, every number). `--quick` shrinks the counts for a
smoke run. Limits: client and server share one process (and the GIL), so latencies at concurrency 64 include
the client's own overhead; numbers from a machine busy with other work are not comparable.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import os
import platform
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from PIL import Image
from rich.console import Console
from rich.table import Table

from benchmarks import ROOT
from benchmarks.common.records import summary_path, write_summary
from conductor.models import default_device
from subagents.llm import batch_for
from tool_server.app import create_app, uvicorn_config
from tool_server.config import ServerConfig
from tool_server.embedded import embedded_config
from tool_server.limits import load_token, percentile

# Client budgets: a batch of 8 page answers on 2 busy cores can take minutes; the server's own deadlines
# (20 s queue + 150 s call) end a call first, so this read timeout only catches a hung server.
CLIENT_TIMEOUT = httpx.Timeout(connect=5.0, read=300.0, write=30.0, pool=300.0)
SERVER_START_S = 300.0  # the lifespan loads SmolLM2 (seconds when idle, longer on a loaded machine)
PHOTO_SIZE = (1280, 720)  # most US plate photos have this size; the first of them is used
# The cheap op mix as a policy uses it: crop and zoom the photo around the plate, then straighten and
# brighten that crop. Outputs stay small, so 64 sessions fit the image store's default 200 MP budget; ops
# on full-size outputs (~1 MP each) would make its LRU evict photos still in use (not_found results).
FIX_CROP: tuple[dict[str, Any], ...] = (
    {"op": "rotate", "degrees": 90},
    {"op": "flip", "direction": "horizontal"},
    {"op": "autocontrast"},
)


@dataclass(frozen=True)
class BenchConfig:
    """What one run measures; `shrunk()` is the smoke-run variant."""

    out: Path = summary_path("perf", "subagents")
    """Where the JSON goes (its folder is created)."""
    data: Path = Path(os.environ.get("CONDUCTOR_DATA", ROOT.parent / "shared" / "data"))
    """The shared real-data folder ($CONDUCTOR_DATA)."""
    pages: int = 8
    """Distinct pages asked at once in phase 1 (8 = the transformers micro-batch, a full batch)."""
    mix_rounds: tuple[tuple[int, int], ...] = ((1, 8), (8, 4), (64, 2))
    """(concurrency, rounds of the 5-op mix per worker): 40, 160 and 640 image ops."""
    read_rounds: tuple[tuple[int, int], ...] = ((1, 8), (8, 3))
    """(concurrency, `read` calls per worker): OCR is heavy, so fewer."""
    quick: bool = False
    """Smoke-run counts (recorded in the JSON so a quick result is never mistaken for a real one)."""

    def shrunk(self) -> BenchConfig:
        mix, read = ((1, 2), (8, 1), (64, 1)), ((1, 2), (8, 1))
        return replace(self, pages=4, mix_rounds=mix, read_rounds=read, quick=True)


def pick_pages(data: Path, count: int) -> list[tuple[str, str]]:
    """(name, question) for `count` + 1 English readable articles of the readability set, by name; the
    last one is for warm-up. Deterministic: INDEX.tsv rows filtered by language, title and article size."""
    with (data / "pages" / "readability" / "INDEX.tsv").open(encoding="utf-8") as file:
        rows = list(csv.DictReader(file, delimiter="\t"))
    chosen = sorted(
        row["page"]
        for row in rows
        if row["lang"].lower().startswith("en") and row["readerable"] == "True"
        and row["title"] and int(row["expected_bytes"]) >= 3000
    )  # fmt: skip
    titles = {row["page"]: row["title"] for row in rows}
    assert len(chosen) > count, f"only {len(chosen)} English pages in {data}, need {count + 1}"
    return [(name, f"What does the article say about {titles[name][:120]}?") for name in chosen[: count + 1]]


def pick_plate(data: Path) -> tuple[Path, list[int]]:
    """The first US plate photo (by name) of PHOTO_SIZE and a box of 3x its plate, as a policy would crop
    before reading."""
    for label in sorted((data / "images" / "plates" / "endtoend" / "us").glob("*.txt")):
        with Image.open(label.with_suffix(".jpg")) as image:  # reads the header only
            if image.size == PHOTO_SIZE:
                break
    else:
        raise FileNotFoundError(f"no {PHOTO_SIZE[0]}x{PHOTO_SIZE[1]} US plate photo under {data}")
    name, x, y, w, h, _plate = label.read_text().split()[:6]
    x0, y0, width, height = map(int, (x, y, w, h))
    box = [max(0, x0 - width), max(0, y0 - height), x0 + 2 * width, y0 + 2 * height]
    return label.parent / name, box


def server_config(plates: Path) -> ServerConfig:
    """The shipped defaults, except: loopback pages may be fetched, plate photos loaded (by name: `plates` is
    the first readable folder), and a free port."""
    return embedded_config(ServerConfig(port=0), roots=(str(plates),), loopback=True)


@contextmanager
def page_server(folder: Path, names: list[str]) -> Iterator[str]:
    """Loopback HTTP serving `/<name>` (any query) as that page's source.html; yields the base URL."""
    bodies = {name: (folder / name / "source.html").read_bytes() for name in names}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            body = bodies.get(self.path.split("?")[0].strip("/"))
            self.send_response(200 if body is not None else 404)
            self.send_header("Content-Type", "text/html")  # no charset: trafilatura detects it, as on the web
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def tool_server(cfg: ServerConfig) -> Iterator[str]:
    """The real app under uvicorn (the shipped keep-alive and connection limits) in a thread; base URL."""
    config = uvicorn_config(cfg, create_app(cfg), log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + SERVER_START_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("no tool server: is the model prepared? (`conductor models prepare`)")
        time.sleep(0.1)
    try:
        yield f"http://{cfg.host}:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)


@dataclass
class Call:
    """One HTTP call as the client saw it."""

    status: int
    body: dict[str, Any]
    seconds: float

    @property
    def outcome(self) -> str:
        if self.status != 200:
            return f"http_{self.status}"
        return "ok" if self.body.get("ok") else f"error:{self.body['error']['kind']}"


async def post(client: httpx.AsyncClient, tool: str, arguments: dict[str, Any], *, session: str) -> Call:
    start = time.perf_counter()
    reply = await client.post(f"/v1/tools/{tool}", json=arguments, headers={"X-Conductor-Session": session})
    return Call(reply.status_code, reply.json(), time.perf_counter() - start)


def latency_summary(calls: list[Call], wall_s: float) -> dict[str, Any]:
    millis = [c.seconds * 1000 for c in calls]
    return {
        "calls": len(calls),
        "p50_ms": percentile(millis, 0.5),
        "p95_ms": percentile(millis, 0.95),
        "wall_s": wall_s,
        "throughput_per_s": len(calls) / wall_s if wall_s else 0.0,
        "http_429": sum(c.status == 429 for c in calls),
        "outcomes": dict(Counter(c.outcome for c in calls)),
    }


async def page_qa_phases(
    client: httpx.AsyncClient, pages_url: str, pages: list[tuple[str, str]]
) -> dict[str, Any]:
    """Phases 1 and 2. The last page warms the model up first (first-call costs are not measured)."""
    *measured, (warm_name, warm_question) = pages

    def ask(name: str, question: str, run: str) -> Awaitable[Call]:
        arguments = {"url": f"{pages_url}/{name}?run={run}", "question": question}
        return post(client, "page_qa", arguments, session="qa")

    warm = await ask(warm_name, warm_question, "warmup")
    start = time.perf_counter()
    together = await asyncio.gather(*(ask(n, q, "concurrent") for n, q in measured))
    concurrent_s = time.perf_counter() - start
    start = time.perf_counter()
    one_by_one = [await ask(n, q, "sequential") for n, q in measured]
    sequential_s = time.perf_counter() - start
    miss = await ask(*measured[0], "cache")
    hit = await ask(*measured[0], "cache")
    cache = (await client.get("/metrics")).json()["tools"]["page_qa"]["cache"]
    return {
        "pages": [name for name, _ in measured],
        "warmup_s": warm.seconds,
        "concurrent": latency_summary(list(together), concurrent_s),
        "sequential": latency_summary(one_by_one, sequential_s),
        "speedup": sequential_s / concurrent_s,
        "answers": [c.body.get("answer", c.outcome) for c in together],
        "cache": {"miss_ms": miss.seconds * 1000, "hit_ms": hit.seconds * 1000,
                  "hit_flagged_cached": bool(hit.body.get("cached")), "metrics": cache},
    }  # fmt: skip


async def load_sessions(
    client: httpx.AsyncClient, plate: Path, box: list[int], *, prefix: str, count: int
) -> list[dict[str, str]]:
    """One session per worker holding the photo and its plate crop: {"photo": id, "crop": id} each."""

    async def one(i: int) -> dict[str, str]:
        session = f"{prefix}-{i}"
        loaded = await post(client, "image_ops", {"op": "load", "image": plate.name}, session=session)
        assert loaded.outcome == "ok", f"loading {plate.name} failed: {loaded.body}"
        crop = {"op": "crop", "image": loaded.body["image_id"], "box": box}
        cropped = await post(client, "image_ops", crop, session=session)
        assert cropped.outcome == "ok", f"cropping {plate.name} failed: {cropped.body}"
        return {"photo": loaded.body["image_id"], "crop": cropped.body["image_id"]}

    return list(await asyncio.gather(*(one(i) for i in range(count))))


def workload_ops(workload: str, box: list[int]) -> list[tuple[str, dict[str, Any]]]:
    """(which image, arguments) of one pass: `read` on the crop, or the op mix."""
    if workload == "read":
        return [("crop", {"op": "read"})]
    on_photo: list[dict[str, Any]] = [{"op": "crop", "box": box}, {"op": "zoom", "box": box, "factor": 2}]
    return [("photo", op) for op in on_photo] + [("crop", op) for op in FIX_CROP]


async def image_level(
    client: httpx.AsyncClient, plate: Path, box: list[int], *, workload: str, concurrency: int, rounds: int
) -> dict[str, Any]:
    """`concurrency` workers, each in its own session, making `rounds` passes of its ops in a closed loop."""
    prefix = f"{workload}-c{concurrency}"
    ids = await load_sessions(client, plate, box, prefix=prefix, count=concurrency)
    ops = workload_ops(workload, box)
    calls: list[tuple[str, Call]] = []

    async def worker(i: int) -> None:
        for _ in range(rounds):
            for image, op in ops:
                arguments = {**op, "image": ids[i][image]}
                calls.append((op["op"], await post(client, "image_ops", arguments, session=f"{prefix}-{i}")))

    start = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    summary = latency_summary([c for _, c in calls], time.perf_counter() - start)
    per_op = {op: percentile([c.seconds * 1000 for o, c in calls if o == op], 0.5) for op, _ in calls}
    return {"workload": workload, "concurrency": concurrency, **summary, "per_op_p50_ms": per_op}


async def run_benchmark(
    cfg: BenchConfig, server: ServerConfig, *, base_url: str, pages_url: str, pages: list[tuple[str, str]]
) -> dict[str, Any]:
    plate, box = pick_plate(cfg.data)
    token = load_token(server)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    limits = httpx.Limits(max_connections=128, max_keepalive_connections=128)  # above the 64 workers
    async with httpx.AsyncClient(
        base_url=base_url, timeout=CLIENT_TIMEOUT, limits=limits, headers=headers
    ) as client:
        page_qa = await page_qa_phases(client, pages_url, pages)
        await image_level(client, plate, box, workload="read", concurrency=1, rounds=1)  # OCR models load
        levels = [("op_mix", c, r) for c, r in cfg.mix_rounds] + [("read", c, r) for c, r in cfg.read_rounds]
        image_ops = [
            await image_level(client, plate, box, workload=w, concurrency=c, rounds=r) for w, c, r in levels
        ]
        metrics = (await client.get("/metrics")).json()
    return {"page_qa": page_qa, "image_ops": image_ops, "plate": plate.name, "server_metrics": metrics}


def machine_info() -> dict[str, Any]:
    import torch

    return {
        "cpu_count": os.cpu_count(), "cpus_usable": len(os.sched_getaffinity(0)),
        "torch_threads": torch.get_num_threads(), "torch": torch.__version__, "cuda": torch.cuda.is_available(),
        "python": platform.python_version(), "platform": platform.platform(),
        "load_avg_at_start": os.getloadavg(),  # other work on the machine skews every number
    }  # fmt: skip


def outcomes(counts: dict[str, int]) -> str:
    return ", ".join(f"{kind} {n}" for kind, n in sorted(counts.items()))


def page_qa_table(qa: dict[str, Any], limits: dict[str, Any]) -> Table:
    table = Table("measure", "value", title=f"page_qa (SmolLM2-135M, micro-batch {limits['max_batch']})")
    n = len(qa["pages"])
    for label, phase in (
        (f"{n} pages at once", qa["concurrent"]),
        (f"{n} pages one by one", qa["sequential"]),
    ):
        table.add_row(f"{label}: wall", f"{phase['wall_s']:.1f} s ({outcomes(phase['outcomes'])})")
    table.add_row("speed-up (sequential / concurrent)", f"{qa['speedup']:.2f}x")
    miss, hit = qa["cache"]["miss_ms"], qa["cache"]["hit_ms"]
    table.add_row("same request: miss / hit", f"{miss:.0f} ms / {hit:.1f} ms")
    cache = qa["cache"]["metrics"]
    rate = f"{cache['hits']} hits, {cache['misses']} misses, hit rate {cache['hit_rate']:.2f}"
    table.add_row("/metrics page_qa cache (whole run)", rate)
    return table


def image_ops_table(rows: list[dict[str, Any]], limits: dict[str, Any]) -> Table:
    cap, queue = limits["image_ops_max_concurrency"], limits["image_ops_queue_s"]
    table = Table(title=f"image_ops (shipped per-tool cap {cap}, queue deadline {queue:g} s)")
    for column in ("workload", "conc.", "calls", "p50 ms", "p95 ms", "calls/s", "429s", "outcomes"):
        table.add_column(column, justify="left" if column in ("workload", "outcomes") else "right")
    for row in rows:
        numbers = (row["p50_ms"], row["p95_ms"], row["throughput_per_s"])
        table.add_row(
            row["workload"], str(row["concurrency"]), str(row["calls"]), *(f"{x:.1f}" for x in numbers),
            str(row["http_429"]), outcomes(row["outcomes"]),
        )  # fmt: skip
    return table


def settings_record(cfg: BenchConfig, server: ServerConfig) -> dict[str, Any]:
    """The run's counts plus the server settings that shape the numbers."""
    model, tools = server.tools["page_qa"].model, server.tools
    return {
        **{key: str(value) if isinstance(value, Path) else value for key, value in asdict(cfg).items()},
        "max_batch": batch_for(default_device(), model.max_batch), "batch_wait_ms": model.batch_wait_ms,
        "page_qa_max_concurrency": tools["page_qa"].limits.max_concurrency,
        "image_ops_max_concurrency": tools["image_ops"].limits.max_concurrency,
        "image_ops_queue_s": tools["image_ops"].limits.queue_timeout_s,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=BenchConfig.out, help="JSON result path")
    parser.add_argument("--quick", action="store_true", help="small counts: a smoke run, not a measurement")
    args = parser.parse_args()
    cfg = BenchConfig(out=args.out).shrunk() if args.quick else BenchConfig(out=args.out)
    pages = pick_pages(cfg.data, cfg.pages)
    server = server_config(pick_plate(cfg.data)[0].parent)
    started, machine = time.perf_counter(), machine_info()
    with (
        page_server(cfg.data / "pages" / "readability", [n for n, _ in pages]) as pages_url,
        tool_server(server) as url,
    ):
        measured = asyncio.run(run_benchmark(cfg, server, base_url=url, pages_url=pages_url, pages=pages))
    machine["load_avg_at_end"] = os.getloadavg()
    settings = settings_record(cfg, server)
    result = {"machine": machine, "settings": settings, **measured, "total_s": time.perf_counter() - started}
    console = Console()
    console.print(page_qa_table(result["page_qa"], settings))
    console.print(image_ops_table(result["image_ops"], settings))
    write_summary(cfg.out, result)
    print(f"wrote {cfg.out} ({result['total_s']:.0f} s{', quick: not a measurement' if cfg.quick else ''})")


if __name__ == "__main__":
    main()
