"""Pre-tokenized datasets: token shards written once by ``scripts/tokenize_dataset.py`` and
read by address, so a rank reads only its own samples.

The shards hold exactly the token stream the streaming path builds (every document tokenized
and followed by eos, concatenated); window k of ``seq_len + 1`` tokens, "global sample k", is
stream tokens ``[k*(L+1), (k+1)*(L+1))``, and the stream wraps to its first token after its
last one, as the streaming path starts its next epoch. Reading a window is O(its tokens):
:class:`TokenStream` skips other ranks' samples by moving a position, without reading them.

Folder layout (format version 1)::

    index.json            written last, atomically: a folder without it is incomplete
    shard_00000.bin ...   flat little-endian uint16 (vocab <= 65536) or uint32 token arrays;
                          shard i holds stream tokens [i*S, i*S + n_i), S = shard_tokens
                          (every shard but the last holds exactly S tokens)
    shard_00000.docs.npy  int64: for each document that ends in the shard, the offset just
                          after its eos inside the shard (documents may span shards)
    progress.jsonl        the writer's resume log (a header, then one line per finished shard)

``index.json``: format, version, dtype, shard_tokens, total_tokens, n_documents, the
tokenizer fingerprint (name, kind, vocab size, bos/eos ids, sha256 of the tokenizer
file(s)), the inputs, the command that wrote it, and per shard: file, n_tokens, n_documents,
first_document, docs_file, sha256 of both files.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import numpy as np
import torch

from trainer.config import ConfigError
from trainer.data.shard_format import (
    DTYPES,
    FORMAT,
    INDEX_NAME,
    PROGRESS_NAME,
    SCRIPT,
    SUPPORTED_VERSIONS,
    describe_fingerprint,
    same_tokenizer,
    sha256_file,
    tokenizer_fingerprint,
)


class TokenDataset:
    """The token shards of a folder, memory-mapped on first use; ``read(start, n)`` returns
    stream tokens ``[start, start + n)`` (modulo the stream length) in O(n).

    Opening checks the index (present, known format) and every shard (present, the recorded
    size); ``verify=True`` also checks every shard's sha256 (reads everything)."""

    name = "tokens"

    def __init__(self, path: str, *, verify: bool = False, option: str = "training.dataset_path"):
        self.path, self.option = path, option
        index_path = os.path.join(path, INDEX_NAME)
        if not os.path.isdir(path):
            raise ConfigError(
                f"{option} '{path}' does not exist or is not a folder; for training.dataset = 'tokens' point "
                f"it at a folder written by python {SCRIPT} INPUT... --out FOLDER"
            )
        if not os.path.isfile(index_path):
            partial = os.path.isfile(os.path.join(path, PROGRESS_NAME))
            why = "its tokenization is unfinished (running or interrupted)" if partial else "it is not a token folder"
            raise ConfigError(
                f"{option} '{path}' has no {INDEX_NAME}: {why}; run (or re-run: it resumes) "
                f"python {SCRIPT} INPUT... --out {path}"
            )
        try:
            with open(index_path) as f:
                index = json.load(f)
        except (OSError, ValueError) as exc:
            raise ConfigError(
                f"{index_path} is unreadable ({exc}); re-run the python {SCRIPT} command that wrote it"
            ) from None
        if not isinstance(index, dict) or index.get("format") != FORMAT:
            raise ConfigError(f"{index_path} is not a {FORMAT} index; point {option} at a folder written by {SCRIPT}")
        if index.get("version") not in SUPPORTED_VERSIONS:
            raise ConfigError(
                f"{index_path} has format version {index.get('version')!r}; this meshtrain reads version(s) "
                f"{', '.join(map(str, SUPPORTED_VERSIONS))}: re-tokenize with this checkout's {SCRIPT}"
            )
        self.index = index
        if index.get("dtype") not in DTYPES:
            raise ConfigError(f"{index_path}: unknown dtype {index.get('dtype')!r} (expected uint16 or uint32)")
        self.dtype = DTYPES[index["dtype"]]
        self.shard_tokens = int(index["shard_tokens"])
        self.shards: list[dict[str, Any]] = list(index["shards"])
        self.total_tokens = int(index["total_tokens"])
        self.fingerprint: dict[str, Any] = index["tokenizer"]
        sizes = [int(s["n_tokens"]) for s in self.shards]
        if (
            not sizes
            or sum(sizes) != self.total_tokens
            or any(n != self.shard_tokens for n in sizes[:-1])
            or not 0 < sizes[-1] <= self.shard_tokens
        ):
            raise ConfigError(f"{index_path} is inconsistent (shard sizes vs total_tokens); {self._fix()}")
        self._sizes = sizes
        for shard in self.shards:
            self._check_shard(shard, verify)
        ids = json.dumps([[s["n_tokens"], s["sha256"]] for s in self.shards]).encode()
        self.dataset_id = hashlib.sha256(ids).hexdigest()[:16]
        self.tokens_read = 0  # instrumentation: tokens copied out of the shards by read()
        self._maps: dict[int, np.ndarray] = {}

    def _fix(self) -> str:
        cmd = self.index.get("command") if hasattr(self, "index") else None
        how = f"`{cmd}`" if cmd else f"the python {SCRIPT} command that wrote it"
        return f"re-run {how} (same inputs and --out: it checks every shard and rewrites bad ones)"

    def _check_shard(self, shard: dict[str, Any], verify: bool) -> None:
        p = os.path.join(self.path, shard["file"])
        expected = int(shard["n_tokens"]) * self.dtype.itemsize
        if not os.path.isfile(p):
            raise ConfigError(f"token shard {p} is missing ({expected} bytes expected); {self._fix()}")
        size = os.path.getsize(p)
        if size != expected:
            what = "truncated" if size < expected else "longer than recorded"
            raise ConfigError(f"token shard {p} is {what} ({size} bytes, the index says {expected}); {self._fix()}")
        if verify and sha256_file(p) != shard["sha256"]:
            raise ConfigError(f"token shard {p} is corrupt (sha256 differs from the index); {self._fix()}")

    @property
    def description(self) -> str:
        """The start-up line's words for this data."""
        return f"token shards in {self.path} ({self.total_tokens:,} tokens)"

    def __len__(self) -> int:
        return self.total_tokens

    @property
    def n_documents(self) -> int:
        return int(self.index["n_documents"])

    def _map(self, i: int) -> np.ndarray:
        m = self._maps.get(i)
        if m is None:
            m = np.memmap(os.path.join(self.path, self.shards[i]["file"]), dtype=self.dtype, mode="r")
            self._maps[i] = m
        return m

    def read(self, start: int, n: int) -> np.ndarray:
        """Stream tokens ``[start, start + n)`` as int64, wrapping past the end (the next epoch)."""
        out = np.empty(n, dtype=np.int64)
        pos, filled, total, s = start % self.total_tokens, 0, self.total_tokens, self.shard_tokens
        while filled < n:
            i = pos // s
            off = pos - i * s
            m = min(n - filled, self._sizes[i] - off)
            out[filled : filled + m] = self._map(i)[off : off + m]
            filled += m
            pos += m
            if pos == total:
                pos = 0
        self.tokens_read += n
        return out

    def document_ends(self) -> np.ndarray:
        """Stream positions just after each document's eos (reads every docs file)."""
        ends = [
            np.load(os.path.join(self.path, s["docs_file"])) + i * self.shard_tokens for i, s in enumerate(self.shards)
        ]
        return np.concatenate(ends) if ends else np.zeros(0, dtype=np.int64)

    def check_tokenizer(self, tokenizer) -> None:
        """ConfigError when the run's tokenizer is not the one the shards were written with."""
        run = tokenizer_fingerprint(tokenizer)
        if not same_tokenizer(self.fingerprint, run):
            where = getattr(tokenizer, "path", None) or "bytes"
            raise ConfigError(
                f"{self.option} '{self.path}' was tokenized with {describe_fingerprint(self.fingerprint)} "
                f"but this run's tokenizer (model.tokenizer_path -> {where}) is {describe_fingerprint(run)}; set "
                f"model.tokenizer_path to the shards' tokenizer, or re-tokenize with this one: python {SCRIPT} "
                f"INPUT... --out NEW_FOLDER --tokenizer {where}"
            )

    def stream(self, seq_len: int) -> TokenStream:
        return TokenStream(self, seq_len)


