"""Reading a job config (TOML file, then ``--section.key value`` overrides, typed and checked
key by key with suggestions for misspelled keys); writing one back as TOML is
:mod:`trainer.config.toml_writer`.

The parser is hand-written (rather than argparse/tyro) so that misspelled keys fail loudly
instead of being silently ignored.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import types
import typing
from typing import Any

from trainer.config.errors import ConfigError
from trainer.config.eval_section import validate_eval
from trainer.config.fields import did_you_mean, nearest, source_entries
from trainer.config.optim_schema import TABLE_KEYS
from trainer.config.schema import (
    ALIASES,
    CONFIG_DIR,
    PARALLELISM_ALIASES,
    SECTIONS,
    JobConfig,
)
from trainer.config.validate import validate_config

try:  # Python >= 3.11
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - exercised only on Python < 3.11
    import tomli as tomllib


# ------------------------------------------------------------------ typed coercion

# `Optional[X]` and `X | None` have different origins (typing.Union vs types.UnionType)
_UNION_ORIGINS = (typing.Union, types.UnionType)
_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}
_TYPE_NAMES = {int: "an int", float: "a float", bool: "a bool (true/false)", str: "a string"}
_LIST_NAMES = {int: "ints", float: "floats", bool: "bools", str: "strings", dict: "kind:weight:path items"}


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is list:
        (inner,) = typing.get_args(tp)
        if inner is dict:
            return "an array of tables (on the command line: [{key = value, ...}, ...])"
        return f"a comma-separated list of {_LIST_NAMES[inner]}"
    if origin in _UNION_ORIGINS:
        inner = [a for a in typing.get_args(tp) if a is not type(None)][0]
        return f"{_TYPE_NAMES[inner]} or none"
    return _TYPE_NAMES[tp]


def _coerce(key: str, tp: Any, value: Any, from_cli: bool) -> Any:
    """Convert a TOML value or a CLI string to the field type, or raise a ConfigError."""

    def bad() -> ConfigError:
        return ConfigError(f"{key} expects {_describe(tp)}, got {value!r}")

    origin = typing.get_origin(tp)
    if origin in _UNION_ORIGINS:  # Optional[X], X | None
        inner = [a for a in typing.get_args(tp) if a is not type(None)][0]
        if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null", "")):
            return None
        try:
            return _coerce(key, inner, value, from_cli)
        except ConfigError:
            raise bad() from None
    if origin is list and typing.get_args(tp) == (dict,):
        if key in TABLE_KEYS:  # [[optimizer.param_groups]]
            return _coerce_tables(key, value, from_cli, bad)
        return source_entries(key, value)  # [[training.sources]]
    if origin is list:
        (inner,) = typing.get_args(tp)
        if isinstance(value, str):
            items = [v.strip() for v in value.split(",")] if value.strip() else []
            return [_coerce(key, inner, v, True) for v in items]
        if not isinstance(value, (list, tuple)):
            raise bad()
        try:
            return [_coerce(key, inner, v, from_cli) for v in value]
        except ConfigError:
            raise bad() from None
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and from_cli and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        raise bad()
    if tp is int:
        if isinstance(value, bool):
            raise bad()
        if isinstance(value, int):
            return value
        if isinstance(value, str) and from_cli:
            try:
                return int(value.strip())
            except ValueError:
                raise bad() from None
        raise bad()
    if tp is float:
        if isinstance(value, bool):
            raise bad()
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str) and from_cli:
            try:
                return float(value.strip())
            except ValueError:
                raise bad() from None
        raise bad()
    if tp is str:
        if isinstance(value, str):
            return value
        # selective_ac_option = 2 in TOML is natural to write; keep the field a string.
        if isinstance(value, int) and not isinstance(value, bool) and key.endswith("selective_ac_option"):
            return str(value)
        raise bad()
    raise TypeError(f"unsupported config field type {tp!r} for {key}")  # programming error


def _coerce_tables(key: str, value: Any, from_cli: bool, bad: Any) -> list[dict[str, Any]]:
    """An array of tables (``[[optimizer.param_groups]]``): each table's keys checked against
    :data:`TABLE_KEYS` (a misspelled key fails with a suggestion) and its values converted. On
    the command line the value is a TOML array of inline tables."""
    if isinstance(value, str) and from_cli:
        try:
            value = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{key} expects a TOML array of inline tables, e.g. [{{pattern = 'x'}}]: {e}") from None
    if not isinstance(value, (list, tuple)) or not all(isinstance(t, dict) for t in value):
        raise bad()
    spec = TABLE_KEYS[key]
    out = []
    for i, table in enumerate(value):
        item = {}
        for k, v in table.items():
            if k not in spec:
                hint = did_you_mean(k, list(spec), listing=f"valid keys: {', '.join(spec)}")
                raise ConfigError(f"unknown key '{k}' in {key}[{i}]; {hint}")
            item[k] = _coerce(f"{key}[{i}].{k}", spec[k], v, from_cli=False)
        out.append(item)
    return out


# --------------------------------------------------------------------- key lookup


def _all_keys() -> list[str]:
    return [f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)] + [
        f"{s}.{a}" for s, al in ALIASES.items() for a in al
    ]


def _leaf_hint(name: str, prefix: str = "") -> str:
    """Suggest section.key for a key given without its section."""
    keys = _all_keys()
    leaf, _close = nearest(name, [k.split(".", 1)[1] for k in keys])
    full = [k for k in keys if leaf is not None and k.endswith("." + leaf)]
    return f"; did you mean '{prefix}{full[0]}'?" if full else ""


# torchtitan 0.2.2 nests the float8 keys as [quantize.linear.float8] and
# [quantize.grouped_mm.float8]; ours are [float8] (the nested section's key renames beside it)
_NESTED_SECTIONS = {
    "quantize.linear.float8": ("float8", {}),
    "quantize.grouped_mm.float8": ("float8", {"fqns": "moe_fqns"}),
}


def _flatten(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in values.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def _resolve_key(section: str, key: str) -> tuple[str, str]:
    """Map (section, key or alias) to the canonical pair, or raise with a suggestion."""
    if section not in SECTIONS and "." in key:
        nested, _, leaf = f"{section}.{key}".rpartition(".")
        if nested in _NESTED_SECTIONS:
            section, renames = _NESTED_SECTIONS[nested]
            key = renames.get(leaf, leaf)
    if section not in SECTIONS:
        best, close = nearest(section, list(SECTIONS))
        hint = f"did you mean '{best}.{key}'?"
        if not close:  # the key may name the section better than the misspelled section does
            leaf = _leaf_hint(key)
            hint = leaf[2:] if leaf else f"{hint} (valid sections: {', '.join(SECTIONS)})"
        raise ConfigError(f"unknown section '{section}'; {hint}")
    key = ALIASES.get(section, {}).get(key, key)
    names = [f.name for f in dataclasses.fields(SECTIONS[section])]
    if key not in names:
        candidates = names + list(ALIASES.get(section, {}))
        hint = did_you_mean(key, candidates, f"{section}.", listing=f"valid keys in [{section}]: {', '.join(names)}")
        raise ConfigError(f"unknown key '{section}.{key}'; {hint}")
    return section, key


def _set(cfg: JobConfig, section: str, key: str, value: Any, from_cli: bool) -> None:
    section, key = _resolve_key(section, key)
    tp = _field_types(SECTIONS[section])[key]
    setattr(getattr(cfg, section), key, _coerce(f"{section}.{key}", tp, value, from_cli))


def apply_mapping(cfg: JobConfig, data: dict[str, Any], source: str) -> None:
    for section, values in data.items():
        if not isinstance(values, dict):
            raise ConfigError(
                f"{source}: top-level key '{section}' must be inside a [section] table{_leaf_hint(section)}"
            )
        if section not in SECTIONS:  # a nested alias such as [quantize.linear.float8]
            values = _flatten(values)
        for key, value in values.items():
            _set(cfg, section, key, value, from_cli=False)


# ------------------------------------------------------------------------ loading


def config_from_dict(data: dict[str, Any]) -> JobConfig:
    """Build and validate a config from a nested ``{section: {key: value}}`` mapping (e.g. TOML)."""
    cfg = JobConfig()
    apply_mapping(cfg, data, source="config")
    validate_config(cfg)
    validate_eval(cfg)
    return cfg


def resolve_config_path(path: str) -> str:
    """Find a config: as given, else a bare name (with or without .toml) in train_configs/."""
    candidates = [path]
    if os.sep not in path and "/" not in path:
        candidates.append(os.path.join(CONFIG_DIR, path))
        if not path.endswith(".toml"):
            candidates.append(os.path.join(CONFIG_DIR, path + ".toml"))
    for c in candidates:
        if os.path.isfile(c):
            return c
    available = sorted(f for f in os.listdir(CONFIG_DIR) if f.endswith(".toml")) if os.path.isdir(CONFIG_DIR) else []
    raise ConfigError(
        f"config file '{path}' not found (looked at: {', '.join(candidates)}); "
        f"pass a path or one of the shipped configs: {', '.join(available) or 'none'}"
    )


def load_toml(path: str) -> dict[str, Any]:
    with open(path, "rb") as f:
        try:
            return tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path} is not valid TOML: {e}") from None


def load_config(argv: list[str] | None = None) -> JobConfig:
    """Defaults < ``--config FILE`` < ``--section.key value`` overrides, then validate.

    ``argv`` excludes the program name (defaults to ``sys.argv[1:]``). ``-h``/``--help``
    prints every key with its default and exits.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    config_path: str | None = None
    overrides: list[tuple[str, str, Any]] = []  # (arg as typed, dotted key, raw value)
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help"):
            print(format_help())
            raise SystemExit(0)
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument '{arg}'; options look like --section.key value")
        name, eq, value = arg[2:].partition("=")
        if not eq:
            has_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
            value = argv[i + 1] if has_value else None
            i += 1 if has_value else 0
        i += 1
        if name in ("config", "job.config_file"):
            if value is None:
                raise ConfigError("--config needs a path, e.g. --config llama3.toml")
            config_path = value
            continue
        if "." not in name:
            hint = _leaf_hint(name, prefix="--") or "; options look like --section.key value"
            raise ConfigError(f"unknown option '--{name}'{hint}")
        overrides.append((arg, name, value))

    cfg = JobConfig()
    if config_path is not None:
        resolved = resolve_config_path(config_path)
        apply_mapping(cfg, load_toml(resolved), source=resolved)
    for _arg, name, value in overrides:
        section, key = name.split(".", 1)
        section_c, key_c = _resolve_key(section, key)
        tp = _field_types(SECTIONS[section_c])[key_c]
        if value is None:
            if tp is not bool:
                raise ConfigError(f"--{section_c}.{key_c} needs a value ({_describe(tp)})")
            value = "true"
        _set(cfg, section_c, key_c, value, from_cli=True)
    validate_config(cfg)
    validate_eval(cfg)  # [eval] (trainer/config/eval_section.py)
    return cfg


def format_help() -> str:
    lines = ["usage: train.py [--config FILE] [--section.key VALUE ...]", ""]
    for section, cls in SECTIONS.items():
        lines.append(f"[{section}]")
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            choices = f.metadata.get("choices")
            extra = f" (one of: {', '.join(map(str, choices))})" if choices else ""
            lines.append(f"  --{section}.{f.name} = {default!r}{extra}\n      {f.metadata.get('help', '')}")
        lines.append("")
    lines.append("aliases: " + ", ".join(f"--parallelism.{a} -> {k}" for a, k in PARALLELISM_ALIASES.items()))
    return "\n".join(lines)
