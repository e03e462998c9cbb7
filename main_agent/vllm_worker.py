"""What the policy samplers add to vLLM's workers (`worker_extension_cls`), called by name via `collective_rpc`.

    AsyncEngineArgs(..., worker_extension_cls="main_agent.vllm_worker.PolicyWorker")       # VLLMPolicy
    VLLM_SERVER_DEV_MODE=1 vllm serve CKPT --worker-extension-cls main_agent.vllm_worker.PolicyWorker

This module is imported inside vLLM's worker processes: it must import nothing heavy from this project.
"""

from __future__ import annotations


class PolicyWorker:
    """Mixed into vLLM's Worker class, so `self` is the worker (`reload_weights`, `model_runner`)."""

    def reload_policy(self, weights_path: str) -> None:
        """Load the trainer's weights from `weights_path` in place, keeping a tied output layer in step.

        vLLM's `reload_weights` copies each loaded tensor into the existing parameter, so an lm_head tied to
        the embedding sees the new values, but it skips layers with nothing in the checkpoint, and on CPU the
        lm_head's matmul runs on a copy packed (oneDNN) at load time. Re-running the head's post-load step
        re-packs that copy from the updated embedding; on GPU the step does nothing.
        """
        self.reload_weights(weights_path=weights_path)  # type: ignore[attr-defined]
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        head = getattr(model, "lm_head", None)
        tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
        if tied and head is not None and hasattr(head, "quant_method"):
            head.quant_method.process_weights_after_loading(head)
