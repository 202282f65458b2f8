"""Preference data (``training.dataset = "preference"``): rows of (prompt, chosen, rejected) ->
pairs of padded windows of ``seq_len + 1`` tokens, for preference objectives (DPO).

Rows (TRL's column names): ``prompt`` (a messages list, or a string: one user turn), ``chosen``
and ``rejected`` (assistant messages, or a string: one assistant turn). Without ``prompt`` (the
column absent, or the row's value missing or null), ``chosen`` and ``rejected`` are whole
conversations and the prompt is their longest common run of leading messages (TRL's
``extract_prompt``: the "implicit prompt" form).

Rendering, as TRL's DPOTrainer tokenizes a conversational row: the prompt rendered with the chat
template and ``add_generation_prompt=True`` (P), prompt + chosen rendered whole (C), prompt +
rejected rendered whole (R), each tokenized as ``apply_chat_template(tokenize=True)`` does. The
completion of both starts at ``n = min(common prefix of P and C, common prefix of P and R)``; the
chosen sequence is C, the rejected R, and their targets (labels) are the tokens from ``n`` on:
the completion only, never the prompt (not an earlier assistant turn of a multi-turn prompt
either). No separator is appended; the window is padded after the sequence.

Windows (never packed): global sample ``2k`` is the chosen sequence of pair k, ``2k + 1`` its
rejected one, so with an even micro-batch size a micro-batch holds whole pairs in adjacent rows
``(2i, 2i + 1)``, on one batch rank (the config refuses an odd one).

Rules, each pair counted in the first step's data line:

- too long (either sequence over ``seq_len + 1`` tokens), by ``training.chat_too_long``:
  ``truncate`` keeps each sequence's first ``seq_len + 1`` tokens (the prompt kept, the completion
  end cut; both sequences by the same rule); a pair whose prompt leaves no completion token in
  the window is dropped. ``drop`` skips the pair;
- identical: a pair whose two windows are equal token for token (after rendering and truncation)
  carries no preference and is skipped;
- empty: a pair with a completion whose messages' content is only whitespace, or that renders
  no token after the prompt, is skipped;
- malformed (a missing ``chosen`` / ``rejected``, a value that is not a string or messages list,
  a completion not starting with an assistant message, an implicit-prompt row whose two
  conversations share no leading message or a template failure): one-line error naming the row.

Position (resume state): ``sample_index`` and the cursor of the first row not yet fully emitted
(with an odd sample index: the row whose rejected sequence comes next); the same on every rank.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch

from trainer.config import ConfigError
from trainer.data.chat import chat_rendering
from trainer.data.chat_template import ChatError, check_messages
from trainer.data.rows import RowFiles

__all__ = ["COLUMNS", "PreferenceSource", "PreferenceStream", "render_pair"]

COLUMNS = ("prompt", "chosen", "rejected")
SKIPS = ("dropped", "identical", "empty")  # why a row gives no pair (the stream counts each)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _turns(value: Any, field: str, role: str) -> list[dict[str, Any]]:
    """A column's value as messages: a string is one ``role`` turn."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if value is None:
        raise ChatError(f"the row has no '{field}' (null); every row needs 'chosen' and 'rejected'")
    if not isinstance(value, list) or not value:
        raise ChatError(
            f"'{field}' must be a string or a non-empty list of {{role, content}} messages, got {_short(value)}"
        )
    try:
        check_messages(value)
    except ChatError as exc:
        raise ChatError(f"'{field}': {exc}") from None
    return value


