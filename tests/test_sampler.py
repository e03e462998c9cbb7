"""The sampler and how the trainer's weights reach it: in-process copy, folders for vLLM, the dev routes of a server.

The vLLM engine itself is exercised in tests/test_vllm.py (skipped without the `vllm` extra); here a loopback
server speaking vLLM's completions and dev-mode protocol stands in for `vllm serve`.
"""

from __future__ import annotations

import asyncio
import os
import weakref
from pathlib import Path

import pytest
import torch

from main_agent.openai_policy import OpenAIPolicy
from main_agent.policy import PolicyError, SamplingConfig
from main_agent.transformers_policy import TransformersPolicy, load_model
from main_agent.vllm_policy import VLLMPolicy
from tests.fake_openai_server import serve
from tests.fake_vllm_server import completions_app
from tests.fakes import ByteChatTokenizer, fake_tool_server
from tests.test_train import check_run_trained, final_weights, parity_score, tiny_config, tiny_llama
from training import step as step_module
from training.config import ConfigError, TrainConfig, load_train_config
from training.loop import train
from training.sampler import Sampler, dense_parameters, export_weights, merged, sampler_settings


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


async def test_a_load_copies_into_the_samplers_own_model(tmp_path: Path) -> None:
    """The first load makes the sampler its own copy of the trained model; after a later load its weights equal
    the trained ones but are separate tensors, at the version loaded."""
    cfg = TrainConfig(run_dir=tmp_path, sampling=SamplingConfig(backend="transformers"))
    trained = tiny_llama(258)
    sampler = Sampler(sampler_settings(cfg), ByteChatTokenizer())
    await sampler.load(trained, 3)
    assert isinstance(sampler.policy, TransformersPolicy) and sampler.policy.model is sampler.model
    with torch.no_grad():
        trained.model.embed_tokens.weight.add_(1.0)
    assert not same_weights(sampler.model, trained)
    await sampler.load(trained, sampler.version + 1)
    assert sampler.version == 4 and same_weights(sampler.model, trained)
    assert sampler.model.model.embed_tokens.weight.data_ptr() != trained.model.embed_tokens.weight.data_ptr()
    assert not (tmp_path / "sampler").exists()  # the in-process copy needs no folder
    await sampler.aclose()


async def test_a_pushed_state_loads_into_the_samplers_own_model(tmp_path: Path) -> None:
    """A Ray rollout worker's sampler samples its own model (no copy) and loads pushed weights into it; a key
    the model lacks is refused."""
    cfg = TrainConfig(run_dir=tmp_path, sampling=SamplingConfig(backend="transformers"))
    mine, trained = tiny_llama(258), tiny_llama(258)
    with torch.no_grad():
        trained.model.norm.weight.add_(1.0)
    sampler = Sampler(sampler_settings(cfg, rank=1), ByteChatTokenizer(), model=mine)
    await sampler.load_state(trained.state_dict(), 2)
    assert sampler.policy.model is mine and same_weights(mine, trained) and sampler.version == 2
    with pytest.raises(AssertionError, match="weights the sampler does not have"):
        await sampler.load_state({"nowhere.weight": torch.zeros(1)}, 3)
    await sampler.aclose()


def test_a_rollout_worker_samples_from_its_own_folder_and_seed(tmp_path: Path) -> None:
    """Ray rollout worker r writes its weights under sampler/worker-r/ and seeds its engine seed + r; it takes
    a GPU push when `[ray] weight_push` names one; the run's own sampler never does."""
    from conductor.cluster import RayConfig

    cfg = TrainConfig(run_dir=tmp_path, ray=RayConfig(weight_push="ipc"))
    run, worker = sampler_settings(cfg), sampler_settings(cfg, rank=2)
    assert run.folder == tmp_path / "sampler" and run.seed == 0 and run.weight_transfer is None
    assert worker.folder == tmp_path / "sampler" / "worker-2" and worker.seed == 2
    assert worker.weight_transfer == "ipc"
    assert sampler_settings(TrainConfig(run_dir=tmp_path), rank=2).weight_transfer is None


def test_export_writes_a_loadable_checkpoint_and_keeps_only_the_newest(tmp_path: Path) -> None:
    """Each version is a complete HF checkpoint under v<N>/; older versions and temporary folders are gone."""
    from transformers import AutoModelForCausalLM

    model = tiny_llama(258)
    export_weights(model, None, tmp_path, 1)
    with torch.no_grad():
        model.model.norm.weight.add_(0.5)
    folder = export_weights(model, None, tmp_path, 2)
    assert folder == tmp_path / "v2" and sorted(p.name for p in tmp_path.iterdir()) == ["v2"]
    assert same_weights(AutoModelForCausalLM.from_pretrained(folder), model)


