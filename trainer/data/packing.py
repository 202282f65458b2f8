"""Packing: documents tokenized, each followed by eos, concatenated, and cut into consecutive
windows of ``seq_len + 1`` tokens (inputs = window[:-1], labels = window[1:]). Window k is
"global sample k"; :class:`PackedStream` reads them in order from a document source and can
skip samples and save/restore its position.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from trainer.data.sources import DocumentSource

IGNORE_INDEX = -100  # a label that is not a target (chat data: every non-assistant token; trainer/data/chat.py)


class PackedStream:
    """Sequential reader of global samples (windows of ``seq_len + 1`` tokens)."""

    def __init__(self, source: DocumentSource, tokenizer, seq_len: int):
        self.source, self.tokenizer, self.window = source, tokenizer, seq_len + 1
        self.eos_id = tokenizer.eos_id
        self.sample_index = 0
        self._cursor = source.start()
        self._tokens: np.ndarray | None = None
        self._pos = 0
        self._next_cursor: list[int] | None = None

    def _load(self) -> None:
        text, ends_doc, self._next_cursor = self.source.read(self._cursor)
        ids = self.tokenizer.encode(text)
        if ends_doc:
            ids.append(self.eos_id)
        self._tokens = np.asarray(ids, dtype=np.int64)

    def _current(self) -> np.ndarray:
        if self._tokens is None:
            self._load()
        while self._pos >= len(self._tokens):
            self._pos -= len(self._tokens)
            self._cursor = self._next_cursor
            self._load()
        return self._tokens

    def _advance(self, n_tokens: int, out: np.ndarray | None) -> None:
        filled = 0
        while filled < n_tokens:
            toks = self._current()
            n = min(n_tokens - filled, len(toks) - self._pos)
            if out is not None:
                out[filled : filled + n] = toks[self._pos : self._pos + n]
            self._pos += n
            filled += n

    def take(self, n_samples: int) -> torch.Tensor:
        out = np.empty(n_samples * self.window, dtype=np.int64)
        self._advance(len(out), out)
        self.sample_index += n_samples
        return torch.from_numpy(out.reshape(n_samples, self.window))

    def skip(self, n_samples: int) -> None:
        self._advance(n_samples * self.window, None)
        self.sample_index += n_samples

    def state(self) -> dict[str, Any]:
        self._current()  # normalise so the cursor points at the piece holding the next token
        return {"sample_index": self.sample_index, "cursor": list(self._cursor), "token_offset": int(self._pos)}

    def passes(self, state: dict[str, Any]) -> int | None:
        """Complete passes over the source before the position ``state`` (a :meth:`state`, whose
        cursor is the piece holding the next token); None for a source without end."""
        return self.source.passes(state["cursor"])

    def restore(self, state: dict[str, Any]) -> None:
        self.sample_index = int(state["sample_index"])
        self._cursor = list(state["cursor"])
        self._pos = int(state["token_offset"])
        self._tokens = None