def split_row(row: dict[str, Any]) -> tuple[list[dict], list[dict], list[dict]]:
    """(prompt, chosen, rejected) messages of a row (module docstring); :class:`ChatError` for a
    malformed one."""
    chosen, rejected = (
        _turns(row.get("chosen"), "chosen", "assistant"),
        _turns(row.get("rejected"), "rejected", "assistant"),
    )
    if row.get("prompt") is None:  # the implicit form: the shared leading messages are the prompt
        if isinstance(row.get("chosen"), str) or isinstance(row.get("rejected"), str):
            raise ChatError("the row has no 'prompt', and string completions hold none; add a 'prompt' column")
        n = 0
        while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
            n += 1
        if n == 0:
            raise ChatError(
                "the row has no 'prompt', and 'chosen' and 'rejected' share no leading message to take as the "
                "prompt; add a 'prompt' column"
            )
        prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
        for name, msgs in (("chosen", chosen), ("rejected", rejected)):
            if msgs and msgs[0]["role"] != "assistant":
                raise ChatError(
                    f"the row has no 'prompt', and '{name}' goes on after the shared messages with a "
                    f"{msgs[0]['role']} turn, not the assistant's answer; add a 'prompt' column"
                )
        return prompt, chosen, rejected
    prompt = _turns(row["prompt"], "prompt", "user")
    for name, msgs in (("chosen", chosen), ("rejected", rejected)):
        if msgs[0]["role"] != "assistant":
            raise ChatError(
                f"'{name}' starts with a {msgs[0]['role']} turn; it must be the assistant's answer (when 'chosen' and "
                "'rejected' hold the whole conversation, leave out the 'prompt' column)"
            )
    return prompt, chosen, rejected


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def render_pair(template, row: dict[str, Any]) -> tuple[list[int], list[int], int] | str:
    """(chosen ids, rejected ids, completion start n) of a row, or ``'empty'``
    (module docstring); :class:`ChatError` for a malformed row."""
    prompt, chosen, rejected = split_row(row)
    if any(not any(m["content"].strip() for m in msgs) for msgs in (chosen, rejected)):
        return "empty"
    tok = template.tokenizer
    p_ids, _ = tok.encode_chat(template.render(prompt, add_generation_prompt=True))
    c_ids, _ = tok.encode_chat(template.render(prompt + chosen))
    r_ids, _ = tok.encode_chat(template.render(prompt + rejected))
    n = min(_common(p_ids, c_ids), _common(p_ids, r_ids))
    if n >= len(c_ids) or n >= len(r_ids):
        return "empty"
    return c_ids, r_ids, n


class PreferenceSource:
    """Rows with ``chosen``, ``rejected`` (and ``prompt``) -> pairs of token windows."""

    def __init__(
        self,
        path: str,
        tokenizer,
        default_tokenizer_path: str,
        *,
        option: str = "training.dataset_path",
        log_epochs: bool = True,
    ):
        self.rows = RowFiles(path, COLUMNS, option=option, log_epochs=log_epochs, optional=("prompt",))
        # the separator is never inside a sequence; padding as chat data's
        self.template, self.separator, self.pad_id = chat_rendering(tokenizer, default_tokenizer_path)
        self.name, self.masked = "preference", True

    @property
    def description(self) -> str:
        return f"preference pairs in {self.rows.description}; template: {self.template.where}"

    def with_rows(self, rows) -> PreferenceSource:
        """This source over other rows (a :class:`~trainer.data.rows.RowStripe` of its own)."""
        clone = copy.copy(self)
        clone.rows = rows
        return clone

    def start(self) -> list[int]:
        return self.rows.start()

    def read(self, cursor: list[int], window: int, too_long: str):
        """(pair or the reason it is skipped (:data:`SKIPS`), whether it was cut, next cursor) of
        the row at ``cursor``; a pair is ((tokens, targets) chosen, (tokens, targets) rejected),
        each ``window`` long, padded."""
        row, where, nxt = self.rows.read(cursor)
        try:
            got = render_pair(self.template, row) if isinstance(row, dict) else None
        except ChatError as exc:
            raise ChatError(f"{where}: {exc}") from None
        if got is None:
            raise ChatError(f"{where}: a preference row must be an object with 'chosen' and 'rejected'")
        if isinstance(got, str):
            return got, False, nxt
        c_ids, r_ids, n = got
        cut = max(len(c_ids), len(r_ids)) > window
        if cut and (too_long == "drop" or n >= window):
            return "dropped", False, nxt
        pair = tuple(self._window(ids[:window], n, window) for ids in (c_ids, r_ids))
        if np.array_equal(pair[0][0], pair[1][0]):
            return "identical", False, nxt
        return pair, cut, nxt

    def _window(self, ids: list[int], n: int, window: int) -> tuple[np.ndarray, np.ndarray]:
        toks = np.full(window, self.pad_id, dtype=np.int64)
        tgt = np.zeros(window, dtype=bool)
        toks[: len(ids)] = ids
        tgt[max(n, 1) : len(ids)] = True  # the first token is never a label
        return toks, tgt


