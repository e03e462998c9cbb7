"""A loopback stand-in for `VLLM_SERVER_DEV_MODE=1 vllm serve`: the routes the policy samplers use.

    app = completions_app(policy)                # any Policy answers /v1/completions
    app = completions_app(policy, dev=True)      # ... plus the dev routes a trainer pushes weights through
    with serve(app) as base_url:                 # "http://127.0.0.1:<port>/v1" (tests/fake_openai_server.py)
        ...
    app.state.requests                           # every completion request body, in order
    app.state.reloads                            # the weights_path of every reload, in order

GET /v1/models; POST /v1/completions with token-id prompts, `return_token_ids` and the sampled tokens'
log-probs (the stop token dropped from `text`, as vLLM does); with `dev`, POST /collective_rpc
{"method": "reload_policy", "kwargs": {"weights_path": ...}}, which loads the folder's safetensors into the
policy's model in place as vLLM's workers do, and POST /reset_prefix_cache.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException, Response
from pydantic import BaseModel


class CompletionRequest(BaseModel):
    model: str
    prompt: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    logprobs: int | None = None
    return_token_ids: bool = False
    skip_special_tokens: bool = True
    seed: int | None = None


def completions_app(policy, *, token_ids: bool = True, dev: bool = False, model: str = "policy") -> FastAPI:
    """Serve `policy` (anything with `sample`) over vLLM's completions protocol."""
    app = FastAPI()
    app.state.requests, app.state.reloads = [], []

    @app.get("/v1/models")
    async def models() -> dict[str, object]:
        return {"object": "list", "data": [{"id": model, "object": "model"}]}

    @app.post("/v1/completions")
    async def complete(body: CompletionRequest) -> dict[str, object]:
        app.state.requests.append(body.model_dump())
        sample = await policy.sample(body.prompt, max_new_tokens=body.max_tokens)
        ids = sample.ids[:-1] if sample.finish_reason == "stop" else sample.ids  # servers drop the stop token
        choice: dict[str, object] = {"index": 0, "text": sample.text, "finish_reason": sample.finish_reason}
        if token_ids and body.return_token_ids:
            choice["token_ids"] = sample.ids
            choice["logprobs"] = {"token_logprobs": sample.logprobs}
        else:
            choice["logprobs"] = {"token_logprobs": sample.logprobs[: len(ids)]}
        return {"id": "cmpl-1", "object": "text_completion", "model": body.model, "choices": [choice]}

    if dev:
        add_dev_routes(app, policy)
    return app


def add_dev_routes(app: FastAPI, policy) -> None:
    @app.post("/collective_rpc")
    async def collective_rpc(body: dict[str, Any]) -> dict[str, object]:
        if body.get("method") != "reload_policy":
            raise HTTPException(400, f"unsupported method {body.get('method')!r}")
        path = Path(body["kwargs"]["weights_path"])
        load_weights(policy.model, path)
        app.state.reloads.append(str(path))
        return {"results": [None]}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        return Response(status_code=200)


def load_weights(model, folder: Path) -> None:
    """The folder's safetensors into `model` in place; a tied lm_head is not in the file."""
    from safetensors.torch import load_file

    result = model.load_state_dict(load_file(folder / "model.safetensors"), strict=False)
    assert not result.unexpected_keys and set(result.missing_keys) <= {"lm_head.weight"}, result
