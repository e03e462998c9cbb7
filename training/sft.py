"""Supervised warm-start: a scripted expert plays tasks through the real tool server; the policy imitates it.

    python -m training.sft [key=value ...]        e.g. tasks=["plate_reading"] limit=32 epochs=2 out_dir=runs/sft

1. `OraclePolicy`, an expert written as code, plays the `Policy` protocol in the ordinary `rollout`, replying in the
   call format of `main_agent.parse`. multihop_pages: concurrent page_qa calls on the supporting pages, in one
   turn, then answer. plate_reading: load, zoom on the plate box padded to 3x, read, answer. video_qa: one
   video_summary call with the question, then answer. The oracle knows the reference (it demonstrates, it does
   not compete), but by default writes it only when an observation showed it (`grounded_answer`), so no
   demonstration teaches stating what no tool showed; otherwise it answers its own reading, which then fails
   the success filter. `trust_reference=True` answers the reference regardless (more data, less honest).
2. `generate_expert_episodes` keeps the successful episodes (`tasks.success`).
3. `sft` minimises the cross-entropy of the oracle's tokens only (the loss mask of `main_agent.tokens`: 0 on the
   prompt and every observation), on exactly the ids the rollout laid down.
4. `run_sft` evaluates a small dev sample before and after (format validity, success) and prints both.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import random
import re
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from main_agent.policy import Sample, load_model_and_tokenizer
from main_agent.rollout import RolloutConfig
from main_agent.tokens import collate, micro_batches, to_sequence
from main_agent.types import Episode
from tool_server.client import ToolClient
from tool_server.config import build
from training import tasks as task_data
from training.config import TrainConfig, parse_override
from training.evaluate import (
    EvalConfig,
    EvalReport,
    evaluate_policy,
    format_table,
    greedy_policy,
    play_all,
    task_tool_client,
)
from training.loss import all_finite, token_logprobs
from training.metrics import save_rollouts
from training.rewards import contains_evidence, normalize_plate
from training.tasks import Task

logger = logging.getLogger(__name__)

_RESPONSE = re.compile(r"<tool_response>(.*?)</tool_response>", re.DOTALL)
_IMAGE = re.compile(r"\b(img_[0-9a-f]+) (\d+)x(\d+)")
_READ = re.compile(r'read: "(.*)"', re.DOTALL)
_PAGE_ANSWER = re.compile(r"page_qa: answer: (.*?) \| quote:", re.DOTALL)
MAX_GRAD_NORM = 1.0  # the usual clip for fine-tuning a small LM: one odd batch cannot wreck the weights
NO_ANSWER = "unknown"  # what the oracle answers when the observations offer nothing


# ---------------------------------------------------------------- the scripted expert


def call_text(name: str, **arguments: object) -> str:
    """One call in the policy's format (see main_agent.parse)."""
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}</tool_call>"


def context_lines(task: Task, label: str) -> list[str]:
    """The values of the `<label>: ...` lines of the task's context, as the policy sees them."""
    prefix = f"{label}: "
    return [line[len(prefix) :].strip() for line in task.context.splitlines() if line.startswith(prefix)]


def grounded_answer(task: Task, bodies: list[str], guess: str, *, trust_reference: bool) -> str:
    """The reference when the observation `bodies` hold it (or when trusted), else the oracle's `guess`.
    Plates count as found when the text `read` returned holds the plate (letters and digits only)."""
    if trust_reference:
        return task.reference
    if task.family == "plate_reading":
        found = normalize_plate(task.reference) in normalize_plate(" ".join(read_lines(bodies)))
    else:
        found = contains_evidence("\n".join(bodies), task.reference)
    return task.reference if found else guess


def read_lines(bodies: list[str]) -> list[str]:
    """The text lines of every image_ops `read` observation (`... read: "line / line"`)."""
    reads = [m.group(1) for b in bodies if (m := _READ.search(b))]
    return [line for text in reads for line in text.split(" / ")]


def multihop_reply(task: Task, observations: list[list[str]], *, trust_reference: bool) -> str:
    """Turn 0: page_qa on every supporting page, all in one turn. Then: answer."""
    if not observations:
        # "Page: <title> <url>" lines, as `tasks.with_base_url` writes them
        urls = dict(line.rsplit(" ", 1) for line in context_lines(task, "Page") if " " in line)
        if not urls:
            raise ValueError(
                f"task {task.task_id} lists no pages: give it a base URL with tasks.with_base_url"
            )
        titles = [t for t in task.meta.supporting_titles if t in urls] or list(urls)[:2]
        return "\n".join(call_text("page_qa", url=urls[t], question=task.question) for t in titles[:4])
    bodies = [b for turn in observations for b in turn]
    answers = [m.group(1).strip() for b in bodies if (m := _PAGE_ANSWER.match(b))]
    useful = [a for a in answers if a and "not in the page" not in a.lower()]
    guess = useful[-1] if useful else NO_ANSWER
    return f"<answer>{grounded_answer(task, bodies, guess, trust_reference=trust_reference)}</answer>"


