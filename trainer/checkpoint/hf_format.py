"""The Hugging Face folder format, read without reading a weight.

A Hugging Face folder holds ``config.json`` and the weights as ``model.safetensors`` or as
``model.safetensors.index.json`` (``weight_map``: key -> shard file) plus the shards it lists.
This module knows the file names, the safetensors dtype names we accept, and how to check a
file before trusting it: :func:`read_header` is a small hand-written safetensors header parser
(8-byte little-endian length, a JSON header, offsets checked against the file size), so a
truncated or foreign file is one :class:`~trainer.checkpoint.errors.CheckpointError` naming
the file and the fix, before anything is memory-mapped. It knows no model: key names, layouts
and ``config.json`` contents come from the model's state-dict adapter
(``models/common/hf_adapter.py``, from the registry: ``models.registry.get_hf_adapter``).
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass
from typing import Any

import torch

from trainer.checkpoint.errors import CheckpointError

__all__ = [
    "CONFIG_FILE",
    "DEFAULT_MAX_SHARD_BYTES",
    "GENERATION_CONFIG_FILE",
    "INDEX_FILE",
    "SINGLE_FILE",
    "ST_DTYPES",
    "HFTensorInfo",
    "parse_size",
    "read_header",
    "read_json",
]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3

# safetensors dtype names -> torch dtypes this loader accepts (weights are converted to the
# parameter's dtype on load); anything else (FP8, integer quantization) is refused up front
ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
}


def parse_size(text: str | int) -> int:
    """``"5GB"``, ``"500MB"``, ``"1.5GiB"``, ``"4096"`` -> bytes (decimal or binary units)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?i?B?)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise ValueError(f"cannot read {text!r} as a size; write e.g. 5GB, 500MB or 4096 (bytes)")
    unit = (m.group(2) or "").upper().rstrip("B")
    base = 1024 if unit.endswith("I") else 1000
    power = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}[unit.rstrip("I")]
    value = int(float(m.group(1)) * base**power)
    if value <= 0:
        raise ValueError(f"a shard size must be > 0 bytes, got {text!r}")
    return value


@dataclass(frozen=True)
class HFTensorInfo:
    file: str  # file name inside the folder
    dtype: str  # safetensors dtype name, e.g. "BF16"
    shape: tuple[int, ...]


def read_json(path: str, what: str, fix: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: {fix}") from None
    except PermissionError:
        raise CheckpointError(f"{path} is not readable (permission denied): fix its permissions") from None
    except IsADirectoryError:
        raise CheckpointError(f"{path} is a folder, expected the {what} file: {fix}") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(
            f"{path} is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}): restore the {what} "
            f"from the model's original files"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(
            f"{path} cannot be read ({exc}): restore the {what} from the model's original files"
        ) from None


def read_hf_config(path: str) -> dict[str, Any]:
    """The parsed config.json of a Hugging Face folder (``path`` is the folder or the file)."""
    file = os.path.join(path, CONFIG_FILE) if os.path.isdir(path) else path
    if not os.path.exists(file):
        raise CheckpointError(
            f"{file} does not exist: point it at a Hugging Face model folder holding config.json (or at the file)"
        )
    config = read_json(file, "config.json", "copy the model's config.json there")
    if not isinstance(config, dict):
        raise CheckpointError(f"{file} is not a JSON object: restore it from the model's files")
    return config


def read_header(path: str) -> dict[str, Any]:
    """The JSON header of a safetensors file, checked against the file size (a truncated
    download fails here, before anything is read). Reads 8 + header bytes, no tensor data."""
    name = os.path.basename(path)
    redo = f"download {name} again"
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path} is truncated ({size} bytes, no safetensors header): {redo}")
            (n,) = struct.unpack("<Q", head)
            if n <= 0 or 8 + n > size:
                raise CheckpointError(f"{path} is truncated or not a safetensors file (header of {n} bytes): {redo}")
            raw = f.read(n)
    except PermissionError:
        raise CheckpointError(f"{path} is not readable (permission denied): fix its permissions") from None
    except IsADirectoryError:
        raise CheckpointError(f"{path} is a folder, expected a safetensors file: {redo}") from None
    except OSError as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(f"{path} cannot be read ({exc.strerror or exc}): {redo}") from None
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointError(f"{path} has a corrupt safetensors header: {redo}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} has a corrupt safetensors header: {redo}")
    end = 0
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            shape = [int(s) for s in info["shape"]]
            begin, stop = (int(x) for x in info["data_offsets"])
            str(info["dtype"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path} has a corrupt safetensors header (entry {key!r}): {redo}") from None
        if stop < begin or any(s < 0 for s in shape):
            raise CheckpointError(f"{path} has a corrupt safetensors header (entry {key!r}): {redo}")
        end = max(end, stop)
    if 8 + n + end > size:
        raise CheckpointError(f"{path} is truncated ({size} bytes, its header needs {8 + n + end}): {redo}")
    return header
