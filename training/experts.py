"""The scripted experts as policies: each task family's `oracle_reply` playing the `Policy` protocol through the
real tool server, the demonstrations SFT imitates (training/sft.py) and the benchmarks' expert rows.

- `OraclePolicy` replies in the call format of `main_agent.parse` with its family's `oracle_reply`
  (training/tasks/: multihop asks hop by hop where the data decomposes the question; plates load, find text, zoom
  on a found region, read, retry; video asks video_summary). Every argument it writes is derivable from what the
  policy has seen; the task's metadata only chooses among those options. The oracle knows the reference (it
  demonstrates, it does not compete), but by default writes it only when an observation showed it, so no
  demonstration teaches stating what no tool showed; otherwise it answers its own reading, which then fails the
  success filter. `trust_reference=True` answers the reference regardless (more data, less honest). With
  `mistakes` > 0 the plate experts sometimes make a mistake first (a zoom before find_text, or on r2 rather than
  r1), marked untrained (`Turn.trained`): the demonstration shows the refusal and the recovery, or the read
  without a plate and the retry, and the loss never teaches the mistake.
- `play_experts` plays one expert per task; `worth_imitating` says which of their episodes a policy should copy.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from main_agent.policy import Sample
from main_agent.rollout import RolloutConfig
from main_agent.types import Episode, Turn
from tool_server.client import ToolClient
from training import tasks as task_data
from training.play import play
from training.tasks import Task
from training.tasks.family import OracleReply


class OraclePolicy:
    """A scripted expert for one task, playing the `Policy` protocol: one instance per episode.

    It watches its episode's turns (`observe`, the rollout's per-turn hook) and answers each `sample` with its
    family's `oracle_reply(task, turns)`, which reads the structured results of earlier calls, never their text.
    Log-probs are reported as 0.0: an expert has no sampler, and SFT does not use them.

    With `mistakes` > 0, at a turn where its family offers one (`mistake_reply`: a call a policy gets wrong
    there, refused or leading nowhere), it makes that mistake with this probability (drawn from the task id, the
    turn and `seed`, so a rerun makes the same ones); the turn is marked untrained (`Sample.trained`): the
    demonstration shows the recovery from it, and never teaches the mistake. `chain=False` plays the family's
    other plan where it has one (`Family.unchained_reply`, corpus_qa's; `SFTConfig.chain`); `reply`, a plan a
    study plays instead of the family's (corpus_qa.full_chain_reply for the answer-rule study).
    """

    def __init__(
        self,
        task: Task,
        tokenizer,
        *,
        trust_reference: bool = False,
        mistakes: float = 0.0,
        seed: int = 0,
        chain: bool = True,
        reply: OracleReply | None = None,
    ) -> None:
        self.family = task_data.family_of(task)
        other = self.family.unchained_reply
        self.reply = reply or (self.family.oracle_reply if chain or other is None else other)
        self.task = task
        self.tokenizer = tokenizer
        self.trust_reference = trust_reference
        self.mistakes = mistakes
        self.seed = seed
        self.version = 0
        self.eos_token_id = int(tokenizer.eos_token_id)
        self.turns: list[Turn] = []

    def observe(self, turn: Turn) -> None:
        self.turns.append(turn)

    async def sample(self, prompt_ids: list[int], *, max_new_tokens: int) -> Sample:
        mistake = self._mistake()
        reply = mistake or self.reply(self.task, self.turns, trust_reference=self.trust_reference)
        ids = self.tokenizer.encode(reply, add_special_tokens=False) + [self.eos_token_id]
        if len(ids) > max_new_tokens:  # the rollout's budget binds the expert too; a cut reply usually fails
            ids = ids[:max_new_tokens]
            reply = self.tokenizer.decode(ids, skip_special_tokens=True)
        finish = "stop" if ids[-1] == self.eos_token_id else "length"
        return Sample(ids, [0.0] * len(ids), reply, finish, trained=mistake is None)

    def _mistake(self) -> str | None:
        """The family's mistake for this turn when the draw says so, else None."""
        offer = self.family.mistake_reply
        if offer is None or draw(self.seed, self.task.task_id, len(self.turns)) >= self.mistakes:
            return None
        return offer(self.task, self.turns)

    async def aclose(self) -> None:
        return None


def draw(seed: int, task_id: str, turn: int) -> float:
    """A uniform number in [0, 1) fixed by its arguments: the same on every machine and run."""
    digest = hashlib.sha256(f"{seed}:{task_id}:{turn}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


async def play_experts(
    tasks: Sequence[Task],
    tools: ToolClient,
    tokenizer,
    *,
    rollout: RolloutConfig,
    max_concurrent: int,
    trust_reference: bool = False,
    mistakes: float = 0.0,
    seed: int = 0,
    chain: bool = True,
    reply: OracleReply | None = None,
) -> list[Episode]:
    """The oracle's episode of each task, in task order, whatever its outcome: one expert per task, watching its
    own turns, at most `max_concurrent` in flight; `mistakes`, `seed`, `chain` and `reply` as in `OraclePolicy`."""
    experts = {
        t.task_id: OraclePolicy(
            t,
            tokenizer,
            trust_reference=trust_reference,
            mistakes=mistakes,
            seed=seed,
            chain=chain,
            reply=reply,
        )
        for t in tasks
    }
    groups = await play(
        tasks,
        lambda task: experts[task.task_id],
        tools=tools,
        tokenizer=tokenizer,
        cfg=rollout,
        max_concurrent=max_concurrent,
        on_turn_for=lambda task: experts[task.task_id].observe,
    )
    return [group[0] for group in groups]


def worth_imitating(task: Task, episode: Episode) -> bool:
    """A right answer, or the family's plain give-up (`Family.gave_up`) once the expert's attempts ran out; for
    an item task, a full ledger with at least half its items right and every trained call served (a deliberate
    mistake's refusal is the lesson, `SFTConfig.mistakes`): the item expert records what the reader showed, and
    a misread plate is the reader's error, not a lesson in what to do (the all-right rule would keep few long
    audits: the reader gets ~4 plates in 5)."""
    if not task.items:
        return task_data.success(task, episode.answer) or task_data.gave_up(task, episode.answer)
    entries = list(enumerate(episode.ledger, start=1))
    refused = any(not r.ok for turn in episode.turns if turn.trained for r in turn.results)
    if refused or any(text is None for _, text in entries):
        return False
    right = sum(task_data.item_reward(task, i, str(text)) for i, text in entries)
    return right >= len(entries) / 2
