"""Learning throughput, the old path against the new one in the same run, on one config.

    python -m benchmarks.perf.throughput [--steps 3] [--policy runs/sft-plates/model] [--precision bf16]
                                         [--out benchmarks/results/perf/throughput/summary.json]

Every part runs in its own spawned process (its own peak RSS, nothing left over from another part):

1. peak: the best of 5 float32 and bfloat16 matmuls (2048 x 2048) in GFLOP/s: the denominator of MFU.
2. train: `examples/train_plates.toml` for `--steps` sync steps from `--policy` with the same seed, twice.
     old = every episode runs whole in the update (share_prefix off), float32, rapidocr's default detector
           (the short side raised to 736 px, what image_ops used before subagents/ocr.py)
     new = the shared-prefix update, `--precision`, the detector at the image's own size
   Both sample with the same backend ("auto": vLLM where installed, else transformers). Per path, averaged over
   the steps after the first (the first also loads models and warms caches): update s, rollout s, whole step s,
   episodes/s, trainer tokens/s on unique tokens (tokens the update cannot skip: a prefix shared by episodes
   counts once), peak RSS, and MFU = 6 x parameters x unique tokens / update time / the peak.
   The update again, both ways on the same batches (the old path's rollouts, learning rate 0): a ratio free
   of what each path's policy happened to sample (3 steps of 8 episodes vary by 2x in length).
3. drift: on the new path's last rollouts, the trainer's log-probs in float32 and in bfloat16 against the
   sampler's: importance ratio mean and largest deviation, and the share of tokens a clip would stop.
4. ocr: `read` of a 384-px plate crop through the real tool server at concurrency 1 and 8, old detector and new.
5. page_qa: 8 calls at once against the same 8 one by one through the real tool server (benchmarks/
   perf/subagents.py's phases), and the profile that bounds it: the same 8 prompts' prefill and whole
   generation through the model, one by one and batched, float32 and bf16 autocast; and, where vLLM is
   installed, the server's phases again with page_qa on the sub-agents' vLLM backend.

Prints one table of ratios and writes JSON. Numbers from a machine busy with other work are not comparable.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import resource
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from benchmarks import ROOT
from benchmarks.common.records import summary_path, write_summary

CONFIG = ROOT / "examples" / "train_plates.toml"
CLIP = (0.2, 0.28)  # the trainer's default clip_eps_low / clip_eps_high


def in_child(fn, *args):
    """`fn(*args)` in a fresh spawned process: its own peak RSS, no model or engine left from another part."""
    with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ---------------------------------------------------------------- 1. peak


def peak_gflops() -> dict[str, float]:
    """Best of 5 timed 2048 x 2048 matmuls per dtype (after one warm-up), in GFLOP/s."""
    import torch

    results = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        a, b = torch.randn(2048, 2048, dtype=dtype), torch.randn(2048, 2048, dtype=dtype)
        a @ b  # warm-up: thread pool and kernel selection
        best = math.inf
        for _ in range(5):
            start = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - start)
        results[name] = 2 * 2048**3 / best / 1e9
    return results


# ---------------------------------------------------------------- 2. train


def old_detector():
    """rapidocr with its default detector limits (short side raised to 736 px): image_ops before ocr.py."""
    import rapidocr

    models = Path(rapidocr.__file__).parent / "models"
    paths = {task: sorted(models.glob(f"*_{task}_*.onnx"))[0] for task in ("det", "cls", "rec")}
    params: dict[str, object] = {f"{task.capitalize()}.model_path": str(p) for task, p in paths.items()}
    params["Global.log_level"] = "error"
    return rapidocr.RapidOCR(params=params)


def use_path(path: str) -> None:
    """Make this process's OCR engine the old or the new one."""
    from subagents import ocr

    if path == "old":
        ocr.make_engine = old_detector


def unique_tokens(sequences: list[list[int]]) -> int:
    """Nodes of the prefix tree of `sequences`: every token counted once per distinct prefix."""
    root: dict[int, dict] = {}
    count = 0
    for ids in sequences:
        node = root
        for token in ids:
            if token not in node:
                node[token] = {}
                count += 1
            node = node[token]
    return count