class TokenStream:
    """The :class:`~trainer.data.packing.PackedStream` interface over a :class:`TokenDataset`:
    ``take`` reads its samples, ``skip`` only moves the position (reads nothing)."""

    def __init__(self, dataset: TokenDataset, seq_len: int):
        self.dataset, self.window = dataset, seq_len + 1
        self.sample_index = 0
        self.position = 0  # stream token of the next sample; grows past the end (epochs)

    def take(self, n_samples: int) -> torch.Tensor:
        tokens = self.dataset.read(self.position, n_samples * self.window)
        self.position += n_samples * self.window
        self.sample_index += n_samples
        return torch.from_numpy(tokens.reshape(n_samples, self.window))

    def skip(self, n_samples: int) -> None:
        self.position += n_samples * self.window
        self.sample_index += n_samples

    def state(self) -> dict[str, Any]:
        return {"sample_index": self.sample_index, "position": self.position, "dataset_id": self.dataset.dataset_id}

    def passes(self, state: dict[str, Any]) -> int:
        """Complete passes over the shards' tokens before the position ``state``."""
        return int(state["position"]) // len(self.dataset)

    def restore(self, state: dict[str, Any]) -> None:
        if "position" not in state:
            raise ValueError(
                "data loader state has no token position (not written by a 'tokens' run); to start this "
                'dataset from its beginning set checkpoint.exclude_from_loading = ["dataloader"]'
            )
        if state.get("dataset_id") not in (None, self.dataset.dataset_id):
            raise ValueError(
                f"data loader state is for another token dataset (id {state.get('dataset_id')}) than "
                f"'{self.dataset.path}' (id {self.dataset.dataset_id}); to start it from its beginning set "
                f'checkpoint.exclude_from_loading = ["dataloader"]'
            )
        self.sample_index = int(state["sample_index"])
        self.position = int(state["position"])
