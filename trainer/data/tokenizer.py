"""Tokenizers: the shipped 2048-token BPE, any local HF ``tokenizer.json``, Meta's original
Llama 3 ``tokenizer.model`` (tiktoken BPE ranks), or raw bytes.

The trainer only needs ``encode``/``encode_batch``/``decode``, ``vocab_size`` and the
bos/eos/pad ids, so every implementation exposes exactly that; nothing is fetched from the
network, which keeps runs on air-gapped clusters reproducible.

``encode`` treats text that looks like a special token (``<|eos|>``, ``<|end_of_text|>``)
as plain text in every implementation: documents are data, and only the packer places
document separators.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from collections.abc import Iterable
from typing import Protocol

from trainer.config import REPO_ROOT, ConfigError
from trainer.config.fields import TOKENIZER_FILES

DEFAULT_TOKENIZER_PATH = os.path.join(REPO_ROOT, "assets", "tokenizer", "tokenizer.json")

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)

# Names used by common tokenizers, tried in order when tokenizer_config.json is absent.
_BOS_CANDIDATES = (BOS_TOKEN, "<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>", "<|endoftext|>")
_EOS_CANDIDATES = (EOS_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>", "<|end▁of▁sentence|>")


# Meta's Llama 3 pre-tokenizer: contractions, letter runs with one optional leading
# non-letter, digits in groups of at most three, punctuation runs, newline runs, spaces.
LLAMA3_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_NUM_SPECIAL_TOKENS = 256
_LLAMA3_NAMED_SPECIALS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|reserved_special_token_2|>",
    "<|reserved_special_token_3|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|reserved_special_token_4|>",
    "<|eot_id|>",
)
# Appended after the BPE ranks in this order (ids 128000..128255 for Meta's 128000 ranks):
# the ten above, then <|reserved_special_token_5|> .. <|reserved_special_token_250|>.
LLAMA3_SPECIAL_TOKENS = _LLAMA3_NAMED_SPECIALS + tuple(
    f"<|reserved_special_token_{i}|>" for i in range(5, 5 + LLAMA3_NUM_SPECIAL_TOKENS - len(_LLAMA3_NAMED_SPECIALS))
)


class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int
    eos_id: int
    pad_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


class HFTokenizer:
    """Wraps a ``tokenizers`` JSON file; no special tokens are added by ``encode`` because
    the packer inserts document separators itself, and special-token text inside a document
    is encoded as plain text (``encode_special_tokens``), not as the special id."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer as _Tok

        self.path = path
        self._chat_tok = None  # encode_chat's instance (special tokens parsed), made on first use
        try:
            self._tok = _Tok.from_file(path)
        except Exception as exc:  # tokenizers raises a bare Exception on a malformed file
            detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise ConfigError(
                f"model.tokenizer_path: {path} is not a readable tokenizer.json ({detail}); point it at a "
                f"Hugging Face tokenizer.json or a Llama 3 tokenizer.model"
            ) from exc
        self._tok.encode_special_tokens = True
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

    def encode_chat(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """A rendered chat conversation as transformers' ``apply_chat_template`` tokenizes it:
        special-token text (``<|im_end|>``) becomes the special id; with each token's character
        span in ``text``. A second instance, so the data thread never flips the shared one."""
        if self._chat_tok is None:
            from tokenizers import Tokenizer as _Tok

            self._chat_tok = _Tok.from_file(self.path)
            self._chat_tok.encode_special_tokens = False
        enc = self._chat_tok.encode(text, add_special_tokens=False)
        return enc.ids, enc.offsets

    def special_token_texts(self) -> list[str]:
        """The text of every special added token (where a chat template's turns end)."""
        return [t.content for t in self._tok.get_added_tokens_decoder().values() if t.special]

    def token_text(self, token_id: int | None) -> str | None:
        """The text of a special token (the chat template's ``eos_token`` etc.)."""
        return None if token_id is None else self._tok.id_to_token(token_id)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path!r}, vocab_size={self.vocab_size})"


class TiktokenTokenizer:
    """Meta's original Llama 3 ``tokenizer.model``: a tiktoken BPE rank file (one
    ``<base64 token> <rank>`` per line) with the Llama 3 split pattern and the 256 special
    tokens of ``LLAMA3_SPECIAL_TOKENS`` appended after the ranks. bos = ``<|begin_of_text|>``,
    eos = ``<|end_of_text|>``, no pad. Gives the same ids as the ``tokenizer.json`` form of the
    same tokenizer.

    The rank file is parsed here rather than by ``tiktoken.load.load_tiktoken_bpe``: that
    function fetches ``http(s)://`` paths and keeps a copy of every file it reads in a cache
    keyed by the path only, so a file replaced at the same path would load stale ranks."""

    def __init__(self, path: str):
        try:
            import tiktoken
        except ImportError as exc:
            raise ConfigError(
                f"model.tokenizer_path: {path} is a tiktoken tokenizer.model but the tiktoken package is "
                f"not installed; `pip install tiktoken`"
            ) from exc
        self.path = path
        ranks = read_tiktoken_ranks(path)
        n = len(ranks)
        self._enc = tiktoken.Encoding(
            name=f"llama3:{os.path.basename(path)}",
            pat_str=LLAMA3_SPLIT_PATTERN,
            mergeable_ranks=ranks,
            special_tokens={tok: n + i for i, tok in enumerate(LLAMA3_SPECIAL_TOKENS)},
        )
        self.num_base_tokens = n
        self.vocab_size = n + len(LLAMA3_SPECIAL_TOKENS)
        self.bos_id = n + LLAMA3_SPECIAL_TOKENS.index("<|begin_of_text|>")
        self.eos_id = n + LLAMA3_SPECIAL_TOKENS.index("<|end_of_text|>")
        self.pad_id = None

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._enc.encode_ordinary_batch(texts)

    def decode(self, ids: Iterable[int]) -> str:
        return self._enc.decode(list(ids), errors="replace")

    def __repr__(self) -> str:
        return f"TiktokenTokenizer({self.path!r}, vocab_size={self.vocab_size})"


