"""The policy sampled through an OpenAI-compatible completions endpoint (`[sampling] backend = "server"`):
`vllm serve` for GPU rollouts, which also reloads the trainer's weights in place.

The `openai` package speaks the protocol over the project's hardened client (conductor/http.py: no redirect
followed, replies capped, each exchange within its timeout, transient failures retried); every failure is a
PolicyError, an infrastructure fault that marks the episode invalid.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import httpx
import openai

from conductor.http import CONNECT_TIMEOUT_S, ReplyRefused, openai_client, reason, retried
from main_agent.policy import SERVER_EXTENSION_FLAG, PolicyError, Sample, SamplingConfig, finish_sample

# One completion: generation on a remote GPU is seconds; 120 s covers a long one on a loaded server.
SAMPLE_TIMEOUT_S = 120.0
# One weight reload: reading a checkpoint is seconds for a small policy, minutes for a large one on a slow disk.
RELOAD_TIMEOUT = httpx.Timeout(600.0, connect=CONNECT_TIMEOUT_S)
# Retries of a completion on transient failures (a server restarting, a dropped connection, 5xx): repeating one is
# safe, as each request carries its own seed.
MAX_RETRIES = 2


class OpenAIPolicy:
    """Sample through an OpenAI-compatible `/v1/completions` endpoint with token-id prompts. `model` None asks
    the server which it serves (the first of /models) at the first sample; `seed` + a counter seeds each request."""

    def __init__(
        self,
        base_url: str,
        model: str | None,
        tokenizer,
        *,
        cfg: SamplingConfig = SamplingConfig(),
        seed: int = 0,
        api_key: str = "EMPTY",
    ) -> None:
        self._openai = openai_client(base_url, api_key=api_key, reply_timeout_s=SAMPLE_TIMEOUT_S)
        self.model_name = model
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.seed = seed
        self.version = 0  # bumped by the trainer after it pushes new weights to the server
        self.eos_token_id = int(tokenizer.eos_token_id)
        self._requests = itertools.count()

    async def sample(self, prompt_ids: list[int], *, max_new_tokens: int) -> Sample:
        if self.model_name is None:
            self.model_name = await self.served_model()
        # Reproducible yet distinct per request: one fixed seed makes vLLM sample a group's episodes alike.
        seed = self.seed + next(self._requests)
        try:
            reply = await retried(
                lambda: self._openai.completions.with_raw_response.create(
                    model=str(self.model_name),
                    prompt=prompt_ids,
                    max_tokens=max_new_tokens,
                    temperature=self.cfg.temperature,
                    top_p=self.cfg.top_p,
                    logprobs=0,  # the sampled token's log-prob only
                    seed=seed,
                    # vLLM: the sampled ids, so nothing is re-tokenised.
                    extra_body={"return_token_ids": True, "skip_special_tokens": False},
                ),
                max_retries=MAX_RETRIES,
            )
            data = reply.http_response.json()
        except openai.APIStatusError as exc:
            raise PolicyError(
                f"policy endpoint answered {exc.status_code}: {exc.response.text[:300]}"
            ) from exc
        except openai.APIError as exc:
            refused = isinstance(exc.__cause__, ReplyRefused)
            raise PolicyError(
                f"policy endpoint {'reply refused' if refused else 'unreachable'}: {reason(exc)}"
            ) from exc
        except ValueError as exc:  # not JSON
            raise PolicyError(f"the policy endpoint's completion is not JSON: {exc}") from exc
        return self._to_sample(data)

    def _to_sample(self, data: dict) -> Sample:
        try:
            choice = data["choices"][0]
        except (KeyError, IndexError, TypeError) as exc:
            raise PolicyError(f"completion response without choices: {str(data)[:300]}") from exc
        text = choice.get("text") or ""
        ids = choice.get("token_ids")
        logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
        exact = isinstance(ids, list)
        if not exact:
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        if not isinstance(logprobs, list) or len(logprobs) != len(ids):
            logprobs, exact = [0.0] * len(ids), False
        finish = "stop" if choice.get("finish_reason") == "stop" else "length"
        return finish_sample(
            ids, [float(x) for x in logprobs], self.tokenizer, finish, exact=exact, text=text
        )

    async def reload_weights(self, folder: Path) -> None:
        """Make a `vllm serve` process load the safetensors in `folder` (a path it can read) in place.

        The server must run `VLLM_SERVER_DEV_MODE=1 vllm serve CKPT --worker-extension-cls
        main_agent.vllm_worker.PolicyWorker` (this project importable there): `/collective_rpc` runs the workers'
        `reload_policy(weights_path)`, then `/reset_prefix_cache` drops the KV blocks of the old weights.
        """
        root = str(self._openai.base_url).rstrip("/").removesuffix("/v1")
        calls: tuple[tuple[str, dict[str, Any] | None], ...] = (
            ("/collective_rpc", {"method": "reload_policy", "kwargs": {"weights_path": str(folder)}}),
            ("/reset_prefix_cache", None),
        )
        for route, body in calls:
            try:
                await self._openai.post(
                    root + route, cast_to=httpx.Response, body=body, options={"timeout": RELOAD_TIMEOUT}
                )
            except openai.APIStatusError as exc:
                if exc.status_code == 404:
                    raise PolicyError(
                        f"{root}{route} not found: start vLLM with VLLM_SERVER_DEV_MODE=1"
                    ) from exc
                if "reload_policy" in exc.response.text:
                    raise PolicyError(
                        f"{root} lacks reload_policy: start vLLM with {SERVER_EXTENSION_FLAG}"
                    ) from exc
                raise PolicyError(
                    f"{root}{route} answered {exc.status_code}: {exc.response.text[:300]}"
                ) from exc
            except openai.APIError as exc:
                raise PolicyError(f"policy server unreachable for a weight reload: {reason(exc)}") from exc

    async def served_model(self) -> str:
        """The model the server serves (the first of `/models`), so settings need not repeat its name."""
        try:
            # A loaded server answers in milliseconds; SAMPLE_TIMEOUT_S covers one warming up.
            reply = await self._openai.models.with_raw_response.list()
            return str(reply.http_response.json()["data"][0]["id"])
        except (openai.APIError, KeyError, IndexError, TypeError, ValueError) as exc:
            raise PolicyError(f"no model listed at {self._openai.base_url}models: {exc!r}") from exc

    async def aclose(self) -> None:
        await self._openai.close()
