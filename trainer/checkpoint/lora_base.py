"""The identity of a LoRA run's frozen base weights, stored in its step checkpoints (which hold
the adapters and their optimizer state only) so that a resume onto another base is refused.

Identity = the base's path and a fingerprint of what is there, computed from the files (the same
on every rank and layout, cheap for any model size):

* a Hugging Face folder or a DCP folder: SHA-256 over every file name and size, the whole of
  the small files (``config.json``, the index, DCP's ``.metadata``, a safetensors header) and 16
  samples of 64 KiB spread evenly through each weight file -- two different fine-tunes of one
  architecture differ in every sample, while the same files copied elsewhere keep it;
* no ``checkpoint.initial_load_path``: the base is the run's seeded init, identified by model,
  flavor, the overrides that shape it and the seed.
"""

from __future__ import annotations

import hashlib
import os
import struct

__all__ = ["BaseIdentity", "base_identity", "fingerprint_folder"]

_SAMPLES = 16
_CHUNK = 64 * 1024
_SMALL = 1 << 20  # files up to 1 MiB are hashed whole


def _hash_file(h, path: str) -> None:
    size = os.path.getsize(path)
    h.update(f"{os.path.basename(path)}:{size};".encode())
    with open(path, "rb") as f:
        if size <= _SMALL:
            h.update(f.read())
            return
        if path.endswith(".safetensors"):  # the header: names, dtypes, shapes, offsets
            (n,) = struct.unpack("<Q", f.read(8))
            h.update(f.read(min(n, _SMALL)))
        for i in range(_SAMPLES):
            f.seek((size - _CHUNK) * i // (_SAMPLES - 1))
            h.update(f.read(_CHUNK))


def fingerprint_folder(folder: str) -> str:
    """Fingerprint of a checkpoint folder's files (see the module docstring), hex."""
    h = hashlib.sha256()
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(root, name)
            h.update(os.path.relpath(path, folder).encode())
            _hash_file(h, path)
    return h.hexdigest()[:32]


class BaseIdentity(dict):
    """``{"path": ..., "fingerprint": ...}`` (a dict, so it pickles into the train state)."""

    def line(self) -> str:
        return f"{self['path'] or 'the seeded init'} (fingerprint {self['fingerprint'][:12]})"


def base_identity(cfg) -> BaseIdentity:
    """The identity of the base a run with config ``cfg`` trains its adapters on."""
    path = cfg.checkpoint.initial_load_path
    if path:
        return BaseIdentity(path=os.path.abspath(path), fingerprint=fingerprint_folder(path))
    m = cfg.model
    key = f"init|{m.name}|{m.flavor}|{m.n_layers}|{m.vocab_size}|{cfg.training.seed}"
    return BaseIdentity(path="", fingerprint=hashlib.sha256(key.encode()).hexdigest()[:32])
