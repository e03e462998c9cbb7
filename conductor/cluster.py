"""Ray: the `[ray]` settings of a run, and joining (or starting) the cluster it runs on.

    cfg = RayConfig(rollout_workers=2, tool_replicas=2)     # `[ray]` of a training run
    with cluster(cfg) as info:                              # ray.init: a local cluster, or the one at address
        ...                                                 # actors (training/ray_*.py), Serve (tool_server)

`ray` is the optional extra `distributed` (`pip install -e '.[distributed]'`); importing this module does not
import it. A local cluster is sized so that every actor a run asks for fits: Ray's CPUs are scheduling tokens,
so on a 2-core machine a run of 2 rollout workers, 1 trainer worker and 2 tool replicas starts (oversubscribed,
said in the log) instead of waiting forever for CPUs that will never come. Each actor sizes its torch threads
to the CPUs it asked for (`actor_threads`), so two actors on one core do not each spin up a thread per core.
A local cluster keeps its files (and its sockets) under a short temp dir when TMPDIR is too long for them
(`ray_temp_dir`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import sys
from collections.abc import Iterator
from dataclasses import dataclass

logger = logging.getLogger(__name__)

LOCAL = "local"
"""`address` for a cluster started by (and ending with) this process."""

AF_UNIX_PATH_MAX = 107
"""The longest socket path Linux accepts (108 bytes of `sun_path` with the final NUL)."""
RAY_SOCKET_TAIL = "/ray/session_2000-01-01_00-00-00_000000_4194304/sockets/plasma_store.9"
"""The longest path Ray puts below its temp root for a socket (a session named by date and a 7-digit pid, a
numbered socket file): Ray refuses to start when the whole passes AF_UNIX_PATH_MAX."""


@dataclass(frozen=True)
class RayConfig:
    """Where a run's actors go and how many (`[ray]`; `conductor train CONFIG --ray [ADDRESS]`)."""

    address: str = LOCAL
    """"local": a cluster started here for the run; "auto": the cluster `ray start --head` runs on this
    machine; "HOST:6379" or "ray://HOST:10001": a cluster elsewhere."""
    rollout_workers: int = 1
    """Rollout worker actors, each with its own sampler and tool client; a step's groups are spread over them."""
    trainer_workers: int = 1
    """Data-parallel trainer actors (torch.distributed: gloo on CPU, NCCL on GPUs); rank 0 checkpoints."""
    tool_replicas: int = 1
    """Tool-server replicas behind Ray Serve (unless `[tools] url` names a running server)."""
    tool_max_replicas: int = 0
    """> tool_replicas: Serve autoscales between the two on queue depth (`tool_target_ongoing_requests`)."""
    tool_target_ongoing_requests: float = 4.0
    """Autoscaling target: calls in flight per replica. 4 keeps a CPU replica's model busy without queueing a
    whole group's calls behind one another."""
    cpus_per_rollout_worker: float = 1.0
    """Ray CPUs each rollout worker reserves; its torch threads follow (at least 1)."""
    gpus_per_rollout_worker: float = 0.0
    """GPUs each rollout worker reserves (> 0: its sampler is a vLLM engine on that GPU)."""
    cpus_per_trainer_worker: float = 1.0
    """Ray CPUs each trainer worker reserves; its torch threads follow (at least 1)."""
    gpus_per_trainer_worker: float = 0.0
    """GPUs each trainer worker reserves (> 0: the model trains on cuda, workers talk over NCCL)."""
    weight_push: str = "object_store"
    """How the weights reach the samplers after every step. "object_store": rank 0 puts them once in Ray's
    object store and every worker reads them (any sampler, any device). "nccl": streamed from the trainer's GPU
    into each vLLM engine on another GPU; "ipc": CUDA IPC, for engines on the trainer's own GPU
    (training/weight_sync.py). Both need `sampling.backend = "vllm"` and GPUs for trainer and rollout workers."""
    cpus_per_tool_replica: float = 1.0
    """Ray CPUs each tool-server replica reserves (its sub-agents' models run on them)."""
    max_restarts: int = 3
    """Times Ray restarts a dead rollout worker before the run gives up on it: a node lost now and then is
    survived; a worker that dies every step is a bug to see, not to hide. (Serve replaces dead tool replicas
    itself, without a limit; trainer workers are not restarted: a fresh one would have missed steps.)"""

    def __post_init__(self) -> None:
        from conductor.settings import ConfigError

        checks = {
            "rollout_workers >= 1": self.rollout_workers >= 1,
            "trainer_workers >= 1": self.trainer_workers >= 1,
            "tool_replicas >= 1": self.tool_replicas >= 1,
            "tool_max_replicas 0 or >= tool_replicas": self.tool_max_replicas in (0,)
            or self.tool_max_replicas >= self.tool_replicas,
            "tool_target_ongoing_requests > 0": self.tool_target_ongoing_requests > 0,
            "cpus and gpus per actor >= 0": min(self.resources) >= 0,
            "max_restarts >= 0": self.max_restarts >= 0,
            "weight_push one of object_store, nccl, ipc": self.weight_push in ("object_store", "nccl", "ipc"),
        }
        failed = [rule for rule, ok in checks.items() if not ok]
        if failed:
            raise ConfigError(f"invalid [ray] settings, need: {', '.join(failed)}")

    @property
    def resources(self) -> tuple[float, ...]:
        """Every per-actor CPU and GPU count."""
        return (
            *(self.cpus_per_rollout_worker, self.gpus_per_rollout_worker, self.cpus_per_trainer_worker),
            *(self.gpus_per_trainer_worker, self.cpus_per_tool_replica),
        )

    @property
    def cpus_needed(self) -> float:
        """Ray CPUs the run's actors reserve together (tool replicas at their maximum)."""
        replicas = max(self.tool_replicas, self.tool_max_replicas)
        return (
            self.rollout_workers * self.cpus_per_rollout_worker
            + self.trainer_workers * self.cpus_per_trainer_worker
            + replicas * self.cpus_per_tool_replica
        )


