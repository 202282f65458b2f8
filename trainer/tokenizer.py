"""Tokenizers: the shipped 2048-token BPE, any local HF ``tokenizer.json``, or raw bytes.

The trainer only needs ``encode``/``decode``, ``vocab_size`` and the bos/eos ids, so both
implementations expose exactly that; nothing is fetched from the network, which keeps
runs on air-gapped clusters reproducible.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Protocol

from trainer.config import ConfigError

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_TOKENIZER_PATH = os.path.join(REPO_ROOT, "assets", "tokenizer", "tokenizer.json")

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)

# Names used by common tokenizers, tried in order when tokenizer_config.json is absent.
_BOS_CANDIDATES = (BOS_TOKEN, "<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>", "<|endoftext|>")
_EOS_CANDIDATES = (EOS_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>", "<|end▁of▁sentence|>")


class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int
    eos_id: int
    pad_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


class HFTokenizer:
    """Wraps a ``tokenizers`` JSON file; no special tokens are added by ``encode`` because
    the packer inserts document separators itself."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer as _Tok

        self.path = path
        self._tok = _Tok.from_file(path)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        configured = _read_tokenizer_config(os.path.dirname(path))
        self.bos_id = self._find_special(configured.get("bos_token"), _BOS_CANDIDATES, "bos")
        self.eos_id = self._find_special(configured.get("eos_token"), _EOS_CANDIDATES, "eos")
        pad = configured.get("pad_token") or PAD_TOKEN
        self.pad_id = self._tok.token_to_id(pad) if isinstance(pad, str) else None

    def _find_special(self, configured: str | None, candidates: tuple[str, ...], what: str) -> int:
        names = ([configured] if isinstance(configured, str) else []) + list(candidates)
        for name in names:
            idx = self._tok.token_to_id(name)
            if idx is not None:
                return idx
        raise ValueError(
            f"tokenizer {self.path} has no {what} token (looked for {', '.join(names)}); "
            f'add a tokenizer_config.json next to it with "{what}_token": "<token>"'
        )

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path!r}, vocab_size={self.vocab_size})"


class ByteTokenizer:
    """UTF-8 bytes 0..255 plus bos/eos/pad at 256..258: needs no asset file and can encode
    anything, useful as a baseline and for tests that must not depend on a trained vocab."""

    vocab_size = 259
    bos_id = 256
    eos_id = 257
    pad_id = 258

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        names = {self.bos_id: BOS_TOKEN, self.eos_id: EOS_TOKEN, self.pad_id: PAD_TOKEN}
        out, buf = [], bytearray()
        for i in ids:
            if i in names:
                out.append(buf.decode("utf-8", errors="replace"))
                out.append(names[i])
                buf = bytearray()
            elif 0 <= i < 256:
                buf.append(i)
            else:
                raise ValueError(f"id {i} is outside the byte tokenizer's vocabulary (0..258)")
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def __repr__(self) -> str:
        return "ByteTokenizer()"


def _read_tokenizer_config(folder: str) -> dict:
    path = os.path.join(folder, "tokenizer_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        cfg = json.load(f)
    # HF sometimes stores special tokens as {"content": "<s>", ...} objects.
    return {k: (v.get("content") if isinstance(v, dict) else v) for k, v in cfg.items()}


def load_tokenizer(path: str = "") -> HFTokenizer | ByteTokenizer:
    """'' -> shipped BPE, 'bytes' -> ByteTokenizer, a folder -> its tokenizer.json, a file -> it."""
    if path == "bytes":
        return ByteTokenizer()
    resolved = path or DEFAULT_TOKENIZER_PATH
    if os.path.isdir(resolved):
        resolved = os.path.join(resolved, "tokenizer.json")
    if not os.path.isfile(resolved):
        if not path:
            raise ConfigError(
                f"shipped tokenizer {resolved} is missing; regenerate it with `python scripts/train_tokenizer.py`"
            )
        raise ConfigError(
            f"model.tokenizer_path: no tokenizer at '{path}' (expected a tokenizer.json file or a "
            f"folder containing one); use '' for the shipped tokenizer or 'bytes' for the byte tokenizer"
        )
    return HFTokenizer(resolved)
