"""Expert parallelism (EP) and expert tensor parallelism (ETP) for grouped MoE experts.

How EP folds into the rest of the parallelism
---------------------------------------------
EP does not get ranks of its own: the ``ep`` mesh dimension is carved out of the ranks that
already hold *different tokens* for the MoE layer (``dp_shard * cp * tp``; under TP the MoE
input is split along tokens across the TP ranks before routing). Because no two ranks of one
EP group hold the same token, dispatching "my tokens to the owner of their expert" moves every
token exactly once, and every expert sees each of its tokens exactly once. ETP, when used, is a
second dimension of such ranks: the ``ep x etp`` grid is made of ranks with distinct tokens;
the ``etp`` peers of an EP owner share the same experts but each keeps only a slice of every
expert's hidden dimension, so the rows the peers received are all-gathered over ``etp``, every
peer computes partial outputs with its hidden slice, and a reduce-scatter returns to each peer
the full outputs of its own rows.

Gradient semantics
------------------
Expert weights are not replicated inside an EP group: rank ``i`` of the ``ep`` mesh owns experts
``[i*E/ep, (i+1)*E/ep)`` (and, with ETP, one hidden slice of them). The backward of the token
all-to-all routes the output gradients of *all* tokens of the EP group back to the owner, so the
owner's local weight gradient is already the sum over every token of the group that picked its
experts; nothing is reduced here. The ranks outside the ``ep x etp`` grid that hold the same
expert shard (the ``efsdp`` mesh) own other tokens; reducing expert gradients across them is
FSDP's job on ``efsdp``. Because the owner's gradient is a *sum* over ``ep`` token shards, that
FSDP reduction must divide by the same factor as the dense parameters use (the number of
data-parallel loss replicas), not by the ``efsdp`` size, or experts get ``ep`` times larger
gradients than dense weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from parallel_dims.torch_compat import simulating_ranks

__all__ = ["apply_expert_parallel"]

_WEIGHT_NAMES = ("w1", "w2", "w3")


@dataclass
class _DispatchPlan:
    """Everything the combine step needs to send each output row back where its token came
    from; kept per call so recomputation under activation checkpointing stays consistent."""

    send_splits: list[int]  # rows this rank sends to each ep rank (= rows it gets back)
    recv_splits: list[int]  # rows this rank receives from each ep rank
    unsort_index: torch.Tensor  # expert-sorted position -> arrival position
    etp_rows: list[int] = field(default_factory=list)  # rows held by each etp peer (ETP only)


def _exchange_counts(counts: torch.Tensor, group: dist.ProcessGroup, gather: bool) -> torch.Tensor:
    """Equal-split all-to-all (``gather=False``) or all-gather (``gather=True``) of a small
    int64 count vector, as a *functional* collective (``_c10d_functional`` ops, stable in torch
    2.11-2.15). Selective activation checkpointing saves functional collectives' outputs
    (models/parallel/activation_checkpoint.py), so the recomputation of a checkpointed MoE
    block reads the counts back instead of exchanging them again; an eager ``dist`` call would
    be re-issued. Not differentiable (counts carry no gradient)."""
    ops = torch.ops._c10d_functional
    n = dist.get_world_size(group)
    if gather:
        out = ops.all_gather_into_tensor(counts, n, group.group_name)
    else:
        splits = [counts.numel() // n] * n
        out = ops.all_to_all_single(counts, splits, splits, group.group_name)
    out = ops.wait_tensor(out)
    if not gather and dist.get_backend(group) == "fake" and not simulating_ranks():
        # torch's fake backend (comm.mode = "fake_backend") fills an all-to-all given split
        # sizes with copies of the input's FIRST chunk; its contract here (trainer/
        # fake_backend.py: balanced routing) is that a rank receives the counts it sends, as
        # the eager call without split sizes gave. The collective is still issued (recorded,
        # timed); its result is what a balanced job would deliver. Not under comm.mode =
        # "local_tensor" (also the fake backend): LocalTensorMode runs the real exchange.
        out = counts.clone()
    return out


def _exclusive_cumsum(t: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(t, dim=0) - t


def _all_to_all_rows(
    x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """Row all-to-all whose backward is the reverse all-to-all, so gradients of a token follow
    it back to the rank that sent it."""
    if dist.get_world_size(group) == 1:
        return x
    return all_to_all_single_autograd(x.contiguous(), out_splits, in_splits, group)


class _ExpertParallelDispatcher:
    """Forward hooks that wrap the experts' own forward with token dispatch/combine.

    Hooks (rather than a wrapper module) keep the module object, its class and its parameter
    FQNs untouched, so FSDP, checkpointing and the MoE layer see the same ``experts``.
    """

    def __init__(
        self,
        num_experts: int,
        ep_group: dist.ProcessGroup,
        etp_group: dist.ProcessGroup | None,
    ) -> None:
        self.num_experts = num_experts
        self.ep_group = ep_group
        self.ep = dist.get_world_size(ep_group)
        self.etp_group = etp_group
        self.etp = 1 if etp_group is None else dist.get_world_size(etp_group)
        self.num_local_experts = num_experts // self.ep
        # A stack, not a single slot, so a forward nested inside another (e.g. recomputation
        # triggered while another forward is in flight) cannot clobber the outer plan.
        self._plans: list[_DispatchPlan] = []

    # ------------------------------------------------------------------ dispatch
    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict):
        if set(kwargs) - {"has_padding"} or len(args) != 2:
            raise ValueError(
                "expert-parallel experts must be called as experts(x, num_tokens_per_expert) "
                f"with two positional arguments (and optionally has_padding=); got {len(args)} "
                f"positional and keyword arguments {sorted(kwargs)}"
            )
        x, counts = args
        routed, local_counts, plan = self._dispatch(x, counts)
        self._plans.append(plan)
        # has_padding passes through: _dispatch rejects rows past the counts' sum and adds
        # none, so the experts see padding exactly where the caller had it
        return (routed, local_counts), kwargs

    def _dispatch(self, x: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, _DispatchPlan]:
        if isinstance(x, DTensor) or isinstance(counts, DTensor):
            raise ValueError(
                "expert-parallel experts expect plain local tensors (this rank's routed tokens), not DTensors"
            )
        if x.dim() != 2:
            raise ValueError(f"routed input must be [tokens, dim], got shape {tuple(x.shape)}")
        if counts.dim() != 1 or counts.numel() != self.num_experts:
            raise ValueError(
                f"num_tokens_per_expert must be 1-D with one count per global expert "
                f"({self.num_experts}), got shape {tuple(counts.shape)}"
            )
        if counts.is_floating_point() or counts.is_complex() or counts.dtype == torch.bool:
            raise ValueError(f"num_tokens_per_expert must be integer, got {counts.dtype}")

        ep, etp, n_local = self.ep, self.etp, self.num_local_experts
        counts_dtype = counts.dtype
        with torch.no_grad():
            counts = counts.to(device=x.device, dtype=torch.int64)
            # recv[s, e]: tokens source ep rank s sends to my local expert e.
            recv = _exchange_counts(counts, self.ep_group, gather=False).view(ep, n_local)
            if etp > 1:
                # seg[p, s, e]: the same, as received by etp peer p; the gathered rows are laid
                # out peer-major, then source rank, then expert.
                seg = _exchange_counts(recv.reshape(-1), self.etp_group, gather=True)
                seg = seg.view(etp * ep, n_local)
                peer_rows = seg.view(etp, -1).sum(dim=1)
            else:
                seg = recv
                peer_rows = recv.new_zeros(0)
            # One host sync for every split size, plus the validity checks that ride along.
            host = torch.cat(
                [
                    counts.view(ep, n_local).sum(dim=1),
                    recv.sum(dim=1),
                    peer_rows,
                    counts.min().view(1),
                ]
            ).tolist()
        send_splits, recv_splits = host[:ep], host[ep : 2 * ep]
        etp_rows = host[2 * ep : 2 * ep + (etp if etp > 1 else 0)]
        if host[-1] < 0:
            raise ValueError("num_tokens_per_expert contains negative counts")
        if sum(send_splits) != x.shape[0]:
            raise ValueError(f"routed input has {x.shape[0]} rows but num_tokens_per_expert sums to {sum(send_splits)}")

        routed = _all_to_all_rows(x, recv_splits, send_splits, self.ep_group)
        if etp > 1:
            mine = sum(recv_splits)
            # Uneven all-gather as an all-to-all of the same rows to every peer: portable to
            # backends without uneven all_gather, and its autograd backward (reverse
            # all-to-all, then the sum over the repeated copies) is exactly the reduce-scatter
            # that adds up the peers' partial input gradients.
            routed = _all_to_all_rows(routed.repeat(etp, 1), etp_rows, [mine] * etp, self.etp_group)

        sort_index, unsort_index = self._sort_indices(seg, routed.shape[0])
        routed = routed.index_select(0, sort_index)
        local_counts = seg.sum(dim=0).to(counts_dtype)
        plan = _DispatchPlan(send_splits, recv_splits, unsort_index, etp_rows)
        return routed, local_counts, plan

    @staticmethod
    def _sort_indices(seg: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather indices between the arrival layout (segment-major: chunk (g, e) for every
        segment g, local expert e) and the expert-major layout the grouped GEMM needs (chunk
        (e, g)); stable within each chunk, O(rows), no per-token Python."""
        n_seg, n_local = seg.shape
        with torch.no_grad():
            arrival_start = _exclusive_cumsum(seg.reshape(-1)).view(n_seg, n_local)
            sorted_start = _exclusive_cumsum(seg.t().reshape(-1)).view(n_local, n_seg).t()
            rows = torch.arange(num_rows, device=seg.device)
            # sorted[i] = arrival[i + shift of i's chunk], chunks enumerated in sorted order.
            sort_index = rows + torch.repeat_interleave(
                (arrival_start - sorted_start).t().reshape(-1),
                seg.t().reshape(-1),
                output_size=num_rows,
            )
            unsort_index = rows + torch.repeat_interleave(
                (sorted_start - arrival_start).reshape(-1),
                seg.reshape(-1),
                output_size=num_rows,
            )
        return sort_index, unsort_index

    # ------------------------------------------------------------------ combine
    def post_forward(self, module: nn.Module, args: tuple, kwargs: dict, out):
        plan = self._plans.pop()
        if not isinstance(out, torch.Tensor) or isinstance(out, DTensor):
            raise ValueError(
                f"experts forward must return a plain tensor under expert parallelism, got {type(out).__name__}"
            )
        out = out.index_select(0, plan.unsort_index)
        if self.etp > 1:
            # Reduce-scatter of the partial (hidden-sliced) outputs back to the peer that owns
            # each row; accumulate in fp32 so low-precision partials lose nothing extra.
            mine = sum(plan.recv_splits)
            pieces = _all_to_all_rows(out, [mine] * self.etp, plan.etp_rows, self.etp_group)
            pieces = pieces.view(self.etp, mine, out.shape[-1])
            out = pieces.sum(dim=0, dtype=torch.float32).to(out.dtype)
        return _all_to_all_rows(out, plan.send_splits, plan.recv_splits, self.ep_group)


