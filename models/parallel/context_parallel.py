"""Context parallelism (CP) for causal attention, with one code path for CPU/gloo and GPU/NCCL.

torch's ``context_parallel`` relies on DTensor sharding rules that exist only for the CUDA SDPA
kernels, so it cannot run on CPU. This module does CP with plain collectives instead:

* Each cp rank holds ``s_local = seq_len / cp`` tokens of every sequence in the load-balanced
  layout of :mod:`models.common.sequence`: chunk ``r`` and chunk ``2*cp-1-r`` of ``2*cp`` equal
  chunks. With causal attention, token ``t`` attends to ``t + 1`` keys, so contiguous shards
  would give the last rank roughly ``2*cp - 1`` times the work of the first; pairing a head chunk
  with its mirror tail chunk gives every rank the same ``(2*cp + 1) * c**2`` query-key pairs
  (``c`` = chunk length), so no rank idles waiting for the slowest one.
* Queries stay local. K and V are all-gathered along the sequence (one collective for both,
  differentiable: its backward is a reduce-scatter that sums every rank's contribution to each
  key's gradient back onto the rank that owns the key), then put back into global order.
* Each local chunk attends only to the key prefix it can see (head chunk ``r``: keys
  ``[0, (r+1)c)``; tail chunk: keys ``[0, (2cp-r)c)``) with a lower-right-aligned causal mask,
  so no work goes to key blocks that are entirely in the future.

Memory: the gathered K and V hold the *global* sequence on every rank, i.e. O(global seq) per
rank and per attention layer (kept for backward), against O(global seq / cp) for Q and the
output. Activations of everything outside attention still shrink by ``cp``; the gathered K/V is
the price of this simple scheme versus ring attention, which streams K/V blocks instead. For
MHA with ``d_v = d_qk`` the gathered buffer is ``2 * bs * heads * seq * d`` elements per layer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from models.common.sequence import load_balanced_shard, load_balanced_unshard

__all__ = [
    "ContextParallelAttentionCore",
    "apply_context_parallel",
    "load_balanced_causal_attention",
    "shard_batch_for_cp",
]

# ``all_gather_tensor_autograd`` is deprecated in newer torch in favour of the ``_single`` name;
# older builds (e.g. on a GPU box) only have the former.
_all_gather_autograd = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd


def _wait(t: torch.Tensor) -> torch.Tensor:
    # Eager funcol results are AsyncCollectiveTensors; waiting here keeps the rest of the code
    # working on plain tensors (under tracing they are plain already).
    if isinstance(t, funcol.AsyncCollectiveTensor):
        return t.wait()
    return t


def _check_mesh(cp_mesh: DeviceMesh) -> None:
    if not isinstance(cp_mesh, DeviceMesh):
        raise ValueError(f"cp_mesh must be a torch DeviceMesh, got {type(cp_mesh).__name__}")
    if cp_mesh.ndim != 1:
        raise ValueError(
            f"cp_mesh must be a 1-D DeviceMesh over the context-parallel group, got a "
            f"{cp_mesh.ndim}-D mesh; slice it first, e.g. world_mesh['cp']"
        )


def _lower_right_causal_mask(n_q: int, first_query_pos: int, device: torch.device) -> torch.Tensor:
    """Boolean mask (True = attend) for queries at global positions ``first_query_pos + i``
    against keys ``[0, first_query_pos + n_q)``. SDPA's ``is_causal`` aligns the diagonal to
    the top-left corner, which is wrong whenever the key prefix is longer than the query chunk."""
    n_k = first_query_pos + n_q
    return torch.ones(n_q, n_k, dtype=torch.bool, device=device).tril_(diagonal=first_query_pos)


def _chunk_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    first_query_pos: int,
    scale: float | None,
) -> torch.Tensor:
    n_q = q.size(2)
    n_k = first_query_pos + n_q
    k, v = k[:, :, :n_k], v[:, :, :n_k]
    if first_query_pos == 0:
        # Square block at the sequence start: the plain causal kernel is exact and fastest.
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    mask = _lower_right_causal_mask(n_q, first_query_pos, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def load_balanced_causal_attention(
    q: torch.Tensor,
    k_global: torch.Tensor,
    v_global: torch.Tensor,
    cp_rank: int,
    cp_size: int,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention of rank ``cp_rank``'s load-balanced local queries against the full
    sequence's keys/values (global order). Kept free of collectives so the per-rank math can be
    checked in one process and on any device.

    q: [bs, h, s_local, d_qk]; k_global: [bs, h, s_local*cp, d_qk]; v_global: [..., d_v].
    """
    s_local = q.size(2)
    if s_local % 2 != 0:
        raise ValueError(
            f"local sequence length {s_local} is odd: the global sequence "
            f"({s_local}*{cp_size}) must be divisible by 2*cp={2 * cp_size} so that every rank "
            f"holds a head chunk and a tail chunk of equal length"
        )
    if k_global.size(2) != s_local * cp_size or v_global.size(2) != s_local * cp_size:
        raise ValueError(
            f"k/v must hold the global sequence of {s_local}*{cp_size}={s_local * cp_size} "
            f"tokens, got {k_global.size(2)} and {v_global.size(2)}"
        )
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} out of range for cp_size={cp_size}")
    c = s_local // 2
    head_start = cp_rank * c
    tail_start = (2 * cp_size - 1 - cp_rank) * c
    out_head = _chunk_attention(q[:, :, :c], k_global, v_global, head_start, scale)
    out_tail = _chunk_attention(q[:, :, c:], k_global, v_global, tail_start, scale)
    return torch.cat([out_head, out_tail], dim=2)


