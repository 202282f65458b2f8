"""A checked Hugging Face folder and the reader every load goes through.

:func:`open_hf_checkpoint` checks the folder before any weight is read: it exists and can be
read, ``config.json`` parses, every shard the index lists exists, every safetensors header
parses and fits its file (:mod:`trainer.checkpoint.hf_format`). :func:`validate_hf_checkpoint`
then checks ``config.json`` against the model's args (``adapter.check_hf_config``) and that
every tensor the adapter expects is present with its shape (from the headers only). Each
problem is one :class:`~trainer.checkpoint.errors.CheckpointError` naming the path or key and
the fix. :class:`HFReader` reads a tensor, or only a slice of it, through memory-mapped
``safe_open`` handles.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from trainer.checkpoint.errors import CheckpointError
from trainer.checkpoint.hf_format import (
    CONFIG_FILE,
    INDEX_FILE,
    SINGLE_FILE,
    ST_DTYPES,
    HFTensorInfo,
    read_header,
    read_json,
)

__all__ = ["HFCheckpoint", "HFReader", "open_hf_checkpoint", "validate_hf_checkpoint"]


@dataclass
class HFCheckpoint:
    """A Hugging Face folder whose structure and safetensors headers were checked (no weight
    has been read): ``config`` is the parsed config.json, ``tensors`` every stored key."""

    path: str
    config: dict[str, Any]
    tensors: dict[str, HFTensorInfo]
    files: list[str]

    def reader(self) -> HFReader:
        return HFReader(self)

    def check_tensors(self, adapter) -> None:
        """Every key ``adapter.hf_keys()`` expects is stored with that shape, in a dtype we
        convert from. Headers only."""
        expected = adapter.hf_keys()
        missing = [k for k in expected if k not in self.tensors]
        if missing:
            raise CheckpointError(
                f"Hugging Face checkpoint {self.path} lacks {len(missing)} of the {len(expected)} tensors "
                f"{adapter.hf_architecture or 'the model'} needs, e.g. {missing[:3]}: it holds another model "
                f"or an incomplete download (stored keys look like {sorted(self.tensors)[:3]})"
            )
        for key, shape in expected.items():
            info = self.tensors[key]
            if tuple(info.shape) != tuple(shape):
                raise CheckpointError(
                    f"Hugging Face checkpoint {self.path}: tensor {key} in {info.file} has shape "
                    f"{list(info.shape)}, expected {list(shape)} for these model args: the file does not match "
                    f"config.json and the chosen flavor (re-download it, or pick the flavor it was saved from)"
                )
            if info.dtype not in ST_DTYPES:
                raise CheckpointError(
                    f"Hugging Face checkpoint {self.path}: tensor {key} in {info.file} is stored as {info.dtype}; "
                    f"only {', '.join(ST_DTYPES)} weights load (dequantize the checkpoint first)"
                )

    def check_config(self, adapter, context: str = "") -> None:
        """``adapter.check_hf_config`` as a one-line CheckpointError naming the file."""
        try:
            adapter.check_hf_config(self.config)
        except ValueError as exc:  # HFConfigMismatch
            where = os.path.join(self.path, CONFIG_FILE)
            raise CheckpointError(f"{where} does not fit {context or 'the model'}: {exc}") from None


def open_hf_checkpoint(path: str) -> HFCheckpoint:
    """Check the folder's structure and every safetensors header; read no weight."""
    fix = (
        "point it at a Hugging Face model folder holding config.json and model.safetensors "
        "(or model.safetensors.index.json and its shards)"
    )
    if not os.path.exists(path):
        raise CheckpointError(f"Hugging Face checkpoint folder {path} does not exist: {fix}")
    if not os.path.isdir(path):
        raise CheckpointError(f"Hugging Face checkpoint {path} is not a folder: {fix}")
    try:
        names = set(os.listdir(path))
    except PermissionError:
        raise CheckpointError(
            f"Hugging Face checkpoint folder {path} is not readable (permission denied): fix its permissions"
        ) from None
    except OSError as exc:
        raise CheckpointError(f"Hugging Face checkpoint folder {path} cannot be read ({exc.strerror or exc})") from None
    config = read_json(
        os.path.join(path, CONFIG_FILE),
        "config.json",
        "copy the model's config.json into the folder (the weights alone do not say which architecture and sizes "
        "they are)",
    )
    if not isinstance(config, dict):
        raise CheckpointError(
            f"{os.path.join(path, CONFIG_FILE)} is not a JSON object: restore it from the model's files"
        )

    files: dict[str, list[str] | None] = {}  # file -> keys the index assigns (None: all)
    if SINGLE_FILE in names:
        files[SINGLE_FILE] = None
    elif INDEX_FILE in names:
        index_path = os.path.join(path, INDEX_FILE)
        index = read_json(index_path, "index", "restore it from the model's original files")
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index_path} has no weight_map: restore it from the model's original files")
        for key, fname in weight_map.items():
            files.setdefault(str(fname), []).append(key)
        for fname, keys in files.items():
            if fname not in names or not os.path.isfile(os.path.join(path, fname)):
                raise CheckpointError(
                    f"{index_path} lists shard {fname} (with {len(keys)} tensors, e.g. {keys[0]}), which is missing "
                    f"from {path}: copy the complete model folder (all {len(files)} shards)"
                )
    else:
        others = sorted(n for n in names if n.endswith((".bin", ".pt", ".pth", ".safetensors")))
        hint = f" (found {', '.join(others[:3])}: only safetensors weights load)" if others else ""
        raise CheckpointError(
            f"Hugging Face checkpoint folder {path} has no {SINGLE_FILE} or {INDEX_FILE}{hint}: {fix}"
        )

    tensors: dict[str, HFTensorInfo] = {}
    for fname, keys in files.items():
        header = read_header(os.path.join(path, fname))
        assigned = None if keys is None else set(keys)
        for key, info in header.items():
            if key == "__metadata__" or (assigned is not None and key not in assigned):
                continue
            tensors[key] = HFTensorInfo(fname, str(info["dtype"]), tuple(int(s) for s in info["shape"]))
        if keys is not None:
            absent = [k for k in keys if k not in header]
            if absent:
                raise CheckpointError(
                    f"{os.path.join(path, INDEX_FILE)} places {absent[0]} in {fname}, which does not hold it: the "
                    f"shard and the index come from different downloads; copy the complete model folder again"
                )
    return HFCheckpoint(path, config, tensors, sorted(files))