def plate_reply(task: Task, observations: list[list[str]], *, trust_reference: bool) -> str:
    """Turn 0: load. 1: zoom on the padded plate box. 2: read the zoomed image. Then: answer.
    A step whose observation lacks the image id it needs ends the episode with the best guess."""
    images = context_lines(task, "Image")
    if not images or task.meta.plate_box is None:
        raise ValueError(f"task {task.task_id} has no image line in its context or no plate box")
    turn = len(observations)
    if turn == 0:
        return call_text("image_ops", op="load", image=images[0])
    found = _IMAGE.search(" ".join(observations[-1])) if turn < 3 else None
    if found is not None and turn == 1:
        box = padded_box(task.meta.plate_box, width=int(found.group(2)), height=int(found.group(3)))
        return call_text("image_ops", op="zoom", image=found.group(1), box=box)
    if found is not None and turn == 2:
        return call_text("image_ops", op="read", image=found.group(1))
    bodies = [b for obs in observations for b in obs]
    guess = max(read_lines(bodies), key=lambda s: len(normalize_plate(s)), default=NO_ANSWER)
    return f"<answer>{grounded_answer(task, bodies, guess, trust_reference=trust_reference)}</answer>"


def padded_box(plate: tuple[int, int, int, int], *, width: int, height: int) -> list[int]:
    """(x, y, w, h) grown by one plate size on every side (3x the box) as [x0, y0, x1, y1] inside the image:
    the crop `image_ops` documents as reading twice as many plates as the full photo at the reader's 384 px."""
    x, y, w, h = plate
    x0, y0 = max(0, min(x - w, width - 1)), max(0, min(y - h, height - 1))
    return [x0, y0, max(x0 + 1, min(x + 2 * w, width)), max(y0 + 1, min(y + 2 * h, height))]


def video_reply(task: Task, observations: list[list[str]], *, trust_reference: bool) -> str:
    """Turn 0: video_summary with the question. Then: answer."""
    videos = context_lines(task, "Video")
    if not videos:
        raise ValueError(f"task {task.task_id} has no video line in its context")
    if not observations:
        return call_text("video_summary", video=videos[0], question=task.question)
    bodies = [b.removeprefix("video_summary: ") for obs in observations for b in obs]
    guess = bodies[-1].splitlines()[0].strip() if bodies and bodies[-1].strip() else NO_ANSWER
    return f"<answer>{grounded_answer(task, bodies, guess, trust_reference=trust_reference)}</answer>"


REPLIES = {"multihop_pages": multihop_reply, "plate_reading": plate_reply, "video_qa": video_reply}


class OraclePolicy:
    """A scripted expert for one task, playing the `Policy` protocol: one instance per episode.

    It reads what came back after its previous reply (the ids past what it has already seen, decoded) and keeps
    the `<tool_response>` bodies of each turn; its next reply is a function of the task and those observations.
    Log-probs are reported as 0.0: an expert has no sampler, and SFT does not use them.
    """

    def __init__(self, task: Task, tokenizer, *, trust_reference: bool = False) -> None:
        if task.family not in REPLIES:
            raise ValueError(f"no oracle for task family {task.family!r}; known: {sorted(REPLIES)}")
        self.task = task
        self.tokenizer = tokenizer
        self.trust_reference = trust_reference
        self.version = 0
        self.eos_token_id = int(tokenizer.eos_token_id)
        self.observations: list[list[str]] = []
        self._seen = 0  # ids of the conversation already read: prompt and own replies so far

    async def sample(self, prompt_ids: list[int], *, max_new_tokens: int) -> Sample:
        if self._seen:
            new = self.tokenizer.decode(prompt_ids[self._seen :], skip_special_tokens=True)
            self.observations.append(_RESPONSE.findall(new))
        reply = REPLIES[self.task.family](self.task, self.observations, trust_reference=self.trust_reference)
        ids = self.tokenizer.encode(reply, add_special_tokens=False) + [self.eos_token_id]
        if len(ids) > max_new_tokens:  # the rollout's budget binds the expert too; a cut reply usually fails
            ids = ids[:max_new_tokens]
            reply = self.tokenizer.decode(ids, skip_special_tokens=True)
        self._seen = len(prompt_ids) + len(ids)
        return Sample(ids, [0.0] * len(ids), reply, "stop" if ids[-1] == self.eos_token_id else "length")

    async def aclose(self) -> None:
        return None


