"""Muon's round-robin distribution (``optimizer.muon_distribution = "round_robin"``, the
default): each whole matrix is orthogonalised by ONE owner rank of the group of ranks that
shard it, and the owner sends every other member its shard of the result.

The sharding group of a parameter (a DTensor on the mesh ParallelDims built for it) is the set
of ranks that differ only in the mesh dimensions whose placement shards one of the two matrix
dimensions (:func:`matrix_mesh_dims`): FSDP's ``dp_shard`` (with ``cp`` folded in), ``tp``, both
under FSDP x TP, ``etp`` and the expert FSDP group for routed experts. Mesh dimensions that
replicate (HSDP's ``dp_replicate``) or shard only a leading (expert) dimension (``ep``) are
not part of it: each such coordinate has its own group, with its own experts.

Owners are chosen once per parameter, by FLOPs: the matrices of one group (parameters on the
same mesh split by the same mesh dimensions) in decreasing Newton-Schulz FLOPs (k (4 m^2 n +
2 m^3) per matrix, m <= n, times the matrices of a 3-D expert block), each to the member with
the least FLOPs so far (the lowest index on a tie): longest-processing-time-first, a function of
the shapes only, so every member computes the same owners without communicating.

Communication per step: two rounds of point-to-point messages, batched
(``dist.batch_isend_irecv``), at most one message per peer and round: every rank sends its local
shards of the matrices a peer owns to that peer (their updates, concatenated in parameter order),
the owners assemble the whole matrices, orthogonalise them, and send each member its shard of
the result back. That is an all-to-all-v over the sharding group; it is done with point-to-point
messages because under FSDP x TP the group is a 2-D sub-mesh with no process group of its own
(the peers are the global ranks of the parameter's ``device_mesh``), and one code path then
serves 1-D and 2-D groups alike. A broadcast would send every member the whole matrix (the
gather scheme's volume); a scatter per matrix would be two rooted collectives per matrix. Per rank
and step: about 2 (S-1)/S of its local shard bytes sent and received for a group of S, against
the all-gather's (S-1) times its local shard bytes received; and 1/S of the group's
Newton-Schulz FLOPs (up to the balance of whole matrices) instead of all of them.

The owner assembles a matrix from its members' shards with per-dimension position lists: the
positions along each matrix dimension of the whole matrix that a member's local rows and
columns are, from the placements' own split rule (``Shard``: ``torch.chunk``; ``_StridedShard``:
its strided pieces), applied over the mesh dimensions left to right as DTensor does (as
trainer/checkpoint/hf_load.py ``local_index`` does for loading). The assembled matrix is the
one the gather scheme's all-gather builds, so both schemes run Newton-Schulz on the same input
with the same kernels and give bitwise the same update (tests/distributed/test_muon_round_robin.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

__all__ = ["RoundRobin", "matrix_mesh_dims", "member_positions", "ns_flops"]


def matrix_mesh_dims(p: DTensor) -> tuple[int, ...]:
    """The mesh dimensions whose placement shards one of ``p``'s two matrix dimensions (a strided
    shard, FSDP over TP, has a ``dim`` too)."""
    out = []
    for i, pl in enumerate(p.placements):
        dim = getattr(pl, "dim", None)
        if dim is not None and dim % p.ndim >= p.ndim - 2:
            out.append(i)
    return tuple(out)


def ns_flops(shape: Sequence[int], steps: int) -> int:
    """Newton-Schulz FLOPs of ``steps`` iterations on every matrix of a ``[..., m, n]`` block:
    per matrix and step, the Gram X X^T (2 m^2 n), its square (2 m^3) and the product with X
    (2 m^2 n), m <= n: k (4 m^2 n + 2 m^3)."""
    *lead, a, b = shape
    m, n = min(a, b), max(a, b)
    count = 1
    for s in lead:
        count *= s
    return count * steps * (4 * m * m * n + 2 * m**3)


def _split_rule(pl):
    """The placement's split rule for a position list (``Shard``: torch.chunk; ``_StridedShard``
    with its split factor)."""
    from torch.distributed.tensor.placement_types import Shard, _StridedShard

    if isinstance(pl, _StridedShard):
        return _StridedShard(0, split_factor=pl.split_factor)
    if isinstance(pl, Shard):
        return Shard(0)
    raise RuntimeError(f"Muon round-robin: cannot split along placement {pl}")


def member_positions(p: DTensor, dims: Sequence[int], coord: Sequence[int]) -> list[torch.Tensor]:
    """For the member at mesh coordinate ``coord`` (only the ``dims`` entries are read): the
    positions along each of ``p``'s two matrix dimensions (rows, columns) of the whole matrix that
    its local rows and columns are, in order."""
    mesh = p.device_mesh
    index = [torch.arange(p.shape[-2]), torch.arange(p.shape[-1])]
    for i in dims:
        pl = p.placements[i]
        k = pl.dim % p.ndim - (p.ndim - 2)
        pieces, _ = _split_rule(pl)._split_tensor(index[k], mesh.size(i), with_padding=False)
        index[k] = pieces[coord[i]]
    return index


@dataclass
class _Plan:
    """One distributed Muon parameter: its sharding group (global ranks, in the group's order),
    this rank's index in it, the owner's index, the whole block's shape on this group (leading
    dims as this rank holds them) and, on the owner, every member's positions."""

    members: list[int]
    me: int
    owner: int
    whole_shape: tuple[int, ...]
    positions: list[list[torch.Tensor]] | None = None

    @property
    def owned(self) -> bool:
        return self.me == self.owner