def _group_ranks(mesh: DeviceMesh, dim: int) -> list[int]:
    return dist.get_process_group_ranks(mesh.get_group(dim))


def _resolve_meshes(
    ep_mesh: DeviceMesh,
    etp_mesh: DeviceMesh | None,
    ep_etp_mesh: DeviceMesh | None,
) -> tuple[DeviceMesh | None, DeviceMesh]:
    """Return (etp mesh or None, mesh the parameters are placed on)."""
    if not isinstance(ep_mesh, DeviceMesh) or ep_mesh.ndim != 1:
        raise ValueError(f"ep_mesh must be a 1-D DeviceMesh, got {ep_mesh!r}")
    if etp_mesh is not None and (not isinstance(etp_mesh, DeviceMesh) or etp_mesh.ndim != 1):
        raise ValueError(f"etp_mesh must be a 1-D DeviceMesh, got {etp_mesh!r}")
    if ep_etp_mesh is None:
        if etp_mesh is None:
            return None, ep_mesh
        try:
            # Builds [ep, etp] over the common root, so param groups match the 1-D meshes even
            # when ep/etp are flattened or non-adjacent dims of that root.
            return etp_mesh, DeviceMesh._concatenate([ep_mesh, etp_mesh])
        except Exception as exc:
            raise ValueError(
                "could not build the 2-D [ep, etp] mesh from ep_mesh and etp_mesh; they must "
                "be 1-D slices of one root DeviceMesh with disjoint dims, or pass ep_etp_mesh "
                f"explicitly ({exc})"
            ) from exc
    if not isinstance(ep_etp_mesh, DeviceMesh) or ep_etp_mesh.ndim != 2:
        raise ValueError(f"ep_etp_mesh must be a 2-D (ep, etp) DeviceMesh, got {ep_etp_mesh!r}")
    if _group_ranks(ep_etp_mesh, 0) != _group_ranks(ep_mesh, 0):
        raise ValueError(
            f"ep_etp_mesh dim 0 groups ranks {_group_ranks(ep_etp_mesh, 0)} but ep_mesh groups "
            f"{_group_ranks(ep_mesh, 0)}; dim 0 of ep_etp_mesh must be the ep dimension"
        )
    if etp_mesh is None:
        if not ep_etp_mesh.mesh_dim_names:
            raise ValueError("ep_etp_mesh needs mesh_dim_names (e.g. ('ep', 'etp'))")
        etp_mesh = ep_etp_mesh[ep_etp_mesh.mesh_dim_names[1]]
    elif _group_ranks(ep_etp_mesh, 1) != _group_ranks(etp_mesh, 0):
        raise ValueError(
            f"ep_etp_mesh dim 1 groups ranks {_group_ranks(ep_etp_mesh, 1)} but etp_mesh groups "
            f"{_group_ranks(etp_mesh, 0)}; dim 1 of ep_etp_mesh must be the etp dimension"
        )
    return etp_mesh, ep_etp_mesh