async def generate_expert_episodes(
    tasks: Sequence[Task], tools: ToolClient, tokenizer, cfg: SFTConfig
) -> list[Episode]:
    """The oracle's successful episodes, in task order; the kept and played counts per family are logged."""
    oracle = functools.partial(OraclePolicy, tokenizer=tokenizer, trust_reference=cfg.trust_reference)
    slots = cfg.max_concurrent_episodes
    episodes = await play_all(
        oracle, tokenizer, tasks, tools=tools, cfg=cfg.rollout_config, max_concurrent=slots
    )
    played = Counter(t.family for t in tasks)
    kept = [(t, e) for t, e in zip(tasks, episodes, strict=True) if task_data.success(t, e.answer)]
    counts = Counter(t.family for t, _ in kept)
    for family in sorted(played):
        logger.info("expert episodes %s: %d of %d succeeded", family, counts[family], played[family])
    return [e for _, e in kept]


# ---------------------------------------------------------------- supervised fine-tuning


def masked_nll(model: nn.Module, batch) -> torch.Tensor:
    """Mean negative log-likelihood of the tokens with loss mask 1 (the expert's completions): a scalar."""
    logprobs = token_logprobs(
        model, batch.input_ids, batch.attention_mask, loss_mask=batch.loss_mask
    )  # [B, T]
    mask = batch.loss_mask  # [B, T], 0 on prompt, observations and padding
    return -(logprobs * mask).sum() / mask.sum().clamp(min=1.0)


def sft(
    model: nn.Module,
    tokenizer,
    episodes: Sequence[Episode],
    *,
    epochs: int,
    lr: float,
    micro_batch_tokens: int,
    seed: int = 0,
) -> list[float]:
    """AdamW on the expert's tokens, one optimizer step per length-sorted micro-batch, micro-batches shuffled
    each epoch; returns the loss of every step. A non-finite loss or gradient raises: the data is fixed and
    clean, so it is a bug or divergence, not noise to skip."""
    sequences = [to_sequence(e, [0.0] * len(e.turns)) for e in episodes if e.turns]
    if not sequences:
        raise ValueError("no expert episodes to fine-tune on")
    batches = micro_batches(sequences, max_tokens=micro_batch_tokens)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)
    device = str(next(model.parameters()).device)
    model.train()
    losses: list[float] = []
    for epoch in range(epochs):
        random.Random(seed * 1_000_003 + epoch).shuffle(batches)
        for chunk in batches:
            losses.append(
                _step(
                    model, optimizer, collate(chunk, pad_id=pad_id, device=device), params, step=len(losses)
                )
            )
        logger.info("sft epoch %d: mean loss %.4f", epoch + 1, sum(losses[-len(batches) :]) / len(batches))
    return losses


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, batch, params: list, *, step: int) -> float:
    loss = masked_nll(model, batch)
    if not all_finite(loss):
        raise FloatingPointError(f"sft step {step}: loss is {loss.item()}")
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
    if not all_finite(grad_norm):
        raise FloatingPointError(f"sft step {step}: gradient norm is {grad_norm.item()}")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.item())


# ---------------------------------------------------------------- the entry point


