"""The one helper every config section declares its keys with (imports nothing else of the
config package, so :mod:`trainer.config.schema` and :mod:`trainer.config.optim_schema` share it)."""

from __future__ import annotations

from dataclasses import field
from typing import Any

__all__ = ["opt"]


def opt(default: Any, help: str, *, choices: tuple | None = None) -> Any:
    """Field with help text and, for enums, the legal values.

    Mutable defaults are copied per instance so two configs never share a list.
    """
    metadata = {"help": help, "choices": choices}
    if isinstance(default, list):
        return field(default_factory=lambda d=default: list(d), metadata=metadata)
    return field(default=default, metadata=metadata)