def _validate_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k, v must be 4-D [bs, n_heads, s_local, head_dim], got shapes "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[:3] != k.shape[:3] or k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"q, k, v must agree on [bs, n_heads, s_local] (repeat GQA heads before the core), "
            f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.size(-1) != k.size(-1):
        raise ValueError(f"q and k head dims differ: {q.size(-1)} vs {k.size(-1)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v devices differ: {q.device}, {k.device}, {v.device}")


class ContextParallelAttentionCore(nn.Module):
    """Drop-in replacement for the causal SDPA attention core when the sequence is sharded
    over a context-parallel group in the load-balanced layout.

    ``forward`` takes the rank's local q/k/v (head chunk then tail chunk along dim 2) and returns
    exactly what causal attention over the whole global sequence gives for those queries. See
    the module docstring for the algorithm, its memory cost and why the layout is load-balanced.
    """

    def __init__(self, cp_mesh: DeviceMesh) -> None:
        super().__init__()
        _check_mesh(cp_mesh)
        self.cp_mesh = cp_mesh
        self.cp_size = cp_mesh.size()
        self.cp_rank = cp_mesh.get_local_rank()
        # Resolved once: funcol accepts a ProcessGroup, and this avoids re-resolving the mesh
        # dimension on every call.
        self._group = cp_mesh.get_group() if self.cp_size > 1 else None

    def extra_repr(self) -> str:
        return f"cp_rank={self.cp_rank}, cp_size={self.cp_size}"

    def _gather_kv(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """All-gather K and V in one collective and return them in global sequence order.

        Collectives concatenate along dim 0 of a contiguous buffer, so the sequence is moved to
        the front and K and V are packed side by side: [s_local, bs*h*d_qk + bs*h*d_v]. After
        the gather, rank r's block holds its head and tail chunk; ``load_balanced_unshard``
        (the same layout definition the data loader and RoPE use) restores global order.
        """
        bs, h, s_local, d_qk = k.shape
        d_v = v.size(-1)
        k_flat = k.permute(2, 0, 1, 3).reshape(s_local, bs * h * d_qk)
        v_flat = v.permute(2, 0, 1, 3).reshape(s_local, bs * h * d_v)
        packed = torch.cat([k_flat, v_flat], dim=1)
        gathered = _wait(_all_gather_autograd(packed, 0, self._group))
        full = load_balanced_unshard(list(gathered.chunk(self.cp_size, dim=0)), dim=0)
        seq = full.size(0)
        k_full, v_full = full.split([bs * h * d_qk, bs * h * d_v], dim=1)
        k_full = k_full.reshape(seq, bs, h, d_qk).permute(1, 2, 0, 3)
        v_full = v_full.reshape(seq, bs, h, d_v).permute(1, 2, 0, 3)
        return k_full, v_full

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float | None = None,
    ) -> torch.Tensor:
        _validate_qkv(q, k, v)
        if self.cp_size == 1:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        if q.size(2) % 2 != 0:
            raise ValueError(
                f"local sequence length {q.size(2)} is odd: the global sequence "
                f"({q.size(2)}*{self.cp_size}) must be divisible by 2*cp={2 * self.cp_size}; "
                f"shard the batch with shard_batch_for_cp"
            )
        k_full, v_full = self._gather_kv(k, v)
        return load_balanced_causal_attention(q, k_full, v_full, self.cp_rank, self.cp_size, scale=scale)


