"""Data-parallel trainer workers (training/ray_trainer.py): W workers sum to the gradient one worker and the
single-process `update` compute, replicas stay identical after a step, checkpoints move between worker counts.

The tiny random Llama with the real tokenizer (`tiny_policy`), float32 on the CPU, gloo between the workers of
one module-scoped local Ray cluster; hand-made sequences sharing a prompt, cut into several micro-batches so
every rank has work (and the ranks unequal shares).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from conductor.cluster import RayConfig, cluster
from main_agent.tokens import TrainSequence, micro_batches
from training.checkpoint import TrainState
from training.config import RunSettings, TrainConfig, config_json
from training.learner import load_learner
from training.loss import token_logprobs
from training.sampler import sampler_state
from training.update import DataParallel, accumulate_gradients, update

ray = pytest.importorskip("ray")

from training.ray_trainer import TrainerGroup  # noqa: E402  # after the skip: needs ray


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    with cluster(RayConfig(trainer_workers=2)):
        yield


@pytest.fixture(scope="module")
def config(tiny_policy: Path, tmp_path_factory: pytest.TempPathFactory) -> TrainConfig:
    run_dir = tmp_path_factory.mktemp("ray-trainer") / "run"
    return TrainConfig(
        run=RunSettings(policy=str(tiny_policy)),
        run_dir=run_dir,
        lr=1e-4,
        precision="fp32",
        device="cpu",
        micro_batch_tokens=40,
    )


@pytest.fixture(scope="module")
def sequences(config: TrainConfig) -> list[TrainSequence]:
    """6 sequences: a shared 8-id prompt, then 8 + 2i sampled ids with advantage +-1; old log-probs are the
    model's own, a little off at odd positions (ratios around 1, inside the clip)."""
    model = load_learner(config).model
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 49_000, (8,), generator=generator).tolist()
    made = []
    for i in range(6):
        ids = prompt + torch.randint(0, 49_000, (8 + 2 * i,), generator=generator).tolist()
        with torch.no_grad():
            own = token_logprobs(model, torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))[0]
        mask = [0] * 8 + [1] * (len(ids) - 8)
        old = [(lp - 0.05 * (t % 2)) * m for t, (lp, m) in enumerate(zip(own.tolist(), mask, strict=True))]
        made.append(TrainSequence(ids, mask, old, [m * (1.0 if i % 2 else -1.0) for m in mask]))
    chunks = micro_batches(made, max_tokens=config.micro_batch_tokens, share_prefix=config.share_prefix)
    assert len(chunks) >= 3, f"{len(chunks)} micro-batches: a rank would have nothing or all"
    return made


def single_process_gradients(cfg: TrainConfig, sequences: list[TrainSequence]) -> dict[str, torch.Tensor]:
    model = load_learner(cfg).model
    assert accumulate_gradients(model, sequences, cfg) is not None
    return {k: p.grad for k, p in model.named_parameters() if p.grad is not None}


def poisoned_on_rank_1(sequences: list[TrainSequence], cfg: TrainConfig) -> list[TrainSequence]:
    """`sequences` with a NaN sampler log-prob in the first sequence of micro-batch 1 (rank 1's first)."""
    chunks = micro_batches(sequences, max_tokens=cfg.micro_batch_tokens, share_prefix=cfg.share_prefix)
    target = chunks[1][0]
    nan_last = [*target.old_logprobs[:-1], math.nan]
    return [dataclasses.replace(s, old_logprobs=nan_last) if s is target else s for s in sequences]


def start(
    cfg: TrainConfig, workers: int, checkpoint: Path | None = None
) -> tuple[TrainerGroup, TrainState | None]:
    return TrainerGroup.start(cfg, RayConfig(trainer_workers=workers), checkpoint=checkpoint)


def test_sampler_weights_are_a_lora_models_adapters_and_a_full_models_state_dict(config: TrainConfig) -> None:
    """Samplers get what they cannot build themselves: only the trainable LoRA parameters (they hold the same
    frozen base), but every state_dict entry of a fully trained model; on the CPU, under state_dict keys."""
    lora = load_learner(dataclasses.replace(config, lora_rank=4)).model
    trainable = {k for k, p in lora.named_parameters() if p.requires_grad}
    weights = sampler_state(lora)
    assert set(weights) == trainable and all("lora_" in k for k in weights)
    assert set(weights) <= set(lora.state_dict())
    full = load_learner(config).model
    assert set(sampler_state(full)) == set(full.state_dict())