def test_a_lora_policy_is_exported_merged_and_keeps_its_adapters() -> None:
    """The sampler gets base + B·A folded into dense weights (same outputs); the trained model stays a LoRA."""
    from peft import LoraConfig, PeftModel, get_peft_model

    lora = get_peft_model(tiny_llama(258), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5)  # B starts at zero: make the adapter matter
    dense = merged(lora)
    ids = torch.tensor([[1, 5, 9, 42, 7]])
    assert not isinstance(dense, PeftModel) and isinstance(lora, PeftModel)
    assert torch.allclose(dense(ids).logits, lora(ids).logits, atol=1e-5)
    assert any("lora_A" in name for name, _ in lora.named_parameters())


@pytest.mark.parametrize("lora", [True, False])
def test_dense_parameters_stream_exactly_the_merged_model(lora: bool) -> None:
    """What a GPU push streams (`dense_parameters`) is `merged(model).named_parameters()`: the same names in the
    same order, equal tensors, no adapter left; the trained model is not changed by it."""
    from peft import LoraConfig, get_peft_model

    model = tiny_llama(258)
    if lora:
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 0.5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    streamed = list(dense_parameters(model))
    expected = list(merged(model).named_parameters())
    assert [n for n, _ in streamed] == [n for n, _ in expected]
    for (name, got), (_, want) in zip(streamed, expected, strict=True):
        assert torch.equal(got, want), name
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


async def test_server_reload_uses_the_dev_routes_and_names_dev_mode_when_missing(tmp_path: Path) -> None:
    """A weight push is /collective_rpc reload_weights with the folder, then /reset_prefix_cache; a server
    started without VLLM_SERVER_DEV_MODE (no such routes) fails with an error that says so."""
    served = TransformersPolicy(tiny_llama(258), ByteChatTokenizer())
    folder = export_weights(tiny_llama(258), None, tmp_path, 1)
    app = completions_app(served, dev=True)
    with serve(app) as url:
        policy = OpenAIPolicy(url, "policy", ByteChatTokenizer())
        await policy.reload_weights(folder)
        await policy.aclose()
    assert app.state.reloads == [str(folder)]
    with serve(completions_app(served)) as url:
        policy = OpenAIPolicy(url, "policy", ByteChatTokenizer())
        with pytest.raises(PolicyError, match="VLLM_SERVER_DEV_MODE=1"):
            await policy.reload_weights(folder)
        await policy.aclose()
    await served.aclose()


async def test_openai_policy_seeds_each_request_differently() -> None:
    """Episodes of a group sent to a server must not share a seed (vLLM would sample them alike)."""
    served = TransformersPolicy(tiny_llama(258), ByteChatTokenizer(), cfg=SamplingConfig(temperature=0.0))
    app = completions_app(served)
    with serve(app) as url:
        policy = OpenAIPolicy(url, "policy", ByteChatTokenizer(), seed=7)
        for _ in range(3):
            await policy.sample([1, 2, 3], max_new_tokens=2)
        await policy.aclose()
    await served.aclose()
    assert [r["seed"] for r in app.state.requests] == [7, 8, 9]


def test_server_sampler_needs_a_url() -> None:
    """sampling backend "server" without a url is a settings error, not a failure at the first rollout."""
    with pytest.raises(ConfigError, match="needs a url"):
        load_train_config(None, ['sampling.backend="server"'])