def _group(p: DTensor, dims: tuple[int, ...]) -> tuple[list[int], int, tuple[int, ...]]:
    """(members as global ranks, this rank's index, this rank's mesh coordinate) of ``p``'s
    sharding group: the mesh's ranks with every other mesh coordinate fixed at this rank's."""
    mesh = p.device_mesh
    coord = tuple(mesh.get_coordinate())
    ranks = mesh.mesh
    sel = tuple(slice(None) if i in dims else c for i, c in enumerate(coord))
    members = [int(r) for r in ranks[sel].reshape(-1)]
    return members, members.index(dist.get_rank()), coord


def _coords(mesh_shape: Sequence[int], dims: Sequence[int], base: Sequence[int]) -> list[tuple[int, ...]]:
    """The mesh coordinates of a group's members in the group's order (row-major over ``dims``)."""
    out = [tuple(base)]
    for i in dims:
        out = [c[:i] + (j,) + c[i + 1 :] for c in out for j in range(mesh_shape[i])]
    return out


class RoundRobin:
    """Owners and positions of Muon's distributed parameters (planned on the first step, then
    cached) and the per-step exchange (:meth:`orthogonalize`)."""

    def __init__(self):
        self._plans: dict[torch.Tensor, _Plan] = {}

    def plan(self, params: Sequence[tuple[DTensor, int]]) -> None:
        """Choose owners for the ``(parameter, ns_steps)`` pairs not planned yet (every member of
        a group passes the same parameters in the same order)."""
        new = [(p, k) for p, k in params if p not in self._plans]
        buckets: dict[tuple, list[tuple[DTensor, int]]] = {}
        for p, k in new:
            buckets.setdefault((p.device_mesh, matrix_mesh_dims(p)), []).append((p, k))
        for (mesh, dims), items in buckets.items():
            members, me, coord = _group(items[0][0], dims)
            whole = {p: _whole_shape(p, dims) for p, _ in items}
            flops = [ns_flops(whole[p], k) for p, k in items]
            loads = [0] * len(members)
            for i in sorted(range(len(items)), key=lambda i: -flops[i]):  # stable: LPT
                owner = loads.index(min(loads))
                loads[owner] += flops[i]
                p = items[i][0]
                plan = _Plan(members, me, owner, whole[p])
                if plan.owned:
                    coords = _coords(mesh.shape, dims, coord)
                    plan.positions = [member_positions(p, dims, c) for c in coords]
                self._plans[p] = plan

    def orthogonalize(
        self, items: Sequence[tuple[DTensor, torch.Tensor]], ns: Callable[[torch.Tensor, DTensor], torch.Tensor]
    ) -> list[torch.Tensor]:
        """``ns(whole, p)`` of every ``(parameter, local update)`` pair's whole matrix, on its
        owner; returns this rank's shard of each result (float32, shaped like the local update)."""
        plans = [self._plans[p] for p, _ in items]
        # round 1: local shards to the owners
        sends: dict[int, list[torch.Tensor]] = {}
        recv_sizes: dict[int, list[int]] = {}
        for plan, (_, u) in zip(plans, items):
            if plan.owned:
                for j, rank in enumerate(plan.members):
                    if j != plan.me:
                        recv_sizes.setdefault(rank, []).append(_numel(plan, j))
            else:
                sends.setdefault(plan.members[plan.owner], []).append(u.float().reshape(-1))
        device = items[0][1].device if items else torch.device("cpu")
        received = _exchange(sends, recv_sizes, device)
        # the owners' Newton-Schulz, and round 2: each member's shard of the result back
        results: list[torch.Tensor | None] = [None] * len(items)
        sends, recv_sizes = {}, {}
        for i, (plan, (p, u)) in enumerate(zip(plans, items)):
            if not plan.owned:
                recv_sizes.setdefault(plan.members[plan.owner], []).append(u.numel())
                continue
            whole = u.new_empty(plan.whole_shape, dtype=torch.float32)
            for j, rank in enumerate(plan.members):
                piece = u.float() if j == plan.me else received[rank].pop(0)
                whole[_at(plan.positions[j])] = piece.reshape(_local_shape(plan, j))
            o = ns(whole, p)
            for j, rank in enumerate(plan.members):
                piece = o[_at(plan.positions[j])]
                if j == plan.me:
                    results[i] = piece.reshape(u.shape)
                else:
                    sends.setdefault(rank, []).append(piece.reshape(-1))
        back = _exchange(sends, recv_sizes, device)
        for i, (plan, (_, u)) in enumerate(zip(plans, items)):
            if not plan.owned:
                results[i] = back[plan.members[plan.owner]].pop(0).reshape(u.shape)
        return results