def train_path(path: str, policy: str, steps: int, precision: str) -> dict[str, Any]:
    """`steps` sync steps of examples/train_plates.toml on the old or the new path; per-step numbers."""
    import torch

    from main_agent.tokens import segment_ids
    from training.config import load_train_config
    from training.loop import train
    from training.metrics import load_episodes, read_metrics

    use_path(path)
    torch.manual_seed(0)
    run_dir = Path(tempfile.mkdtemp(prefix=f"bench-throughput-{path}-"))
    new = path == "new"
    sets = [f"policy={policy}", f"steps={steps}", f"run_dir={run_dir}", "save_every=1000", "seed=0"]
    sets += [f"share_prefix={'true' if new else 'false'}", f"precision={precision if new else 'fp32'}"]
    cfg = load_train_config(CONFIG, sets)
    start = time.monotonic()
    train(cfg)
    wall = time.monotonic() - start
    rows = read_metrics(run_dir / "metrics.jsonl")
    per_step = []
    for row in rows:
        episodes = load_episodes(run_dir / "rollouts" / f"step_{int(row['step'])}.jsonl")
        per_step.append(
            {**row, "unique_tokens": unique_tokens([ids for e in episodes for ids in segment_ids(e)])}
        )
    return {
        "path": path,
        "run_dir": str(run_dir),
        "wall_s": wall,
        "steps": per_step,
        "peak_rss_mb": peak_rss_mb(),
    }


def path_summary(result: dict[str, Any], peak: float, params: int) -> dict[str, float]:
    """Means over the steps after the first (all of them when there is only one)."""
    steps = result["steps"][1:] or result["steps"]

    def avg(key: str) -> float:
        return statistics.fmean(s[key] for s in steps)

    update, rollout = avg("time/train"), avg("time/rollout")
    tokens = avg("unique_tokens")
    return {
        "update_s": update,
        "rollout_s": rollout,
        "step_s": update + rollout + avg("time/weight_sync"),
        "episodes_per_s": avg("episodes/collected") / (update + rollout),
        "unique_tokens": tokens,
        "trainer_tokens_per_s": tokens / update,
        "mfu": 6 * params * tokens / update / (peak * 1e9),
        "reward": avg("reward/final"),
        "peak_rss_mb": result["peak_rss_mb"],
    }


def same_batches(run_dir: str, policy: str, precision: str) -> dict[str, Any]:
    """The update both ways on the same episodes: every step's rollouts of `run_dir` (the old path's), from the
    same weights (learning rate 0), so the ratio is free of what each path's policy happened to sample."""
    import torch

    from conductor.models import resolve_model
    from main_agent.tokens import to_sequences
    from main_agent.transformers_policy import load_model
    from training.config import load_train_config
    from training.metrics import load_episodes
    from training.update import update

    model, _ = load_model(resolve_model(policy))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
    base = load_train_config(CONFIG, [f"policy={policy}"])
    paths = {
        "old": dataclasses.replace(base, share_prefix=False, precision="fp32"),
        "new": dataclasses.replace(base, share_prefix=True, precision=precision),
    }
    files = sorted(Path(run_dir, "rollouts").glob("step_*.jsonl"), key=lambda p: int(p.stem.split("_")[1]))
    times: dict[str, list[float]] = {"old": [], "new": []}
    for file in files:
        episodes = load_episodes(file)
        sequences = [s for e in episodes if e.turns for s in to_sequences(e, [1.0] * len(e.turns))]
        for path, cfg in paths.items():
            start = time.perf_counter()
            update(model, optimizer, sequences, cfg)
            times[path].append(time.perf_counter() - start)
    return {"old_s": times["old"], "new_s": times["new"], "ratio": sum(times["old"]) / sum(times["new"])}


# ---------------------------------------------------------------- 3. drift


