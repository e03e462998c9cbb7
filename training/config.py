"""The trainer's settings: one frozen dataclass composed of the tables every run shares; and `RunSettings`, what
training, evaluation and SFT all set (the policy, the split and how many of its tasks, the data folder, the seed),
declared once here.

    policy = "runs/sft/model"        # top level: the run itself (data, batch shape, optimizer, checkpoints)
    task = "plate_reading"
    [rollout]                        # main_agent.rollout.RolloutConfig: turn, token and time budgets
    [credit]                         # training.advantages.CreditConfig: outcome or turn credit, baseline
    [turn_rewards]                   # training.rewards.TurnRewardWeights: shaping terms per turn
    [sampling]                       # main_agent.policy.SamplingConfig: who samples (transformers, vllm, server)
    [tools]                          # tool_server.embedded.ToolAccess: a running tool server, or one in-process
    [horizon]                        # training.curriculum.HorizonConfig: items per item task, and its curriculum
    [expert_mix]                     # training.expert_mix.ExpertMixConfig: expert episodes in the first steps' groups
    [near_miss]                      # training.near_miss.NearMissConfig: continuations of near-miss prefixes join groups
    [ray]                            # conductor.cluster.RayConfig: workers, replicas, resources (`--ray`)

    cfg = load_train_config(Path("train.toml"), ["group_size=8", "credit.mode=turn", "rollout.max_turns=6"])

Unknown keys are errors naming the key and the valid ones (conductor.settings); a key of the old flat layout
(`max_turns = 6`, `credit = "turn"`, `sampler = "vllm"`) is an error naming its new place. A missing file means
all defaults, which run on a 2-core CPU (slowly: a step of 2 tasks x 4 episodes with the 135M policy takes
minutes there, most of it generation).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from conductor.cluster import RayConfig
from conductor.models import DEFAULT_MODEL, default_device, device_memory_gib
from conductor.settings import ConfigError, load_settings, shared, to_dict
from main_agent.policy import SamplingConfig
from main_agent.rollout import RolloutConfig
from tool_server.embedded import ToolAccess
from training.advantages import CreditConfig
from training.curriculum import HorizonConfig
from training.expert_mix import ExpertMixConfig
from training.near_miss import NearMissConfig
from training.rewards import TurnRewardWeights

RESUME_KEYS = (
    *("task", "split", "limit", "seed", "batch_tasks", "group_size"),
    *("horizon.items", "horizon.max_items", "horizon.factor"),
)
"""Settings a resumed run must share with the saved one: they define the data order and the batch shape, so
changing them would make "continue exactly" a lie. `--force` overrides the check."""

_ROLLOUT = ("max_turns", "max_calls_per_turn", "max_new_tokens", "max_context_tokens", "observation_tokens")
MOVED = {
    **{key: f"rollout.{key}" for key in (*_ROLLOUT, "wall_clock_s")},
    "credit": "credit.mode",
    **{key: f"credit.{key}" for key in ("gamma", "normalize_std", "baseline")},
    "temperature": "sampling.temperature",
    "sampler": "sampling.backend",
    "sampler_url": "sampling.url",
    "vllm_gpu_memory_utilization": "sampling.gpu_memory_utilization",
    "tools_url": "tools.url",
    "max_inflight_tool_calls": "tools.max_inflight_calls",
}
"""The flat keys of earlier versions and where each went; loading one is an error that names the new place."""

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunSettings:
    """What every run of the policy on tasks sets: training, evaluation and SFT each hold one, with defaults of
    their own (`shared(...)`), and its keys sit in their own table (`policy = ...`, `split = "dev"`)."""

    policy: str = DEFAULT_MODEL
    """Built-in model name, or a local checkpoint or LoRA adapter dir: the policy to start from, or to evaluate."""
    split: str = "train"
    """Split of the task family (train, dev or test)."""
    limit: int | None = None
    """Only the first `limit` tasks of the split, in the loader's fixed order (None: all): the same tasks for every
    policy and every run."""
    data_dir: Path | None = None
    """The shared data folder; None: $CONDUCTOR_DATA, else ../shared/data beside the repository."""
    seed: int = 0
    """Seeds what the run draws: training's task order and torch's sampler (reseeded from (seed, step) every step,
    so resume is exact), SFT's micro-batch order, LoRA initialisation, the vLLM samplers. Greedy evaluation draws
    nothing, but a sampling policy would."""


@dataclass(frozen=True)
class TrainConfig:
    """One RL run of the main policy against the tool server."""

    run: RunSettings = shared(RunSettings)
    """The policy to start from, the split of `task` trained on (all of it by default), data folder and seed: keys
    of this table (`policy = ...`, `limit = 64`)."""
    task: str = "multihop_pages"
    """Task family (a key of `training.tasks.FAMILIES`)."""
    task_ids: tuple[str, ...] = ()
    """Train on these tasks of the split only, in the loader's order (empty: all of it, or its first `limit`):
    e.g. those where the warm start's sampled rewards differ, the only groups an update learns from
    (benchmarks/studies/learning's screen). An id the split does not have is an error."""
    steps: int = 20
    """Optimizer steps. Each step samples `batch_tasks` tasks and `group_size` episodes of each."""
    batch_tasks: int = 2
    """Tasks per step (B). B x G episodes are played per step; 8 keep a 2-core CPU busy for minutes."""
    group_size: int = 4
    """Episodes per task (G); their rewards are each other's baseline, so at least 2."""
    reward_kind: Literal["task", "graded"] = "task"
    """The final reward trained on: "task", the family's own (plates: exact match; QA: token F1); "graded",
    partial credit where the family's own is all-or-nothing (plate_reading, plate_audit: 1 - normalised edit
    distance per plate; `Family.graded_reward`), the family's own elsewhere. `success` is logged by the family's
    exact rule either way; evaluation always reports the family's own reward."""
    evidence_weight: float = 0.0
    """Weight w of evidence recall in the final reward, (1 - w) x the answer's reward + w x the share of the
    task's supporting pages a page_qa call read (David-GRPO, arXiv 2601.21699; `rewards.evidence_recall`). Why: a
    small policy's groups mostly score F1 0 alike and teach nothing; reading the right pages differs between
    their episodes and is the step an answer needs first. A convex mix keeps the reward in [0, 1], which credit
    and the logs assume. 0 (the default): today's reward, bit for bit; > 0 needs every task to have supporting
    pages (corpus_qa, multihop_pages; a run of another family fails at its start). Recall is logged
    (`reward/evidence_recall`) wherever tasks have supporting pages, whatever w."""
    lr: float | None = None
    """AdamW learning rate; None: 1e-5 for full fine-tuning, 1e-4 with LoRA (adapters need larger steps)."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up over this many steps, then constant."""
    lora_rank: int = 0
    """0 trains every weight; > 0 trains a peft LoRA of this rank on q, k, v, o (alpha = 2 x rank)."""
    micro_batch_tokens: int | None = None
    """Tokens computed per forward/backward (padding included; a shared prefix counted once). Gradients
    accumulate over all micro-batches of a step. None (the default): by the trained model's device when the run
    starts (`device_sizes`: 2048 on a CPU, up to 65,536 on a GPU), recorded in the run's saved settings."""
    share_prefix: bool = True
    """Run the prompt the episodes of a micro-batch share once, with gradients, and every episode's rest on top
    of its keys and values (same loss and gradients as running each whole episode, in far fewer tokens: the
    ~500-token prompt is most of a short episode). Off: every episode runs whole (the old path, for
    comparison)."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """The matmuls of the update and of a vLLM sampler. "bf16": the update runs its forward and backward under
    torch.autocast (weights, gradients, Adam states and log-probs stay float32) and vLLM samples in bfloat16.
    "auto" (the default): bf16 where the hardware has it (a GPU with bf16, a CPU with AVX512-BF16 or AMX), else
    fp32. Measured on a 2-core AVX512-BF16 CPU (benchmarks/perf/throughput.py): the update 1.4-1.9x and vLLM
    sampling ~1.4x faster; at the first step 1.0 % of sampled tokens fall outside the PPO clip (all float32:
    0.5 %), the importance ratio's mean stays within 0.001 of 1."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this before each optimizer step."""
    clip_eps_low: float = 0.2
    """Importance ratios below 1 - eps_low stop pushing probability down (PPO clip)."""
    clip_eps_high: float = 0.28
    """Importance ratios above 1 + eps_high stop pushing probability up (DAPO clip-higher)."""
    kl_coef: float = 0.0
    """Weight of the k3 KL to the starting policy; > 0 keeps a frozen reference copy of the model in memory."""
    lld_coef: float = 0.0
    """Weight of the likelihood-displacement guard (training/loss.py): on tokens of positive advantage, the loss
    adds lld_coef x relu(old_logp - logp), pulling back up any whose log-prob fell below the sampler's. Why: under
    GRPO on search tasks the likelihood of right trajectories drifts down until training collapses (Lazy
    Likelihood Displacement, arXiv 2512.04220, whose LLDS this reads token by token). 0 (the default): off, the
    loss (and the metrics row) bit for bit as without it; on, its term is logged as `loss/lld`."""
    max_concurrent_episodes: int | None = None
    """Episodes in flight at once; the in-process sampler batches their turns into one generate (a vLLM engine
    schedules them together). None (the default): by the trained model's device when the run starts
    (`device_sizes`: 8 on a CPU, up to 256 on a GPU), recorded in the run's saved settings."""
    max_infra_failure_frac: float = 0.25
    """A step whose share of episodes that cannot be trained on (infrastructure failures, inexact samples)
    exceeds this fails loudly instead of training on the rest: past that the data is biased towards whatever
    did not break."""
    max_staleness: int = 1
    """Async only: drop episodes sampled by weights more than this many versions older than the trained ones.
    The async pipeline runs one step ahead, so 1 keeps everything and 0 drops every prefetched batch."""
    run_dir: Path = Path("runs/train")
    """Where checkpoints, metrics.jsonl, rollouts/, the multihop pages and the vLLM samplers' weights go."""
    save_every: int = 10
    """Checkpoint every this many steps (and always after the last one)."""
    keep_last: int = 2
    """Checkpoints kept on disk; older ones are deleted."""
    device: str = "auto"
    """Where the trained model lives: "auto" (cuda when a GPU is visible, else cpu), "cpu", "cuda" or "cuda:N"."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Turn, token and time budgets of every episode (`[rollout]`)."""
    credit: CreditConfig = field(default_factory=CreditConfig)
    """How a group's rewards become advantages (`[credit]`: mode, gamma, baseline, ...)."""
    turn_rewards: TurnRewardWeights = field(default_factory=TurnRewardWeights)
    """Shaping weights per turn (`[turn_rewards]`); they train only with credit mode "turn", and are always
    logged."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """Who samples the rollouts (`[sampling]`, training/sampler.py): the vLLM backends load each step's
    weights from `run_dir/sampler/`; a server must be able to read that folder."""
    tools: ToolAccess = field(default_factory=ToolAccess)
    """The tool server (`[tools]`): a running one at `url`, or one in this process (the built-in model behind
    every tool, loopback pages allowed for the multihop page server, the tasks' media folders readable)."""
    horizon: HorizonConfig = field(default_factory=HorizonConfig)
    """Item families (plate_audit, multihop_batch): items per task and the curriculum that grows them
    (`[horizon]`); other families ignore it."""
    expert_mix: ExpertMixConfig = field(default_factory=ExpertMixConfig)
    """The scripted expert's episodes joining the groups of the first steps, off-policy, with a weight that fades
    to 0 (`[expert_mix]`, training/expert_mix.py; David-GRPO's expert bootstrapping). Off by default
    (`per_group = 0`); not on Ray."""
    near_miss: NearMissConfig = field(default_factory=NearMissConfig)
    """Continuations resampled from the truncated prefix of a group's near miss (an episode that read a supporting
    page or saw the answer, then failed) join the group and train on their own sampled tokens (`[near_miss]`,
    training/near_miss.py; David-GRPO's grounded expansion). Off by default (`per_group = 0`); not on Ray."""
    ray: RayConfig = field(default_factory=RayConfig)
    """Actors and resources of a run on Ray (`[ray]`; used only with `conductor train --ray`,
    training/ray_session.py): rollout workers, data-parallel trainer workers, tool-server replicas."""

    def __post_init__(self) -> None:
        checks = {
            "steps >= 1": self.steps >= 1,
            "batch_tasks >= 1": self.batch_tasks >= 1,
            "group_size >= 2 (a group of one has no baseline)": self.group_size >= 2,
            "sampling.temperature > 0 (the sampler's log-probs must be the trained distribution's)": (
                self.sampling.temperature > 0
            ),
            "reward_kind task or graded": self.reward_kind in ("task", "graded"),
            "0 <= evidence_weight <= 1": 0.0 <= self.evidence_weight <= 1.0,
            "lld_coef >= 0": self.lld_coef >= 0.0,
            "turn_rewards.info_gain >= 0, and 0 with a forced turn prefix (the gold must follow a header)": (
                self.turn_rewards.info_gain >= 0.0
                and not (
                    self.turn_rewards.info_gain
                    and self.rollout.first_turn_prefix + self.rollout.last_turn_prefix
                )
            ),
            "lora_rank >= 0": self.lora_rank >= 0,
            "micro_batch_tokens >= 1 (or unset)": (
                self.micro_batch_tokens is None or self.micro_batch_tokens >= 1
            ),
            "max_concurrent_episodes >= 1 (or unset)": (
                self.max_concurrent_episodes is None or self.max_concurrent_episodes >= 1
            ),
            "0 <= max_infra_failure_frac <= 1": 0.0 <= self.max_infra_failure_frac <= 1.0,
            "max_staleness >= 0": self.max_staleness >= 0,
            "save_every >= 1": self.save_every >= 1,
            "keep_last >= 1": self.keep_last >= 1,
            "device auto, cpu, cuda or cuda:N": self.device in ("auto", "cpu")
            or self.device.startswith("cuda"),
        }
        failed = [rule for rule, ok in checks.items() if not ok]
        if failed:
            raise ConfigError(f"invalid training settings, need: {', '.join(failed)}")

    @property
    def learning_rate(self) -> float:
        if self.lr is not None:
            return self.lr
        return 1e-4 if self.lora_rank else 1e-5


@dataclass(frozen=True)
class DeviceSizes:
    """What a run sizes by its device when left unset (`device_sizes`)."""

    micro_batch_tokens: int
    max_concurrent_episodes: int


CPU_SIZES = DeviceSizes(micro_batch_tokens=2048, max_concurrent_episodes=8)
"""A CPU's: what a 2-core machine holds and keeps busy (the defaults every earlier run had)."""
GPU_CAPS = DeviceSizes(micro_batch_tokens=65_536, max_concurrent_episodes=256)
"""The largest a GPU gets: the sizes measured on an H200 (docs/training.md, "On a GPU")."""


def device_sizes(device: str, memory_gib: float | None = None) -> DeviceSizes:
    """The sizes for a model on `device` ("cpu", "cuda", "cuda:N") with `memory_gib` of device memory (None: asked
    of the device).

    CPU (and anything not CUDA): `CPU_SIZES`, unchanged. A GPU: 512 micro-batch tokens and 2 episodes in flight
    per GiB of its memory, each rounded down to a power of two, no less than the CPU's and no more than
    `GPU_CAPS`: an H200 (~140 GiB) 65,536 / 256, an 80 GB H100 or A100 32,768 / 128, a 40 GB A100 16,384 / 64,
    an L4 (24 GB) 8,192 / 32. Measured on an H200 (SmolLM2-135M shape, bf16, 256 episodes of 2 turns x 128 new
    tokens, the transformers sampler): the update took 17.7-21.4 s at 2048 tokens, 2.1-3.1 s at 16,384 and
    1.25-1.6 s at 65,536, and a step of 256 episodes sampled 5,700 tokens/s where one of 64 sampled 2,700. Per
    GiB is an estimate, not a measurement: ~1-2 MB of activations and [tokens, vocab] logits a token for the 135M
    model, so a larger policy on a smaller GPU may need `micro_batch_tokens` set lower by hand
    (`python -m benchmarks.perf.gpu_step` measures a device).
    """
    if not device.startswith("cuda"):
        return CPU_SIZES
    memory_gib = device_memory_gib(device) if memory_gib is None else memory_gib
    low, high = CPU_SIZES, GPU_CAPS
    return DeviceSizes(
        micro_batch_tokens=_power_of_two(512 * memory_gib, low.micro_batch_tokens, high.micro_batch_tokens),
        max_concurrent_episodes=_power_of_two(
            2 * memory_gib, low.max_concurrent_episodes, high.max_concurrent_episodes
        ),
    )


def _power_of_two(value: float, low: int, high: int) -> int:
    """The largest power of two <= `value`, kept within [low, high]."""
    below = 1 << (int(value).bit_length() - 1) if value >= 1 else 0
    return min(high, max(low, below))


def with_device_sizes(cfg: TrainConfig, device: str, *, memory_gib: float | None = None) -> TrainConfig:
    """`cfg` with `micro_batch_tokens` and `max_concurrent_episodes`, where unset, chosen for `device` ("auto":
    cuda when visible) and its memory (`device_sizes`; `memory_gib` None: asked of the device), said in the log.
    A value set in the TOML or by `--set` stays as it is. A run's learner calls it with its model's device
    (training/learner.py), and the run uses and saves what it returns; a caller without a learner (the sampler
    built directly, a benchmark) with `cfg.device`."""
    device = default_device() if device == "auto" else device
    sizes = device_sizes(device, memory_gib)
    unset = {
        name: getattr(sizes, name)
        for name in ("micro_batch_tokens", "max_concurrent_episodes")
        if getattr(cfg, name) is None
    }
    if unset:
        logger.info("sized for %s: %s", device, ", ".join(f"{k} {v}" for k, v in unset.items()))
    return dataclasses.replace(cfg, **unset)


def load_train_config(path: Path | None, overrides: Sequence[str] = ()) -> TrainConfig:
    """Defaults, then the TOML file at `path` (if any), then `key=value` overrides (`rollout.max_turns=6`)."""
    return load_settings(TrainConfig, path, overrides, moved=MOVED)


def config_to_dict(cfg: TrainConfig) -> dict[str, Any]:
    """JSON-ready (paths as strings, tables as dicts); `conductor.settings.build` reads it back."""
    return to_dict(cfg)


def config_json(cfg: TrainConfig) -> str:
    """The resolved settings a checkpoint stores (and `training.run.resume_point` compares)."""
    return json.dumps(config_to_dict(cfg), sort_keys=True)


def config_hash(cfg: TrainConfig) -> str:
    """A short stable digest of every setting, logged with the run so results can be matched to settings."""
    text = json.dumps(config_to_dict(cfg), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]
