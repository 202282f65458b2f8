"""Gradient norm and clipping across meshes.

``torch.nn.utils.clip_grad_norm_`` stacks per-parameter norms, which fails once grads live on
different meshes (dense params on ``[fsdp, tp]``, experts on ``[efsdp, ep]``, plain tensors).
Here each gradient's local sum of squares is summed over the process groups it is sharded on
(not over replicated dimensions), gradients sharded over the same groups sharing one
all-reduce per group, the results are added as plain scalars, and pipeline stages are summed
over ``pp``. The result equals the
single-process norm of the whole model's gradient.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate

__all__ = ["clip_grad_norm_", "finalize_grads", "grad_norm"]


def finalize_grads(params: Iterable[torch.Tensor]) -> None:
    """Turn partial DTensor grads (replicated params fed sharded inputs, with no FSDP to reduce
    them) into the param's own placements, so every later consumer sees true gradients."""
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and isinstance(p, DTensor) and g.placements != p.placements:
            if any(isinstance(pl, Partial) for pl in g.placements):
                p.grad = g.redistribute(p.device_mesh, p.placements)


def _reduction_dims(g: DTensor) -> tuple[tuple[tuple[int, ...], DeviceMesh, int], ...]:
    """The mesh dimensions over which the sum of squares of ``g``'s local shard is a partial
    sum: those on which ``g`` is sharded (size > 1), each with the ranks of its group (the key
    that makes equal groups of different mesh objects one group)."""
    mesh = g.device_mesh
    return tuple(
        (tuple(dist.get_process_group_ranks(mesh.get_group(dim))), mesh, dim)
        for dim, placement in enumerate(g.placements)
        if not placement.is_replicate() and mesh.size(dim) > 1
    )


def _all_reduce_on(sq: torch.Tensor, mesh: DeviceMesh, dim: int) -> None:
    # its own frame: the collective recorder (parallel_dims/comm_record.py) names the group
    # from the mesh among the caller's locals
    dist.all_reduce(sq, group=mesh.get_group(dim))


def _sum_of_squares(grads: list[torch.Tensor]) -> torch.Tensor:
    """The sum of squares of every element of ``grads`` (local tensors), as a float64 scalar:
    one ``torch._foreach_norm`` per (device, dtype) group, which reads each gradient once (a
    per-tensor ``pow`` then ``sum`` reads it twice and writes a squared copy). It accumulates in
    float64: ``_foreach_norm`` in float32 adds up less accurately than ``sum``'s cascade on CPU
    (1.4e-7 against 2.7e-8 relative on a few 1M-element tensors), enough to move the norm 1.3e-6
    off the float64 norm of one process in tests/distributed/test_parallelize_equivalence.py; in
    float64 the norm is exact to float32's resolution, and the pass stays memory-bound."""
    by_device_dtype: dict = defaultdict(list)
    for t in grads:
        by_device_dtype[(t.device, t.dtype)].append(t)
    total = None
    for (_, _dtype), ts in by_device_dtype.items():
        sq = torch.stack(torch._foreach_norm(ts, 2, dtype=torch.float64)).square().sum()
        total = sq if total is None else total + sq.to(total.device)
    return total


def grad_norm(params: Iterable[torch.Tensor], pp_mesh: DeviceMesh | None = None) -> torch.Tensor:
    """Global L2 norm of the grads of ``params`` (float32 scalar, same value on every rank).

    Each gradient's local sum of squares is a partial sum over the groups it is sharded on;
    gradients with the same groups (whatever mesh object they carry: FSDP2 and TP create
    several equal meshes) are summed locally and all-reduced once per group, so the step
    issues one 8-byte (float64) all-reduce per distinct (sharding groups, group) pair, not one per mesh
    object."""
    by_groups: dict = defaultdict(list)
    reducers: dict = {}
    for p in params:
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor):
            if any(isinstance(pl, Partial) for pl in g.placements):  # a square is not linear
                g = g.redistribute(
                    g.device_mesh, [Replicate() if isinstance(pl, Partial) else pl for pl in g.placements]
                )
            dims = _reduction_dims(g)
            key = tuple(ranks for ranks, _, _ in dims)
            reducers.setdefault(key, [(mesh, dim) for _, mesh, dim in dims])
            by_groups[key].append(g.to_local())
        else:
            by_groups[("local", g.device)].append(g)
    total = None
    for key, grads in by_groups.items():
        sq = _sum_of_squares(grads)
        for mesh, dim in reducers.get(key, ()):
            # gradients in host memory (training.cpu_offload) on an accelerator's mesh: the
            # collective runs on the mesh's device (NCCL has no CPU tensors)
            sq = sq if sq.device.type == mesh.device_type else sq.to(mesh.device_type)
            _all_reduce_on(sq, mesh, dim)
        total = sq if total is None else total + sq.to(total.device)
    if total is None:
        total = torch.zeros((), dtype=torch.float64)
    if pp_mesh is not None and pp_mesh.size() > 1:
        total = total.to(pp_mesh.device_type, copy=True)
        dist.all_reduce(total, group=pp_mesh.get_group())
    return total.sqrt().float()


def clip_grad_norm_(
    params: Iterable[torch.Tensor],
    max_norm: float,
    pp_mesh: DeviceMesh | None = None,
    norm_excludes: Iterable[torch.Tensor] = (),
) -> torch.Tensor:
    """Scale grads so their global norm is at most ``max_norm`` (<= 0 disables clipping);
    return the norm before clipping. ``norm_excludes``: parameters scaled but left out of the
    norm (a second copy of a tied weight on another pipeline stage, counted once by its twin).

    No host sync: the scale is computed on the device, and a non-finite norm leaves the grads
    unscaled (the trainer stops on it before the optimizer step)."""
    params = [p for p in params if p.grad is not None]
    skip = {id(p) for p in norm_excludes}
    norm = grad_norm([p for p in params if id(p) not in skip], pp_mesh)
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