def drift(run_dir: str, policy: str) -> dict[str, dict[str, float]]:
    """The trainer's log-probs of the last step's rollouts, float32 and bf16, against the sampler's."""
    import torch

    from conductor.models import resolve_model
    from main_agent.tokens import collate, micro_batches, to_sequences
    from main_agent.transformers_policy import load_model
    from training.loss import batch_logprobs
    from training.metrics import load_episodes

    last = sorted(Path(run_dir, "rollouts").glob("step_*.jsonl"), key=lambda p: int(p.stem.split("_")[1]))[-1]
    episodes = load_episodes(last)
    sequences = [s for e in episodes if e.turns for s in to_sequences(e, [0.0] * len(e.turns))]
    model, _ = load_model(resolve_model(policy))
    model.eval()
    result = {}
    for precision in ("fp32", "bf16"):
        ratios = []
        for chunk in micro_batches(sequences, max_tokens=2048, share_prefix=True):
            batch = collate(chunk, pad_id=0, share_prefix=True)
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                logprobs = batch_logprobs(model, batch)
            mask = batch.loss_mask.bool()
            ratios.append(torch.exp(logprobs - batch.old_logprobs)[mask])
        ratio = torch.cat(ratios)
        outside = (ratio < 1 - CLIP[0]) | (ratio > 1 + CLIP[1])
        result[precision] = {
            "ratio_mean": float(ratio.mean()),
            "ratio_max_dev": float((ratio - 1).abs().max()),
            "outside_clip": float(outside.float().mean()),
            "tokens": int(ratio.numel()),
        }
    return result


# ---------------------------------------------------------------- 4-5. sub-agents


def subagents_part(path: str, data: str) -> dict[str, Any]:
    """`read` at concurrency 1 and 8 (and, on the new path, page_qa 8 at once vs one by one) through the real
    tool server, with the old or the new OCR detector."""
    import httpx

    from benchmarks.perf.subagents import (
        CLIENT_TIMEOUT,
        image_level,
        page_qa_phases,
        page_server,
        pick_pages,
        pick_plate,
        server_config,
        tool_server,
    )

    use_path(path)
    data_dir = Path(data)
    plate, box = pick_plate(data_dir)
    pages = pick_pages(data_dir, 8)

    async def measure(base_url: str, pages_url: str) -> dict[str, Any]:
        async with httpx.AsyncClient(base_url=base_url, timeout=CLIENT_TIMEOUT) as client:
            await image_level(
                client, plate, box, workload="read", concurrency=1, rounds=1
            )  # the engine loads
            reads = [
                await image_level(client, plate, box, workload="read", concurrency=c, rounds=r)
                for c, r in ((1, 8), (8, 3))
            ]
            qa = await page_qa_phases(client, pages_url, pages) if path == "new" else None
        return {"read": reads, "page_qa": qa}

    folder = data_dir / "pages" / "readability"
    with (
        page_server(folder, [name for name, _ in pages]) as pages_url,
        tool_server(server_config(plate.parent)) as url,
    ):
        return asyncio.run(measure(url, pages_url))


def page_qa_vllm(data: str) -> dict[str, Any] | None:
    """page_qa 8 at once vs one by one through the real tool server with the sub-agents' in-process vLLM backend
    (`[page_qa.model] backend = "vllm"`); None where vLLM is not installed."""
    import importlib.util

    import httpx

    from benchmarks.perf.subagents import (
        CLIENT_TIMEOUT,
        page_qa_phases,
        page_server,
        pick_pages,
        server_config,
        tool_server,
    )

    if importlib.util.find_spec("vllm") is None:
        return None
    data_dir = Path(data)
    pages = pick_pages(data_dir, 8)
    cfg = server_config(data_dir)
    qa = cfg.tools["page_qa"]
    vllm_qa = dataclasses.replace(qa, model=dataclasses.replace(qa.model, backend="vllm"))
    cfg = dataclasses.replace(cfg, tools={**cfg.tools, "page_qa": vllm_qa})

    async def measure(base_url: str, pages_url: str) -> dict[str, Any]:
        async with httpx.AsyncClient(base_url=base_url, timeout=CLIENT_TIMEOUT) as client:
            return await page_qa_phases(client, pages_url, pages)

    folder = data_dir / "pages" / "readability"
    with page_server(folder, [name for name, _ in pages]) as pages_url, tool_server(cfg) as url:
        return asyncio.run(measure(url, pages_url))


