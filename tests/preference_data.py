"""Preference test data (``training.dataset = "preference"``): rows of (prompt, chosen, rejected)
in TRL's column names, written as JSONL or parquet, built locally (nothing downloaded).

Forms (trainer/data/preference.py):

- ``explicit``: ``prompt`` a messages list (a system turn on every third row, earlier
  user/assistant exchanges on some), ``chosen`` / ``rejected`` one assistant message each;
- ``strings``: ``prompt``, ``chosen`` and ``rejected`` plain strings (one user turn, one assistant
  turn);
- ``implicit``: no ``prompt``; ``chosen`` and ``rejected`` whole conversations sharing their
  leading messages.

The chosen answer is the rejected one's words reversed and extended, so a pair's two completions
always differ (and their lengths differ: truncation cuts them at different places).
"""

from __future__ import annotations

import json
import random

from tests.chat_data import tokenizer_folder, write_parquet

__all__ = ["FORMS", "preference_rows", "tokenizer_folder", "write_jsonl", "write_parquet_rows"]

FORMS = ("explicit", "strings", "implicit")
_WORDS = "alpha beta gamma delta echo fox golf hotel india julia kilo lima mike nova oscar".split()


def _text(rng: random.Random, k: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(k))


def preference_rows(n: int, seed: int = 0, *, form: str = "explicit", long_every: int = 0) -> list[dict]:
    """``n`` rows of ``form`` (:data:`FORMS`); with ``long_every`` every such row's answers are
    60-90 words (longer than a small test window: the truncate / drop rule)."""
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        question = _text(rng, rng.randint(2, 6))
        k = rng.randint(60, 90) if long_every and i % long_every == 0 else rng.randint(1, 7)
        rejected = _text(rng, k)
        chosen = " ".join(reversed(rejected.split())) + " " + _text(rng, rng.randint(1, 3))
        if form == "strings":
            rows.append({"prompt": question, "chosen": chosen, "rejected": rejected})
            continue
        prompt = [{"role": "system", "content": _text(rng, 3)}] if i % 3 == 0 else []
        if i % 2:  # an earlier exchange: its assistant turn is prompt, never a target
            prompt += [{"role": "user", "content": _text(rng, 2)}, {"role": "assistant", "content": _text(rng, 3)}]
        prompt.append({"role": "user", "content": question})
        good, bad = [{"role": "assistant", "content": chosen}], [{"role": "assistant", "content": rejected}]
        if form == "implicit":
            rows.append({"chosen": prompt + good, "rejected": prompt + bad})
        else:
            rows.append({"prompt": prompt, "chosen": good, "rejected": bad})
    return rows


def write_jsonl(path, rows: list[dict]) -> str:
    """One JSON object per line (a row may lack a column: the bad-row tests)."""
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return str(path)


def write_parquet_rows(path, rows: list[dict], row_group_size: int = 16) -> str:
    """The rows as one parquet file (columns: the first row's keys; every row must have them)."""
    columns = {key: [row[key] for row in rows] for key in rows[0]}
    return write_parquet(path, columns, row_group_size=row_group_size)