def _whole_shape(p: DTensor, dims: tuple[int, ...]) -> tuple[int, ...]:
    """The block this rank's group orthogonalises: the local leading (expert) dims, the whole
    matrix dims."""
    local = p.to_local().shape
    return (*local[:-2], p.shape[-2], p.shape[-1])


def _local_shape(plan: _Plan, j: int) -> tuple[int, ...]:
    rows, cols = plan.positions[j]
    return (*plan.whole_shape[:-2], len(rows), len(cols))


def _numel(plan: _Plan, j: int) -> int:
    n = 1
    for s in _local_shape(plan, j):
        n *= s
    return n


def _at(positions: list[torch.Tensor]) -> tuple:
    """An index of a whole block picking the given rows and columns (slices where contiguous)."""
    out = []
    for idx in positions:
        lo = int(idx[0]) if idx.numel() else 0
        if idx.numel() == 0 or torch.equal(idx, torch.arange(lo, lo + idx.numel())):
            out.append(slice(lo, lo + idx.numel()))
        else:
            out.append(idx)
    if all(isinstance(x, slice) for x in out):
        return (Ellipsis, *out)
    rows, cols = out
    rows = torch.arange(rows.start, rows.stop) if isinstance(rows, slice) else rows
    cols = torch.arange(cols.start, cols.stop) if isinstance(cols, slice) else cols
    return (Ellipsis, rows[:, None], cols[None, :])


def _exchange(
    sends: dict[int, list[torch.Tensor]], recv_sizes: dict[int, list[int]], device: torch.device
) -> dict[int, list[torch.Tensor]]:
    """One round: one message per peer each way (the listed tensors concatenated in order);
    returns the received tensors per peer, split back into the listed sizes."""
    if not sends and not recv_sizes:
        return {}
    ops, bufs = [], {}
    for rank, sizes in sorted(recv_sizes.items()):
        bufs[rank] = torch.empty(sum(sizes), dtype=torch.float32, device=device)
        ops.append(dist.P2POp(dist.irecv, bufs[rank], rank))
    for rank, tensors in sorted(sends.items()):
        ops.append(dist.P2POp(dist.isend, torch.cat(tensors), rank))
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return {rank: list(torch.split(bufs[rank], sizes)) for rank, sizes in recv_sizes.items()}
