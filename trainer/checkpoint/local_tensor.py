"""Checkpoints of a ``comm.mode = "local_tensor"`` run (trainer/simulation/local_tensor.py): every rank of
the job is simulated in this one process, so the checkpoint is written and read by this process
alone, in the format every real run reads.

DCP's own distributed save and load plan across ranks with gather/scatter to one rank, an MPMD
operation LocalTensor refuses. So :class:`LocalTensorFolder` (the run's ``step-N`` folder, with
the same tmp-then-rename publishing and ``keep_latest_k`` retention as
:class:`~trainer.checkpoint.dcp.CheckpointFolder`) saves each tensor in FULL: a sharded DTensor
is gathered over its mesh under the simulation (``full_tensor``), and every simulated rank must
then hold the same value (``LocalTensor.reconcile`` checks it) before it is written once with
``no_dist=True``. Keys, dtypes and the ``train_state`` blob are those of a real save, and DCP
reshards on load, so a real multi-process run of any layout resumes from it. Loading reads every
tensor in full on the host and cuts each simulated rank's piece the way its DTensor is sharded,
so a local_tensor run resumes from a real run's checkpoint (written sharded by N processes) as
well as from its own.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from models.common.init import canonical_fqn, write_full_into
from parallel_dims.torch_compat import host_side
from trainer.checkpoint.async_save import DrillWriter
from trainer.checkpoint.dcp import EXCLUDABLE, CheckpointFolder, train_state_blob
from trainer.checkpoint.errors import CheckpointError
from trainer.checkpoint.state import (
    checkpoint_keys,
    checkpoint_state_dict,
    from_blob,
    is_complete,
    set_rng_state,
    stored_optimizer_keys,
)

__all__ = ["LocalTensorFolder", "full_value", "load_full_weights", "load_local_initial_weights"]


def full_value(value: Any) -> Any:
    """A plain, full tensor for ``value`` (a DTensor over LocalTensors, or a LocalTensor that
    every simulated rank holds alike); anything else unchanged. Collective for DTensors (called
    under the simulation)."""
    from torch.distributed._local_tensor import LocalTensor

    if isinstance(value, DTensor):
        value = value.full_tensor()
    if isinstance(value, LocalTensor):
        try:
            return value.reconcile()
        except AssertionError:
            raise CheckpointError(
                "comm.mode = local_tensor: a checkpointed tensor differs between simulated ranks although "
                "the checkpoint stores one value for all; this is a bug in the simulation, please report it"
            ) from None
    return value


def _template(value: Any) -> Any:
    """The host tensor a full ``value`` is read into (global shape, its dtype); non-tensors as is."""
    if isinstance(value, torch.Tensor):
        return torch.empty(tuple(value.shape), dtype=value.dtype, device="cpu")
    return value


def _cut(target: Any, full: Any) -> Any:
    """``full`` cut for every simulated rank like ``target`` (a DTensor is sharded like it; a
    LocalTensor gets the same value on every rank); non-tensors as loaded."""
    if isinstance(target, DTensor):
        return distribute_tensor(full.to(target.dtype), target.device_mesh, target.placements, src_data_rank=None)
    if isinstance(target, torch.Tensor):
        out = torch.empty_like(target)
        out.copy_(full.to(target.dtype))
        return out
    return full


class LocalTensorFolder(CheckpointFolder):
    """The run's checkpoint folder in local_tensor mode: full tensors, one writer (module
    docstring). The base class's publishing, retention and step listing are used as they are,
    with the simulation off (one process: its barriers are no-ops on the fake group)."""

    def state(self, step, model_parts, optimizer=None, lr_scheduler=None, dataloader=None, extra=None):
        state: dict[str, Any] = {"model": {k: full_value(v) for k, v in checkpoint_state_dict(model_parts).items()}}
        if optimizer is not None:
            state["optimizer"] = {k: full_value(v) for k, v in optimizer.state_dict().items()}
        with host_side():  # host objects: the same for every simulated rank, rank 0's by definition
            data = dataloader.state_dict() if dataloader is not None else None  # every rank's (PerRankLoader)
            state["train_state"] = train_state_blob(step, lr_scheduler, data, extra)
        return state

    def save_state(self, step: int, state: dict[str, Any]) -> str:
        with host_side():
            tmp = self.begin(step)
            dcp.save(state, storage_writer=DrillWriter(tmp, step=step, rank=0), no_dist=True)
            return self.publish(step)

    def begin(self, step: int) -> str:
        with host_side():
            return super().begin(step)

    def publish(self, step: int) -> str:
        with host_side():
            return super().publish(step)

    def read(self, path: str, model_parts, optimizer, lr_scheduler, dataloader, *, exclude: Iterable[str]) -> dict:
        return load_full_checkpoint(path, model_parts, optimizer, lr_scheduler, dataloader, exclude)


def load_full_checkpoint(
    path: str,
    model_parts: Sequence[nn.Module],
    optimizer=None,
    lr_scheduler=None,
    dataloader=None,
    exclude: Iterable[str] = (),
) -> dict[str, Any]:
    """What :func:`trainer.checkpoint.dcp.load_checkpoint` restores, read in full on the host
    and cut per simulated rank; the saved ``extra`` dict."""
    exclude = set(exclude)
    unknown = exclude - set(EXCLUDABLE)
    if unknown:
        raise ValueError(f"cannot exclude {sorted(unknown)} from loading; choose from {EXCLUDABLE}")
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path} does not exist")
    if not is_complete(path):
        raise CheckpointError(f"{path} is not a complete checkpoint (no .metadata)")
    stored = checkpoint_keys(path)
    model_sd = checkpoint_state_dict(model_parts)
    missing = [k for k in model_sd if f"model.{k}" not in stored]
    if missing:
        raise CheckpointError(f"checkpoint {path} lacks {len(missing)} model weights, e.g. {missing[:3]}")
    load_optimizer = (
        optimizer is not None and "optimizer" not in exclude and any(k.startswith("optimizer.") for k in stored)
    )
    optim_sd = stored_optimizer_keys(optimizer.state_dict(), stored) if load_optimizer else {}  # materialises state
    with host_side():
        state: dict[str, Any] = {"model": {k: _template(v) for k, v in model_sd.items()}}
        if load_optimizer:
            state["optimizer"] = {k: _template(v) for k, v in optim_sd.items()}
        if "train_state" in stored:
            state["train_state"] = b""
        dcp.load(state, checkpoint_id=path, no_dist=True)
    with torch.no_grad():
        for key, param in model_sd.items():
            write_full_into(param, state["model"][key])
    if load_optimizer:
        optimizer.load_state_dict({k: _cut(optim_sd[k], v) for k, v in state["optimizer"].items()})
    if "train_state" not in state:
        return {}
    with host_side():  # plain tensors (the RNG state), not one per simulated rank
        train_state = from_blob(state["train_state"])
    if lr_scheduler is not None and "lr_scheduler" not in exclude and train_state.get("lr_scheduler"):
        lr_scheduler.load_state_dict(train_state["lr_scheduler"])
    if dataloader is not None and "dataloader" not in exclude and train_state.get("dataloader"):
        dataloader.load_state_dict(train_state["dataloader"])
    if "rng" not in exclude and train_state.get("rng"):
        with host_side():
            set_rng_state(train_state["rng"])
    return dict(train_state.get("extra") or {})


def load_local_initial_weights(checkpoint, model_parts: list[nn.Module], log) -> None:
    """local_tensor mode: a seed checkpoint's full weights (``checkpoint.initial_load_path``)
    read on the host and cut per simulated rank (DCP's distributed load cannot run there)."""
    path = checkpoint.initial_load_path
    if path:
        count = load_full_weights(path, model_parts)
        checkpoint.initial_load_path = ""  # read: the checkpoint manager has nothing to load
        log(f"loaded initial weights from {path} ({count} tensors, read once and cut per simulated rank)")


def load_full_weights(path: str, model_parts: list[nn.Module]) -> int:
    """Read every parameter of ``model_parts`` in full from the DCP checkpoint ``path`` on the
    host (no process group: the same bytes for every rank) and cut each rank's piece from it, as
    the FQN-seeded init does; returns how many tensors were read."""
    params = {}
    for part in model_parts:
        for name, p in part.named_parameters():
            params[canonical_fqn(name)] = p
    stored = checkpoint_keys(path)
    missing = sorted(k for k in params if f"model.{k}" not in stored)
    if missing:
        raise CheckpointError(f"checkpoint {path} lacks {len(missing)} model weights, e.g. {missing[:3]}")
    with host_side():
        full = {k: torch.empty(tuple(p.shape), dtype=p.dtype, device="cpu") for k, p in params.items()}
        dcp.load({"model": full}, checkpoint_id=path, no_dist=True)
    with torch.no_grad():
        for k, p in params.items():
            write_full_into(p, full[k])
    return len(full)