class _AllReduceCounts:
    """Sums per-sequence MoE expert-selection counts over the cp group, so the sequence-wise
    auxiliary loss is computed on whole sequences rather than on each rank's slice. The counts
    are statistics of discrete routing decisions, so no gradient flows through them."""

    def __init__(self, cp_mesh: DeviceMesh) -> None:
        self._group = cp_mesh.get_group()

    def __call__(self, counts: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return _wait(funcol.all_reduce(counts.detach().contiguous(), "sum", self._group))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(group_size={self._group.size()})"


def apply_context_parallel(model: nn.Module, cp_mesh: DeviceMesh) -> nn.Module:
    """Make ``model`` context-parallel over ``cp_mesh`` (in place; returns it).

    Every module with an ``nn.Module`` attribute ``core`` (the attention kernel) gets a
    :class:`ContextParallelAttentionCore`; every module with ``reduce_aux_counts`` (MoE) gets a
    cp all-reduce; and ``model.cp_rank`` / ``model.cp_size`` are set so the model computes RoPE
    positions for its load-balanced tokens. The replaced core must be plain causal attention
    without parameters: anything else (sliding window, document masks) would be silently lost.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be an nn.Module, got {type(model).__name__}")
    _check_mesh(cp_mesh)
    modules = list(model.named_modules())
    attention = [(name, m) for name, m in modules if isinstance(getattr(m, "core", None), nn.Module)]
    if not attention:
        raise ValueError(
            f"{type(model).__name__} has no module with an nn.Module `core` attribute: context "
            f"parallelism replaces the attention core, so there is nothing to parallelize"
        )
    for name, m in attention:
        if any(True for _ in m.core.parameters()):
            raise ValueError(
                f"{name or type(model).__name__}.core has parameters; the CP core is "
                f"parameter-free causal attention and would drop them"
            )
    for _, m in attention:
        m.core = ContextParallelAttentionCore(cp_mesh)
    if cp_mesh.size() > 1:
        reduce_counts: Callable[[torch.Tensor], torch.Tensor] = _AllReduceCounts(cp_mesh)
        for _, m in modules:
            if hasattr(m, "reduce_aux_counts"):
                m.reduce_aux_counts = reduce_counts
    model.cp_rank = cp_mesh.get_local_rank()
    model.cp_size = cp_mesh.size()
    return model


def shard_batch_for_cp(tensor: torch.Tensor, dim: int, cp_mesh: DeviceMesh) -> torch.Tensor:
    """This rank's load-balanced slice of a full-sequence batch tensor (tokens, labels, ...)
    along ``dim``. Raises ValueError if that length is not divisible by ``2 * cp``."""
    _check_mesh(cp_mesh)
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if not -tensor.dim() <= dim < tensor.dim():
        raise ValueError(f"dim={dim} out of range for a {tensor.dim()}-D tensor")
    cp_size = cp_mesh.size()
    if cp_size > 1 and tensor.size(dim) % (2 * cp_size) != 0:
        raise ValueError(
            f"sequence length {tensor.size(dim)} (dim {dim}) is not divisible by "
            f"2*cp={2 * cp_size}; context parallelism splits each sequence into 2*cp "
            f"load-balanced chunks"
        )
    return load_balanced_shard(tensor, dim, cp_mesh.get_local_rank(), cp_size)
