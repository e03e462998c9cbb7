"""The small-policy recipe's reward and loss settings, each shown to do what it says: evidence recall mixed into
the final reward (`evidence_weight`), the likelihood-displacement guard (`lld_coef`), and the absence of a
per-turn 1/T. Unit tests: hand-built episodes, tiny tensors, and a tiny random Llama where a weight gradient is
needed."""

from __future__ import annotations

import dataclasses
from typing import cast

import pytest
import torch

from main_agent.tokens import TrainSequence, collate, to_sequences
from main_agent.types import Episode, ToolCall, ToolResult, Turn
from tests.test_train import tiny_llama
from training import tasks as task_data
from training.advantages import EpisodeCredit, TurnCredit, outcome_advantages
from training.config import ConfigError, TrainConfig, load_train_config
from training.loss import policy_loss
from training.rewards import evidence_recall, supporting_pages, token_f1, with_evidence
from training.step import Scored, check_evidence, score, score_groups
from training.tasks import Task
from training.tasks.task import TaskMeta
from training.update import accumulate_gradients, update

WEIGHTS = TrainConfig().turn_rewards

# ---------------------------------------------------------------- episodes of a two-page corpus question


def corpus_task(task_id: str = "corpus-q1") -> Task:
    """A corpus_qa question whose supporting pages are Bridge.md (hop 1) and Answer.md (hop 2)."""
    meta = TaskMeta(
        supporting_titles=("Bridge", "Answer"),
        page_titles=("Other", "Bridge", "Answer", "Answer of AB"),
        page_paths=("dev/Other.md", "dev/Bridge.md", "dev/Answer.md", "dev/XAnswer.md"),
        split="dev",
    )
    question = "Where did the band first perform?"
    return Task(task_id, "corpus_qa", question, ("search", "page_qa"), "Tulsa", meta=meta)


def read(name: str, *, ok: bool = True) -> Turn:
    """A turn whose one page_qa call opened corpus file `name`."""
    payload: dict[str, object] = {"url": f"file:///tmp/corpus/dev/{name}", "answer": "x"}
    result = ToolResult("page_qa", ok, "x", None, 1.0, 0, 0, False, payload)
    return Turn(
        [5, 6, 7], [-1.0, -1.0, -1.0], [8, 9], "", "", [ToolCall("page_qa", {}, "")], [result], [], 0, 0, 0
    )


def played(*names: str, answer: str | None = "Tulsa OK", task_id: str = "corpus-q1") -> Episode:
    """An episode reading `names` (ok) one a turn, then answering `answer`."""
    return Episode(task_id, "q", [1, 2], [read(n) for n in names], answer, "answer", 0, 1.0, 1.0, 0.0)


# ---------------------------------------------------------------- evidence recall


def test_reading_both_supporting_pages_scores_higher_than_one_with_the_same_answer() -> None:
    """Same answer (F1 2/3), weight 0.5: both pages read pays 0.5 F1 + 0.5, one page 0.5 F1 + 0.25, and the final
    reward stays in [0, 1]."""
    both, one = played("Bridge.md", "Answer.md"), played("Answer.md")
    for episode in (both, one):
        score(episode, corpus_task(), WEIGHTS, "task", evidence_weight=0.5)
    f1 = token_f1("Tulsa OK", "Tulsa")
    assert both.reward == pytest.approx(0.5 * f1 + 0.5) and one.reward == pytest.approx(0.5 * f1 + 0.25)
    assert one.reward is not None and both.reward is not None
    assert 0.0 <= one.reward < both.reward <= 1.0


def test_evidence_weight_zero_gives_exactly_the_old_reward() -> None:
    """At weight 0 (the default) the final reward is the family's own, bit for bit, for every reading and for a
    family without pages (whose recall is never asked)."""
    clip = Task("v1", "video_qa", "Who?", ("video_summary",), "Ada Lovelace")
    cases = [
        (corpus_task(), played("Bridge.md", "Answer.md")),
        (corpus_task(), played("Answer.md", answer="tulsa")),
        (corpus_task(), played(answer=None)),
        (clip, played(answer="Ada", task_id="v1")),
    ]
    for task, episode in cases:
        score(episode, task, WEIGHTS, "task")
        default = episode.reward
        score(episode, task, WEIGHTS, "task", evidence_weight=0.0)
        assert episode.reward == default == task_data.reward_for(task, episode.answer)