def apply_expert_parallel(
    experts: nn.Module,
    ep_mesh: DeviceMesh,
    etp_mesh: DeviceMesh | None = None,
    *,
    ep_etp_mesh: DeviceMesh | None = None,
) -> nn.Module:
    """Shard ``experts`` (``w1``/``w3`` [E, hidden, dim], ``w2`` [E, dim, hidden]) over ``ep``
    along the expert dim and, with ``etp``, over the hidden dim; then make
    ``experts(x, num_tokens_per_expert)`` keep its single-device meaning for this rank's tokens
    (``x`` sorted by global expert, counts for all E experts) while each expert only runs on
    its owner. See the module docstring for how EP folds into the mesh and what the gradients
    mean.

    Parameters become DTensors (``Shard(0)`` on ``ep``; ``[Shard(0), Shard(1 or 2)]`` on
    ``[ep, etp]``) so distributed checkpoints reshard them. Every rank must pass the same
    full weights (or meta weights): each one keeps its own slice without communication.
    ``ep_etp_mesh`` is the 2-D ``(ep, etp)`` mesh to place parameters on; when omitted it is
    built from the two 1-D meshes, which must then be slices of one root mesh. Returns the
    same module object, modified in place.
    """
    if getattr(experts, "_expert_parallel", None) is not None:
        raise ValueError("apply_expert_parallel was already applied to this module")
    weights = {}
    for name in _WEIGHT_NAMES:
        w = getattr(experts, name, None)
        if not isinstance(w, torch.Tensor):
            raise ValueError(f"experts module has no tensor parameter {name!r}")
        if isinstance(w, DTensor):
            raise ValueError(f"experts.{name} is already a DTensor; apply EP to plain weights")
        if w.dim() != 3:
            raise ValueError(f"experts.{name} must be 3-D, got shape {tuple(w.shape)}")
        weights[name] = w
    n_experts, hidden, dim = weights["w1"].shape
    if tuple(weights["w3"].shape) != (n_experts, hidden, dim) or tuple(weights["w2"].shape) != (n_experts, dim, hidden):
        raise ValueError(
            "expected w1, w3 of shape [E, hidden, dim] and w2 of shape [E, dim, hidden], got "
            + ", ".join(f"{n}={tuple(w.shape)}" for n, w in weights.items())
        )

    etp_mesh, param_mesh = _resolve_meshes(ep_mesh, etp_mesh, ep_etp_mesh)
    ep = ep_mesh.size()
    etp = 1 if etp_mesh is None else etp_mesh.size()
    if n_experts % ep != 0:
        legal = [d for d in range(1, n_experts + 1) if n_experts % d == 0]
        raise ValueError(
            f"n_experts={n_experts} is not divisible by ep={ep}; legal ep values for {n_experts} experts: {legal}"
        )
    if hidden % etp != 0:
        legal = [d for d in range(1, hidden + 1) if hidden % d == 0]
        raise ValueError(f"expert hidden dim {hidden} is not divisible by etp={etp}; legal etp values: {legal}")

    if etp_mesh is None:
        placements = {name: [Shard(0)] for name in _WEIGHT_NAMES}
    else:
        # w1/w3 split the hidden (output) rows, w2 the hidden (input) columns, so each etp
        # rank's slice forms a complete SwiGLU over its part of hidden; outputs are partial
        # sums over hidden that the combine step adds up.
        placements = {
            "w1": [Shard(0), Shard(1)],
            "w2": [Shard(0), Shard(2)],
            "w3": [Shard(0), Shard(1)],
        }
    for name, w in weights.items():
        dw = distribute_tensor(w.detach(), param_mesh, placements[name], src_data_rank=None)
        experts.register_parameter(name, nn.Parameter(dw, requires_grad=w.requires_grad))

    dispatcher = _ExpertParallelDispatcher(
        n_experts,
        ep_mesh.get_group(0),
        etp_mesh.get_group(0) if etp_mesh is not None and etp > 1 else None,
    )
    experts._expert_parallel = dispatcher
    experts.register_forward_pre_hook(dispatcher.pre_forward, with_kwargs=True)
    experts.register_forward_hook(dispatcher.post_forward, with_kwargs=True)
    return experts