def page_qa_profile(data: str) -> dict[str, Any]:
    """What bounds page_qa's fan-out: the 8 measured pages' prompts (as page_qa builds them) through the
    backend's model directly, prefill and whole greedy generation, one by one and as one batch, in float32
    and under bf16 autocast. If prefill costs the same either way, it bounds the fan-out ratio."""
    import torch

    from benchmarks.perf.subagents import pick_pages
    from conductor.batching import left_pad
    from subagents import page_qa
    from subagents.llm import BackendConfig
    from subagents.transformers_llm import TransformersLLM

    folder = Path(data) / "pages" / "readability"
    cfg = page_qa.Config()
    llm = TransformersLLM(BackendConfig())
    prompts = []
    for name, question in pick_pages(Path(data), 8)[:-1]:
        prep = page_qa.prepare(
            (folder / name / "source.html").read_bytes(), "text/html", question=question, cfg=cfg
        )
        prompts.append(llm.render(page_qa.build_prompt(["\n".join(c) for c in prep.top], question)))

    def timed(fn) -> tuple[float, Any]:
        start = time.perf_counter()
        out = fn()
        return time.perf_counter() - start, out

    def prefill(batch: list[list[int]]) -> None:
        ids, mask = left_pad(batch, pad_id=llm.pad_id)
        with torch.inference_mode():
            llm.model(input_ids=ids, attention_mask=mask)

    result: dict[str, Any] = {"prompt_tokens": [len(p) for p in prompts]}
    for precision in ("fp32", "bf16"):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            prefill(prompts[:1])  # warm-up
            alone = sum(timed(lambda p=p: prefill([p]))[0] for p in prompts)
            together = timed(lambda: prefill(prompts))[0]
            runs = [timed(lambda p=p: llm.generate_batch([p], cfg.max_new_tokens)) for p in prompts]
            batch_s, outputs = timed(lambda: llm.generate_batch(prompts, cfg.max_new_tokens))
        sequential = sum(s for s, _ in runs)
        result[precision] = {
            "prefill_one_by_one_s": alone,
            "prefill_batch_s": together,
            "generate_one_by_one_s": sequential,
            "generate_batch_s": batch_s,
            "speedup": sequential / batch_s,
            "new_tokens_one_by_one": [len(out[0]) for _, out in runs],
            "new_tokens_batch": [len(out) for out in outputs],
            "same_answers": [out[0] for _, out in runs] == outputs,
        }
    return result


# ---------------------------------------------------------------- the table


Row = tuple[str, str, str, str]