def read_tiktoken_ranks(path: str) -> dict[bytes, int]:
    """The BPE ranks of a tiktoken rank file; a ``ConfigError`` naming ``path`` and the fix
    when the file is not one (ranks must be 0..n-1, each token once, all 256 bytes present)."""

    def bad(problem: str) -> ConfigError:
        return ConfigError(
            f"model.tokenizer_path: {path} is not a tiktoken BPE rank file ({problem}); point it at Meta's "
            f"Llama 3 tokenizer.model (original/tokenizer.model in Hugging Face repos) or at a tokenizer.json "
            f"(SentencePiece .model files, e.g. Llama 2's, are not supported)"
        )

    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise ConfigError(f"model.tokenizer_path: cannot read {path} ({exc.strerror}); check the path") from exc
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        fields = line.split()
        try:
            if len(fields) != 2:
                raise ValueError
            token, rank = base64.b64decode(fields[0], validate=True), int(fields[1])
        except (ValueError, binascii.Error):
            raise bad(f"line {lineno} is not '<base64 token> <rank>'") from None
        if not token or token in ranks:
            raise bad(f"line {lineno} repeats a token or has an empty one")
        ranks[token] = rank
    if not ranks:
        raise bad("it is empty")
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise bad(f"the ranks are not 0..{len(ranks) - 1}, each once")
    missing = sum(bytes([b]) not in ranks for b in range(256))
    if missing:
        raise bad(f"{missing} of the 256 single bytes have no rank, so some text could not be encoded")
    return ranks


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


def read_json_config(path: str) -> dict:
    """A tokenizer folder's JSON file (``tokenizer_config.json``) as a dict; a ConfigError naming
    the file when it is not a JSON object (truncated, hand-edited)."""
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(
            f"model.tokenizer_path: {path} is not valid JSON ({exc}); restore the model's own copy of the file"
        ) from None
    if not isinstance(cfg, dict):
        raise ConfigError(
            f"model.tokenizer_path: {path} holds a JSON {type(cfg).__name__}, not an object; "
            "restore the model's own copy of the file"
        )
    return cfg


def _read_tokenizer_config(folder: str) -> dict:
    path = os.path.join(folder, "tokenizer_config.json")
    if not os.path.isfile(path):
        return {}
    cfg = read_json_config(path)
    # HF sometimes stores special tokens as {"content": "<s>", ...} objects.
    return {k: (v.get("content") if isinstance(v, dict) else v) for k, v in cfg.items()}


# Looked for in this order inside a folder: a Hugging Face repo has tokenizer.json at the top
# and Meta's tiktoken file under original/; Meta's own downloads have tokenizer.model only.
_FOLDER_CANDIDATES = TOKENIZER_FILES


def _is_json_file(path: str) -> bool:
    if path.endswith(".json"):
        return True
    if path.endswith(".model"):
        return False
    try:
        with open(path, "rb") as f:
            return f.read(64).lstrip().startswith(b"{")
    except OSError:
        return False  # the tiktoken reader reports the unreadable file


def load_tokenizer(path: str = "") -> HFTokenizer | TiktokenTokenizer | ByteTokenizer:
    """'' -> the shipped BPE, 'bytes' -> ``ByteTokenizer``, otherwise a file or a folder.

    A file ending in ``.json`` is a Hugging Face ``tokenizer.json`` and one ending in ``.model``
    (Meta's Llama 3 ``tokenizer.model``) a tiktoken BPE rank file; any other file is the former
    when its content is a JSON object, else the latter. A folder uses the first of ``tokenizer.json``, ``tokenizer.model``,
    ``original/tokenizer.model`` that it holds: a published Hugging Face Llama 3 repo has both
    forms and loads ``tokenizer.json`` (whose bos/eos may come from a tokenizer_config.json
    next to it, e.g. ``<|eot_id|>`` for Instruct models; the tiktoken form always uses
    ``<|begin_of_text|>``/``<|end_of_text|>``). Both forms give the same ids on the same text.
    """
    if path == "bytes":
        return ByteTokenizer()
    resolved = path or DEFAULT_TOKENIZER_PATH
    if os.path.isdir(resolved):
        found = [os.path.join(resolved, c) for c in _FOLDER_CANDIDATES if os.path.isfile(os.path.join(resolved, c))]
        resolved = found[0] if found else os.path.join(resolved, _FOLDER_CANDIDATES[0])
    if not os.path.isfile(resolved):
        if not path:
            raise ConfigError(
                f"shipped tokenizer {resolved} is missing; regenerate it with `python scripts/train_tokenizer.py`"
            )
        raise ConfigError(
            f"model.tokenizer_path: no tokenizer at '{path}' (expected a tokenizer.json or tokenizer.model file, "
            f"or a folder containing one, or original/tokenizer.model); use '' for the shipped tokenizer or "
            f"'bytes' for the byte tokenizer"
        )
    if _is_json_file(resolved):
        return HFTokenizer(resolved)
    return TiktokenTokenizer(resolved)
