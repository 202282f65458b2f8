"""The offline tokenizer's user error."""

from __future__ import annotations


class BadInput(ValueError):
    """An input, option or output folder the tokenizer cannot work with (one line, exit 2)."""
