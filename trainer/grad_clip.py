"""Gradient norm and clipping across meshes.

``torch.nn.utils.clip_grad_norm_`` stacks per-parameter norms, which fails once grads live on
different meshes (dense params on ``[fsdp, tp]``, experts on ``[efsdp, ep]``, plain tensors).
Here grads are grouped by their DTensor spec, each group's sum of squares is reduced by DTensor
itself (``full_tensor`` sums over sharded dims and not over replicated ones), the groups are
added as plain scalars, and pipeline stages are summed over ``pp``. The result equals the
single-process norm of the whole model's gradient.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial

__all__ = ["clip_grad_norm_", "finalize_grads", "grad_norm"]


def finalize_grads(params: Iterable[torch.Tensor]) -> None:
    """Turn partial DTensor grads (replicated params fed sharded inputs, with no FSDP to reduce
    them) into the param's own placements, so every later consumer sees true gradients."""
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and isinstance(p, DTensor) and g.placements != p.placements:
            if any(isinstance(pl, Partial) for pl in g.placements):
                p.grad = g.redistribute(p.device_mesh, p.placements)


def _spec_key(t: torch.Tensor):
    if isinstance(t, DTensor):
        return (id(t.device_mesh), t.placements)
    return ("local", t.device)


def _sum_partial(t: DTensor) -> torch.Tensor:
    """The full value of a scalar DTensor: its local value summed over the mesh dimensions on
    which it is a partial sum. What ``full_tensor()`` does, one all-reduce per such dimension,
    without DTensor's merging of several dimensions into one flattened collective (which
    torch 2.11 cannot do on a mesh with a size-1 dimension, e.g. FSDP's trivial mesh x tp)."""
    local = t.to_local().clone()
    for dim, placement in enumerate(t.placements):
        if isinstance(placement, Partial) and t.device_mesh.size(dim) > 1:
            if placement.reduce_op != "sum":
                raise ValueError(f"gradient norm squares are sums, got a {placement} placement")
            dist.all_reduce(local, group=t.device_mesh.get_group(dim))
    return local


def grad_norm(params: Iterable[torch.Tensor], pp_mesh: DeviceMesh | None = None) -> torch.Tensor:
    """Global L2 norm of the grads of ``params`` (float32 scalar, same value on every rank)."""
    groups: dict = defaultdict(list)
    for p in params:
        if p.grad is not None:
            groups[_spec_key(p.grad)].append(p.grad)
    total = None
    for grads in groups.values():
        squares = [g.float().pow(2).sum() for g in grads]
        sq = torch.stack(squares).sum() if len(squares) > 1 else squares[0]
        if isinstance(sq, DTensor):
            sq = _sum_partial(sq)
        total = sq if total is None else total + sq.to(total.device)
    if total is None:
        total = torch.zeros((), dtype=torch.float32)
    if pp_mesh is not None and pp_mesh.size() > 1:
        total = total.clone()
        dist.all_reduce(total, group=pp_mesh.get_group())
    return total.sqrt()


def clip_grad_norm_(params: Iterable[torch.Tensor], max_norm: float, pp_mesh: DeviceMesh | None = None) -> torch.Tensor:
    """Scale grads so their global norm is at most ``max_norm`` (<= 0 disables clipping);
    return the norm before clipping.

    No host sync: the scale is computed on the device, and a non-finite norm leaves the grads
    unscaled (the trainer stops on it before the optimizer step)."""
    params = [p for p in params if p.grad is not None]
    norm = grad_norm(params, pp_mesh)
    if max_norm > 0:
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        scale = torch.where(torch.isfinite(norm), scale, torch.ones_like(scale))
        by_device_dtype: dict = defaultdict(list)
        for p in params:
            g = p.grad
            local = g._local_tensor if isinstance(g, DTensor) else g
            by_device_dtype[(local.device, local.dtype)].append(local)
        for (device, dtype), grads in by_device_dtype.items():
            torch._foreach_mul_(grads, scale.to(device, dtype))
    return norm
