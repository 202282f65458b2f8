"""Writing a job config back as TOML: a minimal writer for one level of tables of scalars and
lists (what :meth:`trainer.config.schema.JobConfig.to_toml` and ``train.py``'s resolved config
use). Imports nothing from the rest of the config package."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["dump_toml"]


def _toml_scalar(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)  # always has '.', 'e' or both, which TOML requires of floats
    if isinstance(v, str):
        out = []
        for ch in v:
            if ch == "\\":
                out.append("\\\\")
            elif ch == '"':
                out.append('\\"')
            elif ch == "\n":
                out.append("\\n")
            elif ch == "\t":
                out.append("\\t")
            elif ord(ch) < 0x20 or ord(ch) == 0x7F:
                out.append(f"\\u{ord(ch):04x}")
            else:
                out.append(ch)
        return '"' + "".join(out) + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_scalar(x) for x in v) + "]"
    if isinstance(v, dict):  # an inline table ([[optimizer.param_groups]], [[training.sources]]); bare-word keys
        return "{" + ", ".join(f"{k} = {_toml_scalar(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {type(v).__name__} value {v!r} as TOML")


def dump_toml(data: dict[str, dict[str, Any]], header: str = "") -> str:
    """Minimal writer for one level of tables of scalars/lists; None values are omitted
    (TOML has no null) and therefore fall back to their default when read back."""
    lines = [f"# {header}"] if header else []
    for section, values in data.items():
        if lines:
            lines.append("")
        lines.append(f"[{section}]")
        for key, value in values.items():
            if value is None:
                lines.append(f"# {key} = none (unset)")
            else:
                lines.append(f"{key} = {_toml_scalar(value)}")
    return "\n".join(lines) + "\n"
