"""Smoke tests of the `conductor` entry point, run as a user would (a subprocess), mostly on bad input."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fake_openai_server import unused_port
from tests.test_trace import episodes

REPO = Path(__file__).resolve().parent.parent
ASK = ("ask", "What does page_qa return?", "--max-turns", "1", "--json")
COLD_START = re.compile(
    r"cold start: [\d.]+ s \(imports [\d.]+ s, index [\d.]+ s, policy [\d.]+ s, tools [\d.]+ s\)"
)


def conductor(
    *args: str, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "app.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env={**os.environ, **(env or {})},
    )


def user_error(out: subprocess.CompletedProcess[str]) -> str:
    """The one line a user-fixable error prints, after checking it is the only thing on stderr."""
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert len(out.stderr.splitlines()) == 1 and out.stderr.startswith("error: "), out.stderr
    return out.stderr


def test_help_lists_every_command():
    """The CLI starts and names all its subcommands."""
    out = conductor("--help")
    assert out.returncode == 0
    for command in ("serve", "ask", "trace", "train", "sft", "eval", "plot", "models"):
        assert command in out.stdout


def test_trace_renders_an_episodes_file_and_names_a_bad_line(tmp_path):
    """`conductor trace` writes one page holding every episode of the file; a line that is not an episode, or a
    file that is not there, is one error line naming it, exit code 2, nothing written."""
    log = tmp_path / "rollouts.jsonl"
    log.write_text("".join(e.to_json() + "\n" for e in episodes()), encoding="utf-8")
    out = conductor("trace", str(log), "-o", str(tmp_path / "trace.html"))
    assert out.returncode == 0, out.stderr
    page = (tmp_path / "trace.html").read_text(encoding="utf-8")
    assert all(e.task_id in page for e in episodes())
    log.write_text(episodes()[0].to_json() + "\n{not json\n", encoding="utf-8")
    assert "rollouts.jsonl:2: not an episode" in user_error(
        conductor("trace", str(log), "-o", str(tmp_path / "b.html"))
    )
    assert "missing.jsonl" in user_error(conductor("trace", str(tmp_path / "missing.jsonl")))
    assert not (tmp_path / "b.html").exists()


def test_ask_refuses_an_empty_question():
    """An empty question is a clear error with exit code 2, not a traceback."""
    out = conductor("ask", "   ")
    assert out.returncode == 2 and "question is empty" in out.stderr
    assert "Traceback" not in out.stderr


def test_ask_refuses_a_missing_image(tmp_path):
    """A missing attachment is named in the error."""
    out = conductor("ask", "What is the plate?", "--image", str(tmp_path / "nope.jpg"))
    assert out.returncode == 2 and "nope.jpg: no such file" in out.stderr


def test_ask_reports_an_unreachable_tool_server(smollm2_path):
    """--tools-url pointing at nothing says so in one line with the fix, instead of hanging or crashing."""
    out = conductor(*ASK, "--tools-url", f"http://127.0.0.1:{unused_port()}", "--policy", str(smollm2_path))
    assert "unreachable" in user_error(out) and "conductor serve" in out.stderr


def test_reader_flags_that_cannot_work_are_one_line_each():
    """`ask` and `serve` check --reader-url before loading anything: nobody answering there, or --reader-model
    without it, is one line and exit code 2 (the flags' mapping itself: test_server_config, test_ask)."""
    nobody = f"http://127.0.0.1:{unused_port()}/v1"
    asked = conductor(*ASK, "--reader-url", nobody)
    assert f"--reader-url: no OpenAI-compatible endpoint answers at {nobody}/models" in user_error(asked)
    served = conductor("serve", "--port", str(unused_port()), "--reader-url", nobody)
    assert f"--reader-url: no OpenAI-compatible endpoint answers at {nobody}/models" in user_error(served)
    alone = conductor("serve", "--reader-model", "big")
    assert alone.returncode == 2 and "Invalid value for --reader-model" in alone.stderr, alone.stderr


def test_ask_without_a_prepared_model_says_how_to_prepare_it(tmp_path):
    """An empty $CONDUCTOR_HOME is one line naming `conductor models prepare`, exit code 2, no traceback."""
    out = conductor(*ASK, "--policy", "smollm2-135m-instruct", env={"CONDUCTOR_HOME": str(tmp_path)})
    assert "run `conductor models prepare`" in user_error(out) and out.stdout == ""


def one_turn(policy: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    """One real turn on the in-process tools (their built-in model loaded): the forced search call, sampled by a
    tiny random policy so that it takes seconds, not minutes."""
    return conductor(*ASK, "--policy", str(policy), "--require-call", *flags, timeout=600)


def test_ask_prints_the_episode_and_nothing_else(tiny_policy):
    """Without -v a real run (policy and tools in-process) prints no log line and no progress bar: stdout is the
    episode's JSON alone and stderr is empty."""
    out = one_turn(tiny_policy)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert len(json.loads(out.stdout)["turns"]) == 1


def test_ask_verbose_says_where_the_cold_start_went(tiny_policy):
    """-v prints one line splitting the seconds from start to the first policy turn; stdout stays pure JSON."""
    out = one_turn(tiny_policy, "-v")
    lines = [line for line in out.stderr.splitlines() if line.startswith("cold start:")]
    assert out.returncode == 0 and len(lines) == 1 and COLD_START.fullmatch(lines[0]), out.stderr
    assert json.loads(out.stdout)["stop_reason"] == "max_turns"


def test_ask_reports_a_model_that_cannot_be_found(tmp_path):
    """An unknown policy model is a clear error."""
    out = conductor("ask", "Who?", "--policy", str(tmp_path / "no-model"))
    assert out.returncode == 2 and "neither a built-in model" in out.stderr


def test_serve_rejects_an_unknown_config_key(tmp_path):
    """A typo in the server config is named, not silently ignored."""
    config = tmp_path / "server.toml"
    config.write_text("[page_qa]\nchunk_charz = 10\n")
    out = conductor("serve", "--config", str(config))
    assert out.returncode != 0 and "chunk_charz" in out.stderr


def test_serve_refuses_an_unsafe_bind_in_one_line(tmp_path):
    """Binding off loopback with no token is refused before anything is bound or loaded: one line on
    stderr naming the problem and the fix, exit code 2, no traceback."""
    config = tmp_path / "server.toml"
    config.write_text('[server]\ntoken_env = "CONDUCTOR_TEST_NO_SUCH_TOKEN"\n')
    out = conductor("serve", "--config", str(config), "--host", "0.0.0.0", "--port", str(unused_port()))
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert errors == [
        "error: refusing to bind 0.0.0.0: not loopback and no token; "
        "set $CONDUCTOR_TEST_NO_SUCH_TOKEN or token_file"
    ]


def test_train_names_a_bad_setting_without_a_traceback():
    """A training setting that cannot work is refused up front with the rule it breaks; a key of the old flat
    layout names its new place."""
    out = conductor("train", "--set", "sampling.backend=server")
    assert out.returncode == 2 and "needs a url" in out.stderr and "Traceback" not in out.stderr
    moved = conductor("train", "--set", "max_turns=4")
    assert moved.returncode == 2 and "rollout.max_turns" in moved.stderr and "Traceback" not in moved.stderr


def test_train_resume_without_a_checkpoint_says_so(tmp_path):
    """Resuming a folder that holds no checkpoint is a one-line error, not a traceback or a fresh run."""
    out = conductor("train", "--resume", str(tmp_path))
    assert out.returncode == 1 and "no checkpoint to resume" in out.stderr and "Traceback" not in out.stderr


def test_models_list_shows_the_builtin_model():
    """`models list` names the built-in model and whether it is prepared."""
    out = conductor("models", "list")
    assert out.returncode == 0 and "smollm2-135m-instruct" in out.stdout


@pytest.mark.slow
def test_serve_with_replicas_serves_the_real_tools_from_ray_serve(smollm2_path, tmp_path):
    """`conductor serve --replicas 2` runs the real tool server (every sub-agent's model loaded in each replica)
    behind one loopback port: it lists the four tools with a replica named on each answer, and SIGTERM stops
    it (and its local Ray cluster) cleanly (SIGINT may be ignored here: pytest run as a background job)."""
    import signal

    import httpx

    pytest.importorskip("ray", reason="Ray is the optional extra `distributed`")
    port = unused_port()
    args = [sys.executable, "-m", "app.cli", "serve", "--replicas", "2", "--port", str(port)]
    log = (tmp_path / "stderr").open("w")  # a file, not a pipe: nothing reads stderr while this waits
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        # The ready line is printed once Serve runs the app and /health answers (EOF: it died). Ray's driver
        # prints the raylet's error messages to stdout as well, whatever log_to_driver says, so lines before
        # it are Ray's own.
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if "replicas on Ray Serve" in line:
                break
        assert seen and "2 replicas on Ray Serve" in seen[-1], (seen, proc.poll())
        answer = httpx.get(f"http://127.0.0.1:{port}/v1/tools", timeout=60)
        assert answer.status_code == 200 and len(answer.json()) == 4
        assert answer.headers["x-conductor-replica"]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)
        log.close()
    assert proc.returncode == 0, (tmp_path / "stderr").read_text()[-2000:]
