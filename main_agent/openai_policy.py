"""The policy sampled through an OpenAI-compatible completions endpoint (`[sampling] backend = "server"`):
`vllm serve` for GPU rollouts, which also reloads the trainer's weights in place."""

from __future__ import annotations

import itertools
from pathlib import Path

import httpx

from main_agent.policy import SERVER_EXTENSION_FLAG, PolicyError, Sample, SamplingConfig, finish_sample


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
        # Generation on a remote GPU is seconds; 120 s covers a long completion on a loaded server.
        timeout = httpx.Timeout(connect=5.0, read=120.0, write=30.0, pool=30.0)
        self._http = httpx.AsyncClient(
            base_url=base_url.rstrip("/"), timeout=timeout, headers={"Authorization": f"Bearer {api_key}"}
        )
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
        body = {
            "model": self.model_name,
            "prompt": prompt_ids,
            "max_tokens": max_new_tokens,
            "temperature": self.cfg.temperature,
            "top_p": self.cfg.top_p,
            "logprobs": 0,  # the sampled token's log-prob only
            "return_token_ids": True,  # vLLM: the sampled ids, so nothing is re-tokenised
            "skip_special_tokens": False,
            # Reproducible yet distinct per request: one fixed seed makes vLLM sample a group's episodes alike.
            "seed": self.seed + next(self._requests),
        }
        try:
            response = await self._http.post("/completions", json=body)
        except httpx.HTTPError as exc:
            raise PolicyError(f"policy endpoint unreachable: {exc!r}") from exc
        if response.status_code != 200:
            raise PolicyError(f"policy endpoint answered {response.status_code}: {response.text[:300]}")
        return self._to_sample(response.json())

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
        root = str(self._http.base_url).rstrip("/").removesuffix("/v1")
        # Reading a checkpoint is seconds for a small policy, minutes for a large one on a slow disk.
        timeout = httpx.Timeout(600.0, connect=5.0)
        calls = (
            ("/collective_rpc", {"method": "reload_policy", "kwargs": {"weights_path": str(folder)}}),
            ("/reset_prefix_cache", None),
        )
        for route, body in calls:
            try:
                response = await self._http.post(root + route, json=body, timeout=timeout)
            except httpx.HTTPError as exc:
                raise PolicyError(f"policy server unreachable for a weight reload: {exc!r}") from exc
            if response.status_code == 404:
                raise PolicyError(f"{root}{route} not found: start vLLM with VLLM_SERVER_DEV_MODE=1")
            if response.status_code != 200 and "reload_policy" in response.text:
                raise PolicyError(f"{root} lacks reload_policy: start vLLM with {SERVER_EXTENSION_FLAG}")
            if response.status_code != 200:
                raise PolicyError(f"{root}{route} answered {response.status_code}: {response.text[:300]}")

    async def served_model(self) -> str:
        """The model the server serves (the first of `/models`), so settings need not repeat its name."""
        try:
            # A loaded server answers in milliseconds; the client's 120 s read timeout covers one warming up.
            response = await self._http.get("/models")
            response.raise_for_status()
            return str(response.json()["data"][0]["id"])
        except (httpx.HTTPError, KeyError, IndexError, TypeError, ValueError) as exc:
            raise PolicyError(f"no model listed at {self._http.base_url}/models: {exc!r}") from exc

    async def aclose(self) -> None:
        await self._http.aclose()
