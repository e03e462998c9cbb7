"""Micro-batching: concurrent generation requests share one `generate` call.

A 135M model on CPU spends most of a decoding step on overhead that does not grow with the batch, so eight
requests decoded together cost little more than one. `MicroBatcher` queues requests; a single worker task
takes the first waiting request, waits at most `wait_ms` for up to `max_batch - 1` more, and hands the
batch's prompts to a blocking `generate_batch(prompts, max_new_tokens)` run in a worker thread (one batch at
a time: torch already uses every core for one). The batch runs to the largest limit among its requests; each
caller cuts its own output to its own limit (a prefix, for greedy decoding and for sampling alike).

The batcher knows nothing about models: `generate_batch` takes token id lists and returns one output per
prompt (generated ids for the frozen backends, ids with log-probs for the policy), so unit tests drive it
with a plain function.

Failure isolation: if a batch of several requests raises, each request is run alone once, so one bad
request fails only itself. Callers that give up (cancelled `submit`) are skipped before their batch runs.
Limits: the worker is bound to the event loop that first submitted; a submit from a new loop (e.g. a
new `asyncio.run`) restarts it there. A batch already running when `aclose` is called finishes in its
thread (torch cannot be interrupted); its callers are failed at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

GenerateBatch = Callable[[list[list[int]], int], list[T]]
"""Blocking: prompts (token ids, unpadded) and a shared limit -> one output per prompt."""

# What a failing `generate_batch` may raise: torch reports bad shapes, out-of-memory and device faults as
# RuntimeError, tokenizer/generation-config misuse as ValueError. Anything else is a bug and propagates.
GENERATION_ERRORS = (RuntimeError, ValueError)


class GenerationError(Exception):
    """One request could not be generated: its batch failed, or the batcher closed before it ran. Neutral on
    purpose: the sub-agents' backend turns it into `BackendError`, the policy into `PolicyError`."""

    def __init__(self, message: str, *, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable


@dataclass
class _Request(Generic[T]):
    prompt: list[int]
    max_new_tokens: int
    future: asyncio.Future[T]


class MicroBatcher(Generic[T]):
    """Queue of generation requests served in batches by one worker task."""

    def __init__(self, generate_batch: GenerateBatch[T], *, max_batch: int, wait_ms: float) -> None:
        assert max_batch >= 1, f"max_batch must be >= 1, got {max_batch}"
        self._generate_batch = generate_batch
        self._max_batch = max_batch
        self._wait_s = wait_ms / 1000
        self._queue: asyncio.Queue[_Request] | None = None
        self._worker: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._running: list[_Request] = []
        self._closed = False
        self.batch_sizes: list[int] = []
        """Size of every batch run so far, for tests and benchmarks."""

    @property
    def queue_depth(self) -> int:
        """Requests waiting for a batch (not counting the batch now running)."""
        return 0 if self._queue is None else self._queue.qsize()

    async def submit(self, prompt: list[int], max_new_tokens: int) -> T:
        """The output for `prompt`, generated with a limit of at least `max_new_tokens`. Raises GenerationError."""
        if self._closed:
            raise GenerationError("backend is closed", retryable=True)
        queue = self._ensure_worker()
        request = _Request(prompt, max_new_tokens, asyncio.get_running_loop().create_future())
        queue.put_nowait(request)
        return await request.future

    async def aclose(self) -> None:
        """Stop the worker; queued and running requests fail with a retryable GenerationError."""
        self._closed = True
        if self._worker is not None and self._loop is asyncio.get_running_loop():
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)
        pending = list(self._running)
        while self._queue is not None and not self._queue.empty():
            pending.append(self._queue.get_nowait())
        for request in pending:
            _fail(request, GenerationError("backend closed before the request ran", retryable=True))

    def _ensure_worker(self) -> asyncio.Queue[_Request]:
        loop = asyncio.get_running_loop()
        if self._queue is None or self._worker is None or self._worker.done() or self._loop is not loop:
            if self._loop is not None and self._loop is not loop:
                logger.info("micro-batcher restarting on a new event loop")
            self._loop = loop
            self._queue = asyncio.Queue()
            self._worker = loop.create_task(self._work(self._queue), name="micro-batcher")
        return self._queue

    async def _work(self, queue: asyncio.Queue[_Request]) -> None:
        while True:
            batch: list[_Request] = []
            self._running = batch  # visible to aclose from the moment a request leaves the queue
            try:
                await self._collect(queue, batch)
                await self._run(batch)
            except Exception as exc:  # a bug, not swallowed: every caller of this batch gets it raised
                logger.exception("micro-batcher bug; failing the %d requests of this batch", len(batch))
                for request in batch:
                    if not request.future.done():
                        request.future.set_exception(exc)

    async def _collect(self, queue: asyncio.Queue[_Request], batch: list[_Request]) -> None:
        """Fill `batch` with the first waiting request plus whatever arrives within the wait bound."""
        batch.append(await queue.get())
        deadline = time.monotonic() + self._wait_s
        while len(batch) < self._max_batch:
            if not queue.empty():
                batch.append(queue.get_nowait())
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                async with asyncio.timeout(remaining):
                    batch.append(await queue.get())
            except TimeoutError:  # a get cut by the timeout leaves its item queued: nothing is lost
                break

    async def _run(self, batch: list[_Request]) -> None:
        live = [r for r in batch if not r.future.done()]  # callers that gave up are skipped
        if not live:
            return
        self.batch_sizes.append(len(live))
        try:
            outputs = await self._generate(live)
        except GENERATION_ERRORS as exc:
            if len(live) == 1:
                logger.warning("generation failed: %s", exc)
                _fail(live[0], GenerationError(f"generation failed: {exc}", retryable=False))
                return
            logger.warning("batch of %d failed (%s); running its requests one by one", len(live), exc)
            for request in live:
                await self._run([request])
            return
        for request, output in zip(live, outputs, strict=True):
            if not request.future.done():
                request.future.set_result(output)

    async def _generate(self, batch: list[_Request]) -> list[T]:
        prompts = [r.prompt for r in batch]
        limit = max(r.max_new_tokens for r in batch)  # a shorter limit's output is a prefix of a longer one
        return await asyncio.to_thread(self._generate_batch, prompts, limit)


def _fail(request: _Request, error: GenerationError) -> None:
    if not request.future.done():
        request.future.set_exception(error)


def left_pad(prompts: list[list[int]], *, pad_id: int):
    """Left-pad prompts into [batch, width] ids and attention-mask tensors (decoder-only generation)."""
    import torch

    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)  # [batch, width]
    attention_mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        attention_mask[row, width - len(prompt) :] = 1
    return input_ids, attention_mask