def test_evidence_recall_counts_ok_reads_of_supporting_pages_only() -> None:
    """Recall is the share of supporting pages a page_qa call read and came back ok on: a failed read, a
    distractor and a file whose name merely ends alike (XAnswer.md) read nothing; a task without supporting pages
    has none (None); a page two hops share counts once."""
    task = corpus_task()
    assert supporting_pages(task) == ["Bridge.md", "Answer.md"]
    assert evidence_recall(task, played()) == 0.0
    assert evidence_recall(task, played("Other.md", "XAnswer.md")) == 0.0
    failed = dataclasses.replace(played(), turns=[read("Bridge.md", ok=False), read("Answer.md")])
    assert evidence_recall(task, failed) == 0.5
    assert evidence_recall(task, played("Answer.md", "Bridge.md", "Answer.md")) == 1.0
    assert evidence_recall(Task("v1", "video_qa", "Who?", ("video_summary",), "Ada"), played()) is None
    twice = dataclasses.replace(task, meta=dataclasses.replace(task.meta, hops=(("a?", 2), ("b #1?", 2))))
    assert evidence_recall(twice, played("Answer.md")) == 1.0


def test_a_positive_evidence_weight_needs_supporting_pages() -> None:
    """A weight > 0 on a task that has no supporting pages is an error, not a silent fall-back to the answer's
    reward: at the start of a run (`check_evidence`, ConfigError) and when scoring; weight 0 checks nothing."""
    clip = Task("v1", "video_qa", "Who?", ("video_summary",), "Ada Lovelace")
    with pytest.raises(ConfigError, match="v1 of video_qa"):
        check_evidence([corpus_task(), clip], 0.3)
    check_evidence([clip], 0.0)
    check_evidence([corpus_task()], 0.3)
    with pytest.raises(ValueError, match="supporting pages"):
        score(played(task_id="v1"), clip, WEIGHTS, "task", evidence_weight=0.3)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        with_evidence(1.0, 1.0, 1.5)


def test_evidence_recall_is_logged_in_the_step_row_whatever_the_weight() -> None:
    """`reward/evidence_recall` is the mean recall of the scored episodes of tasks with pages (here 1 and 0.5),
    logged at weight 0 too; a step of tasks without pages has no such key."""
    group = [played("Bridge.md", "Answer.md"), played("Answer.md")]
    scored = score_groups([group], [corpus_task()], TrainConfig())
    assert scored.metrics()["reward/evidence_recall"] == pytest.approx(0.75)
    assert [e.reward for e in group] == [token_f1("Tulsa OK", "Tulsa")] * 2
    assert "reward/evidence_recall" not in Scored([], [], [], []).metrics()


def test_recipe_settings_parse_as_settings_and_refuse_out_of_range_values() -> None:
    """`--set evidence_weight=0.5 --set lld_coef=0.1` parse; both default to 0 (off); a weight outside [0, 1] or
    a negative coefficient is refused with the rule it breaks."""
    cfg = load_train_config(None, ["evidence_weight=0.5", "lld_coef=0.1"])
    assert (cfg.evidence_weight, cfg.lld_coef) == (0.5, 0.1)
    assert (TrainConfig().evidence_weight, TrainConfig().lld_coef) == (0.0, 0.0)
    with pytest.raises(ConfigError, match="evidence_weight"):
        load_train_config(None, ["evidence_weight=1.5"])
    with pytest.raises(ConfigError, match="lld_coef"):
        load_train_config(None, ["lld_coef=-0.1"])


# ---------------------------------------------------------------- the likelihood-displacement guard

# Five tokens: A > 0 whose log-prob fell, A > 0 that rose, A < 0 that fell, A < 0 that rose, A > 0 unchanged.
OLD = torch.tensor([[-1.0, -1.0, -1.0, -1.0, -1.0]])
NEW = [[-1.1, -0.9, -1.1, -0.9, -1.0]]
ADV = torch.tensor([[1.0, 1.0, -1.0, -1.0, 1.0]])
MASK = torch.ones(1, 5)


def loss_and_grad(lld_coef: float | None, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
    logprobs = torch.tensor(NEW, requires_grad=True)
    extra = {} if lld_coef is None else {"lld_coef": lld_coef}
    out = policy_loss(logprobs, OLD, ADV, MASK, **extra, **kwargs)  # type: ignore[arg-type]
    out.loss.backward()
    assert logprobs.grad is not None
    return out.loss.detach(), logprobs.grad


def test_lld_coef_zero_leaves_the_loss_bit_identical() -> None:
    """lld_coef 0 (and leaving it out) gives exactly the clipped surrogate's loss and gradient, computed here as
    the loss computed it before the guard existed."""
    logprobs = torch.tensor(NEW, requires_grad=True)
    ratio = torch.exp(torch.where(MASK.bool(), logprobs - OLD, 0.0))
    adv = torch.where(MASK.bool(), ADV, 0.0)
    before = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.28) * adv).sum() / 5.0
    before.backward()
    assert logprobs.grad is not None
    for coef in (None, 0.0):
        loss, grad = loss_and_grad(coef)
        assert torch.equal(loss, before.detach()) and torch.equal(grad, logprobs.grad)


