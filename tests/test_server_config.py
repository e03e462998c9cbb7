"""Loading the tool server's TOML config: sections, defaults, and errors that name the bad key."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from conductor.models import DEFAULT_READER
from conductor.settings import ConfigError
from subagents import SUBAGENTS
from subagents.llm import BackendConfig
from subagents.spans import RULES
from tool_server.config import ServerConfig, ToolLimits, load_config, parse_config, reader_overrides


def test_no_file_means_defaults() -> None:
    """Without a file every sub-agent runs on the default reader (one model in memory), and the server binds
    loopback."""
    cfg = load_config(None)
    assert cfg == ServerConfig()
    assert cfg.host == "127.0.0.1"
    assert cfg.tools["page_qa"].model == BackendConfig(model=DEFAULT_READER)
    assert {cfg.tools[n].model.model for n in SUBAGENTS} == {DEFAULT_READER}


def test_a_page_qa_model_table_starts_from_the_default_reader(tmp_path: Path) -> None:
    """`[page_qa.model]` keys change what they name and keep the rest of the default reader's settings (its
    model); so does another tool's table, from that tool's default (the same reader)."""
    path = tmp_path / "server.toml"
    path.write_text("[page_qa.model]\nmax_new_tokens = 32\n[video_summary.model]\nmax_new_tokens = 64\n")
    cfg = load_config(path)
    assert cfg.tools["page_qa"].model == BackendConfig(model=DEFAULT_READER, max_new_tokens=32)
    assert cfg.tools["video_summary"].model == BackendConfig(model=DEFAULT_READER, max_new_tokens=64)


def test_toml_sections_fill_typed_fields(tmp_path: Path) -> None:
    """[server], [fetch], [cache] and per-tool sections land in their dataclasses; arrays become tuples."""
    path = tmp_path / "server.toml"
    path.write_text(
        '[server]\nport = 9000\nallowed_hosts = ["box:9000"]\n'
        '[fetch]\nallow_private_cidrs = ["127.0.0.0/8"]\n'
        '[cache]\ndirectory = "cache-dir"\nmax_entries = 5\n'
        '[page_qa.model]\nbackend = "openai"\nmodel = "served"\nbase_url = "http://127.0.0.1:8000/v1"\n'
        "[page_qa.limits]\nmax_concurrency = 2\nqueue_timeout_s = 5\n"
        '[search]\ncorpus_dir = "docs"\n'
    )
    cfg = load_config(path)
    assert (cfg.port, cfg.allowed_hosts) == (9000, ("box:9000",))
    assert cfg.fetch.allow_private_cidrs == ("127.0.0.0/8",)
    assert (cfg.cache.directory, cfg.cache.max_entries) == (Path("cache-dir"), 5)
    assert (cfg.tools["page_qa"].model.backend, cfg.tools["page_qa"].model.model) == ("openai", "served")
    assert cfg.tools["page_qa"].limits == ToolLimits(max_concurrency=2, queue_timeout_s=5.0)
    assert cfg.tools["search"].config.corpus_dir == "docs"
    assert cfg.tools["image_ops"].model == BackendConfig(model=DEFAULT_READER)


@pytest.mark.parametrize(
    ("data", "named"),
    [
        ({"server": {"prot": 1}}, "'prot' in [server]; valid keys: host, port"),
        ({"page_qa": {"model": {"modle": "x"}}}, "'modle' in [page_qa.model]"),
        ({"page_qa": {"limits": {"max_conc": 1}}}, "'max_conc' in [page_qa.limits]"),
        ({"pageqa": {}}, "'pageqa' in the settings; valid keys: server, files, fetch, cache, page_qa"),
        ({"search": {"top_k": 3}}, "'top_k' in [search]"),
    ],
)
def test_unknown_keys_are_named_with_the_valid_ones(data: dict[str, Any], named: str) -> None:
    """A typo is an error naming the key and what is valid, never a silent default."""
    with pytest.raises(ConfigError, match="unknown key") as info:
        parse_config(data)
    assert named in str(info.value)


@pytest.mark.parametrize(
    "data",
    [
        {"server": {"port": "8700"}},
        {"page_qa": {"model": {"backend": "llamacpp"}}},
        {"fetch": {"allow_private_cidrs": "127.0.0.0/8"}},
        {"cache": {"enabled": 1}},
    ],
)
def test_wrong_value_types_are_refused(data: dict[str, Any]) -> None:
    """A value of the wrong type or outside a Literal fails at load time, naming the field."""
    with pytest.raises(ConfigError):
        parse_config(data)


def test_example_config_loads() -> None:
    """examples/server.toml is a valid, complete example."""
    path = Path(__file__).resolve().parent.parent / "examples" / "server.toml"
    cfg = load_config(path)
    assert cfg.host == "127.0.0.1"


@pytest.mark.parametrize(
    ("data", "new_place"),
    [
        ({"fetch": {"allow_file_roots": ["/data"]}}, "files.roots"),
        ({"image_ops": {"allowed_roots": ["/data"]}}, "files.roots"),
        ({"video_summary": {"allowed_roots": ["/data"]}}, "files.roots"),
    ],
)
def test_moved_keys_name_their_new_place(data: dict[str, Any], new_place: str) -> None:
    """The three readable-folder settings of earlier versions are one now: loading an old one says where."""
    with pytest.raises(ConfigError, match=f"has moved: set {new_place}"):
        parse_config(data)
    assert parse_config({"files": {"roots": ["/data"]}}).files.roots == ("/data",)


def test_tool_sections_come_from_the_subagents_dict(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sub-agent added to SUBAGENTS brings its own [name], [name.model] and [name.limits] sections; nothing
    else in the server lists tools by name."""
    import dataclasses
    from types import SimpleNamespace

    from tool_server import config

    @dataclasses.dataclass(frozen=True)
    class EchoConfig:
        loud: bool = False

    echo = SimpleNamespace(NAME="echo", Config=EchoConfig)
    monkeypatch.setattr(config, "SUBAGENTS", {**SUBAGENTS, "echo": echo})
    cfg = config.parse_config({"echo": {"loud": True, "limits": {"max_concurrency": 1}}})
    assert cfg.tools["echo"].config == EchoConfig(loud=True)
    assert cfg.tools["echo"].limits.max_concurrency == 1
    assert set(cfg.tools) == {*SUBAGENTS, "echo"}


