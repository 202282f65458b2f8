"""What the schema's fields are made of: the field helper every config section declares its
keys with (default, help, legal values: :mod:`trainer.config.schema` and
:mod:`trainer.config.optim_schema` share it), the shared choice tuples, and the entries of a data
mixture (``[[training.sources]]``). Imports nothing from the rest of the config package but its
error."""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from dataclasses import field
from typing import Any

from trainer.config.errors import ConfigError

__all__ = [
    "DATASETS",
    "SOURCE_KEYS",
    "TEXT_DOCUMENTS",
    "TOKENIZER_FILES",
    "did_you_mean",
    "nearest",
    "opt",
    "source_entries",
]

# what one document of a .txt file is (trainer/data/sources.py FileSource)
TEXT_DOCUMENTS = ("file", "blank_line", "line")
DATASETS = ("synthetic", "text", "jsonl", "tokens", "hf", "chat", "preference")
SOURCE_KEYS = ("path", "kind", "weight", "name")
# what a tokenizer folder holds, in the order model.tokenizer_path looks (trainer/data/tokenizer.py)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "original/tokenizer.model")


def _words(name: str) -> set[str]:
    return {w for w in re.split(r"[._\-]+", name.lower()) if w}


def nearest(name: str, candidates: Sequence[str]) -> tuple[str | None, bool]:
    """The candidate nearest ``name`` and whether it is close (difflib's ratio >= 0.6): else the
    one sharing the rarest words with it (``shard_degree`` -> ``data_parallel_shard_degree``),
    ties by that ratio. ``(None, False)`` when there are no candidates."""
    if not candidates:
        return None, False
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    if close:
        return close[0], True
    # a shared word counts by its rarity among the candidates ("degree" ends seven keys)
    words = _words(name)
    counts: dict[str, int] = {}
    for c in candidates:
        for w in _words(c):
            counts[w] = counts.get(w, 0) + 1

    def score(c: str) -> tuple[float, float]:
        shared = sum(1 / counts[w] for w in words & _words(c))
        return shared, difflib.SequenceMatcher(None, name.lower(), c.lower()).ratio()

    best = max(candidates, key=score)
    return best, False


def did_you_mean(name: str, candidates: Sequence[str], prefix: str = "", listing: str = "") -> str:
    """``did you mean 'PREFIX<nearest>'?``, followed by ``listing`` (the legal names) when the
    nearest is not close."""
    best, close = nearest(name, candidates)
    if best is None:
        return listing
    hint = f"did you mean '{prefix}{best}'?"
    return hint if close or not listing else f"{hint} ({listing})"


def opt(default: Any, help: str, *, choices: tuple | None = None) -> Any:
    """Field with help text and, for enums, the legal values.

    Mutable defaults are copied per instance so two configs never share a list.
    """
    metadata = {"help": help, "choices": choices}
    if isinstance(default, list):
        return field(default_factory=lambda d=default: list(d), metadata=metadata)
    return field(default=default, metadata=metadata)


def source_entries(key: str, value: Any) -> list[dict[str, Any]]:
    """``[[training.sources]]`` tables (path, kind, weight, optional name) or, on the command
    line, ``kind:weight:path`` items separated by commas, as checked dicts."""
    if isinstance(value, str):
        items = [v.strip() for v in value.split(",") if v.strip()]
        value = []
        for item in items:
            parts = item.split(":", 2)
            if len(parts) != 3:
                raise ConfigError(f"{key} item {item!r} must be kind:weight:path (e.g. chat:0.2:data/chat.parquet)")
            value.append({"kind": parts[0], "weight": parts[1], "path": parts[2]})
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{key} expects [[{key}]] tables with path, kind and weight, got {value!r}")
    out = []
    for i, entry in enumerate(value):
        where = f"{key}[{i}]"
        if not isinstance(entry, dict):
            raise ConfigError(f"{where} must be a table with path, kind and weight, got {entry!r}")
        unknown = sorted(set(entry) - set(SOURCE_KEYS))
        if unknown:
            hint = did_you_mean(unknown[0], SOURCE_KEYS, listing=f"its keys are {', '.join(SOURCE_KEYS)}")
            raise ConfigError(f"{where} has unknown key(s) {', '.join(unknown)}; {hint}")
        kind = entry.get("kind")
        if kind not in DATASETS:
            raise ConfigError(f"{where}.kind must be one of {', '.join(DATASETS)}, got {kind!r}")
        try:
            weight = float(entry.get("weight"))
        except (TypeError, ValueError):
            raise ConfigError(f"{where}.weight must be a number > 0, got {entry.get('weight')!r}") from None
        if not weight > 0 or weight == float("inf"):
            raise ConfigError(f"{where}.weight must be a finite number > 0, got {entry.get('weight')!r}")
        path = entry.get("path", "")
        if not isinstance(path, str) or (kind != "synthetic" and not path):
            raise ConfigError(f"{where} (kind '{kind}') needs a path (a file or folder)")
        out.append({"path": path, "kind": kind, "weight": weight, "name": str(entry.get("name") or "")})
    kinds = [e["kind"] for e in out]
    for i, e in enumerate(out):  # default names: the kind, numbered where a kind repeats
        e["name"] = e["name"] or (e["kind"] if kinds.count(e["kind"]) == 1 else f"{e['kind']}_{i}")
    names = [e["name"] for e in out]
    if len(set(names)) != len(names):
        raise ConfigError(f"{key}: the names {names} repeat; give each entry its own name")
    return out