def test_lld_pulls_up_only_positive_advantage_tokens_that_fell() -> None:
    """With lld_coef c the gradient changes by -c / N on the positive-advantage token whose log-prob fell below
    the sampler's (descent raises it), and not at all on tokens that rose, stayed, or have negative advantage;
    `lld` is relu(old - logp) / N over those tokens, logged whatever c."""
    _, plain = loss_and_grad(0.0)
    _, guarded = loss_and_grad(0.5)
    torch.testing.assert_close(guarded - plain, torch.tensor([[-0.5 / 5, 0.0, 0.0, 0.0, 0.0]]))
    assert guarded[0, 0] < plain[0, 0] < 0
    out = policy_loss(torch.tensor(NEW), OLD, ADV, MASK)
    assert out.lld.item() == pytest.approx(0.1 / 5)
    with pytest.raises(ValueError, match="lld_coef"):
        policy_loss(torch.tensor(NEW), OLD, ADV, MASK, lld_coef=-1.0)


def trained_sequences(old_logprob: float) -> list[TrainSequence]:
    """Two byte-token episodes of a group, advantages +0.5 and -0.5, sampled with `old_logprob` per token."""
    turn = Turn([70, 71, 72], [old_logprob] * 3, [10], "", "", [], [], [], 0, 0, 0)
    episode = Episode("t", "q", [1, 2, 3], [turn], "a", "answer", 0, 0.0, 0.0, 0.0)
    return to_sequences(episode, [0.5]) + to_sequences(episode, [-0.5])


def test_update_passes_lld_coef_to_the_loss_and_logs_it() -> None:
    """Through the optimizer step: with old log-probs of 0 every sampled token has fallen below the sampler's, so
    lld_coef > 0 changes the step's gradient and `loss/lld` is logged > 0; at lld_coef 0 the metrics row has no
    such key (a run without the guard logs what it always did)."""
    sequences = trained_sequences(0.0)
    grads = []
    for coef in (0.0, 1.0):
        model = tiny_llama(258)
        cfg = TrainConfig(lld_coef=coef, micro_batch_tokens=64, precision="fp32")
        assert accumulate_gradients(model, sequences, cfg) is not None
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        optimizer.zero_grad(set_to_none=True)
        stats = update(model, optimizer, sequences, cfg)
        assert stats.skipped is None
        assert stats.metrics()["loss/lld"] > 0 if coef else "loss/lld" not in stats.metrics()
    assert not torch.equal(grads[0], grads[1])


# ---------------------------------------------------------------- no 1/T


def turns_of(n: int) -> list[Turn]:
    """`n` turns of identical content: the same three sampled tokens and the same observation."""
    return [Turn([5, 6, 7], [-1.0, -1.0, -1.0], [8, 9], "", "", [], [], [], 0, 0, 0) for _ in range(n)]


def test_an_episode_of_four_like_turns_weighs_twice_one_of_two() -> None:
    """Outcome credit gives every turn the episode's whole advantage (no 1/T); laid onto tokens and through the
    loss, the 4-turn episode's total gradient on its log-probs is twice the 2-turn episode's."""
    shapes = ((1.0, 2), (1.0, 4), (0.0, 3), (0.0, 3))  # (final reward, turns): two right, two wrong
    group = [EpisodeCredit(reward, (TurnCredit(0.0, None),) * n) for reward, n in shapes]
    advantages = outcome_advantages(group, normalize_std=False)
    assert advantages[0] == [0.5] * 2 and advantages[1] == [0.5] * 4
    episodes = [Episode("t", "q", [1, 2], turns_of(n), "a", "answer", 0, 0.0, 0.0, 0.0) for n in (2, 4)]
    sequences = [s for e, a in zip(episodes, advantages[:2], strict=True) for s in to_sequences(e, a)]
    batch = collate(sequences, pad_id=0)
    old, adv, mask = (cast(torch.Tensor, t) for t in (batch.old_logprobs, batch.advantages, batch.loss_mask))
    logprobs = old.clone().requires_grad_(True)  # ratio 1: the gradient is -A / N per token
    policy_loss(logprobs, old, adv, mask).loss.backward()
    assert logprobs.grad is not None
    two, four = logprobs.grad.sum(dim=1).tolist()
    assert two < 0 and four == pytest.approx(2 * two, rel=1e-6)