@dataclass(frozen=True)
class ClusterInfo:
    """What `cluster` joined."""

    address: str
    local: bool
    cpus: float
    gpus: float


def free_port() -> int:
    """A TCP port free on this node now, for a rendezvous opened moments later (a narrow race: another process
    may take it in between)."""
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def require_ray():
    """The ray module, or an ImportError saying how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise ImportError(
            "Ray is not installed: pip install -e '.[distributed]' (ray[default,serve])"
        ) from exc
    return ray


@contextlib.contextmanager
def cluster(cfg: RayConfig) -> Iterator[ClusterInfo]:
    """Join the cluster at `cfg.address`, or start a local one sized for the run; leave (and stop a local one)
    on exit. Joining a cluster this process already joined reuses it and leaves it running."""
    ray = require_ray()
    if ray.is_initialized():
        yield info(ray, local=False)
        return
    local = cfg.address == LOCAL
    kwargs: dict[str, object] = {
        "runtime_env": {"env_vars": worker_env()},
        "log_to_driver": logger.isEnabledFor(logging.DEBUG),
        "configure_logging": False,
    }
    if local:
        kwargs["_temp_dir"] = ray_temp_dir()
        cpus = max(float(os.cpu_count() or 1), cfg.cpus_needed)
        if cpus > (os.cpu_count() or 1):
            logger.info(
                "local Ray cluster oversubscribed: %.1f CPUs reserved on %d cores", cpus, os.cpu_count()
            )
        kwargs.update(num_cpus=math.ceil(cpus), include_dashboard=False)
    # Ray's own spelling: "local" starts a cluster whatever RAY_ADDRESS or the last `ray start` names (no
    # address would join that one, and num_cpus would then fail).
    ray.init(address=cfg.address, **kwargs)
    try:
        joined = info(ray, local=local)
        logger.info("Ray cluster %s: %.0f CPUs, %.0f GPUs", joined.address, joined.cpus, joined.gpus)
        yield joined
    finally:
        with contextlib.suppress(Exception):  # Serve may not have started; shutting it down is best effort
            from ray import serve

            serve.shutdown()
        ray.shutdown()


def ray_temp_dir() -> str | None:
    """Where a local cluster keeps its files: None (Ray's own choice: $RAY_TMPDIR, else $TMPDIR, else /tmp) when
    its socket paths fit AF_UNIX_PATH_MAX, else /tmp/ray-UID, said in the log. A long TMPDIR (a CI runner's, a
    pytest sandbox's) otherwise stops Ray at start-up with "AF_UNIX path length cannot exceed 107 bytes"."""
    root = os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp"
    if len((root + RAY_SOCKET_TAIL).encode()) <= AF_UNIX_PATH_MAX:
        return None
    short = f"/tmp/ray-{os.getuid()}"
    logger.info(
        "temp dir %s is too long for Ray's socket paths (at most %d bytes): the local cluster uses %s",
        root, AF_UNIX_PATH_MAX, short,
    )  # fmt: skip
    return short


def worker_env() -> dict[str, str]:
    """Environment the workers get from the driver: its import path (workers import this project as the driver
    does), and MKL's reproducibility mode when set (`MKL_CBWR=AUTO,STRICT`: without it MKL's results depend on
    the operands' memory alignment, so two processes holding the same weights differ by an ulp)."""
    env = {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    if "MKL_CBWR" in os.environ:
        env["MKL_CBWR"] = os.environ["MKL_CBWR"]
    return env


def info(ray, *, local: bool) -> ClusterInfo:
    resources = ray.cluster_resources()
    address = ray.get_runtime_context().gcs_address
    return ClusterInfo(address, local, float(resources.get("CPU", 0)), float(resources.get("GPU", 0)))


def actor_threads(cpus: float) -> int:
    """Torch threads for an actor that reserved `cpus` Ray CPUs: at least one, at most the machine's cores."""
    return max(1, min(int(cpus), os.cpu_count() or 1))