def test_the_data_parallel_path_of_one_rank_is_the_single_process_step(
    config: TrainConfig, sequences: list[TrainSequence]
) -> None:
    """With a gloo group of one, `update(dp=...)` (rank share, both all-reduces, grads as bucket views) gives
    the same stats and weights as the plain path, bit for bit: the data-parallel code adds only the sums."""
    import torch.distributed as dist

    plain, ranked = load_learner(config), load_learner(config)
    expected = update(plain.model, plain.optimizer, sequences, config)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        stats = update(ranked.model, ranked.optimizer, sequences, config, dp=DataParallel(0, 1))
    finally:
        dist.destroy_process_group()
    assert stats.skipped is None and stats == expected
    after = plain.model.state_dict()
    assert all(torch.equal(v, after[k]) for k, v in ranked.model.state_dict().items())


@pytest.mark.slow
def test_two_workers_sum_to_the_gradient_of_one_worker_and_of_a_single_process(
    ray_cluster: None, config: TrainConfig, sequences: list[TrainSequence]
) -> None:
    """2 gloo workers, each backpropagating alternate micro-batches, both end with the whole step's gradient:
    the one a single worker computes, and the single-process `accumulate_gradients` (float32 tolerance)."""
    expected = single_process_gradients(config, sequences)
    for workers in (1, 2):
        group, _ = start(config, workers)
        try:
            per_rank = ray.get([w.gradients.remote(sequences) for w in group.workers])
        finally:
            group.shutdown()
        assert len(per_rank) == workers
        for grads in per_rank:
            assert grads.keys() == expected.keys()
            for key, grad in expected.items():
                # float32 sums of the same terms in another order (and another thread count)
                torch.testing.assert_close(
                    grads[key], grad, rtol=1e-5, atol=1e-7, msg=f"{workers} workers: {key}"
                )
        assert all(torch.equal(per_rank[0][k], g) for k, g in per_rank[-1].items())


@pytest.mark.slow
def test_after_a_data_parallel_step_the_replicas_are_identical_and_match_a_single_process_step(
    ray_cluster: None, config: TrainConfig, sequences: list[TrainSequence]
) -> None:
    """One step on 2 workers: both replicas hold the same weights bit for bit (same summed gradients, same
    AdamW), equal to the single-process `update`'s (allclose); the same stats; the rate the step used. Then a
    step with a NaN in rank 1's share only: both ranks skip it together (no rank left waiting in a
    collective), the weights stay."""
    learner = load_learner(config)
    before = {k: v.clone() for k, v in learner.model.state_dict().items()}
    expected = update(learner.model, learner.optimizer, sequences, config)
    group, _ = start(config, 2)
    try:
        stats, lr = group.update(sequences)
        replicas = ray.get([w.weights.remote() for w in group.workers])
        skipped, _ = group.update(poisoned_on_rank_1(sequences, config))
        after_skip = ray.get([w.weights.remote() for w in group.workers])
    finally:
        group.shutdown()
    assert skipped.skipped == "non-finite loss"
    assert all(torch.equal(v, w[k]) for w in after_skip for k, v in replicas[0].items())
    assert stats.skipped is None and lr == config.lr and stats.n_tokens == expected.n_tokens
    for name in ("pg_loss", "clip_frac", "ratio_mean", "grad_norm"):
        assert getattr(stats, name) == pytest.approx(getattr(expected, name), rel=1e-5), name
    trained = learner.model.state_dict()
    assert any(not torch.equal(before[k], v) for k, v in trained.items())
    for key, value in replicas[0].items():
        assert torch.equal(value, replicas[1][key]), key
        torch.testing.assert_close(value, trained[key], rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.slow
def test_a_checkpoint_written_by_two_workers_resumes_on_one_with_the_same_state(
    ray_cluster: None, config: TrainConfig, sequences: list[TrainSequence], tmp_path: Path
) -> None:
    """LoRA on 2 workers, one step, rank 0 saves; 1 worker resumes it: the TrainState, the adapter weights,
    the optimizer and schedule states (saved again from the resumed worker) are those saved."""
    cfg = dataclasses.replace(config, lora_rank=4, run_dir=tmp_path / "two", warmup_steps=3)
    saved_state = TrainState(step=1, policy_version=1, seed=cfg.run.seed)
    two, _ = start(cfg, 2)
    try:
        two.update(sequences)
        path = two.save(1, saved_state, config_json(cfg), keep_last=1)
        weights = ray.get(two.sampler_weights())
    finally:
        two.shutdown()
    one, state = start(dataclasses.replace(cfg, run_dir=tmp_path / "one"), 1, checkpoint=path)
    try:
        resumed = ray.get(one.sampler_weights())
        assert state is not None
        again = one.save(1, state, config_json(cfg), keep_last=1)
    finally:
        one.shutdown()
    assert dataclasses.replace(state, config_hash="") == saved_state
    assert weights.keys() == resumed.keys() and all(torch.equal(weights[k], resumed[k]) for k in weights)
    for name in ("optimizer.pt", "scheduler.pt"):
        first, second = (torch.load(p / name, weights_only=True) for p in (path, again))
        assert_same(first, second, name)


def assert_same(a: object, b: object, where: str) -> None:
    """Nested state dicts equal, tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"
