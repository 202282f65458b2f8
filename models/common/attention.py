"""The attention "core": the part of attention that mixes information across positions.

Everything before it (projections, RoPE, head repetition) and after it (output projection) is
per-token, so the core is the only piece context parallelism must replace. Every attention
module owns one as ``.core`` and calls it with already-rotated, already-repeated heads and the
micro-batch's mask: ``forward(q, k, v, mask, scale=None)``. The mask is whatever the core's
:meth:`~AttentionCore.prepare` built from the micro-batch's document structure
(``models/common/documents.py``); the decoder shell calls ``prepare`` once per micro-batch on
its first layer's core and hands the result to every layer, so no layer rebuilds it and
activation checkpointing saves one reference to it, not one copy per layer. The context-parallel
applier swaps in a core with the same two methods (``models/parallel/context_parallel.py``).

Masks (``attn_mask_type``): ``causal`` (every token sees every earlier token of the row) or
``block_causal`` (a token sees the earlier tokens of its own document only).

Kernels (``attn_type``):

* ``sdpa``: ``scaled_dot_product_attention``; ``causal`` uses its ``is_causal`` fast path,
  ``block_causal`` a boolean ``[bs, 1, q, k]`` mask. The reference path, and the only one that
  trains on CPU.
* ``flex``: FlexAttention with a ``BlockMask`` built per micro-batch and the kernel compiled
  (uncompiled it materializes the whole score matrix). Its block sparsity skips key blocks that
  are entirely in other documents, so many short documents cost less than full causal
  attention. torch 2.13 has no FlexAttention backward on CPU: training needs CUDA (forward runs
  on CPU, which is how the tests check the masks).
* ``varlen``: ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention over the concatenated
  documents, one causal sequence each); CUDA only, no context parallelism, ``block_causal`` only.

Values narrower than queries and keys (MLA: head dim 128 against 192) go to the kernel as they
are where a kernel at least as fast as the one padded values would get takes them, and are
padded with zero columns (sliced off after) where not: :func:`value_head_plan` decides, by
asking SDPA's own backend selection for the actual shapes and dtype once per configuration.
FlexAttention always takes them unpadded, varlen (FlashAttention, one head dim) always padded.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from models.common.documents import ATTN_MASK_TYPES, ATTN_TYPES, Documents
from parallel_dims.torch_compat import guard_cpu_flash_attention, mark_constant_result

__all__ = [
    "AttentionCore",
    "ValueHeadPlan",
    "VarlenLayout",
    "block_causal_mask",
    "chunk_block_mask",
    "repeat_kv",
    "sdpa_value_plan",
    "value_head_plan",
    "varlen_layout",
]

# Where torch's CPU flash attention cannot run bfloat16 (an ATen build below AVX-512 on an AMX
# host, e.g. ATEN_CPU_CAPABILITY=default: the cpu_flash_attention_pack row of
# parallel_dims/torch_compat.py), it runs without oneDNN's packing; elsewhere nothing changes.
# At import, so every process that builds a model has it before its first attention, the
# launcher's forked ranks included (inherited from the server, which imported the models).
guard_cpu_flash_attention()


def block_causal_mask(docs: Documents, q_start: int, n_q: int) -> torch.Tensor:
    """Boolean ``[bs, 1, n_q, q_start + n_q]`` mask (True = attend) for the queries at global
    positions ``q_start .. q_start + n_q - 1`` against the key prefix ``[0, q_start + n_q)``:
    causal (lower-right aligned) and within one document."""
    ids = docs.ids
    n_k = q_start + n_q
    q_pos = torch.arange(q_start, n_k, device=ids.device)
    k_pos = torch.arange(n_k, device=ids.device)
    causal = k_pos[None, :] <= q_pos[:, None]
    same_doc = ids[:, q_start:n_k, None] == ids[:, None, :n_k]
    return (causal[None] & same_doc).unsqueeze(1)


def chunk_block_mask(docs: Documents | None, q_start: int, n_q: int, bs: int, device: torch.device):
    """FlexAttention ``BlockMask`` for the same query chunk and key prefix as
    :func:`block_causal_mask`; plain causal (lower-right aligned) when ``docs`` is None."""
    from torch.nn.attention.flex_attention import create_block_mask

    n_k = q_start + n_q
    if docs is None:

        def mask_mod(b, h, q_idx, kv_idx):
            return kv_idx <= q_idx + q_start

        batch = None
    else:
        ids = docs.ids

        def mask_mod(b, h, q_idx, kv_idx):
            q_global = q_idx + q_start
            return (kv_idx <= q_global) & (ids[b, q_global] == ids[b, kv_idx])

        batch = bs
    # compiled mask construction avoids materializing [bs, q, k] on the GPU; on CPU (tests,
    # forward only) the eager construction is fine and compiles nothing
    return create_block_mask(mask_mod, batch, None, n_q, n_k, device=device, _compile=device.type == "cuda")


@functools.cache
def _compiled_flex() -> Callable[..., torch.Tensor]:
    # flex_attention must run compiled: eagerly it materializes the full score matrix
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask, scale: float | None) -> torch.Tensor:
    """FlexAttention (compiled) of ``q, k, v`` under ``block_mask``."""
    return _compiled_flex()(q, k, v, block_mask=block_mask, scale=scale)


@dataclass(frozen=True)
class VarlenLayout:
    """The packed-sequence description ``varlen_attn`` takes: every document of every row as
    one sequence of the flattened ``[bs * s]`` tokens. ``cu_seqlens``: int32 ``[n_docs + 1]``
    offsets; ``max_len``: the longest document."""

    cu_seqlens: torch.Tensor
    max_len: int


def varlen_layout(docs: Documents) -> VarlenLayout:
    """Split every row at its document ends and list the pieces in flattened token order."""
    ids = docs.ids
    docs_per_row = ids[:, -1] + 1
    row_offset = torch.cumsum(docs_per_row, 0) - docs_per_row
    flat = (ids + row_offset[:, None]).flatten()
    lengths = torch.bincount(flat, minlength=int(docs_per_row.sum()))
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=ids.device)
    cu[1:] = torch.cumsum(lengths, 0)
    return VarlenLayout(cu_seqlens=cu, max_len=int(lengths.max()))


def _varlen_kernel(q, k, v, cu, cu_k, max_q, max_k, *, scale, window_size):  # pragma: no cover - CUDA only
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn(q, k, v, cu, cu_k, max_q, max_k, scale=scale, window_size=window_size)


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: VarlenLayout, scale: float | None, kernel=None
) -> torch.Tensor:
    """Causal attention within each document of ``layout`` for ``q, k, v`` ``[bs, h, s, d]``:
    the rows are flattened to ``[bs * s, h, d]`` and each document is one sequence of the
    varlen kernel (``kernel`` defaults to torch's ``varlen_attn``; tests pass a reference)."""
    bs, h, s = q.shape[:3]
    kernel = kernel or _varlen_kernel

    def flat(t: torch.Tensor) -> torch.Tensor:
        return t.transpose(1, 2).reshape(bs * s, t.size(1), t.size(-1))

    cu = layout.cu_seqlens
    out = kernel(flat(q), flat(k), flat(v), cu, cu, layout.max_len, layout.max_len, scale=scale, window_size=(-1, 0))
    return out.reshape(bs, s, h, out.size(-1)).transpose(1, 2)


def _check_kinds(mask_type: str, attn_type: str) -> None:
    if mask_type not in ATTN_MASK_TYPES:
        raise ValueError(f"attn_mask_type must be one of {', '.join(ATTN_MASK_TYPES)}; got {mask_type!r}")
    if attn_type not in ATTN_TYPES:
        raise ValueError(f"attn_type must be one of {', '.join(ATTN_TYPES)}; got {attn_type!r}")


# SDPA's backends from slowest to fastest on the GPUs we train on: the unfused math path, the
# memory-efficient kernel, FlashAttention 2, cuDNN's attention (Hopper, Blackwell). FlashAttention
# needs one head dim for q, k and v; the other three take a narrower v (cuDNN on torch's checks
# for the part, e.g. head dims up to 256 on sm90 with cuDNN >= 9.10). On CPU only the flash
# kernel is fused, and it needs one head dim too.
_SPEED = {
    SDPBackend.MATH: 0,
    SDPBackend.EFFICIENT_ATTENTION: 1,
    SDPBackend.FLASH_ATTENTION: 2,
    SDPBackend.CUDNN_ATTENTION: 3,
}
_NAMES = {
    SDPBackend.MATH: "math",
    SDPBackend.EFFICIENT_ATTENTION: "efficient",
    SDPBackend.FLASH_ATTENTION: "flash",
    SDPBackend.CUDNN_ATTENTION: "cudnn",
}
# The priority unpadded values run under when cuDNN takes them: torch's default order
# (flash, efficient, math, cudnn in 2.11-2.15) would give them to the memory-efficient kernel.
CUDNN_FIRST = [
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
]
# The probe's q/k/v: one row of 2 heads and 128 tokens. SDPA's conditions that depend on batch,
# heads or length (cuDNN: no key length 1, batch and heads <= 65535; before cuDNN 9, lengths of
# at least 64) do not arise in training, so the plan holds for every micro-batch shape and is
# computed once per (device, dtype, head dims, mask kind, grad) rather than per shape.
_PROBE_HEADS, _PROBE_LEN = 2, 128


@dataclass(frozen=True)
class ValueHeadPlan:
    """How values narrower than q/k reach the kernel: ``pad`` to q/k's head dim (zero columns,
    sliced off after) or not, the kernel that then runs (``cudnn``, ``flash``, ``efficient``,
    ``math``: SDPA backends; ``flex``; ``varlen``), and whether SDPA must run with cuDNN first
    (:meth:`priority`)."""

    pad: bool
    kernel: str
    cudnn_first: bool = False

    def priority(self) -> contextlib.AbstractContextManager:
        """The context the attention call runs in: cuDNN first where it takes the values."""
        return sdpa_kernel(CUDNN_FIRST, set_priority=True) if self.cudnn_first else contextlib.nullcontext()

    def describe(self, d_qk: int, d_v: int) -> str:
        if self.pad:
            return f"V padded {d_v}->{d_qk} ({self.kernel})"
        return f"V unpadded ({self.kernel})"


@functools.cache
def _probe(device: str, dtype: torch.dtype, d_qk: int, d_v: int, masked: bool, grad: bool) -> ValueHeadPlan:
    def backend(v_dim: int, first_cudnn: bool) -> SDPBackend:
        def t(d: int) -> torch.Tensor:
            x = torch.empty(1, _PROBE_HEADS, _PROBE_LEN, d, device=device, dtype=dtype)
            return x.requires_grad_(grad)

        mask = torch.ones(_PROBE_LEN, _PROBE_LEN, dtype=torch.bool, device=device).tril() if masked else None
        ctx = sdpa_kernel(CUDNN_FIRST, set_priority=True) if first_cudnn else contextlib.nullcontext()
        with ctx:
            # the choice scaled_dot_product_attention itself makes for these inputs
            return SDPBackend(torch._fused_sdp_choice(t(d_qk), t(d_qk), t(v_dim), mask, 0.0, not masked))

    narrow = backend(d_v, first_cudnn=True)
    padded = backend(d_qk, first_cudnn=False)  # as the padded call runs: torch's default priority
    if _SPEED.get(narrow, -1) >= _SPEED.get(padded, -1):
        return ValueHeadPlan(
            pad=False, kernel=_NAMES.get(narrow, str(narrow)), cudnn_first=narrow == SDPBackend.CUDNN_ATTENTION
        )
    return ValueHeadPlan(pad=True, kernel=_NAMES.get(padded, str(padded)))


@mark_constant_result  # torch.compiler.assume_constant_result without importing dynamo here
def _constant_plan(device: str, dtype: torch.dtype, d_qk: int, d_v: int, masked: bool, grad: bool) -> tuple:
    # under torch.compile this runs once at trace time and its result is baked into the graph
    # (a tuple: dynamo holds the result as a constant, whose methods it cannot call)
    plan = _probe(device, dtype, d_qk, d_v, masked, grad)
    return plan.pad, plan.kernel, plan.cudnn_first


def sdpa_value_plan(
    device: torch.device | str, dtype: torch.dtype, d_qk: int, d_v: int, masked: bool, grad: bool = True
) -> ValueHeadPlan:
    """The plan for SDPA on ``device`` in ``dtype`` with q/k head dim ``d_qk`` and v head dim
    ``d_v < d_qk``, with a boolean mask (``masked``) or the causal flag. Values go unpadded when
    the backend SDPA picks for them (with cuDNN first) is at least as fast as the one it picks
    for padded values (torch's default order), padded otherwise: on CUDA in bf16 cuDNN where it
    takes the shapes, else FlashAttention on padded values; in fp32 on CUDA the memory-efficient
    kernel either way, so unpadded; on CPU the flash kernel on padded values (the math path,
    which upcasts bf16, is what unpadded values would get)."""
    return _probe(str(torch.device(device)), dtype, d_qk, d_v, masked, grad)


def value_head_plan(
    core: nn.Module, device: torch.device, dtype: torch.dtype, d_qk: int, d_v: int, grad: bool = True
) -> ValueHeadPlan:
    """How ``core`` (an :class:`AttentionCore`, or the context-parallel core that replaces it)
    should get values of head dim ``d_v`` next to queries and keys of head dim ``d_qk`` on
    ``device`` in ``dtype`` (``grad``: the inputs require grad). A constant under
    ``torch.compile``; the start-up report asks the same question."""
    if core.attn_type == "flex":
        return ValueHeadPlan(pad=False, kernel="flex")  # FlexAttention takes v of its own head dim
    if core.attn_type == "varlen" or d_v >= d_qk:
        return ValueHeadPlan(pad=d_v < d_qk, kernel=core.attn_type)
    # SDPA gets a boolean mask for block-causal masking and, under context parallelism (the CP
    # core's cp_size > 1), for its load-balanced chunks; the causal flag otherwise
    masked = core.mask_type != "causal" or getattr(core, "cp_size", 1) > 1
    return ValueHeadPlan(*_constant_plan(str(device), dtype, d_qk, d_v, masked, grad))


class AttentionCore(nn.Module):
    """Softmax attention over ``q, k`` [bs, heads, s, d_qk] and ``v`` [bs, heads, s, d_v] with
    the mask ``mask_type`` on the kernel ``attn_type`` (see the module docstring).

    Query and key heads must already match (GQA repetition happens before the core) so that a
    replacement core never needs to know the head grouping."""

    def __init__(self, mask_type: str = "causal", attn_type: str = "sdpa") -> None:
        super().__init__()
        _check_kinds(mask_type, attn_type)
        self.mask_type = mask_type
        self.attn_type = attn_type

    def extra_repr(self) -> str:
        return f"mask_type={self.mask_type}, attn_type={self.attn_type}"

    def prepare(self, docs: Documents | None, bs: int, s: int, device: torch.device) -> Any:
        """The mask of one micro-batch of ``bs`` rows of ``s`` tokens (``docs`` is None for
        ``causal``): None (sdpa causal), a boolean mask, a ``BlockMask`` or a
        :class:`VarlenLayout`."""
        if self.mask_type == "block_causal" and docs is None:
            raise ValueError("block_causal attention needs the micro-batch's document structure")
        if self.attn_type == "flex":
            return chunk_block_mask(docs if self.mask_type == "block_causal" else None, 0, s, bs, device)
        if self.mask_type == "causal":
            return None
        if self.attn_type == "varlen":
            return varlen_layout(docs)
        return block_causal_mask(docs, 0, s)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any = None, scale: float | None = None
    ) -> torch.Tensor:
        if self.attn_type == "flex":
            return flex_attention(q, k, v, mask, scale)
        if self.attn_type == "varlen":
            return varlen_attention(q, k, v, mask, scale)
        if mask is None:
            if self.mask_type != "causal":
                raise ValueError("block_causal attention called without its mask; build it with core.prepare")
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def kv_repeats(q: torch.Tensor, k: torch.Tensor) -> int:
    """How many local query heads share each local key/value head (``[bs, s, heads, d]``
    tensors of this rank); a clear error when tensor parallelism split them unevenly."""
    local_q_heads, local_kv_heads = q.shape[2], k.shape[2]
    if local_q_heads % local_kv_heads != 0:
        raise ValueError(
            f"Local query heads ({local_q_heads}) are not a multiple of local KV heads "
            f"({local_kv_heads}); the tensor-parallel degree must divide n_kv_heads."
        )
    return local_q_heads // local_kv_heads


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Expand ``[bs, s, kv_heads, d]`` to ``[bs, s, kv_heads * n_rep, d]`` so that query head
    ``h`` reads key/value head ``h // n_rep`` (the grouping Llama checkpoints use)."""
    if n_rep == 1:
        return x
    bs, s, kv_heads, d = x.shape
    return x.unsqueeze(3).expand(bs, s, kv_heads, n_rep, d).reshape(bs, s, kv_heads * n_rep, d)
