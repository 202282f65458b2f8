"""Context parallelism (CP) for causal and block-causal attention, with one code path for
CPU/gloo and GPU/NCCL.

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

* Block-causal (document) masking composes with this: document ids are defined on the global
  row, so the model gathers the row's token ids over cp once per micro-batch
  (:class:`SequenceGather`, set as the model's ``sequence_gather``), and :meth:`prepare` builds
  each chunk's mask (causal within the key prefix AND same document) once per micro-batch for
  every layer. On FlexAttention the two chunk masks are ``BlockMask`` s over the same prefixes.

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

from models.common.attention import AttentionCore, block_causal_mask, chunk_block_mask, flex_attention
from models.common.documents import Documents
from models.common.sequence import load_balanced_shard, load_balanced_unshard
from parallel_dims.torch_compat import per_rank, per_rank_autograd

__all__ = [
    "ContextParallelAttentionCore",
    "SequenceGather",
    "apply_context_parallel",
    "load_balanced_causal_attention",
    "shard_batch_for_cp",
]

# ``all_gather_tensor_autograd`` is deprecated in newer torch in favour of the ``_single`` name;
# older builds (e.g. on a GPU box) only have the former.
_all_gather_autograd = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


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
    mask=None,
    attn_type: str = "sdpa",
) -> torch.Tensor:
    n_q = q.size(2)
    n_k = first_query_pos + n_q
    k, v = k[:, :, :n_k], v[:, :, :n_k]
    if attn_type == "flex":
        return flex_attention(q, k, v, mask, scale)
    if mask is not None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    if first_query_pos == 0:
        # Square block at the sequence start: the plain causal kernel is exact and fastest.
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    mask = _lower_right_causal_mask(n_q, first_query_pos, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def _chunk_starts(s_local: int, cp_rank: int, cp_size: int) -> tuple[int, int, int]:
    """(chunk length, global start of the head chunk, global start of the tail chunk)."""
    c = s_local // 2
    return c, cp_rank * c, (2 * cp_size - 1 - cp_rank) * c


def load_balanced_causal_attention(
    q: torch.Tensor,
    k_global: torch.Tensor,
    v_global: torch.Tensor,
    cp_rank: int,
    cp_size: int,
    scale: float | None = None,
    masks: tuple | None = None,
    attn_type: str = "sdpa",
) -> torch.Tensor:
    """Causal attention of rank ``cp_rank``'s load-balanced local queries against the full
    sequence's keys/values (global order). Kept free of collectives so the per-rank math can be
    checked in one process and on any device.

    q: [bs, h, s_local, d_qk]; k_global: [bs, h, s_local*cp, d_qk]; v_global: [..., d_v].
    ``masks``: the (head chunk, tail chunk) masks :meth:`ContextParallelAttentionCore.prepare`
    built (block-causal, or any FlexAttention mask); None for plain causal SDPA.
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
    c, head_start, tail_start = _chunk_starts(s_local, cp_rank, cp_size)
    head_mask, tail_mask = masks if masks is not None else (None, None)
    out_head = _chunk_attention(q[:, :, :c], k_global, v_global, head_start, scale, head_mask, attn_type)
    out_tail = _chunk_attention(q[:, :, c:], k_global, v_global, tail_start, scale, tail_mask, attn_type)
    return torch.cat([out_head, out_tail], dim=2)


