"""conductor.settings: TOML tables -> frozen dataclasses, strict types, composed tables, moved keys, round trip."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from conductor.settings import ConfigError, build, load_settings, parse_override, shared, to_dict


@dataclass(frozen=True)
class Inner:
    depth: int = 1
    """A knob of the inner table."""
    mode: Literal["a", "b"] = "a"
    """A closed set of choices."""


@dataclass(frozen=True)
class Outer:
    name: str = "x"
    ratio: float = 0.5
    folder: Path | None = None
    tags: tuple[str, ...] = ()
    inner: Inner = field(default_factory=Inner)

    def __post_init__(self) -> None:
        if self.ratio > 1:
            raise ValueError(f"ratio must be <= 1, got {self.ratio}")


MOVED = {"depth": "inner.depth", "inner.old": "inner.mode"}


def test_tables_compose_and_values_take_their_types(tmp_path: Path) -> None:
    """A nested dataclass is a TOML table; arrays become tuples, strings Paths, ints floats where declared."""
    path = tmp_path / "s.toml"
    path.write_text('name = "y"\nratio = 1\nfolder = "runs/a"\ntags = ["p", "q"]\n[inner]\ndepth = 3\n')
    cfg = load_settings(Outer, path)
    assert cfg == Outer("y", 1.0, Path("runs/a"), ("p", "q"), Inner(3, "a"))


def test_overrides_reach_into_tables_and_read_toml_values() -> None:
    """`inner.depth=4` sets a nested key; a bare word that is not TOML stays a string."""
    cfg = load_settings(Outer, None, ["inner.depth=4", "name=plain_word", 'inner.mode="b"'])
    assert (cfg.inner, cfg.name) == (Inner(4, "b"), "plain_word")
    assert parse_override("tags=['a']") == ("tags", ["a"])
    with pytest.raises(ConfigError, match="not key=value"):
        parse_override("novalue")


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"nmae": "y"}, "unknown key 'nmae' in the settings; valid keys: name, ratio"),
        ({"inner": {"deep": 1}}, "unknown key 'deep' in [inner]; valid keys: depth, mode"),
        ({"ratio": "0.5"}, "ratio: expected float, got '0.5'"),
        ({"inner": {"depth": True}}, "expected int, got True"),
        ({"inner": {"mode": "c"}}, "'c' is not one of 'a', 'b'"),
        ({"inner": 3}, "[inner] must be a table"),
        ({"tags": "p"}, "expected an array"),
        ({"ratio": 2.0}, "ratio must be <= 1"),
    ],
)
def test_mistakes_are_errors_that_say_what_is_wrong(data: dict, message: str) -> None:
    """A typo, a wrong type, a value outside a Literal or a class's own check: one ConfigError, never a
    silent default or a coerced value."""
    with pytest.raises(ConfigError) as info:
        build(Outer, data, "the settings")
    assert message in str(info.value)


def test_moved_keys_name_their_new_place() -> None:
    """A key that moved is an error naming where it lives now, also when its old name is now a table's."""
    with pytest.raises(ConfigError, match=r"'depth' in the settings has moved: set inner\.depth instead"):
        build(Outer, {"depth": 2}, "the settings", moved=MOVED)
    with pytest.raises(ConfigError, match=r"set inner\.mode instead"):
        build(Outer, {"inner": {"old": "a"}}, "the settings", moved=MOVED)
    with pytest.raises(ConfigError, match=r"'inner' in the settings is now a table"):
        build(Outer, {"inner": "b"}, "the settings", moved={"inner": "inner.mode"})


def test_to_dict_round_trips() -> None:
    """`to_dict` is JSON-ready (paths as strings, tuples as lists, None kept) and `build` reads it back."""
    cfg = Outer("z", 0.25, Path("/tmp/f"), ("a",), Inner(2, "b"))
    data = to_dict(cfg)
    assert data == {
        "name": "z",
        "ratio": 0.25,
        "folder": "/tmp/f",
        "tags": ["a"],
        "inner": {"depth": 2, "mode": "b"},
    }
    assert build(Outer, data, "the settings") == cfg
    assert build(Outer, to_dict(Outer()), "the settings") == Outer()


def test_a_table_starts_from_its_fields_default_not_its_class_default() -> None:
    """Setting one key of a table keeps the other keys of the field's own default: evaluation's greedy sampling
    stays greedy when only its backend is set (its class default would sample at temperature 1)."""
    from training.evaluate import load_eval_config

    @dataclass(frozen=True)
    class Deep:
        inner: Inner = field(default_factory=lambda: Inner(depth=7))

    assert build(Deep, {"inner": {"mode": "b"}}, "the settings") == Deep(Inner(7, "b"))
    cfg = load_eval_config(None, ["sampling.backend=transformers"])
    assert cfg.sampling.temperature == 0.0


@dataclass(frozen=True)
class Run:
    split: str = "train"
    limit: int | None = None


@dataclass(frozen=True)
class WithShared:
    run: Run = shared(lambda: Run(split="dev"))
    name: str = "x"
    inner: Inner = field(default_factory=Inner)


def test_a_shared_fields_keys_sit_in_its_configs_own_table() -> None:
    """Settings several configs share are declared once, yet written where users always wrote them: `limit = 3`
    at the top, not under [run]; each config keeps its own defaults; errors list the keys as written; `to_dict`
    writes them back flat."""
    cfg = build(WithShared, {"limit": 3, "name": "y", "inner": {"depth": 2}}, "the settings")
    assert cfg == WithShared(Run("dev", 3), "y", Inner(2))
    with pytest.raises(
        ConfigError, match="unknown key 'run' in the settings; valid keys: split, limit, name, inner"
    ):
        build(WithShared, {"run": {"limit": 3}}, "the settings")
    with pytest.raises(ConfigError, match="limit: expected int"):
        build(WithShared, {"limit": "3"}, "the settings")
    assert to_dict(cfg) == {"split": "dev", "limit": 3, "name": "y", "inner": {"depth": 2, "mode": "a"}}
    assert build(WithShared, to_dict(cfg), "the settings") == cfg


def test_train_eval_and_sft_share_one_declaration_of_the_run_settings() -> None:
    """policy, split, limit, data_dir and seed are one dataclass (RunSettings) in all three configs, set by the
    same keys as before; evaluation and SFT keep their own defaults; eval's old `n` names `limit`."""
    from training.config import RunSettings, load_train_config
    from training.evaluate import load_eval_config
    from training.sft import load_sft_config

    keys = ["policy=p", "split=test", "limit=5", "data_dir=d", "seed=7"]
    expected = RunSettings("p", "test", 5, Path("d"), 7)
    assert load_train_config(None, keys).run == load_eval_config(None, keys).run == expected
    assert load_sft_config(keys).run == expected
    assert (load_eval_config(None).run.split, load_eval_config(None).run.limit) == ("dev", 100)
    assert load_sft_config([]).run.limit == 16 and load_train_config(None).run == RunSettings()
    with pytest.raises(ConfigError, match="'n' in the settings has moved: set limit instead"):
        load_eval_config(None, ["n=5"])
