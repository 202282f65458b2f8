"""Loading a Hugging Face folder into this rank's model parts, whatever their layout.

Each rank computes, for every tensor of its model parts (plain tensor or DTensor of any
FSDP/TP/EP/HSDP/CP layout; pipeline stages hold only their layers), which rows/columns of the
full tensor it holds (:func:`local_index`), asks the adapter for exactly that block
(``adapter.from_hf_local``), which reads it through :class:`~trainer.checkpoint.hf_reader.HFReader`
with ``safe_open(...).get_slice(key)[slices]`` (memory-mapped, only those bytes), and copies the
block into the local shard, converting dtype on the way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from models import registry
from models.parallel.lora import is_adapter_key
from trainer.checkpoint.hf_reader import HFCheckpoint, validate_hf_checkpoint

__all__ = ["LoadStats", "load_hf_into_model", "local_index"]

# Prefixes that wrappers (activation checkpointing, torch.compile, FSDP1) put into module names;
# state-dict keys and the adapter use the plain FQN.
_WRAPPER_PARTS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")


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
    adapter = registry.get_hf_adapter(model_name, args)
    ckpt = checkpoint or validate_hf_checkpoint(folder, adapter, context)
    covered = adapter.our_keys()
    stats = LoadStats()
    with ckpt.reader() as reader:
        for part in model_parts:
            params = {_plain_name(n) for n, _ in part.named_parameters()}
            for key, t in _model_state(part).items():
                if is_adapter_key(key):  # LoRA adapters: never part of a base checkpoint
                    continue
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
