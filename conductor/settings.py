"""Settings: TOML tables -> frozen dataclasses, checked key by key; bigger settings compose smaller ones as tables.

    cfg = load_settings(TrainConfig, Path("train.toml"), ["group_size=8", "rollout.max_turns=6"], moved=MOVED)

A dataclass field whose type is itself a dataclass is a table (`[rollout]`, `[credit.turn_rewards]`); every other
field is a key of its table. A field declared with `shared(...)` holds settings several configs share (the policy,
the tasks, the seed: `training.config.RunSettings`): declared once, each config with its own defaults, and their
keys sit in the config's own table, as if declared there (`split = "dev"`, read as `cfg.run.split`). Rules, the
same for every settings class of the project:
- Unknown keys are errors naming the key and the valid ones: a typo must never fall back to a default.
- A key that moved (an old flat key, say) is an error naming its new place, from the `moved` map the loader is
  given (`{"max_turns": "rollout.max_turns"}`).
- Types are checked, not coerced: a string is no number and an integer no boolean (an integer is accepted where a
  float is expected). TOML arrays become tuples (the dataclasses are frozen); strings become `Path` where the
  field is a path; TOML has no null, so optional fields are simply left out (`to_dict` writes None, read back).
- `key=value` overrides name nested keys with dots and read the value as TOML; a bare word that is not TOML
  (`task=plate_reading`, `run_dir=runs/x`) is kept as a string.

`to_dict` is the inverse of `build`: JSON-ready (paths as strings), so a run can store its settings and be
checked or rebuilt from them.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
import types
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

D = TypeVar("D")


class ConfigError(ValueError):
    """A settings file or override names a key that does not exist or gives a value of the wrong type."""


def load_settings(
    cls: type[D], path: Path | None, overrides: Sequence[str] = (), *, moved: Mapping[str, str] | None = None
) -> D:
    """Defaults, then the TOML file at `path` (if any), then `key=value` overrides; ConfigError on any problem."""
    return build(cls, read_settings(path, overrides), "the settings", moved=moved or {})


def read_settings(path: Path | None, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """The TOML file at `path` (none: an empty table) with `key=value` overrides written into it, unchecked: for a
    file whose tables are laid out unlike its dataclasses (the tool server's), which builds them itself."""
    data: dict[str, Any] = {}
    if path is not None:
        with path.open("rb") as file:
            data = tomllib.load(file)
    for text in overrides:
        key, value = parse_override(text)
        *tables, name = key.split(".")
        target = data
        for table in tables:
            target = target.setdefault(table, {})
            if not isinstance(target, dict):
                raise ConfigError(f"override {text!r}: {table} is not a table")
        target[name] = value
    return data


def parse_override(text: str) -> tuple[str, object]:
    """`"group_size=8"` -> ("group_size", 8). The value is read as a TOML value; a bare word that is not one
    (`task=plate_reading`, `run_dir=runs/x`) is kept as a string."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {text!r} is not key=value")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return key.strip(), value


def build(
    cls: type[D],
    table: Mapping[str, Any],
    section: str,
    *,
    moved: Mapping[str, str] | None = None,
    base: D | None = None,
) -> D:
    """An instance of dataclass `cls` from a table: keys and types checked, nested dataclasses built from
    sub-tables. Keys left out keep `base`'s values (default: the class's defaults); a sub-table starts from its
    field's own default, so an evaluation's greedy `[sampling]` stays greedy when only its backend is set.
    `moved` maps dotted old keys to their new dotted place; `section` names the table in errors."""
    moved = moved or {}
    hints = get_type_hints(cls)
    check_keys(table, keys_of(cls), section, moved=moved)
    values: dict[str, Any] = {}
    for spec in dataclasses.fields(cls):  # type: ignore[arg-type]
        key, hint = spec.name, hints[spec.name]
        start = getattr(base, key) if base is not None else _default(spec)
        if _is_shared(spec):  # its keys sit in this table
            own = {k: v for k, v in table.items() if k in keys_of(hint)}
            values[key] = build(hint, own, section, base=start)
        elif key not in table:
            continue
        elif _is_settings(hint):
            sub = sub_table(table, key, section, moved=moved)
            values[key] = build(hint, sub, _sub(section, key), moved=_nested(moved, key), base=start)
        else:
            values[key] = coerce(table[key], hint, f"{section} {key}" if section != "the settings" else key)
    try:
        return dataclasses.replace(base, **values) if base is not None else cls(**values)  # type: ignore[type-var]
    except (TypeError, ValueError) as exc:  # a dataclass's own checks (__post_init__) on the values given
        raise ConfigError(f"{section}: {exc}") from exc


def shared(factory: Callable[[], D]) -> D:
    """A field of settings several configs share, with this config's defaults (`shared(lambda:
    RunSettings(split="dev"))`): its keys sit in the config's own table, as if declared there."""
    return dataclasses.field(default_factory=factory, metadata={"shared": True})


def keys_of(cls: type) -> list[str]:
    """The keys a table of `cls` may hold: its fields, with a shared field's keys in place of its name."""
    hints = get_type_hints(cls)
    fields = dataclasses.fields(cls)
    return [k for f in fields for k in (keys_of(hints[f.name]) if _is_shared(f) else [f.name])]


def check_keys(
    table: Mapping[str, Any], valid: Sequence[str], section: str, *, moved: Mapping[str, str] | None = None
) -> None:
    """ConfigError for the first key of `table` not in `valid`, naming it and the valid ones (or, if it moved,
    its new place)."""
    for key in table:
        if key not in valid:
            raise ConfigError(_unknown(key, list(valid), section, moved or {}))


def sub_table(
    table: Mapping[str, Any], key: str, section: str, *, moved: Mapping[str, str] | None = None
) -> Mapping[str, Any]:
    """`table[key]`, which must be a table; an empty one when it is left out."""
    value = table.get(key, {})
    if not isinstance(value, Mapping):
        raise ConfigError(_not_table(key, value, section, moved or {}))
    return value


def _is_shared(spec: dataclasses.Field) -> bool:
    return bool(spec.metadata.get("shared"))


def _default(spec: dataclasses.Field) -> Any:
    """A field's default value (None when it has none: the table then starts from its class's defaults)."""
    if spec.default is not dataclasses.MISSING:
        return spec.default
    if spec.default_factory is not dataclasses.MISSING:
        return spec.default_factory()
    return None


def _is_settings(hint: Any) -> bool:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def _sub(section: str, key: str) -> str:
    return f"[{key}]" if section == "the settings" else f"[{section.strip('[]')}.{key}]"


def _nested(moved: Mapping[str, str], key: str) -> dict[str, str]:
    """The moved-key entries under table `key`, relative to it."""
    prefix = key + "."
    return {old[len(prefix) :]: new for old, new in moved.items() if old.startswith(prefix)}


def _unknown(key: str, valid: list[str], section: str, moved: Mapping[str, str]) -> str:
    if key in moved:
        return f"{key!r} in {section} has moved: set {moved[key]} instead ({_as_toml(moved[key])})"
    return f"unknown key {key!r} in {section}; valid keys: {', '.join(valid)}"


def _not_table(key: str, value: Any, section: str, moved: Mapping[str, str]) -> str:
    if key in moved:  # an old flat key whose name is now a table's, e.g. credit = "turn"
        return f"{key!r} in {section} is now a table: set {moved[key]} instead ({_as_toml(moved[key])})"
    return f"{_sub(section, key)} must be a table, got {value!r}"


def _as_toml(dotted: str) -> str:
    """How to write a dotted key in a TOML file: `rollout.max_turns` -> `max_turns = ... under [rollout]`."""
    *tables, name = dotted.split(".")
    return f"`{name} = ...` under [{'.'.join(tables)}]" if tables else f"`{name} = ...` at the top"


def coerce(value: Any, hint: Any, where: str) -> Any:
    """`value` checked against `hint` and converted where TOML cannot express it (tuple, Path)."""
    origin, args = get_origin(hint), get_args(hint)
    if value is None and type(None) in args:  # an optional field written back by `to_dict`
        return None
    if origin in (Union, types.UnionType):
        errors = []
        for option in (a for a in args if a is not type(None)):
            try:
                return coerce(value, option, where)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError("; ".join(errors))
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{where}: {value!r} is not one of {', '.join(map(repr, args))}")
        return value
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{where}: expected an array, got {value!r}")
        item = args[0] if args else Any
        return tuple(coerce(v, item, where) for v in value)
    return _coerce_scalar(value, hint, where)


def _coerce_scalar(value: Any, hint: Any, where: str) -> Any:
    if hint is Path and isinstance(value, str):
        return Path(value)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float, str, bool, Path) and type(value) is not hint:
        raise ConfigError(f"{where}: expected {hint.__name__}, got {value!r}")
    return value


def check_range(name: str, value: float, low: float, high: float) -> None:
    """ValueError unless `value` is a finite number in [low, high]: for a dataclass's `__post_init__`, whose
    ValueError `build` reports as a ConfigError naming the table. TOML and JSON can spell nan and inf."""
    if not (math.isfinite(value) and low <= value <= high):
        raise ValueError(f"{name} must be a finite number from {low:g} to {high:g}, got {value!r}")


def to_dict(cfg: Any) -> dict[str, Any]:
    """JSON-ready settings (paths as strings, tuples as lists, tables as dicts, a shared field's keys in its
    config's own table); `build` reads them back."""
    out: dict[str, Any] = {}
    for spec in dataclasses.fields(cfg):
        value = _plain(getattr(cfg, spec.name))
        if _is_shared(spec):
            out.update(value)
        else:
            out[spec.name] = value
    return out


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return to_dict(value)
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    return value
