"""``config.json`` helpers shared by the Hugging Face adapters (``models/common/hf_adapter.py``):
the mismatch error, one compared field, the RoPE settings in either transformers format, and
value equality as the config check means it."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["ConfigField", "HFConfigMismatch", "rope_config", "same_value"]


class HFConfigMismatch(ValueError):
    """A ``config.json`` that does not describe the chosen model/flavor. ``mismatches`` holds
    ``(field, config.json value, our value)`` for every field that differs; the message names
    them all on one line, with the fix."""

    def __init__(self, message: str, mismatches: list[tuple[str, Any, Any]] | None = None) -> None:
        super().__init__(message)
        self.mismatches = list(mismatches or [])


# ---------------------------------------------------------------------------------------------
# config.json helpers shared by the model adapters


@dataclass(frozen=True)
class ConfigField:
    """One compared ``config.json`` field: its name there, its value there, ours, the name of
    our field (for the message) and whether it is a shape (what :meth:`infer_flavor` uses)."""

    field: str
    theirs: Any
    ours: Any
    our_name: str
    shape: bool = True


def rope_config(config: Mapping[str, Any]) -> tuple[float | None, dict[str, Any] | None]:
    """``(rope_theta, scaling)`` from a ``config.json`` in either format: transformers < 5
    (``rope_theta`` + ``rope_scaling``) or >= 5 (``rope_parameters`` with ``rope_theta`` and
    ``rope_type`` inside). ``scaling`` is None for plain RoPE, else a dict with ``rope_type``."""
    params = config.get("rope_parameters")
    theta = config.get("rope_theta")
    scaling = config.get("rope_scaling")
    if isinstance(params, Mapping):
        theta = params.get("rope_theta", theta)
        scaling = dict(params)
    if not isinstance(scaling, Mapping):
        return theta, None
    scaling = dict(scaling)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type in (None, "default"):
        return theta, None
    scaling["rope_type"] = rope_type
    scaling.pop("type", None)
    scaling.pop("rope_theta", None)
    return theta, scaling


def same_value(a: Any, b: Any) -> bool:
    """Equality for config values: floats compare with a relative 1e-9 (JSON round trips of
    decimal literals are exact, but a value may come in as int or float)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0)
    return a == b