@pytest.mark.parametrize(
    ("data", "named"),
    [
        ({"server": {"request_timeout_s": float("nan")}}, "request_timeout_s"),
        ({"server": {"keep_alive_s": float("inf")}}, "keep_alive_s"),
        ({"server": {"max_connections": 0}}, "max_connections"),
        ({"server": {"max_connections": 100, "max_connections_per_peer": 200}}, "max_connections_per_peer"),
        ({"page_qa": {"limits": {"queue_timeout_s": float("nan")}}}, "queue_timeout_s"),
        ({"search": {"limits": {"max_concurrency": 0}}}, "max_concurrency"),
        ({"image_ops": {"model": {"batch_wait_ms": float("nan")}}}, "batch_wait_ms"),
    ],
)
def test_numbers_out_of_range_or_not_finite_are_config_errors(data: dict[str, Any], named: str) -> None:
    """NaN, infinities (TOML spells both) and out-of-range limits are ConfigErrors naming the key, at start-up
    as in a hot swap: no setting may leave the server unable to answer."""
    with pytest.raises(ConfigError, match=named):
        parse_config(data)


OPENAI = {"backend": "openai", "model": "served", "base_url": "http://127.0.0.1:8000/v1"}


@pytest.mark.parametrize(
    ("data", "named"),
    [
        ({"page_qa": {"model": {**OPENAI, "base_url": "http://127.0.0.1:8000/v1\r"}}}, "control characters"),
        ({"page_qa": {"model": {**OPENAI, "base_url": "ftp://127.0.0.1/v1"}}}, "http:// or https://"),
        ({"page_qa": {"model": {**OPENAI, "api_key_env": "HOME"}}}, "'HOME' is not one of"),
        ({"server": {"allowed_api_key_envs": ["CONDUCTOR_TOKEN"]}}, "must not hold token_env"),
    ],
)
def test_a_bad_base_url_or_an_unlisted_key_variable_is_a_config_error(
    data: dict[str, Any], named: str
) -> None:
    """A base_url with a control character or a scheme other than http(s), an api_key_env that [server]
    allowed_api_key_envs does not list, or a list holding the server's own token variable fail at start-up as a
    ConfigError saying which (before: accepted, to fail or leak a secret at the first call)."""
    with pytest.raises(ConfigError, match=named):
        parse_config(data)
    listed = parse_config(
        {
            "server": {"allowed_api_key_envs": ["MY_KEY"]},
            "page_qa": {"model": {**OPENAI, "api_key_env": "MY_KEY"}},
        }
    )
    assert listed.tools["page_qa"].model.api_key_env == "MY_KEY"


