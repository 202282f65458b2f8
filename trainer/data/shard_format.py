"""The token-shard folder format, shared by the reader (:mod:`trainer.data.token_shards`) and
the offline writer (:mod:`tools.tokenize`): names, versions, dtypes, checksums and the tokenizer
fingerprint recorded in ``index.json``. The layout itself is described in
:mod:`trainer.data.token_shards`.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import numpy as np

FORMAT = "meshtrain-tokens"
FORMAT_VERSION = 1
SUPPORTED_VERSIONS = (1,)
INDEX_NAME = "index.json"
PROGRESS_NAME = "progress.jsonl"
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
SCRIPT = "scripts/tokenize_dataset.py"


def token_dtype_name(vocab_size: int) -> str:
    """The narrowest shard dtype that holds every id of a vocabulary of ``vocab_size``."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def shard_file(i: int) -> str:
    return f"shard_{i:05d}.bin"


def docs_file(i: int) -> str:
    return f"shard_{i:05d}.docs.npy"


def sha256_file(path: str, block: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


def tokenizer_fingerprint(tokenizer) -> dict[str, Any]:
    """What identifies a tokenizer's ids: its file(s)' sha256 (a ``tokenizer_config.json``
    next to a ``tokenizer.json`` is included: it may choose bos/eos), vocab size and the
    bos/eos ids. ``name`` (folder/file) is for messages only."""
    path = getattr(tokenizer, "path", None)
    h = hashlib.sha256()
    if path:
        files = [path]
        config = os.path.join(os.path.dirname(path), "tokenizer_config.json")
        if path.endswith(".json") and os.path.isfile(config):
            files.append(config)
        for f in files:
            h.update(os.path.basename(f).encode() + b"\0")
            with open(f, "rb") as fh:
                h.update(fh.read())
            h.update(b"\0")
        name = os.path.join(os.path.basename(os.path.dirname(os.path.abspath(path))), os.path.basename(path))
    else:  # the byte tokenizer has no file: its ids are fixed by the code
        h.update(f"{type(tokenizer).__name__}:{tokenizer.vocab_size}".encode())
        name = "bytes"
    return {
        "name": name,
        "kind": type(tokenizer).__name__,
        "vocab_size": int(tokenizer.vocab_size),
        "bos_id": int(tokenizer.bos_id),
        "eos_id": int(tokenizer.eos_id),
        "sha256": h.hexdigest(),
    }


def same_tokenizer(a: dict[str, Any], b: dict[str, Any]) -> bool:
    keys = ("sha256", "vocab_size", "bos_id", "eos_id")
    return all(a.get(k) == b.get(k) for k in keys)


def describe_fingerprint(fp: dict[str, Any]) -> str:
    return (
        f"{fp.get('name')} (vocab {fp.get('vocab_size')}, eos {fp.get('eos_id')}, sha256 {str(fp.get('sha256'))[:12]})"
    )