class PreferenceStream:
    """The :class:`~trainer.data.packing.PackedStream` interface over a :class:`PreferenceSource`:
    ``take`` returns (tokens, targets), both ``[n, seq_len + 1]``; sample 2k is pair k's chosen
    window, 2k + 1 its rejected one."""

    pair_unit = 2  # samples per row: a mixture's schedule and striped reading keep them together

    def __init__(self, source: PreferenceSource, seq_len: int, *, too_long: str):
        if too_long not in ("truncate", "drop"):
            raise ValueError(f"preference too_long {too_long!r}")
        self.source, self.window, self.too_long = source, seq_len + 1, too_long
        self.sample_index = 0
        self._cursor = source.start()
        self._pair: tuple[list[int], Any, bool, list[int]] | None = None  # (its row's cursor, pair, cut, next)
        self.pairs = self.truncated = self.dropped = self.identical = self.empty = 0
        self.target_tokens = 0

    def _load(self) -> tuple[Any, bool]:
        """The pair of the first row from the cursor that gives one (the cursor moved past the
        rows skipped, each counted)."""
        skipped = 0
        while self._pair is None or self._pair[0] != self._cursor:
            got, cut, nxt = self.source.read(self._cursor, self.window, self.too_long)
            if isinstance(got, str):
                setattr(self, got, getattr(self, got) + 1)
                skipped += 1
                if skipped > (self.source.rows.n_rows or 100_000):  # a whole epoch, or very many
                    raise ConfigError(
                        f"no row of {self.source.rows.path} gives a preference pair for seq_len + 1 = {self.window} "
                        f"tokens ({skipped} skipped in a row: {self.dropped} too long "
                        f"(training.chat_too_long = {self.too_long}), {self.identical} identical, {self.empty} "
                        "with an empty completion); raise seq_len, set training.chat_too_long = truncate or fix the data"
                    )
                self._cursor = nxt
                continue
            self._pair = (list(self._cursor), got, cut, nxt)
        return self._pair[1], self._pair[2]

    def _one(self) -> tuple[np.ndarray, np.ndarray]:
        pair, cut = self._load()
        if self.sample_index % 2 == 0:
            toks, tgt = pair[0]
            self.pairs += 1
            self.truncated += cut
        else:
            toks, tgt = pair[1]
            self._cursor = self._pair[3]
        self.sample_index += 1
        self.target_tokens += int(tgt[1:].sum())
        return toks, tgt

    def take(self, n_samples: int) -> tuple[torch.Tensor, torch.Tensor]:
        got = [self._one() for _ in range(n_samples)]
        toks = np.stack([g[0] for g in got]) if got else np.empty((0, self.window), dtype=np.int64)
        tgt = np.stack([g[1] for g in got]) if got else np.empty((0, self.window), dtype=bool)
        return torch.from_numpy(toks), torch.from_numpy(tgt)

    addressable = False  # rows may be skipped (the rules): another rank's samples are read to find its own

    def skip(self, n_samples: int) -> None:
        for _ in range(n_samples):
            self._one()

    def state(self) -> dict[str, Any]:
        return {"sample_index": self.sample_index, "cursor": list(self._cursor), "pairs": True}

    def passes(self, state: dict[str, Any]) -> int:
        """Complete passes over the rows before the position ``state``."""
        return self.source.rows.passes(state["cursor"])

    def restore(self, state: dict[str, Any]) -> None:
        if "cursor" not in state or not state.get("pairs"):
            raise ValueError(
                "data loader state has no preference row cursor (not written by a 'preference' run); to start this "
                'dataset from its beginning set checkpoint.exclude_from_loading = ["dataloader"]'
            )
        self.sample_index = int(state["sample_index"])
        self._cursor = list(state["cursor"])
        self._pair = None

    def notes(self) -> str:
        """The first step's data line: pairs read so far and the rows each rule skipped."""
        return preference_notes([self])


def preference_notes(streams: list[PreferenceStream], whose: str = "") -> str:
    """The data-line words of one or several streams (a source's stripes on this rank)."""
    s0 = streams[0]
    pairs, trunc, drop, same, empty = (
        sum(getattr(s, k) for s in streams) for k in ("pairs", "truncated", "dropped", "identical", "empty")
    )
    windows = sum(s.sample_index for s in streams)
    return (
        f"preference: {whose}{pairs} pairs in {windows} windows (chosen, rejected), {trunc} truncated and {drop} "
        f"dropped as longer than {s0.window} tokens (training.chat_too_long = {s0.too_long}), {same} identical and "
        f"{empty} with an empty completion skipped"
    )
