"""Consolidated weights: the model of a run (or of a DCP checkpoint) as one ``.pt`` or
``.safetensors`` file of full, unsharded tensors under plain FQNs (``checkpoint.last_save_model_only``;
``python -m trainer.checkpoint STEP_DIR OUT``). The Hugging Face folder export is
:mod:`trainer.checkpoint.hf_write`."""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from trainer.checkpoint.errors import CheckpointError
from trainer.checkpoint.live import LiveModel
from trainer.checkpoint.state import barrier, distributed, export_dtype, is_complete, rank
from trainer.runtime.files import atomic_path

__all__ = ["export_checkpoint", "export_consolidated"]


def _write_consolidated(state: dict[str, torch.Tensor], path: str, dtype: str) -> str:
    target = export_dtype(dtype)
    state = {k: (v.to(target) if v.is_floating_point() else v).contiguous() for k, v in state.items()}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if path.endswith(".safetensors"):
        try:
            from safetensors.torch import save_file
        except ImportError:
            raise RuntimeError(
                f"cannot write {path}: safetensors is not installed; export to a .pt path instead"
            ) from None
        with atomic_path(path) as tmp:
            save_file(state, tmp)
    else:
        with atomic_path(path) as tmp:
            torch.save(state, tmp)
    return path


def export_checkpoint(checkpoint_dir: str, path: str, dtype: str = "float32") -> str:
    """Single process: consolidate the model weights of a DCP checkpoint into one file."""
    if not os.path.isdir(checkpoint_dir):
        raise CheckpointError(f"checkpoint {checkpoint_dir} does not exist: point it at a step-N folder of a run")
    if not is_complete(checkpoint_dir):
        raise CheckpointError(f"{checkpoint_dir} is not a complete checkpoint (no .metadata)")
    meta = dcp.FileSystemReader(checkpoint_dir).read_metadata().state_dict_metadata
    state = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in meta.items()
        if k.startswith("model.") and isinstance(m, TensorStorageMetadata)
    }
    if not state:
        raise CheckpointError(f"{checkpoint_dir} holds no model weights")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=checkpoint_dir, no_dist=True)
    return _write_consolidated({k[len("model.") :]: v for k, v in state.items()}, path, dtype)


def export_consolidated(
    model_parts: Sequence[nn.Module], path: str, dtype: str = "float32", *, process_group=None
) -> str:
    """Write the full weights as one ``.pt`` (or ``.safetensors``) file from rank 0.

    Collective. Without pipeline parallelism rank 0 holds every FQN and the weights are
    gathered with ``get_model_state_dict(full_state_dict=True, cpu_offload=True)``. With
    pipeline stages on other ranks, rank 0 cannot gather their weights that way, so each
    tensor is gathered by the ranks that hold it and the first of them sends it to rank 0,
    already in the export dtype (:class:`~trainer.checkpoint.live.LiveModel`): rank 0 holds the
    model in the export dtype, which it writes anyway; no temporary checkpoint is written.
    """
    pg = process_group
    writer = rank(pg) == 0
    own = sorted(k for part in model_parts for k in get_model_state_dict(part).keys())
    all_keys: list[Any] = [own]
    if distributed() and dist.get_world_size(pg) > 1:
        all_keys = [None] * dist.get_world_size(pg)
        dist.all_gather_object(all_keys, own, group=pg)
    if all(set(keys) <= set(all_keys[0]) for keys in all_keys):
        full: dict[str, torch.Tensor] = {}
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        for part in model_parts:
            full.update(get_model_state_dict(part, options=opts))
        if writer:
            _write_consolidated(full, path, dtype)
        barrier(pg)
        return path
    target = export_dtype(dtype)
    live = LiveModel(model_parts, pg)
    state = live.fetch(live.order, 0, cast=lambda t: t.to(target) if t.is_floating_point() else t)
    if writer:
        _write_consolidated(state, path, dtype)
    del state
    barrier(pg)
    return path
