"""Scaling out on Ray, measured on this machine in one run: rollout workers, tool-server replicas, weight push,
and what the Ray path costs against the single-process one.

    python -m benchmarks.perf.ray [--policy runs/sft-plates/model] [--tasks 4] [--steps 2]
                                  [--out benchmarks/results/perf/ray/summary.json]

1. collect: the same `--tasks` plate photos x 2 episodes from `examples/train_plates.toml`'s policy and budgets,
   seeded alike, played
     a. in one process (the in-process sampler and tool server, training.play): the baseline;
     b. on Ray by 1 rollout worker holding every core, 1 tool-server replica (Ray Serve);
     c. by 2 rollout workers of half the cores each, 1 replica;
     d. by 2 rollout workers, 2 replicas.
   Each first plays one other photo (models loaded, engines warm) on fresh replicas, so the timed round starts
   with a cold result cache. Per row: episodes/s, and tool calls/s and sampled tokens/s, which do not depend on
   how long the episodes happened to be (more workers draw other seeded samples); the ratios c/b (workers),
   d/c (replicas) and b/a (Ray's cost at one worker, the same episodes) are of calls/s.
2. push: the trainer's weights through the object store to 1 and 2 rollout workers (put + every worker's
   load), full model and a rank-16 LoRA's adapters, the median of 3. On a GPU machine also the push over the
   GPU into a vLLM rollout worker's engine (`[ray] weight_push`: CUDA IPC on the trainer's GPU, NCCL to a
   second GPU when there is one) against the object store between the same two actors.
3. train: `--steps` sync steps of train_plates in one process and on Ray with 1 rollout + 1 trainer worker
   (same seed, so the same episodes): whole-step seconds and their ratio, update and weight-sync seconds.

On a GPU machine the rollout workers take one GPU each (`--gpus`, 1 where CUDA is: vLLM engines) and part 1 adds
a row with one worker and one tool replica per GPU it finds (when it finds more than 2). Prints one table and
writes JSON; numbers from a machine busy with other work are not comparable.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import ROOT
from benchmarks.common.records import summary_path, write_summary

# MKL's results depend on operand alignment unless this is set (read at its first call, so before torch runs
# anything): with it, one rollout worker samples exactly what one process samples (tests/test_ray_train.py),
# which makes rows a and b, and the two training paths, the same episodes.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

CONFIG = ROOT / "examples" / "train_plates.toml"
GROUP = 2  # episodes per photo: enough to batch turns, small enough to keep four rows within minutes


def base_config(args: argparse.Namespace, run_dir: Path):
    from training.config import load_train_config, with_device_sizes

    sets = [f"policy={args.policy}", f"group_size={GROUP}", f"run_dir={run_dir}", "seed=0"]
    return with_device_sizes(load_train_config(CONFIG, sets), "auto")  # as a run's learner would size it


def photos(cfg, n: int, offset: int):
    from training import tasks as task_data

    tasks = task_data.load_family(cfg.task, cfg.run.split, data_dir=cfg.run.data_dir, limit=offset + n)
    return tasks[offset : offset + n]


def episodes_per_s(groups, seconds: float) -> dict[str, float]:
    """Throughput of one collection. More workers draw other samples (worker r seeds from (seed, step, r)), so
    calls/s and sampled tokens/s, which do not depend on how long the episodes happened to be, sit beside
    episodes/s."""
    episodes = [e for g in groups for e in g]
    failed = sum(e.stop_reason == "infra_failed" for e in episodes)
    calls = sum(len(t.calls) for e in episodes for t in e.turns)
    tokens = sum(len(t.completion_ids) for e in episodes for t in e.turns)
    return {"episodes": len(episodes), "infra_failed": failed, "calls": calls, "tokens": tokens, "s": seconds,
            "episodes_per_s": len(episodes) / seconds, "calls_per_s": calls / seconds,
            "tokens_per_s": tokens / seconds}  # fmt: skip


# ---------------------------------------------------------------- 1. collect


async def collect_local(cfg, warm, timed) -> dict[str, float]:
    """Row a: the single-process path (in-process sampler and tool server)."""
    from main_agent.backends import load_policy
    from training import play
    from training.data_order import seed_step

    sampling = dataclasses.replace(cfg.sampling, backend="transformers")  # what a rollout worker samples with
    policy, tokenizer = load_policy(cfg.run.policy, sampling, max_batch=cfg.max_concurrent_episodes)
    ready_all = [*warm, *timed]
    async with play.tool_session(ready_all, work_dir=cfg.run_dir, access=cfg.tools) as (tools, ready):
        kw = dict(tools=tools, tokenizer=tokenizer, cfg=cfg.rollout, group_size=GROUP, max_concurrent=8)
        seed_step(cfg, 1)  # as rollout worker 0 seeds its collections 1 and 2
        await play.play(ready[: len(warm)], lambda _: policy, **kw)
        seed_step(cfg, 2)
        start = time.monotonic()
        groups = await play.play(ready[len(warm) :], lambda _: policy, **kw)
        return episodes_per_s(groups, time.monotonic() - start)


async def collect_ray(cfg, warm, timed, weights) -> dict[str, float]:
    """Rows b-d: rollout workers and Serve replicas as `cfg.ray` says, fresh for the row."""
    from training.ray_rollout import RolloutGroup
    from training.ray_session import serve_tools

    async with serve_tools(cfg, [*warm, *timed]) as (url, ready):
        group = await RolloutGroup.start(cfg, tools_url=url, weights=weights, version=0)
        try:
            await group.collect(ready[: len(warm)], 1)
            start = time.monotonic()
            groups = await group.collect(ready[len(warm) :], 2)
            return episodes_per_s(groups, time.monotonic() - start)
        finally:
            await group.close()


def part_collect(args, cfg, ray) -> dict[str, Any]:
    from conductor.cluster import RayConfig
    from training.ray_rollout import load_structure

    warm, timed = photos(cfg, 1, 0), photos(cfg, args.tasks, 1)  # one photo loads every model
    rows = {"a_one_process": asyncio.run(collect_local(cfg, warm, timed))}
    cores, gpus = os.cpu_count() or 1, args.gpus
    weights = ray.put(load_structure(cfg)[0].state_dict())
    layouts = {
        "b_1_worker_1_replica": RayConfig(cpus_per_rollout_worker=cores, gpus_per_rollout_worker=gpus),
        "c_2_workers_1_replica": RayConfig(
            rollout_workers=2, cpus_per_rollout_worker=cores / 2, gpus_per_rollout_worker=gpus
        ),
        "d_2_workers_2_replicas": RayConfig(
            rollout_workers=2,
            cpus_per_rollout_worker=cores / 2,
            gpus_per_rollout_worker=gpus,
            tool_replicas=2,
        ),
    }
    found = int(ray.cluster_resources().get("GPU", 0))
    if gpus and found > 2:  # a GPU machine: as many samplers (and tool replicas) as it has GPUs
        layouts[f"e_{found}_workers_{found}_replicas"] = RayConfig(
            rollout_workers=found, cpus_per_rollout_worker=cores / found, gpus_per_rollout_worker=1,
            tool_replicas=found,
        )  # fmt: skip
    for name, layout in layouts.items():
        print(f"collect {name} ...", flush=True)
        rows[name] = asyncio.run(collect_ray(dataclasses.replace(cfg, ray=layout), warm, timed, weights))
    return rows


# ---------------------------------------------------------------- 2. push


def part_push(args, cfg, ray) -> dict[str, Any]:
    """The object-store push: put once, every worker loads (what RolloutGroup.push does each step)."""
    from conductor.cluster import RayConfig
    from training.ray_rollout import load_structure

    out: dict[str, Any] = {}
    for kind, lora_rank in (("full", 0), ("lora16", 16)):
        for workers in (1, 2):
            layout = RayConfig(rollout_workers=workers, cpus_per_rollout_worker=1)
            run_cfg = dataclasses.replace(cfg, lora_rank=lora_rank, ray=layout)
            model = load_structure(run_cfg)[0]
            state = {k: v for k, v in model.state_dict().items() if lora_rank == 0 or "lora_" in k}
            unique = {v.untyped_storage().data_ptr(): v for v in state.values()}  # a tied head counts once
            mb = sum(v.numel() * v.element_size() for v in unique.values()) / 2**20
            out[f"{kind}_{workers}w"] = asyncio.run(push_times(run_cfg, state, mb, ray))
    return out


async def push_times(cfg, state, mb: float, ray) -> dict[str, float]:
    from training.ray_rollout import RolloutGroup

    group = await RolloutGroup.start(cfg, tools_url="http://127.0.0.1:9", weights=ray.put(state), version=0)
    try:
        seconds = []
        for version in (1, 2, 3):
            start = time.monotonic()
            await group.push(ray.put(state), version)
            seconds.append(time.monotonic() - start)
        return {"mb": mb, "s": statistics.median(seconds)}
    finally:
        await group.close()


def part_push_gpu(cfg) -> dict[str, Any]:
    """On GPUs: the push over the GPU (`[ray] weight_push`, training/weight_sync.py) against the object store,
    the same trainer worker and vLLM rollout worker: CUDA IPC on a shared GPU, NCCL when there are two."""
    import torch

    from conductor.cluster import RayConfig
    from main_agent.policy import SamplingConfig

    out: dict[str, Any] = {}
    for transport in ["ipc"] + (["nccl"] if torch.cuda.device_count() >= 2 else []):
        gpus = 0.5 if transport == "ipc" else 1.0
        layout = RayConfig(gpus_per_rollout_worker=gpus, gpus_per_trainer_worker=gpus, weight_push=transport)
        sampling = SamplingConfig(backend="vllm", gpu_memory_utilization=0.3)
        for kind, lora_rank in (("full", 0), ("lora16", 16)):
            run_cfg = dataclasses.replace(
                cfg, lora_rank=lora_rank, ray=layout, device="cuda", sampling=sampling
            )
            print(f"push {transport} {kind} ...", flush=True)
            out[f"{transport}_{kind}"] = asyncio.run(gpu_push_times(run_cfg))
    return out


async def gpu_push_times(cfg) -> dict[str, float]:
    from training.ray_rollout import RolloutGroup
    from training.ray_trainer import TrainerGroup
    from training.sampler import dense_parameters

    trainers, _ = TrainerGroup.start(cfg, cfg.ray, checkpoint=None)
    group = await RolloutGroup.start(cfg, tools_url="http://127.0.0.1:9", weights=trainers.sampler_weights(), version=0)  # fmt: skip
    try:
        stored, streamed = [], []
        await asyncio.to_thread(trainers.link, {0: group.workers[0]}, cfg.ray.weight_push)
        for version in (1, 2, 3):
            start = time.monotonic()
            await group.push(trainers.sampler_weights(), version)
            stored.append(time.monotonic() - start)
            start = time.monotonic()
            await asyncio.to_thread(trainers.send, [0], version)
            streamed.append(time.monotonic() - start)
        dense = sum(t.numel() * t.element_size() for _, t in dense_parameters(load_structure_of(cfg)))
        return {
            "mb": dense / 2**20,
            "object_store_s": statistics.median(stored),
            "s": statistics.median(streamed),
        }
    finally:
        await group.close()
        trainers.shutdown()


def load_structure_of(cfg):
    from training.ray_rollout import load_structure

    return load_structure(cfg)[0]


# ---------------------------------------------------------------- 3. train


def part_train(args, cfg) -> dict[str, Any]:
    from conductor.cluster import RayConfig
    from training.loop import train
    from training.metrics import read_metrics

    cores = os.cpu_count() or 1
    cfg = dataclasses.replace(cfg, steps=args.steps, group_size=4, save_every=args.steps)
    out = {}
    one = RayConfig(
        cpus_per_rollout_worker=cores, cpus_per_trainer_worker=cores, gpus_per_rollout_worker=args.gpus
    )
    for name, on_ray in (("one_process", False), ("ray_1_1", True)):
        print(f"train {name} ...", flush=True)
        run_dir = train(dataclasses.replace(cfg, run_dir=cfg.run_dir / name, ray=one), on_ray=on_ray)
        rows = read_metrics(run_dir / "metrics.jsonl")
        keys = ("time/rollout", "time/train", "time/weight_sync")
        out[name] = {k: statistics.mean(r[k] for r in rows) for k in keys}
        out[name]["step_s"] = sum(out[name].values())
        out[name]["loss/pg"] = [r["loss/pg"] for r in rows]
    return out


# ---------------------------------------------------------------- report


def table(result: dict[str, Any]) -> str:
    c, p, t = result["collect"], result["push"], result["train"]
    lines = ["| part | row | measure | value |", "|---|---|---|---|"]
    for name, row in c.items():
        lines.append(f"| collect | {name} | episodes/s ({row['episodes']} episodes, {row['calls']} calls, "
                     f"{row['tokens']} tokens, {row['infra_failed']} failed; calls/s {row['calls_per_s']:.3f}, "
                     f"tokens/s {row['tokens_per_s']:.1f}) | {row['episodes_per_s']:.3f} |")  # fmt: skip
    ratio = lambda a, b: c[a]["calls_per_s"] / c[b]["calls_per_s"]  # noqa: E731  (calls: see episodes_per_s)
    lines += [
        f"| collect | 2 workers / 1 worker | calls/s ratio | {ratio('c_2_workers_1_replica', 'b_1_worker_1_replica'):.2f}x |",
        f"| collect | 2 replicas / 1 replica | calls/s ratio | {ratio('d_2_workers_2_replicas', 'c_2_workers_1_replica'):.2f}x |",
        f"| collect | Ray 1 worker / one process | calls/s ratio | {ratio('b_1_worker_1_replica', 'a_one_process'):.2f}x |",
    ]
    for name, row in p.items():
        lines.append(f"| push | {name} ({row['mb']:.0f} MiB) | s per push | {row['s']:.3f} |")
    for name, row in result.get("push_gpu", {}).items():
        lines.append(f"| push | GPU {name} (streams {row['mb']:.0f} MiB; object store {row['object_store_s']:.3f} s) "
                     f"| s per push | {row['s']:.3f} |")  # fmt: skip
    for name, row in t.items():
        lines.append(f"| train | {name} | s/step (rollout {row['time/rollout']:.1f}, update {row['time/train']:.1f}, "
                     f"sync {row['time/weight_sync']:.2f}) | {row['step_s']:.1f} |")  # fmt: skip
    lines.append(
        f"| train | Ray / one process | step time ratio | {t['ray_1_1']['step_s'] / t['one_process']['step_s']:.2f}x |"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", default="runs/sft-plates/model")
    parser.add_argument("--tasks", type=int, default=4, help="photos per timed collection (x2 episodes)")
    parser.add_argument("--steps", type=int, default=2, help="training steps per path in part 3")
    parser.add_argument(
        "--gpus", type=float, default=None, help="GPUs per rollout worker (default: 1 where CUDA is, else 0)"
    )
    parser.add_argument("--parts", default="collect,push,train")
    parser.add_argument("--out", type=Path, default=summary_path("perf", "ray"))
    args = parser.parse_args()
    if args.gpus is None:
        import torch

        args.gpus = 1.0 if torch.cuda.is_available() else 0.0
    from conductor.cluster import RayConfig, cluster

    started = time.monotonic()
    result: dict[str, Any] = {"cores": os.cpu_count(), "args": {k: str(v) for k, v in vars(args).items()}}
    with tempfile.TemporaryDirectory(prefix="bench_ray_") as tmp:
        cfg = base_config(args, Path(tmp))
        sized = RayConfig(rollout_workers=2, tool_replicas=2, cpus_per_rollout_worker=os.cpu_count() or 1)
        with cluster(sized):
            import ray

            if "collect" in args.parts:
                result["collect"] = part_collect(args, cfg, ray)
            if "push" in args.parts:
                result["push"] = part_push(args, cfg, ray)
            if "push" in args.parts and args.gpus > 0:
                result["push_gpu"] = part_push_gpu(cfg)
        if "train" in args.parts:
            result["train"] = part_train(args, cfg)  # each path its own cluster (train on Ray starts one)
    result["wall_s"] = time.monotonic() - started
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_summary(args.out, result)
    if {"collect", "push", "train"} <= set(result):
        print(table(result))
    print(f"wrote {args.out} ({result['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
