"""Hugging Face checkpoint folders: validate, read (each rank only its shard), write.

A Hugging Face folder holds ``config.json`` and the weights as ``model.safetensors`` or as
``model.safetensors.index.json`` (``weight_map``: key -> shard file) plus the shards it lists.
This module knows the folder format, never a model: the key names, layouts and ``config.json``
contents come from the model's state-dict adapter (``models/common/hf_adapter.py``, reached via
:func:`models.registry.get_hf_adapter`).

Reading (:func:`load_hf_into_model`, :func:`convert_hf_to_dcp`):

1. :func:`open_hf_checkpoint` checks the folder before any weight is read: it exists and can be
   read, ``config.json`` parses, every shard the index lists exists, every safetensors header
   parses and fits its file. Then ``config.json`` is checked against the model's args
   (``adapter.check_hf_config``), and every tensor the adapter expects is present with its
   shape (from the headers only). Each problem is one :class:`~trainer.checkpoint.CheckpointError`
   naming the path or key and the fix.
2. Each rank computes, for every tensor of its model parts (plain tensor or DTensor of any
   FSDP/TP/EP/HSDP/CP layout; pipeline stages hold only their layers), which rows/columns of
   the full tensor it holds (:func:`local_index`), asks the adapter for exactly that block
   (``adapter.from_hf_local``), which reads it through :class:`HFReader` with
   ``safe_open(...).get_slice(key)[slices]``: memory-mapped, only those bytes.
3. The block is copied into the local shard (converting dtype on the way).

Writing (:func:`save_hf_checkpoint`, :func:`export_dcp_to_hf`): ``to_hf`` per group of tensors
(a layer), shards of at most ``max_shard_bytes`` named ``model-0000i-of-0000N.safetensors``
(or one ``model.safetensors``), the index with ``metadata.total_size`` and ``weight_map``,
``config.json`` from ``adapter.hf_config(dtype)`` and a ``generation_config.json``. Everything is
written into ``<out>.tmp`` and renamed to ``<out>`` last, so an interrupted save never leaves a
folder under the final name.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import struct
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from trainer.checkpoint import CheckpointError, _fsync_dir, _read_failure
from trainer.cli_errors import unwrap_dcp

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_MAX_SHARD_BYTES",
    "HFCheckpoint",
    "HFReader",
    "LoadStats",
    "convert_hf_to_dcp",
    "export_dcp_to_hf",
    "hf_adapter_for",
    "load_hf_into_model",
    "local_index",
    "open_hf_checkpoint",
    "parse_size",
    "plan_shards",
    "save_hf_checkpoint",
    "validate_hf_checkpoint",
]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3

# safetensors dtype names -> torch dtypes this loader accepts (weights are converted to the
# parameter's dtype on load); anything else (FP8, integer quantization) is refused up front
_ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
}
_EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Prefixes that wrappers (activation checkpointing, torch.compile, FSDP1) put into module names;
# state-dict keys and the adapter use the plain FQN.
_WRAPPER_PARTS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")
_LAYER_RE = re.compile(r"^layers\.(\d+)\.")


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


# ==================================================================================== reading


@dataclass(frozen=True)
class HFTensorInfo:
    file: str  # file name inside the folder
    dtype: str  # safetensors dtype name, e.g. "BF16"
    shape: tuple[int, ...]


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
            if info.dtype not in _ST_DTYPES:
                raise CheckpointError(
                    f"Hugging Face checkpoint {self.path}: tensor {key} in {info.file} is stored as {info.dtype}; "
                    f"only {', '.join(_ST_DTYPES)} weights load (dequantize the checkpoint first)"
                )

    def check_config(self, adapter, context: str = "") -> None:
        """``adapter.check_hf_config`` as a one-line CheckpointError naming the file."""
        try:
            adapter.check_hf_config(self.config)
        except ValueError as exc:  # HFConfigMismatch
            where = os.path.join(self.path, CONFIG_FILE)
            raise CheckpointError(f"{where} does not fit {context or 'the model'}: {exc}") from None


def _fail(message: str) -> CheckpointError:
    return CheckpointError(message)


def _read_json(path: str, what: str, fix: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise _fail(f"{path} is missing: {fix}") from None
    except PermissionError:
        raise _fail(f"{path} is not readable (permission denied): fix its permissions") from None
    except IsADirectoryError:
        raise _fail(f"{path} is a folder, expected the {what} file: {fix}") from None
    except json.JSONDecodeError as exc:
        raise _fail(
            f"{path} is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}): restore the {what} "
            f"from the model's original files"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise _fail(f"{path} cannot be read ({exc}): restore the {what} from the model's original files") from None


def _read_header(path: str) -> dict[str, Any]:
    """The JSON header of a safetensors file, checked against the file size (a truncated
    download fails here, before anything is read). Reads 8 + header bytes, no tensor data."""
    name = os.path.basename(path)
    redo = f"download {name} again"
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise _fail(f"{path} is truncated ({size} bytes, no safetensors header): {redo}")
            (n,) = struct.unpack("<Q", head)
            if n <= 0 or 8 + n > size:
                raise _fail(f"{path} is truncated or not a safetensors file (header of {n} bytes): {redo}")
            raw = f.read(n)
    except PermissionError:
        raise _fail(f"{path} is not readable (permission denied): fix its permissions") from None
    except IsADirectoryError:
        raise _fail(f"{path} is a folder, expected a safetensors file: {redo}") from None
    except OSError as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise _fail(f"{path} cannot be read ({exc.strerror or exc}): {redo}") from None
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise _fail(f"{path} has a corrupt safetensors header: {redo}") from None
    if not isinstance(header, dict):
        raise _fail(f"{path} has a corrupt safetensors header: {redo}")
    end = 0
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            shape = [int(s) for s in info["shape"]]
            begin, stop = (int(x) for x in info["data_offsets"])
            str(info["dtype"])
        except (KeyError, TypeError, ValueError):
            raise _fail(f"{path} has a corrupt safetensors header (entry {key!r}): {redo}") from None
        if stop < begin or any(s < 0 for s in shape):
            raise _fail(f"{path} has a corrupt safetensors header (entry {key!r}): {redo}")
        end = max(end, stop)
    if 8 + n + end > size:
        raise _fail(f"{path} is truncated ({size} bytes, its header needs {8 + n + end}): {redo}")
    return header


def open_hf_checkpoint(path: str) -> HFCheckpoint:
    """Check the folder's structure and every safetensors header; read no weight."""
    fix = (
        "point it at a Hugging Face model folder holding config.json and model.safetensors "
        "(or model.safetensors.index.json and its shards)"
    )
    if not os.path.exists(path):
        raise _fail(f"Hugging Face checkpoint folder {path} does not exist: {fix}")
    if not os.path.isdir(path):
        raise _fail(f"Hugging Face checkpoint {path} is not a folder: {fix}")
    try:
        names = set(os.listdir(path))
    except PermissionError:
        raise _fail(
            f"Hugging Face checkpoint folder {path} is not readable (permission denied): fix its permissions"
        ) from None
    except OSError as exc:
        raise _fail(f"Hugging Face checkpoint folder {path} cannot be read ({exc.strerror or exc})") from None
    config = _read_json(
        os.path.join(path, CONFIG_FILE),
        "config.json",
        "copy the model's config.json into the folder (the weights alone do not say which architecture and sizes "
        "they are)",
    )
    if not isinstance(config, dict):
        raise _fail(f"{os.path.join(path, CONFIG_FILE)} is not a JSON object: restore it from the model's files")

    files: dict[str, list[str] | None] = {}  # file -> keys the index assigns (None: all)
    if SINGLE_FILE in names:
        files[SINGLE_FILE] = None
    elif INDEX_FILE in names:
        index_path = os.path.join(path, INDEX_FILE)
        index = _read_json(index_path, "index", "restore it from the model's original files")
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise _fail(f"{index_path} has no weight_map: restore it from the model's original files")
        for key, fname in weight_map.items():
            files.setdefault(str(fname), []).append(key)
        for fname, keys in files.items():
            if fname not in names or not os.path.isfile(os.path.join(path, fname)):
                raise _fail(
                    f"{index_path} lists shard {fname} (with {len(keys)} tensors, e.g. {keys[0]}), which is missing "
                    f"from {path}: copy the complete model folder (all {len(files)} shards)"
                )
    else:
        others = sorted(n for n in names if n.endswith((".bin", ".pt", ".pth", ".safetensors")))
        hint = f" (found {', '.join(others[:3])}: only safetensors weights load)" if others else ""
        raise _fail(f"Hugging Face checkpoint folder {path} has no {SINGLE_FILE} or {INDEX_FILE}{hint}: {fix}")

    tensors: dict[str, HFTensorInfo] = {}
    for fname, keys in files.items():
        header = _read_header(os.path.join(path, fname))
        assigned = None if keys is None else set(keys)
        for key, info in header.items():
            if key == "__metadata__" or (assigned is not None and key not in assigned):
                continue
            tensors[key] = HFTensorInfo(fname, str(info["dtype"]), tuple(int(s) for s in info["shape"]))
        if keys is not None:
            absent = [k for k in keys if k not in header]
            if absent:
                raise _fail(
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


def hf_adapter_for(model_name: str, args):
    from models.registry import get_hf_adapter

    return get_hf_adapter(model_name, args)


def validate_hf_checkpoint(path: str, adapter, context: str = "") -> HFCheckpoint:
    """Structure, headers, ``config.json`` against the args, then every expected key and shape:
    all before any weight is read."""
    ckpt = open_hf_checkpoint(path)
    ckpt.check_config(adapter, context)
    ckpt.check_tensors(adapter)
    return ckpt


# ---------------------------------------------------------------------- which part a rank holds


def local_index(t: Tensor) -> tuple[Tensor, list[Tensor] | None]:
    """``(local tensor, index)`` of a state-dict entry: ``index[d]`` holds the positions along
    dim ``d`` of the FULL tensor that the local tensor's rows/columns are, in order (None for a
    plain tensor: everything). Placements are applied left to right over mesh dims, as DTensor
    does: ``Replicate`` keeps the dim whole, ``Shard(d)`` takes this rank's ``torch.chunk``
    piece, ``_StridedShard(d, split_factor)`` (FSDP over a TP-sharded dim) its strided piece
    (the placements' own ``_split_tensor`` rule, applied to position lists)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Shard

    try:
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:  # pragma: no cover - every supported torch has it
        _StridedShard = ()

    if not isinstance(t, DTensor):
        return t, None
    local = t.to_local()
    mesh = t.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:  # this rank is not in the tensor's mesh: holds nothing of it
        return local, [torch.arange(0) for _ in t.shape]
    index = [torch.arange(n) for n in t.shape]
    for mesh_dim, p in enumerate(t.placements):
        if p.is_replicate():
            continue
        if _StridedShard and isinstance(p, _StridedShard):
            rule = _StridedShard(0, split_factor=p.split_factor)
        elif isinstance(p, Shard):
            rule = Shard(0)
        else:
            raise RuntimeError(f"cannot load into a DTensor with placement {p} (only Shard/Replicate are state)")
        pieces, _ = rule._split_tensor(index[p.dim], mesh.size(mesh_dim), with_padding=False)
        index[p.dim] = pieces[coord[mesh_dim]]
    if tuple(len(i) for i in index) != tuple(local.shape):
        raise RuntimeError(
            f"computed local shape {tuple(len(i) for i in index)} for placements {t.placements} on mesh "
            f"{mesh.shape}, but the local tensor is {tuple(local.shape)}"
        )
    return local, index


def _slices_of(index: list[Tensor] | None, shape: Sequence[int]) -> tuple[tuple[slice, ...], list[Tensor | None]]:
    """Covering slices of the full tensor, plus per dim the positions to pick inside the
    block read with them (None where the positions are the whole contiguous slice)."""
    if index is None:
        return tuple(slice(0, n) for n in shape), [None] * len(shape)
    slices, picks = [], []
    for idx in index:
        if idx.numel() == 0:
            slices.append(slice(0, 0))
            picks.append(None)
            continue
        lo, hi = int(idx.min()), int(idx.max()) + 1
        slices.append(slice(lo, hi))
        contiguous = hi - lo == idx.numel() and bool((idx[1:] > idx[:-1]).all())
        picks.append(None if contiguous else idx - lo)
    return tuple(slices), picks


def _plain_name(name: str) -> str:
    return ".".join(p for p in name.split(".") if p not in _WRAPPER_PARTS)


@dataclass
class LoadStats:
    """What one rank loaded: tensors, elements copied into local shards, elements read."""

    tensors: int = 0
    local_elements: int = 0
    elements_read: int = 0
    kept: list[str] = field(default_factory=list)  # buffers with no Hugging Face source (kept)


def _model_state(part: nn.Module) -> dict[str, Tensor]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(part)


@torch.no_grad()
def load_hf_into_model(
    model_parts: Sequence[nn.Module],
    folder: str,
    model_name: str,
    args,
    *,
    context: str = "",
    checkpoint: HFCheckpoint | None = None,
) -> LoadStats:
    """Load a Hugging Face folder into this rank's model parts, whatever their layout, each
    rank reading only the slices of the checkpoint tensors it holds. Checks the folder,
    config.json against ``args`` and every tensor's shape first (CheckpointError, one line).
    Buffers the checkpoint does not hold (RoPE tables are not state) keep their values; a
    parameter the checkpoint cannot fill is an error, never left silently at its init."""
    adapter = hf_adapter_for(model_name, args)
    ckpt = checkpoint or validate_hf_checkpoint(folder, adapter, context)
    covered = adapter.our_keys()
    stats = LoadStats()
    with ckpt.reader() as reader:
        for part in model_parts:
            params = {_plain_name(n) for n, _ in part.named_parameters()}
            for key, t in _model_state(part).items():
                if key not in covered:
                    if key in params:
                        raise RuntimeError(
                            f"parameter {key} of {model_name} has no source in the Hugging Face adapter "
                            f"({type(adapter).__name__}): it would stay at its random init"
                        )
                    stats.kept.append(key)
                    continue
                if tuple(t.shape) != tuple(covered[key]):
                    raise RuntimeError(f"{key}: the model has shape {tuple(t.shape)}, the adapter {covered[key]}")
                local, index = local_index(t)
                stats.tensors += 1
                if local.numel() == 0:
                    continue
                slices, picks = _slices_of(index, t.shape)
                block = adapter.from_hf_local(key, slices, reader.read)
                for dim, pick in enumerate(picks):
                    if pick is not None:
                        block = block.index_select(dim, pick)
                if tuple(block.shape) != tuple(local.shape):
                    raise RuntimeError(
                        f"{key}: the adapter returned {tuple(block.shape)} for slices {slices}, the local shard is "
                        f"{tuple(local.shape)}"
                    )
                local.copy_(block)
                stats.local_elements += local.numel()
        stats.elements_read = reader.elements_read
    return stats


# ==================================================================================== writing


def plan_shards(sizes: Sequence[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    """Pack ``(key, nbytes)`` in order into files of at most ``max_shard_bytes`` (a tensor
    larger than that gets a file of its own)."""
    files: list[list[str]] = []
    current: list[str] = []
    used = 0
    for key, nbytes in sizes:
        if current and used + nbytes > max_shard_bytes:
            files.append(current)
            current, used = [], 0
        current.append(key)
        used += nbytes
    if current:
        files.append(current)
    return files


def shard_names(n: int) -> list[str]:
    if n == 1:
        return [SINGLE_FILE]
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def _export_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _EXPORT_DTYPES:
        raise ValueError(f"export dtype must be one of {sorted(_EXPORT_DTYPES)}, got {dtype!r}")
    return _EXPORT_DTYPES[dtype]


def _dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in _EXPORT_DTYPES.items()}[dtype]


def _stored_dtype(t: Tensor, dtype: torch.dtype, keep_fp32: bool) -> torch.dtype:
    if not t.is_floating_point():
        return t.dtype
    return torch.float32 if keep_fp32 else dtype


def _prepare(t: Tensor, dtype: torch.dtype) -> Tensor:
    t = t.detach().to("cpu").to(dtype).contiguous()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()  # a view of a larger tensor: safetensors wants owned storage
    return t


class HFFolderWriter:
    """Write shards into ``<final>.tmp``; :meth:`commit` adds the index and config files and
    renames to ``<final>`` (an existing ``<final>`` is replaced only then)."""

    def __init__(self, final: str):
        self.final = os.path.abspath(final)
        self.tmp = self.final + ".tmp"

    def start(self) -> None:
        if os.path.exists(self.tmp):
            shutil.rmtree(self.tmp)  # left by a crashed save
        os.makedirs(self.tmp)

    def write_file(self, name: str, tensors: Mapping[str, Tensor]) -> None:
        from safetensors.torch import save_file

        save_file(dict(tensors), os.path.join(self.tmp, name), metadata={"format": "pt"})

    def commit(
        self,
        config: Mapping[str, Any],
        files: Sequence[Sequence[str]],
        total_size: int,
    ) -> str:
        names = shard_names(len(files))
        if len(files) > 1:
            index = {
                "metadata": {"total_size": int(total_size)},
                "weight_map": {k: name for name, keys in zip(names, files) for k in sorted(keys)},
            }
            self._write_json(INDEX_FILE, index)
        gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None}
        if gen:
            self._write_json(GENERATION_CONFIG_FILE, {"_from_model_config": True, **gen})
        self._write_json(CONFIG_FILE, dict(config))
        _fsync_dir(self.tmp)
        old = self.final + ".old"
        if os.path.exists(old):
            shutil.rmtree(old)
        if os.path.exists(self.final):
            os.replace(self.final, old)
        os.replace(self.tmp, self.final)
        _fsync_dir(os.path.dirname(self.final))
        if os.path.exists(old):
            shutil.rmtree(old)
        return self.final

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)

    def _write_json(self, name: str, obj: Any) -> None:
        with open(os.path.join(self.tmp, name), "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2, sort_keys=False)
            f.write("\n")


def save_hf_checkpoint(
    out_dir: str,
    hf_state_dict: Mapping[str, Tensor],
    config: Mapping[str, Any],
    *,
    dtype: str | torch.dtype = "float32",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    keep_fp32: Callable[[str], bool] | None = None,
) -> str:
    """Single process: write an in-memory Hugging Face state dict (already in HF keys and
    layouts) as a folder; ``config`` is written as config.json as given."""
    target = _export_dtype(dtype)
    keep = keep_fp32 or (lambda _k: False)
    dtypes = {k: _stored_dtype(t, target, keep(k)) for k, t in hf_state_dict.items()}
    sizes = [(k, t.numel() * dtypes[k].itemsize) for k, t in hf_state_dict.items()]
    files = plan_shards(sizes, max_shard_bytes)
    writer = HFFolderWriter(out_dir)
    writer.start()
    try:
        for name, keys in zip(shard_names(len(files)), files):
            writer.write_file(name, {k: _prepare(hf_state_dict[k], dtypes[k]) for k in keys})
        return writer.commit(config, files, sum(n for _, n in sizes))
    except BaseException:
        writer.abort()
        raise


# ------------------------------------------------------------------ DCP <-> Hugging Face


def _group_of(key: str) -> str:
    m = _LAYER_RE.match(key)
    return f"layers.{m.group(1)}" if m else key.split(".")[0]


def _groups(keys: Iterable[str]) -> list[tuple[str, list[str]]]:
    """Our keys grouped by layer (``layers.N``) or top-level module, first appearance order."""
    out: dict[str, list[str]] = {}
    for k in keys:
        out.setdefault(_group_of(k), []).append(k)
    return list(out.items())


def _dcp_model_meta(dcp_dir: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if not os.path.isdir(dcp_dir):
        raise CheckpointError(f"checkpoint {dcp_dir} does not exist: point it at a step-N folder of a run")
    if not os.path.isfile(os.path.join(dcp_dir, ".metadata")):
        raise CheckpointError(
            f"{dcp_dir} is not a complete checkpoint (no .metadata): point it at a step-N folder of a run "
            f"(checkpoint.folder) or a folder written by convert_hf.py to-dcp"
        )
    try:
        meta = dcp.FileSystemReader(dcp_dir).read_metadata().state_dict_metadata
    except Exception as exc:  # a truncated or foreign .metadata
        raise CheckpointError(f"checkpoint {dcp_dir} is unreadable (truncated or corrupt .metadata: {exc})") from None
    out = {
        k[len("model.") :]: (tuple(m.size), m.properties.dtype)
        for k, m in meta.items()
        if k.startswith("model.") and isinstance(m, TensorStorageMetadata)
    }
    if not out:
        raise CheckpointError(f"checkpoint {dcp_dir} holds no model weights")
    return out


def _dcp_read(dcp_dir: str, keys: Sequence[str], meta) -> dict[str, Tensor]:
    import torch.distributed.checkpoint as dcp

    state = {k: torch.empty(meta[k][0], dtype=meta[k][1]) for k in keys}
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({"model": state}, checkpoint_id=dcp_dir, no_dist=True)
    except BaseException as exc:  # DCP wraps what failed in a CheckpointException (a BaseException)
        reason = _read_failure(exc, "shard file")
        if reason is None:
            inner = unwrap_dcp(exc)
            if inner is exc:
                raise
            raise inner from None
        raise CheckpointError(
            f"checkpoint {dcp_dir} is unreadable ({reason}): point it at another step-N folder, or write this one "
            f"again (save it again, or rerun convert_hf.py to-dcp)"
        ) from None
    return state


def _hf_of_group(adapter, group_state: Mapping[str, Tensor], placeholders: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``to_hf`` of a subset of our keys: the adapter converts full state dicts, so the other
    keys are meta placeholders (no memory, no compute) and only the subset's outputs are kept."""
    full = dict(placeholders)
    full.update(group_state)
    hf = adapter.to_hf(full)
    wanted = [h for k in group_state for h in adapter.hf_keys_for(k)]
    return {h: hf[h] for h in wanted}


def export_dcp_to_hf(
    dcp_dir: str,
    out_dir: str,
    model_name: str,
    args,
    *,
    dtype: str | torch.dtype = "bfloat16",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    progress: Callable[[str], None] | None = None,
    process_group=None,
) -> str:
    """Write the model weights of a DCP checkpoint (``model.<fqn>`` keys: a run's step-N or a
    convert_hf.py to-dcp folder) as a Hugging Face folder.

    Collective when torch.distributed is initialized (every rank of ``process_group`` calls
    it): shard file i is converted and written by rank ``i % world``, so the work and memory are
    spread; rank 0 writes the index and config files and publishes the folder. One process
    holds at most the layer groups of the file it is writing (ours and Hugging Face's) plus that
    file's tensors."""
    say = progress or (lambda _m: None)
    target = _export_dtype(dtype)
    adapter = hf_adapter_for(model_name, args)
    meta = _dcp_model_meta(dcp_dir)
    ours = adapter.our_keys()
    missing = [k for k in ours if k not in meta]
    if missing:
        raise CheckpointError(
            f"checkpoint {dcp_dir} lacks {len(missing)} weights of {model_name} with these args, e.g. {missing[:3]}: "
            f"it was saved from another model or flavor (pass the --model/--flavor it was trained with)"
        )
    wrong = [(k, meta[k][0], s) for k, s in ours.items() if tuple(meta[k][0]) != tuple(s)]
    if wrong:
        k, got, want = wrong[0]
        raise CheckpointError(
            f"checkpoint {dcp_dir}: {k} has shape {list(got)}, expected {list(want)} for {model_name} with these args: "
            f"pick the flavor (and model.n_layers / vocab_size) it was trained with"
        )
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank(process_group) if distributed else 0
    world = dist.get_world_size(process_group) if distributed else 1

    # plan from shapes only: to_hf on meta tensors gives every Hugging Face key and shape
    placeholders = {k: torch.empty(s, dtype=meta[k][1], device="meta") for k, s in ours.items()}
    groups = _groups(ours)
    hf_meta: list[tuple[str, str, Tensor]] = []  # (group, hf key, meta tensor)
    for gname, keys in groups:
        for h, t in _hf_of_group(adapter, {k: placeholders[k] for k in keys}, placeholders).items():
            hf_meta.append((gname, h, t))
    expected = adapter.hf_keys()
    produced = {h: tuple(t.shape) for _, h, t in hf_meta}
    if produced != {k: tuple(v) for k, v in expected.items()}:
        raise RuntimeError(f"{type(adapter).__name__}.to_hf does not produce exactly hf_keys()")
    dtypes = {h: _stored_dtype(t, target, adapter.keep_in_fp32(h)) for _, h, t in hf_meta}
    sizes = [(h, t.numel() * dtypes[h].itemsize) for _, h, t in hf_meta]
    files = plan_shards(sizes, max_shard_bytes)
    names = shard_names(len(files))
    group_of = {h: g for g, h, _ in hf_meta}
    group_keys = dict(groups)

    writer = HFFolderWriter(out_dir)
    if rank == 0:
        writer.start()
    if distributed:
        dist.barrier(group=process_group)
    try:
        mine = [i for i in range(len(files)) if i % world == rank]
        cache: dict[str, dict[str, Tensor]] = {}  # group -> its Hugging Face tensors
        for i in mine:
            needed = list(dict.fromkeys(group_of[h] for h in files[i]))
            for g in list(cache):
                if g not in needed:
                    del cache[g]
            for g in needed:
                if g not in cache:
                    cache[g] = _hf_of_group(adapter, _dcp_read(dcp_dir, group_keys[g], meta), placeholders)
            writer.write_file(names[i], {h: _prepare(cache[group_of[h]][h], dtypes[h]) for h in files[i]})
            say(f"wrote {names[i]} ({len(files[i])} tensors) [{i + 1}/{len(files)}]")
        cache.clear()
    except BaseException:
        if not distributed:
            writer.abort()
        raise
    if distributed:
        dist.barrier(group=process_group)
    if rank == 0:
        writer.commit(adapter.hf_config(_dtype_name(target)), files, sum(n for _, n in sizes))
    if distributed:
        dist.barrier(group=process_group)
    return os.path.abspath(out_dir)


def convert_hf_to_dcp(
    hf_dir: str,
    out_dir: str,
    model_name: str,
    args,
    *,
    context: str = "",
    progress: Callable[[str], None] | None = None,
) -> str:
    """Single process: a Hugging Face folder -> a DCP folder (``.metadata`` + one file per
    tensor, ``model.<fqn>`` keys, the model's parameter dtypes) that
    ``checkpoint.initial_load_path`` accepts. Everything is checked before anything is written;
    tensors are converted one at a time while DCP writes them (a lazy save planner), so about
    one tensor is in memory, never the model."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from models.registry import get_model_spec, model_names

    say = progress or (lambda _m: None)
    if model_name not in model_names():
        raise ValueError(f"unknown model {model_name!r}; valid: {', '.join(model_names())}")
    adapter = hf_adapter_for(model_name, args)
    ckpt = validate_hf_checkpoint(hf_dir, adapter, context)
    say(f"checked {hf_dir}: config.json fits, {len(ckpt.tensors)} tensors in {len(ckpt.files)} file(s)")
    with torch.device("meta"):
        model = get_model_spec(model_name, _first_flavor(model_name)).model_cls(args)
    state = model.state_dict()
    covered = adapter.our_keys()
    uncovered = [k for k in state if k not in covered]
    if uncovered:
        raise RuntimeError(
            f"{type(adapter).__name__} has no source for {uncovered[:5]}: cannot write a full checkpoint"
        )
    placeholders = {k: torch.empty(t.shape, dtype=t.dtype, device="meta") for k, t in state.items()}
    out_dir = os.path.abspath(out_dir)
    tmp = out_dir + ".tmp"
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    reader = ckpt.reader()
    groups = _groups(state)
    position = {k: gi for gi, (_, keys) in enumerate(groups) for k in keys}
    seen: set[int] = set()

    class _LazyPlanner(DefaultSavePlanner):
        def resolve_data(self, write_item):
            key = write_item.index.fqn[len("model.") :]
            gi = position[key]
            if gi not in seen:
                seen.add(gi)
                say(f"converting {groups[gi][0]} ({len(groups[gi][1])} tensors) [{len(seen)}/{len(groups)}]")
            ref = placeholders[key]
            full = tuple(slice(0, n) for n in ref.shape)
            return adapter.from_hf_local(key, full, reader.read).to(ref.dtype).contiguous()

    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(
                {"model": placeholders},
                storage_writer=FileSystemWriter(tmp, single_file_per_rank=False, thread_count=1),
                planner=_LazyPlanner(),
                no_dist=True,
            )
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        # dcp.save reports what failed while it planned or wrote (here: reading the Hugging Face
        # tensors in resolve_data, e.g. a CheckpointError for a corrupt safetensors file) as a
        # CheckpointException, a BaseException wrapping it: raise what actually failed
        inner = unwrap_dcp(exc)
        if inner is exc:
            raise
        raise inner from None
    finally:
        reader.close()
    os.replace(tmp, out_dir)
    _fsync_dir(os.path.dirname(out_dir))
    return out_dir


def _first_flavor(model_name: str) -> str:
    from models.registry import flavor_names

    return flavor_names(model_name)[0]
