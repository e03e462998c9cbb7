"""The trainer's settings: one frozen dataclass, read from TOML plus `key=value` overrides.

Every top-level key of the TOML file is a `TrainConfig` field; the turn-reward weights live in a `[turn_rewards]`
table. Unknown keys are errors that name the key and the valid ones, as in the tool server's config. A missing file
means all defaults, which run on a 2-core CPU (slowly: a step of 2 tasks x 4 episodes with the 135M policy takes
minutes there, most of it generation).

    cfg = load_train_config(Path("train.toml"), ["group_size=8", "lr=3e-5", "turn_rewards.valid_call=0.0"])
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from conductor.settings import ConfigError, build
from main_agent.rollout import RolloutConfig
from training.advantages import CreditConfig
from training.rewards import TurnRewardWeights

RESUME_KEYS = ("task", "split", "limit", "seed", "batch_tasks", "group_size")
"""Settings a resumed run must share with the saved one: they define the data order and the batch shape, so
changing them would make "continue exactly" a lie. `--force` overrides the check."""


@dataclass(frozen=True)
class TrainConfig:
    """One RL run of the main policy against the tool server."""

    policy: str = "smollm2-135m-instruct"
    """Built-in model name or a local checkpoint dir (dense or LoRA adapter) to start from."""
    task: str = "multihop_pages"
    """Task family (a key of `training.tasks.TASK_FAMILIES`)."""
    split: str = "train"
    """Split of the task family to train on."""
    limit: int | None = None
    """Use only the first `limit` tasks of the split (None: all)."""
    data_dir: Path | None = None
    """The shared data folder; None: $CONDUCTOR_DATA, else ../shared/data beside the repository."""
    steps: int = 20
    """Optimizer steps. Each step samples `batch_tasks` tasks and `group_size` episodes of each."""
    batch_tasks: int = 2
    """Tasks per step (B). B x G episodes are played per step; 8 keep a 2-core CPU busy for minutes."""
    group_size: int = 4
    """Episodes per task (G); their rewards are each other's baseline, so at least 2."""
    seed: int = 0
    """Seeds the task order and torch's sampler (reseeded from (seed, step) every step, so resume is exact)."""
    lr: float | None = None
    """AdamW learning rate; None: 1e-5 for full fine-tuning, 1e-4 with LoRA (adapters need larger steps)."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up over this many steps, then constant."""
    lora_rank: int = 0
    """0 trains every weight; > 0 trains a peft LoRA of this rank on q, k, v, o (alpha = 2 x rank)."""
    micro_batch_tokens: int = 2048
    """Padded tokens per forward/backward. The [tokens, vocab] logits dominate memory: 2048 x 49152 floats is
    400 MB, plus its gradient. Gradients accumulate over all micro-batches of a step."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this before each optimizer step."""
    clip_eps_low: float = 0.2
    """Importance ratios below 1 - eps_low stop pushing probability down (PPO clip)."""
    clip_eps_high: float = 0.28
    """Importance ratios above 1 + eps_high stop pushing probability up (DAPO clip-higher)."""
    kl_coef: float = 0.0
    """Weight of the k3 KL to the starting policy; > 0 keeps a frozen reference copy of the model in memory."""
    credit: Literal["outcome", "turn"] = "outcome"
    """"outcome": GRPO, one advantage per episode; "turn": return-to-go minus a group baseline per turn."""
    gamma: float = 1.0
    """Per-turn discount of turn credit, in (0, 1]."""
    normalize_std: bool = False
    """Divide advantages by the group's reward std (off: Dr. GRPO shows it biases towards easy groups)."""
    baseline: Literal["turn_index", "anchor"] = "turn_index"
    """Turn credit's baseline: same turn index, or same call (anchor) anywhere in the group."""
    turn_rewards: TurnRewardWeights = field(default_factory=TurnRewardWeights)
    """Shaping weights per turn (`[turn_rewards]`); they train only with credit = "turn", and are always logged."""
    max_turns: int = 10
    """Policy turns per episode: a plate needs five (load, find_text, zoom, read, answer) and up to four more when
    a read fails and is retried; a four-hop MuSiQue question asked hop by hop needs five."""
    max_calls_per_turn: int = 4
    """Calls beyond this in one turn are dropped with a note to the policy."""
    max_new_tokens: int = 320
    """Tokens per policy turn: the oracle's turn of page_qa calls on loopback URLs measures ~200 (max ~300);
    an upper bound only, sampling stops at the end-of-turn token."""
    max_context_tokens: int = 2048
    """The main context budget: prompt with tool schemas (~600 tokens) plus a few turns and observations."""
    observation_tokens: int = 192
    """Each tool result is cut to this many tokens with a visible marker."""
    wall_clock_s: float = 600.0
    """Whole-episode budget: sub-agent calls take 10-20 s each on a loaded 2-core CPU."""
    temperature: float = 1.0
    """Sampling temperature. Keep 1.0: the sampler's log-probs then match the trainer's (the ratio starts at 1)."""
    max_concurrent_episodes: int = 8
    """Episodes in flight at once; their policy turns are batched into one generate."""
    max_inflight_tool_calls: int = 8
    """Tool calls in flight at once across all episodes (the tool client's concurrency cap)."""
    max_infra_failure_frac: float = 0.25
    """A step whose share of infrastructure-failed episodes exceeds this fails loudly instead of training on the
    survivors: past that the data is biased towards whatever did not break."""
    max_staleness: int = 1
    """Async only: drop episodes sampled by weights more than this many versions older than the trained ones.
    The async pipeline runs one step ahead, so 1 keeps everything and 0 drops every prefetched batch."""
    run_dir: Path = Path("runs/train")
    """Where checkpoints, metrics.jsonl, rollouts/ and the multihop pages go."""
    save_every: int = 10
    """Checkpoint every this many steps (and always after the last one)."""
    keep_last: int = 2
    """Checkpoints kept on disk; older ones are deleted."""
    sampler: Literal["transformers", "vllm", "server"] = "transformers"
    """Who samples rollouts (training/sampler.py): "transformers", a copy of the model in this process (CPU);
    "vllm", a vLLM engine in this process (the `vllm` extra, for a GPU); "server", a `vllm serve` at
    `sampler_url` started with VLLM_SERVER_DEV_MODE=1 that can read `run_dir`. The vLLM samplers load each
    step's weights from `run_dir/sampler/`."""
    sampler_url: str | None = None
    """The vLLM server's OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1 (sampler = "server")."""
    vllm_gpu_memory_utilization: float = 0.3
    """sampler = "vllm": the engine's share of GPU memory (weights + KV cache); the rest holds the trainer's
    weights, gradients and Adam states, ~16 bytes a parameter in float32."""
    device: str = "auto"
    """Where the trained model lives: "auto" (cuda when a GPU is visible, else cpu), "cpu", "cuda" or "cuda:N"."""
    tools_url: str | None = None
    """A running tool server; None runs one in-process with default settings (the built-in model behind every
    tool, loopback pages allowed for the multihop page server, the tasks' media folders readable)."""

    def __post_init__(self) -> None:
        checks = {
            "steps >= 1": self.steps >= 1,
            "batch_tasks >= 1": self.batch_tasks >= 1,
            "temperature > 0": self.temperature > 0,
            "lora_rank >= 0": self.lora_rank >= 0,
            "micro_batch_tokens >= 1": self.micro_batch_tokens >= 1,
            "0 <= max_infra_failure_frac <= 1": 0.0 <= self.max_infra_failure_frac <= 1.0,
            "max_staleness >= 0": self.max_staleness >= 0,
            "save_every >= 1": self.save_every >= 1,
            "keep_last >= 1": self.keep_last >= 1,
            "sampler_url with sampler = 'server'": self.sampler != "server" or bool(self.sampler_url),
            "0 < vllm_gpu_memory_utilization < 1": 0.0 < self.vllm_gpu_memory_utilization < 1.0,
            "device auto, cpu, cuda or cuda:N": self.device in ("auto", "cpu")
            or self.device.startswith("cuda"),
        }
        failed = [rule for rule, ok in checks.items() if not ok]
        if failed:
            raise ConfigError(f"invalid training settings, need: {', '.join(failed)}")
        self.credit_config  # noqa: B018 -- CreditConfig validates group_size, gamma and the baseline

    @property
    def learning_rate(self) -> float:
        if self.lr is not None:
            return self.lr
        return 1e-4 if self.lora_rank else 1e-5

    @property
    def credit_config(self) -> CreditConfig:
        return CreditConfig(
            credit=self.credit,
            group_size=self.group_size,
            gamma=self.gamma,
            normalize_std=self.normalize_std,
            baseline=self.baseline,
        )

    @property
    def rollout_config(self) -> RolloutConfig:
        return RolloutConfig(
            max_turns=self.max_turns,
            max_calls_per_turn=self.max_calls_per_turn,
            max_new_tokens=self.max_new_tokens,
            max_context_tokens=self.max_context_tokens,
            observation_tokens=self.observation_tokens,
            wall_clock_s=self.wall_clock_s,
        )