class HFReader:
    """``read(hf_key, slices or None) -> Tensor`` over a checked folder: memory-mapped
    ``safe_open`` handles (one per shard, opened on first use), only the requested slice is
    copied out. ``elements_read`` counts what was read, per key and in total."""

    def __init__(self, checkpoint: HFCheckpoint):
        self.checkpoint = checkpoint
        self._handles: dict[str, Any] = {}
        self.elements_read = 0
        self.reads: dict[str, int] = {}

    def __enter__(self) -> HFReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for h in self._handles.values():
            h.__exit__(None, None, None)
        self._handles.clear()

    def _handle(self, fname: str):
        if fname not in self._handles:
            from safetensors import safe_open

            path = os.path.join(self.checkpoint.path, fname)
            try:
                h = safe_open(path, framework="pt", device="cpu")
                h.__enter__()
            except Exception as exc:  # safetensors raises its own error types
                raise CheckpointError(f"{path} cannot be read ({exc}): download it again") from None
            self._handles[fname] = h
        return self._handles[fname]

    def read(self, key: str, slices: tuple[slice, ...] | None = None) -> Tensor:
        info = self.checkpoint.tensors.get(key)
        if info is None:
            raise CheckpointError(f"Hugging Face checkpoint {self.checkpoint.path} has no tensor {key}")
        h = self._handle(info.file)
        if slices is None:
            t = h.get_tensor(key)
        else:
            t = h.get_slice(key)[tuple(slices)]
        self.elements_read += t.numel()
        self.reads[key] = self.reads.get(key, 0) + t.numel()
        return t


def validate_hf_checkpoint(path: str, adapter, context: str = "") -> HFCheckpoint:
    """Structure, headers, ``config.json`` against the args, then every expected key and shape:
    all before any weight is read."""
    ckpt = open_hf_checkpoint(path)
    ckpt.check_config(adapter, context)
    ckpt.check_tensors(adapter)
    return ckpt