@pytest.mark.slow
def test_server_sampler_samples_with_every_version_the_trainer_writes(
    tiny_policy: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two training steps sampled by a server over loopback HTTP: it loads the run's starting weights, then each
    step's, and ends holding exactly the weights of the final checkpoint; only the newest folder is kept."""
    from tests.test_train import STUB_TASKS
    from training import tasks as task_data

    monkeypatch.setattr(task_data, "load_family", lambda *a, **k: STUB_TASKS)
    monkeypatch.setattr(step_module, "score", parity_score)
    model, tokenizer = load_model(tiny_policy)
    with torch.no_grad():
        model.model.norm.weight.add_(1.0)  # the server starts on other weights than the run's
    served = TransformersPolicy(model, tokenizer)
    app = completions_app(served, dev=True)
    with serve(app) as url:
        sampling = SamplingConfig(backend="server", url=url)
        cfg = tiny_config(tmp_path / "run", tiny_policy, sampling=sampling)
        run_dir = train(cfg, transport=fake_tool_server())
    rows = check_run_trained(run_dir, tiny_policy, 2)
    assert [r["policy_version"] for r in rows] == [1, 2]
    assert app.state.reloads == [str(run_dir / "sampler" / f"v{v}") for v in (0, 1, 2)]
    final = final_weights(run_dir)
    assert all(torch.equal(model.state_dict()[k], final[k]) for k in final)
    assert sorted(p.name for p in (run_dir / "sampler").iterdir()) == ["v2"]
    assert len(app.state.requests) >= 4 and {r["model"] for r in app.state.requests} == {"policy"}


@pytest.mark.parametrize(("precision", "dtype"), [("bf16", "bfloat16"), ("fp32", "float32")])
async def test_a_vllm_sampler_computes_in_the_trainers_precision(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, precision: str, dtype: str
) -> None:
    """The vLLM engine is started in the update's precision (bfloat16 for a bf16 trainer, float32 otherwise) on
    the run's current weights."""
    import main_agent.vllm_policy

    started: dict[str, object] = {}

    def fake_start(folder: Path, tokenizer, **kwargs):
        started.update(kwargs, folder=folder)
        return "engine"

    monkeypatch.setattr(main_agent.vllm_policy.VLLMPolicy, "start", fake_start)
    cfg = TrainConfig(run_dir=tmp_path, precision=precision, sampling=SamplingConfig(backend="vllm"))
    sampler = Sampler(sampler_settings(cfg), None)
    await sampler.load(tiny_llama(258), 2)
    assert sampler.policy == "engine"
    assert started["dtype"] == dtype and started["version"] == 2
    assert started["folder"] == tmp_path / "sampler" / "v2"


class SavedTokenizer(ByteChatTokenizer):
    """The byte tokenizer, written beside exported weights as an HF tokenizer would be."""

    def save_pretrained(self, folder: Path) -> None:
        (Path(folder) / "tokenizer_config.json").write_text("{}")


class RecordingEngine:
    """An `AsyncLLM` stand-in: the folders `reload_policy` is asked to load, and prefix-cache resets."""

    def __init__(self) -> None:
        self.reloads: list[str] = []
        self.resets = 0

    async def collective_rpc(self, method: str, kwargs: dict) -> None:
        assert method == "reload_policy"
        self.reloads.append(kwargs["weights_path"])

    async def reset_prefix_cache(self) -> None:
        self.resets += 1

    def shutdown(self) -> None:
        pass


async def test_a_workers_vllm_sampler_starts_once_reloads_in_place_and_takes_streamed_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ray rollout worker 1 under an IPC weight push: the first load starts its engine on the exported folder
    (seed + 1, the transport named, pickled IPC handles allowed), a later one reloads the next folder in place;
    weights streamed into the engine (`engine`) are labelled by `streamed`."""
    import main_agent.vllm_policy
    from conductor.cluster import RayConfig
    from main_agent.vllm_policy import VLLMPolicy

    engine, started = RecordingEngine(), {}

    def fake_start(folder: Path, tokenizer, **kwargs):
        started.update(kwargs, folder=folder)
        return VLLMPolicy(engine, tokenizer, cfg=kwargs["cfg"], version=kwargs["version"])

    monkeypatch.setattr(main_agent.vllm_policy.VLLMPolicy, "start", fake_start)
    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION", raising=False)
    cfg = TrainConfig(
        run_dir=tmp_path, sampling=SamplingConfig(backend="vllm"), ray=RayConfig(weight_push="ipc")
    )
    model = tiny_llama(258)
    sampler = Sampler(sampler_settings(cfg, rank=1), SavedTokenizer(), model=model)
    await sampler.load_state(model.state_dict(), 0)
    folder = tmp_path / "sampler" / "worker-1"
    assert started["folder"] == folder / "v0" and started["seed"] == 1 and started["weight_transfer"] == "ipc"
    assert (folder / "v0" / "tokenizer_config.json").is_file()  # the folder an engine starts on is complete
    assert os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1" and engine.reloads == []
    await sampler.load_state(model.state_dict(), 1)
    assert engine.reloads == [str(folder / "v1")] and engine.resets == 1 and sampler.version == 1
    assert sampler.engine() is engine
    sampler.streamed(2)
    assert sampler.version == 2 and sampler.policy.version == 2
    await sampler.aclose()


def test_closing_a_vllm_policy_shuts_its_engine_down_once_and_lets_it_go() -> None:
    """`VLLMPolicy.aclose` shuts the engine down once (a second close is a no-op) and drops it, so vLLM's own
    `__del__` runs then and not at interpreter exit, where it fails with "Exception ignored" on every command."""

    class Engine:
        shutdowns = 0

        def shutdown(self) -> None:
            Engine.shutdowns += 1

    engine = Engine()
    gone = weakref.ref(engine)
    policy = VLLMPolicy(engine, ByteChatTokenizer(), cfg=SamplingConfig())
    del engine
    asyncio.run(policy.aclose())
    asyncio.run(policy.aclose())
    assert Engine.shutdowns == 1 and gone() is None