def load_train_config(path: Path | None, overrides: Sequence[str] = ()) -> TrainConfig:
    """Defaults, then the TOML file at `path` (if any), then `key=value` overrides (see `parse_override`)."""
    data: dict[str, Any] = {}
    if path is not None:
        with path.open("rb") as file:
            data = tomllib.load(file)
    for text in overrides:
        key, value = parse_override(text)
        *tables, name = key.split(".")
        target = data
        for table in tables:
            target = target.setdefault(table, {})
        target[name] = value
    return config_from_dict(data)


def parse_override(text: str) -> tuple[str, object]:
    """`"group_size=8"` -> ("group_size", 8). The value is read as a TOML value; a bare word that is not one
    (`task=plate_reading`, `run_dir=runs/x`) is kept as a string."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {text!r} is not key=value")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return key.strip(), value


def config_from_dict(data: Mapping[str, Any]) -> TrainConfig:
    """A TrainConfig from parsed TOML or `config_to_dict` output; ConfigError names unknown keys and bad types."""
    none_by_default = {f.name for f in dataclasses.fields(TrainConfig) if f.default is None}
    table = {k: v for k, v in data.items() if not (v is None and k in none_by_default)}  # TOML has no null
    weights = table.pop("turn_rewards", {})
    if not isinstance(weights, dict):
        raise ConfigError(f"[turn_rewards] must be a table, got {weights!r}")
    base = build(TrainConfig, table, "the training config")
    return dataclasses.replace(base, turn_rewards=build(TurnRewardWeights, weights, "[turn_rewards]"))


def config_to_dict(cfg: TrainConfig) -> dict[str, Any]:
    """JSON-ready: paths as strings; `config_from_dict` reads it back."""
    return {
        key: str(value) if isinstance(value, Path) else value
        for key, value in dataclasses.asdict(cfg).items()
    }


def config_hash(cfg: TrainConfig) -> str:
    """A short stable digest of every setting, logged with the run so results can be matched to settings."""
    text = json.dumps(config_to_dict(cfg), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]