def table(result: dict[str, Any]) -> str:
    """The measures, old against new, one row each: training, the sub-agents, page_qa's batching, the drift."""
    rows = [("measure", "old", "new", "new/old or old/new"), *_train_rows(result), *_subagent_rows(result)]
    rows += _page_qa_rows(result) + _drift_rows(result)
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join(" | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


def _train_rows(result: dict[str, Any]) -> list[Row]:
    old, new = result["train"]["old"], result["train"]["new"]
    rows = []
    for key, label, better in (
        ("update_s", "update s/step", "lower"),
        ("rollout_s", "rollout s/step", "lower"),
        ("step_s", "whole step s", "lower"),
        ("episodes_per_s", "episodes/s", "higher"),
        ("trainer_tokens_per_s", "trainer unique tokens/s", "higher"),
        ("mfu", "MFU", "higher"),
        ("peak_rss_mb", "peak RSS MB", "lower"),
        ("reward", "training reward (mean)", "same"),
    ):
        a, b = old[key], new[key]
        ratio = a / b if better == "lower" else b / a if better == "higher" else math.nan
        rows.append((label, f"{a:.3g}", f"{b:.3g}", f"{ratio:.2f}x" if math.isfinite(ratio) else ""))
    same = result["same_batches"]
    old_s, new_s = statistics.fmean(same["old_s"]), statistics.fmean(same["new_s"])
    rows.append(
        ("update on the same batches s/step", f"{old_s:.3g}", f"{new_s:.3g}", f"{same['ratio']:.2f}x")
    )
    return rows


def _subagent_rows(result: dict[str, Any]) -> list[Row]:
    rows = []
    for path in ("old", "new"):
        for level in result["subagents"][path]["read"]:
            label = f"OCR read c={level['concurrency']} p50/p95 ms ({path})"
            rows.append((label, f"{level['p50_ms']:.0f}", f"{level['p95_ms']:.0f}", ""))
    backends = {"": result["subagents"]["new"]["page_qa"], " (vLLM backend)": result.get("page_qa_vllm")}
    for where, qa in backends.items():
        if qa is not None:
            one, many = qa["sequential"]["wall_s"], qa["concurrent"]["wall_s"]
            label = f"page_qa 8 one by one / at once s{where}"
            rows.append((label, f"{one:.1f}", f"{many:.1f}", f"{qa['speedup']:.2f}x"))
    return rows


def _page_qa_rows(result: dict[str, Any]) -> list[Row]:
    rows = []
    for precision in ("fp32", "bf16"):
        prof = result["page_qa_profile"][precision]
        one, batch = prof["prefill_one_by_one_s"], prof["prefill_batch_s"]
        label = f"page_qa prefill 8 one by one / batch s ({precision})"
        rows.append((label, f"{one:.1f}", f"{batch:.1f}", f"{one / batch:.2f}x"))
        one, batch = prof["generate_one_by_one_s"], prof["generate_batch_s"]
        label = f"page_qa generate 8 one by one / batch s ({precision})"
        rows.append((label, f"{one:.1f}", f"{batch:.1f}", f"{prof['speedup']:.2f}x"))
    return rows


def _drift_rows(result: dict[str, Any]) -> list[Row]:
    return [
        (
            f"ratio mean / max dev / outside clip ({precision})",
            f"{d['ratio_mean']:.4f}",
            f"{d['ratio_max_dev']:.3g}",
            f"{d['outside_clip']:.4f}",
        )
        for precision, d in result["drift"].items()
    ]


def main() -> None:
    import os

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="sync training steps per path")
    parser.add_argument(
        "--policy", default=str(ROOT / "runs" / "sft-plates" / "model"), help="the start policy"
    )
    parser.add_argument("--precision", default="bf16", choices=("fp32", "bf16"), help="the new path's update")
    parser.add_argument(
        "--data", default=os.environ.get("CONDUCTOR_DATA", str(ROOT.parent / "shared" / "data"))
    )
    parser.add_argument("--out", type=Path, default=summary_path("perf", "throughput"))
    args = parser.parse_args()
    if not Path(args.policy, "config.json").is_file():
        sys.exit(
            f"{args.policy} is not a checkpoint: warm-start one first"
            " (benchmarks.studies.rl.bench, conductor sft)"
        )
    started = time.monotonic()
    peak = in_child(peak_gflops)
    train = {p: in_child(train_path, p, args.policy, args.steps, args.precision) for p in ("old", "new")}
    params = in_child(count_parameters, args.policy)
    flops = peak["bfloat16" if args.precision == "bf16" else "float32"]
    summary = {p: path_summary(train[p], peak["float32"] if p == "old" else flops, params) for p in train}
    result = {
        "settings": dataclasses.asdict(Settings(args.steps, args.policy, args.precision, str(CONFIG))),
        "peak_gflops": peak,
        "parameters": params,
        "train": summary,
        "train_raw": train,
        "same_batches": in_child(same_batches, train["old"]["run_dir"], args.policy, args.precision),
        "drift": in_child(drift, train["new"]["run_dir"], args.policy),
        "subagents": {p: in_child(subagents_part, p, args.data) for p in ("old", "new")},
        "page_qa_profile": in_child(page_qa_profile, args.data),
        "page_qa_vllm": in_child(page_qa_vllm, args.data),
        "wall_s": time.monotonic() - started,
    }
    print(table(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_summary(args.out, result)
    print(f"wrote {args.out} ({result['wall_s'] / 60:.1f} min)")


@dataclasses.dataclass(frozen=True)
class Settings:
    steps: int
    policy: str
    precision: str
    config: str


def count_parameters(policy: str) -> int:
    from conductor.models import resolve_model
    from main_agent.transformers_policy import load_model

    model, _ = load_model(resolve_model(policy))
    return sum(p.numel() for p in model.parameters())


if __name__ == "__main__":
    main()