def _chunk_masks(ids, q_positions, cp_rank, cp_size, s_local, mask_type, attn_type, bs, device):
    """The (head chunk, tail chunk) masks of rank ``cp_rank`` (see
    :meth:`ContextParallelAttentionCore.prepare`); ``ids`` None without documents."""
    docs = None if ids is None else Documents(ids=ids, q_positions=q_positions)
    c, head_start, tail_start = _chunk_starts(s_local, cp_rank, cp_size)
    if attn_type == "flex":
        chunk_docs = docs if mask_type == "block_causal" else None
        return tuple(chunk_block_mask(chunk_docs, start, c, bs, device) for start in (head_start, tail_start))
    if mask_type == "causal":
        return None
    return tuple(block_causal_mask(docs, start, c) for start in (head_start, tail_start))


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

    def __init__(self, cp_mesh: DeviceMesh, mask_type: str = "causal", attn_type: str = "sdpa") -> None:
        super().__init__()
        _check_mesh(cp_mesh)
        if attn_type not in ("sdpa", "flex"):
            raise ValueError(
                f"attn_type={attn_type!r} does not compose with context parallelism (varlen attention "
                "runs whole documents, not one rank's load-balanced chunks); use 'sdpa' or 'flex' with cp > 1"
            )
        if mask_type not in ("causal", "block_causal"):
            raise ValueError(f"mask_type must be 'causal' or 'block_causal', got {mask_type!r}")
        self.mask_type = mask_type
        self.attn_type = attn_type
        self.cp_mesh = cp_mesh
        self.cp_size = cp_mesh.size()
        self.cp_rank = cp_mesh.get_local_rank()
        # Resolved once: funcol accepts a ProcessGroup, and this avoids re-resolving the mesh
        # dimension on every call.
        self._group = cp_mesh.get_group() if self.cp_size > 1 else None

    def extra_repr(self) -> str:
        return f"cp_rank={self.cp_rank}, cp_size={self.cp_size}, mask_type={self.mask_type}, attn_type={self.attn_type}"

    def prepare(self, docs: Documents | None, bs: int, s_local: int, device: torch.device):
        """The (head chunk, tail chunk) masks of one micro-batch (``s_local`` = this rank's
        tokens per row): None for causal SDPA (the causal kernels need none), boolean
        block-causal masks, or FlexAttention ``BlockMask`` s."""
        if self.mask_type == "block_causal" and docs is None:
            raise ValueError("block_causal attention needs the micro-batch's document structure")
        if self.cp_size == 1:
            s_local_docs = docs if self.mask_type == "block_causal" else None
            if self.attn_type == "flex":
                return chunk_block_mask(s_local_docs, 0, s_local, bs, device)
            return None if s_local_docs is None else block_causal_mask(s_local_docs, 0, s_local)
        if self.attn_type == "sdpa" and self.mask_type == "causal":
            return None
        # per rank: the chunk offsets depend on the cp rank (one per simulated rank in local_tensor)
        ids, q_positions = (docs.ids, docs.q_positions) if docs is not None else (None, None)
        return per_rank(_chunk_masks)(
            ids, q_positions, self.cp_rank, self.cp_size, s_local, self.mask_type, self.attn_type, bs, device
        )

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
        mask=None,
        scale: float | None = None,
    ) -> torch.Tensor:
        _validate_qkv(q, k, v)
        if self.mask_type == "block_causal" and mask is None:
            raise ValueError("block_causal attention called without its masks; build them with core.prepare")
        if self.cp_size == 1:
            if self.attn_type == "flex":
                return flex_attention(q, k, v, mask, scale)
            if mask is not None:
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        if q.size(2) % 2 != 0:
            raise ValueError(
                f"local sequence length {q.size(2)} is odd: the global sequence "
                f"({q.size(2)}*{self.cp_size}) must be divisible by 2*cp={2 * self.cp_size}; "
                f"shard the batch with shard_batch_for_cp"
            )
        k_full, v_full = self._gather_kv(k, v)
        # per rank: which key prefix each chunk sees, and its kernel, depend on the cp rank
        return per_rank_autograd(
            load_balanced_causal_attention,
            (q, k_full, v_full),
            self.cp_rank,
            self.cp_size,
            scale=scale,
            masks=mask,
            attn_type=self.attn_type,
        )


class SequenceGather:
    """This rank's ``[bs, s_local]`` token ids -> the whole row's ``[bs, s_local * cp]`` in
    sequence order: one all-gather over the cp group per micro-batch (integers, no gradient),
    then the load-balanced layout undone. The model computes document ids from the result."""

    def __init__(self, cp_mesh: DeviceMesh) -> None:
        self._group = cp_mesh.get_group()
        self.cp_size = cp_mesh.size()

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids.t().contiguous()  # [s_local, bs]: collectives gather along dim 0
        gathered = _wait(_all_gather(local, 0, self._group))
        full = load_balanced_unshard(list(gathered.chunk(self.cp_size, dim=0)), dim=0)
        return full.t()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(cp_size={self.cp_size})"


class AllReduceCounts:
    """Sums per-sequence MoE expert-selection counts over a group holding slices of the same
    sequences (cp; tp under sequence parallelism), so the sequence-wise auxiliary loss is
    computed on whole sequences rather than on each rank's slice. The counts
    are statistics of discrete routing decisions, so no gradient flows through them."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self._group = mesh.get_group()

    def __call__(self, counts: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return _wait(funcol.all_reduce(counts.detach().contiguous(), "sum", self._group))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(group_size={self._group.size()})"


def apply_context_parallel(model: nn.Module, cp_mesh: DeviceMesh) -> nn.Module:
    """Make ``model`` context-parallel over ``cp_mesh`` (in place; returns it).

    Every module with an ``nn.Module`` attribute ``core`` (the attention kernel) gets a
    :class:`ContextParallelAttentionCore`; every module with ``add_aux_count_reduction`` (MoE) gets a
    cp all-reduce of its aux-loss counts; ``model.cp_rank`` / ``model.cp_size`` are set so the model computes RoPE
    positions for its load-balanced tokens, and ``model.sequence_gather`` so it computes document
    ids on the whole row. The replaced core must be a parameter-free
    :class:`~models.common.attention.AttentionCore`; its mask type (causal or block-causal) and
    kernel (sdpa or flex) carry over, and a core of any other kind is refused rather than
    silently replaced.
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
        if not isinstance(m.core, AttentionCore):
            raise ValueError(
                f"{name or type(model).__name__}.core is a {type(m.core).__name__}, not an AttentionCore; "
                "context parallelism knows how to shard causal and block-causal attention only"
            )
    for _, m in attention:
        m.core = ContextParallelAttentionCore(cp_mesh, m.core.mask_type, m.core.attn_type)
    if cp_mesh.size() > 1:
        reduce_counts: Callable[[torch.Tensor], torch.Tensor] = AllReduceCounts(cp_mesh)
        for _, m in modules:
            if hasattr(m, "add_aux_count_reduction"):
                m.add_aux_count_reduction(reduce_counts)
    model.cp_rank = cp_mesh.get_local_rank()
    model.cp_size = cp_mesh.size()
    if cp_mesh.size() > 1:
        model.sequence_gather = SequenceGather(cp_mesh)
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
    return per_rank(load_balanced_shard)(tensor, dim, cp_mesh.get_local_rank(), cp_size)
