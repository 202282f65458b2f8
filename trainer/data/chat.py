"""Chat data (``training.dataset = "chat"``): conversations -> windows of ``seq_len + 1`` tokens
with a target mask, for supervised fine-tuning with the loss on the assistant's tokens only.

Each row's ``messages`` is rendered with the chat template (:mod:`trainer.data.chat_template`)
and followed by the document separator (:func:`chat_separator`), which is never a target.
Targets are the assistant turns' tokens (their end-of-turn token included); the first token of a
conversation never is, so no label crosses from one conversation into the next.

Windows (global sample k = window k, as for pre-training):

- ``packed``: conversations in order, whole, into each window while they fit; the rest of the
  window is padding. With ``model.attn_mask_type = "block_causal"`` each conversation is one
  document (the separator ends it), so none attends to another.
- ``padded``: one conversation per window, padded.

A conversation longer than a window (``seq_len + 1`` tokens with its separator) is cut to fit
(``truncate``) or skipped (``drop``), by ``training.chat_too_long``; the counts are reported.
The position (resume state) is the cursor of the first row not yet in an emitted window, the
same on every rank and every layout: every rank reads the rows in the same order.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch

from trainer.config import ConfigError
from trainer.data.chat_template import ChatError, ChatTemplate, load_chat_template
from trainer.data.rows import RowFiles

__all__ = ["ChatSource", "ChatStream", "chat_rendering", "chat_separator"]

_PROBE = [
    {"role": "system", "content": "s"},
    {"role": "user", "content": "u"},
    {"role": "assistant", "content": "a"},
    {"role": "user", "content": "u"},
    {"role": "assistant", "content": "a"},
]


def _probe(template: ChatTemplate) -> list[dict[str, str]]:
    """The probe conversation the template renders (:data:`_PROBE`, without its system turn
    for a template that refuses system turns); a ConfigError naming the template when it fails
    on both."""
    try:
        template.render(_PROBE)
        return _PROBE
    except ChatError:  # a template without system turns
        try:
            template.render(_PROBE[1:])
            return _PROBE[1:]
        except ChatError as exc:
            raise ConfigError(
                f"the chat template ({template.where}) fails on a user/assistant conversation: {exc}; fix the template"
            ) from None


def check_renders_targets(template: ChatTemplate) -> None:
    """Refuse (one line, at start-up) a template under which an assistant turn has no token to
    train on: every label would be ignored and the run would train at loss 0, the weights moved
    by weight decay alone. Tried on :data:`_PROBE`; a template that cannot locate the turns
    there is left to fail on the first row, naming it."""
    try:
        _ids, targets = template.encode(_probe(template))
    except ChatError:
        return
    if not any(targets):
        raise ConfigError(
            f"the chat template ({template.where}) renders no assistant tokens (a user/assistant conversation gives "
            "no target token, so the loss would be 0 and nothing learned); fix the template so it writes "
            "each assistant message's content"
        )


def chat_separator(template: ChatTemplate) -> int:
    """The token that ends each conversation (the model's document separator): the tokenizer's
    EOS, unless the template writes it inside conversations (an end-of-turn EOS, as Qwen3's
    ``<|im_end|>`` or Llama 3 Instruct's ``<|eot_id|>``); then its PAD token."""
    tok = template.tokenizer
    ids, _ = tok.encode_chat(template.render(_probe(template)))
    for candidate in (tok.eos_id, getattr(tok, "pad_id", None)):
        if candidate is not None and candidate not in ids:
            return candidate
    raise ConfigError(
        f"the chat template ({template.where}) writes the tokenizer's EOS (id {tok.eos_id}) inside conversations "
        'and the tokenizer has no other PAD token to end them with; add a "pad_token" that the template does '
        "not use to the tokenizer_config.json"
    )


def chat_rendering(tokenizer, default_tokenizer_path: str) -> tuple[ChatTemplate, int, int]:
    """(the chat template, checked to render targets; the document separator, never inside a
    conversation; the padding id: EOS when it is not the separator (the pads are then one
    trailing document), else the PAD token if any; never a target either way)."""
    template = load_chat_template(tokenizer, default_tokenizer_path)
    separator = chat_separator(template)
    check_renders_targets(template)
    pad = getattr(tokenizer, "pad_id", None)
    pad_id = tokenizer.eos_id if separator != tokenizer.eos_id or pad is None else pad
    return template, separator, pad_id


class ChatSource:
    """Rows with ``messages`` -> (token ids, target mask) per conversation."""

    def __init__(
        self,
        path: str,
        tokenizer,
        default_tokenizer_path: str,
        *,
        option: str = "training.dataset_path",
        log_epochs: bool = True,
    ):
        self.rows = RowFiles(path, "messages", option=option, log_epochs=log_epochs)
        self.template, self.separator, self.pad_id = chat_rendering(tokenizer, default_tokenizer_path)
        self.name, self.masked = "chat", True

    @property
    def description(self) -> str:
        return f"chat conversations in {self.rows.description}; template: {self.template.where}"

    def with_rows(self, rows) -> ChatSource:
        """This source over other rows (a :class:`~trainer.data.rows.RowStripe` of its own),
        the template and tokens shared."""
        clone = copy.copy(self)
        clone.rows = rows
        return clone

    def start(self) -> list[int]:
        return self.rows.start()

    def read(self, cursor: list[int]) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """(ids with the separator appended, targets, next cursor) of the row at ``cursor``."""
        messages, where, nxt = self.rows.read(cursor)
        try:
            ids, targets = self.template.encode(messages)
        except ChatError as exc:
            raise ChatError(f"{where}: {exc}") from None
        ids = np.asarray([*ids, self.separator], dtype=np.int64)
        tgt = np.asarray([*targets, False], dtype=bool)
        tgt[0] = False
        return ids, tgt, nxt


class ChatStream:
    """The :class:`~trainer.data.packing.PackedStream` interface over a :class:`ChatSource`;
    ``take`` returns (tokens, targets), both ``[n, seq_len + 1]``."""

    def __init__(self, source: ChatSource, seq_len: int, *, packing: str, too_long: str):
        if packing not in ("packed", "padded") or too_long not in ("truncate", "drop"):
            raise ValueError(f"chat packing {packing!r} / too_long {too_long!r}")
        self.source, self.window, self.packing, self.too_long = source, seq_len + 1, packing, too_long
        self.sample_index = 0
        self._cursor = source.start()
        self._held: tuple[list[int], np.ndarray, np.ndarray, list[int], bool] | None = None
        self.conversations = self.truncated = self.dropped = 0  # counted as windows are built
        self.target_tokens = 0

    def _peek(self) -> tuple[np.ndarray, np.ndarray]:
        skipped = 0
        while self._held is None or self._held[0] != self._cursor:
            ids, tgt, nxt = self.source.read(self._cursor)
            cut = len(ids) > self.window
            if cut:
                if self.too_long == "drop":
                    self.dropped += 1
                    skipped += 1
                    if skipped > (self.source.rows.n_rows or 100_000):  # a whole epoch, or very many
                        raise ConfigError(
                            f"no conversation of {self.source.rows.path} fits in seq_len + 1 = {self.window} tokens "
                            f"(training.chat_too_long = drop skipped {skipped} in a row); raise seq_len or set "
                            "training.chat_too_long = truncate"
                        )
                    self._cursor = nxt
                    continue
                ids = np.append(ids[: self.window - 1], self.source.separator)
                tgt = np.append(tgt[: self.window - 1], False)
            self._held = (list(self._cursor), ids, tgt, nxt, cut)
        return self._held[1], self._held[2]

    def _one(self) -> tuple[np.ndarray, np.ndarray]:
        toks = np.full(self.window, self.source.pad_id, dtype=np.int64)
        tgt = np.zeros(self.window, dtype=bool)
        filled = 0
        while True:
            ids, t = self._peek()
            if filled and (self.packing == "padded" or filled + len(ids) > self.window):
                break
            toks[filled : filled + len(ids)], tgt[filled : filled + len(ids)] = ids, t
            filled += len(ids)
            self.conversations += 1
            self.truncated += self._held[4]
            self._cursor = self._held[3]
            if self.packing == "padded":
                break
        self.target_tokens += int(tgt[1:].sum())
        return toks, tgt

    def take(self, n_samples: int) -> tuple[torch.Tensor, torch.Tensor]:
        pairs = [self._one() for _ in range(n_samples)]
        self.sample_index += n_samples
        toks = np.stack([p[0] for p in pairs])
        tgt = np.stack([p[1] for p in pairs])
        return torch.from_numpy(toks), torch.from_numpy(tgt)

    @property
    def addressable(self) -> bool:
        """Window k is row k (``padded`` + ``truncate``) in a file read by row number: other
        ranks' windows are skipped without reading them."""
        return self.packing == "padded" and self.too_long == "truncate" and self.source.rows.addressable

    def skip(self, n_samples: int) -> None:
        if self.addressable:
            self._cursor = self.source.rows.advance(self._cursor, n_samples)
        else:
            for _ in range(n_samples):
                self._one()
        self.sample_index += n_samples

    def state(self) -> dict[str, Any]:
        return {"sample_index": self.sample_index, "cursor": list(self._cursor)}

    def passes(self, state: dict[str, Any]) -> int:
        """Complete passes over the rows before the position ``state`` (its cursor: the first
        row not yet in an emitted window)."""
        return self.source.rows.passes(state["cursor"])

    def restore(self, state: dict[str, Any]) -> None:
        if "cursor" not in state or "position" in state:
            raise ValueError(
                "data loader state has no chat row cursor (not written by a 'chat' run); to start this "
                'dataset from its beginning set checkpoint.exclude_from_loading = ["dataloader"]'
            )
        self.sample_index = int(state["sample_index"])
        self._cursor = list(state["cursor"])
        self._held = None

    def notes(self) -> str:
        """The start-up data line's words: conversations read so far, truncated or dropped (where
        each rank reads only its own rows: this rank's)."""
        whose = "this rank's " if self.addressable else ""
        return (
            f"chat: {whose}{self.conversations} conversations in {self.sample_index} windows ({self.packing}), "
            f"{self.truncated} truncated and {self.dropped} dropped as longer than {self.window} tokens "
            f"(training.chat_too_long = {self.too_long})"
        )