@dataclass(frozen=True)
class SFTConfig:
    """One supervised warm-start of the main policy on expert episodes (`conductor sft`)."""

    policy: str = "smollm2-135m-instruct"
    """Built-in model name or local checkpoint dir to start from."""
    tasks: tuple[str, ...] = ("multihop_pages", "plate_reading")
    """Task families to demonstrate (keys of `training.tasks.TASK_FAMILIES`)."""
    split: str = "train"
    """Split the demonstrations are played on."""
    limit: int | None = 16
    """First `limit` tasks of each family (None: all); on 2 CPU cores each expert episode costs 10-60 s."""
    epochs: int = 3
    """Passes over the kept expert episodes."""
    lr: float = 1e-5
    """AdamW learning rate for full fine-tuning of a 135M model."""
    micro_batch_tokens: int = 2048
    """Padded tokens per optimizer step; the [tokens, vocab] logits dominate memory (400 MB at 2048 x 49152)."""
    out_dir: Path = Path("runs/sft")
    """Where the model (`model/`), the expert episodes, the report and the task pages and videos go."""
    tools_url: str | None = None
    """A running tool server; None runs one in this process set up for the tasks."""
    data_dir: Path | None = None
    """The shared data folder; None: $CONDUCTOR_DATA, else ../shared/data beside the repository."""
    seed: int = 0
    """Seeds the micro-batch order and evaluation."""
    max_concurrent_episodes: int = 4
    """Episodes in flight at once, expert and evaluation alike."""
    eval_split: str = "dev"
    """Split of the before/after evaluation."""
    eval_n: int = 8
    """Evaluation tasks per family (the first ones of `eval_split`); 0 skips the evaluation."""
    trust_reference: bool = False
    """The oracle answers the reference even when no observation showed it (see the module docstring)."""
    max_new_tokens: int = 320
    """Tokens per turn for the expert and both evaluations. The oracle's multihop turn (two page_qa calls on
    loopback URLs) is ~200 SmolLM2 tokens, up to 300; RL must then allow as many or its replies get cut."""

    @property
    def rollout_config(self) -> RolloutConfig:
        """Training's budgets with this turn length: what the demonstrations and evaluations play under."""
        return dataclasses.replace(TrainConfig().rollout_config, max_new_tokens=self.max_new_tokens)


def load_sft_config(overrides: Sequence[str]) -> SFTConfig:
    """Defaults plus `key=value` overrides, values read as TOML (`tasks=["video_qa"]`, `limit=8`)."""
    return build(SFTConfig, dict(parse_override(text) for text in overrides), "the sft settings")


def _tasks(cfg: SFTConfig, split: str, limit: int | None) -> list[Task]:
    return [t for f in cfg.tasks for t in task_data.load_family(f, split, data_dir=cfg.data_dir, limit=limit)]


async def _demonstrate_and_learn(cfg: SFTConfig, model: nn.Module, tokenizer) -> dict[str, object]:
    """Evaluate on dev, play the oracle on train, fine-tune, evaluate again (all in one tool session); returns
    the contents of `sft_report.json`."""
    train = _tasks(cfg, cfg.split, cfg.limit)
    dev = _tasks(cfg, cfg.eval_split, cfg.eval_n) if cfg.eval_n else []
    eval_cfg = EvalConfig(
        cfg.rollout_config, seed=cfg.seed, max_concurrent_episodes=cfg.max_concurrent_episodes
    )
    policy = greedy_policy(model, tokenizer, eval_cfg)
    work = cfg.out_dir / "work"
    reports: list[EvalReport] = []
    async with task_tool_client(
        [*train, *dev], work_dir=work, tools_url=cfg.tools_url, data_dir=cfg.data_dir
    ) as (
        tools,
        ready,
    ):
        train, dev = ready[: len(train)], ready[len(train) :]

        async def check(label: str) -> None:
            if dev:
                report, _ = await evaluate_policy(
                    policy, tokenizer, dev, tools=tools, cfg=eval_cfg, label=label
                )
                reports.append(report)

        await check("before sft")
        episodes = await generate_expert_episodes(train, tools, tokenizer, cfg)
        save_rollouts(cfg.out_dir / "expert_episodes.jsonl", episodes)
        learn = functools.partial(
            sft, epochs=cfg.epochs, lr=cfg.lr, micro_batch_tokens=cfg.micro_batch_tokens
        )
        losses = await asyncio.to_thread(learn, model, tokenizer, episodes, seed=cfg.seed)
        await check("after sft")
    await policy.aclose()
    print(format_table(reports) if reports else "no evaluation (eval_n=0)")
    before, after = [dataclasses.asdict(r) for r in reports] if reports else [None, None]
    return {
        "expert_tasks": len(train),
        "expert_episodes": len(episodes),
        "losses": losses,
        "before": before,
        "after": after,
    }


def run_sft(cfg: SFTConfig) -> Path:
    """The `conductor sft` entry point; returns the fine-tuned checkpoint dir (`<out_dir>/model`)."""
    from subagents.models import resolve_model

    torch.manual_seed(cfg.seed)
    model, tokenizer = load_model_and_tokenizer(resolve_model(cfg.policy))
    report = asyncio.run(_demonstrate_and_learn(cfg, model, tokenizer))
    out = cfg.out_dir / "model"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (cfg.out_dir / "sft_report.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(
        f"{report['expert_episodes']} expert episodes of {report['expert_tasks']} tasks; model saved to {out}"
    )
    return out


def main(argv: Sequence[str]) -> None:
    """`python -m training.sft [key=value ...]`"""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    run_sft(load_sft_config(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