def test_overrides_reach_every_table_and_are_checked_like_the_file(tmp_path: Path) -> None:
    """`--set` works on the server's file as on every config: dotted keys reach [server], a tool's own table and
    its [<tool>.limits], and a typo in one is the same error as in the file."""
    path = tmp_path / "server.toml"
    path.write_text("[server]\nport = 9000\n")
    cfg = load_config(path, ["server.port=9001", "page_qa.top_k=3", "page_qa.limits.max_concurrency=2"])
    assert (cfg.port, cfg.tools["page_qa"].config.top_k, cfg.tools["page_qa"].limits.max_concurrency) == (
        9001,
        3,
        2,
    )
    with pytest.raises(ConfigError, match="unknown key 'prot' in \\[server\\]; valid keys: host, port"):
        load_config(path, ["server.prot=1"])


def test_the_reader_flags_are_page_qa_model_overrides(tmp_path: Path) -> None:
    """`--reader-url URL --reader-model NAME` is `[page_qa.model] backend = "openai"` with that base_url and model:
    page_qa's own settings and every other tool are as without them, and the flags win over the file;
    `--reader-model NAME` alone is the built-in model NAME in process."""
    url = "http://127.0.0.1:8000/v1"
    cfg = load_config(None, reader_overrides(url, "Qwen/Qwen2.5-1.5B-Instruct"))
    reader = BackendConfig(backend="openai", base_url=url, model="Qwen/Qwen2.5-1.5B-Instruct")
    default = ServerConfig()
    page_qa = dataclasses.replace(default.tools["page_qa"], model=reader)
    assert cfg == dataclasses.replace(default, tools={**default.tools, "page_qa": page_qa})
    path = tmp_path / "server.toml"
    path.write_text(
        '[page_qa]\nanswer_mode = "align"\n[page_qa.model]\nbackend = "vllm"\nmax_new_tokens = 32\n'
    )
    from_file = load_config(path, reader_overrides(url, "m")).tools["page_qa"]
    assert from_file.config.answer_mode == "align"  # "align" generates: any backend answers it
    assert from_file.model == BackendConfig(backend="openai", base_url=url, model="m", max_new_tokens=32)
    builtin = load_config(None, reader_overrides(None, "smollm2-135m-instruct")).tools["page_qa"]
    assert builtin.model == BackendConfig(model="smollm2-135m-instruct")  # in process, by its built-in name
    assert builtin.config.extract == RULES["smollm2-135m-instruct"]  # with the rule chosen for it
    with pytest.raises(ValueError, match="'big' is not a built-in model; built in: smollm2-135m-instruct"):
        reader_overrides(None, "big")
