"""The routed experts of every MoE model (``models/common/moe.py``): ``E`` SwiGLU experts as
stacked weights, computed with grouped GEMMs (or a per-expert loop where no sync-free grouped
kernel exists), and the choice between them.

``GroupedExperts.forward(x, num_tokens_per_expert)`` is the contract expert parallelism wraps:
it receives tokens already sorted by (local) expert and only ever computes on local tensors, so
the EP wrapper can all-to-all tokens in front of it and the weights can be DTensor shards. The
routing, dispatch, combine and balancing around it are ``models/common/moe.py``; the float8
grouped GEMMs it can run are ``models/common/float8_grouped.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from models.common.float8_grouped import float8_experts_forward
from parallel_dims.torch_compat import per_rank_autograd

__all__ = ["GroupedExperts", "expert_compute_dtype", "grouped_mm_by_default"]


def _local(w: torch.Tensor) -> torch.Tensor:
    return w.to_local() if isinstance(w, DTensor) else w


# What ``torch._grouped_mm`` accepts (ATen ``_grouped_mm_validate_inputs``: float32, bfloat16,
# float16; float64 is rejected). Inputs and output share one dtype.
_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def grouped_mm_by_default(device: torch.device, dtype: torch.dtype, dim: int, hidden_dim: int) -> bool:
    """The automatic (``use_grouped_mm=None``) choice of :class:`GroupedExperts`: True where
    ``torch._grouped_mm`` is a real grouped kernel with no host sync for expert GEMMs of this
    compute ``dtype`` and local shape (``hidden_dim`` is the local, possibly ETP-sliced, one).

    * ``torch._grouped_mm`` exists and accepts ``dtype`` (float32, bfloat16, float16);
    * every row stride is 16-byte aligned: ``dim`` and ``hidden_dim`` times the element size
      are multiples of 16 (the op rejects other strides);
    * CPU: any of those dtypes. ATen runs its per-group ``mm`` fallback there, which reads the
      offsets in C++ (no device to sync with). Equal to the loop up to rounding (the per-group
      GEMMs may sum in another order than the loop's ``mm``, depending on the CPU); fwd+bwd
      about as fast as the O(E) loop up to 64 experts (loop/grouped time 0.86-1.14) and
      faster at 128 (1.22-1.26), 6-23x faster than the old O(E^2) loop at 64-128 experts
      (``benchmarks/moe.py``: 4096 rows, dim 256, hidden 128, float32, one thread);
    * CUDA: bfloat16 on compute capability 9.x/10.x only, the CUTLASS kernel ("fast path, no
      d2h sync needed" in ``_grouped_mm_cuda``; it also needs 16-byte-aligned base pointers,
      which freshly allocated tensors have). Everything else on CUDA (float32, float16, other
      GPUs, ROCm) goes to the same ATen fallback, which copies the offsets to the host in
      every call (``offs.cpu()``): 3 syncs per layer forward and 6 backward, against the
      loop's one per layer, for the same per-expert ``mm`` kernels. There the loop is the
      default; ``use_grouped_mm=True`` still forces the fallback;
    * under ``torch.compile`` only bfloat16: the op's meta kernel, which tracing runs,
      rejects other dtypes (torch 2.13), so float32 compiles the loop (a graph break at its
      ``.tolist()``) instead of failing;
    * any other device: the loop."""
    if not hasattr(torch, "_grouped_mm") or dtype not in _GROUPED_MM_DTYPES:
        return False
    row_bytes = dtype.itemsize
    if (dim * row_bytes) % 16 != 0 or (hidden_dim * row_bytes) % 16 != 0:
        return False
    if dtype != torch.bfloat16 and torch.compiler.is_compiling():
        return False  # the op's meta kernel (what compile traces with) accepts only bf16
    if device.type == "cpu":
        return True
    if device.type == "cuda" and torch.version.hip is None:
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device)[0] in (9, 10)
    return False


def expert_compute_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the expert GEMMs run in, and the dtype of the experts' output.

    ``torch._grouped_mm`` is not covered by autocast, so :class:`GroupedExperts` applies the
    autocast rule itself: when autocast is enabled for ``x``'s device type, the autocast dtype
    (weights in float64 are not autocast-eligible and keep theirs). Otherwise the weights'
    dtype: FSDP2 mixed precision hands the module bf16 weights while the routed tokens may be
    float32, and the module computes in its parameters' precision."""
    device_type = x.device.type
    # (a fixed list rather than torch.amp.is_autocast_available, which torch 2.11's compiler
    # cannot trace)
    if (
        device_type in _AUTOCAST_DEVICE_TYPES
        and torch.is_autocast_enabled(device_type)
        and weight.dtype != torch.float64
    ):
        return torch.get_autocast_dtype(device_type)
    return weight.dtype


_AUTOCAST_DEVICE_TYPES = ("cpu", "cuda")


class _ZeroGradPastTotal(torch.autograd.Function):
    """Identity whose backward zeroes the gradient rows of padding (rows past the counts'
    sum). ``torch._grouped_mm`` leaves output rows past the last offset uninitialised, in the
    forward and in its input-gradient GEMM, so those rows must be masked on both sides. Only
    applied where the caller may pass padding rows (``GroupedExperts.forward``'s
    ``has_padding``, True unless the caller states otherwise; MoE states otherwise, and the
    EP wrapper passes the caller's statement on: it rejects inputs with rows past the counts'
    sum, so it adds none)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(valid)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (valid,) = ctx.saved_tensors
        return torch.where(valid, grad, 0), None


class GroupedExperts(nn.Module):
    """``E`` SwiGLU experts stored as stacked weights ``w1``/``w3`` [E, hidden, dim] and ``w2``
    [E, dim, hidden], so EP and FSDP can shard them along the expert dimension as one tensor.

    Two implementations, with the same results up to rounding: their GEMM calls differ, so the
    order of a dot product's additions may too (float32, bfloat16 and float16 agree within a
    per-element rounding-error bound, zeros of padding and empty experts exactly;
    ``tests/unit/test_moe_kernels.py``):

    * grouped GEMM: three ``torch._grouped_mm`` calls over all local experts. Group offsets
      are a device-side cumsum of the counts, the count check is a device-side
      ``torch._assert_async`` and padding rows (where the caller may have any) are masked on
      device, so this path never syncs with the host and, in bfloat16, compiles into one
      graph. What a failed check looks like on a GPU: nothing at this line. The kernel's
      assert fires on the device and CUDA's "device-side assert triggered" error reaches
      Python only at the next synchronizing call (often the step's loss ``.item()``), maybe
      without this message;
      the CUDA context is then unusable (every later CUDA call in the process fails, only a
      restart recovers), and the other ranks wait in their next collective until the NCCL
      watchdog's timeout ends them. (On CPU it raises RuntimeError here, with the message.)
      Only a caller passing inconsistent counts can trigger it: the MoE's own counts always
      satisfy it.
    * loop: one ``mm`` chain per expert over ``torch.split`` of the tokens. It needs the group
      sizes on the host: exactly one ``.tolist()`` per call, which also validates the counts
      (ValueError). The stacked weights are ``unbind``-ed once, so the backward stacks the E
      per-expert gradients once: O(E) work. (Indexing ``w1[e]`` per expert made autograd
      build a full [E, hidden, dim] zero gradient per expert: O(E^2).)

    ``use_grouped_mm``: None picks the grouped GEMM where :func:`grouped_mm_by_default` says
    it is a sync-free kernel for the compute dtype and shapes (CPU float32/bfloat16/float16
    with 16-byte-aligned rows; CUDA bfloat16 on sm90/sm100) and the loop elsewhere; True
    forces the grouped GEMM, False the loop.

    Compute dtype (:func:`expert_compute_dtype`): the autocast dtype when autocast is on,
    else the weights' dtype; tokens and weights are cast to it before the GEMMs, and the
    output has it.

    In both paths experts that receive no token still produce a (zero) gradient for their
    weights, so data-parallel gradient reductions see the same parameter set on every rank."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, use_grouped_mm: bool | None = None) -> None:
        super().__init__()
        if dim <= 0 or hidden_dim <= 0 or num_experts <= 0:
            raise ValueError(
                "GroupedExperts needs positive dim, hidden_dim and num_experts, got "
                f"{dim}, {hidden_dim}, {num_experts}."
            )
        self.num_experts = num_experts
        self.use_grouped_mm = use_grouped_mm
        # float8 GEMMs (model.converters = ["float8_experts"], set by the converter before any
        # parallelism): None (off), or whether they are emulated (float8.emulate)
        self.float8_emulate: bool | None = None
        # LoRA on the routed experts (model.converters = ["lora"] with lora.experts, set by the
        # converter): None, or (module, w1, w2, w3) -> the weights with their adapters' deltas
        self.lora_delta = None
        # Provisional values so a model used without init_weights is still finite; the real
        # (layout-independent) init comes from the model's init_weights.
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim).normal_(0.0, 0.02))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim).normal_(0.0, 0.02))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim).normal_(0.0, 0.02))

    def forward(
        self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor, *, has_padding: bool = True
    ) -> torch.Tensor:
        """``x`` [T, dim] sorted by expert; ``num_tokens_per_expert`` [E_local] (integer, on
        any device). Rows past the sum of the counts (padding) produce zero rows and get zero
        gradients. ``has_padding=False`` states that the counts sum to exactly T: the grouped
        path then skips the padding mask (two elementwise passes over [T, dim] in forward and
        one in backward) and checks the statement on device instead. Returns [T, dim] in the
        compute dtype."""
        w1, w2, w3 = _local(self.w1), _local(self.w2), _local(self.w3)
        if self.lora_delta is not None:  # LoRA adapters per expert (models/parallel/lora_experts.py)
            w1, w2, w3 = self.lora_delta(self, w1, w2, w3)
        e_local = w1.shape[0]
        if num_tokens_per_expert.dim() != 1 or num_tokens_per_expert.shape[0] != e_local:
            raise ValueError(
                f"num_tokens_per_expert has shape {tuple(num_tokens_per_expert.shape)} but this "
                f"rank holds {e_local} experts; pass one count per local expert."
            )
        if num_tokens_per_expert.is_floating_point() or num_tokens_per_expert.is_complex():
            raise ValueError(f"num_tokens_per_expert must be integer, got {num_tokens_per_expert.dtype}.")
        if x.dim() != 2:
            raise ValueError(f"GroupedExperts expects x of shape [T, dim], got {tuple(x.shape)}.")
        dtype = expert_compute_dtype(x, w1)
        x, w1, w2, w3 = (t.to(dtype) for t in (x, w1, w2, w3))
        if self.float8_emulate is not None:  # per simulated rank under local_tensor: it reads the sizes
            return per_rank_autograd(
                float8_experts_forward, (x, w1, w2, w3), num_tokens_per_expert, self.float8_emulate
            )
        if self.use_grouped_mm is None:
            grouped = grouped_mm_by_default(x.device, dtype, w1.shape[2], w1.shape[1])
        else:
            grouped = self.use_grouped_mm
        if grouped:
            return self._grouped_mm_forward(x, w1, w2, w3, num_tokens_per_expert, has_padding)
        # The loop path's one host sync; the sizes also let us validate the counts.
        sizes = num_tokens_per_expert.tolist()
        total = sum(sizes)
        if total > x.shape[0] or min(sizes) < 0:
            raise ValueError(
                f"num_tokens_per_expert sums to {total} (min {min(sizes)}) but x has "
                f"{x.shape[0]} rows; counts must be non-negative and cover at most the rows given."
            )
        if not has_padding and total != x.shape[0]:
            raise ValueError(
                f"has_padding=False but num_tokens_per_expert sums to {total} while x has {x.shape[0]} "
                "rows; pass has_padding=True for inputs with padding rows."
            )
        return self._loop_forward(x, w1, w2, w3, sizes)

    @classmethod
    def _grouped_mm_forward(
        cls,
        x: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        w3: torch.Tensor,
        counts: torch.Tensor,
        has_padding: bool = True,
    ) -> torch.Tensor:
        rows = x.shape[0]
        counts = counts.to(device=x.device)
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        total = offsets[-1]
        # Checked on device, no host sync: on CPU a violation raises RuntimeError here, on
        # CUDA it is a device-side assert that stops the stream before a GEMM reads past x.
        if has_padding:
            torch._assert_async(
                (counts.min() >= 0) & (total <= rows),
                "GroupedExperts: num_tokens_per_expert must be non-negative and sum to at most the number of rows of x",
            )
        else:
            torch._assert_async(
                (counts.min() >= 0) & (total == rows),
                "GroupedExperts: has_padding=False but num_tokens_per_expert is negative or does not sum to the "
                "number of rows of x; pass has_padding=True for inputs with padding rows",
            )
        if rows == 0:
            # No tokens at all (e.g. an EP rank that received none); the counts are zero by
            # the check above, so the loop over E empty groups needs no host read and gives
            # every weight its zero gradient (torch._grouped_mm rejects empty inputs).
            return cls._loop_forward(x, w1, w2, w3, [0] * w1.shape[0])
        if not has_padding:
            h = F.silu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offsets))
            h = h * torch._grouped_mm(x, w3.transpose(-2, -1), offs=offsets)
            return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offsets)
        valid = (torch.arange(rows, device=x.device) < total).unsqueeze(-1)
        x = _ZeroGradPastTotal.apply(x, valid)
        h = F.silu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offsets))
        h = h * torch._grouped_mm(x, w3.transpose(-2, -1), offs=offsets)
        out = torch._grouped_mm(h, w2.transpose(-2, -1), offs=offsets)
        # Zero the uninitialised padding rows. The backward of where() is a fresh dense
        # gradient, which _grouped_mm's CPU backward needs (it rejects the stride-0 gradient
        # of out.sum()).
        return torch.where(valid, out, 0)

    @staticmethod
    def _loop_forward(
        x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, sizes: list[int]
    ) -> torch.Tensor:
        rows, total = x.shape[0], sum(sizes)
        pieces = torch.split(x, sizes + [rows - total] if total < rows else sizes)
        # unbind once: its backward stacks the E per-expert gradients into one [E, ...]
        # tensor. Experts with zero tokens still run (on empty inputs), so every weight gets
        # a (zero) gradient.
        outs = [
            (F.silu(x_e @ a.transpose(0, 1)) * (x_e @ c.transpose(0, 1))) @ b.transpose(0, 1)
            for x_e, a, b, c in zip(pieces, w1.unbind(0), w2.unbind(0), w3.unbind(0))
        ]
        if total < rows:
            outs.append(x.new_zeros(rows - total, w2.shape[1]))
        return torch.cat(outs)

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden={self.w1.shape[1]}, dim={self.w1.shape[2]}, "
            f"use_grouped_mm={self.use_grouped_mm}"
            + ("" if self.float8_emulate is None else f", float8={'emulated' if self.float8_emulate else 'rowwise'}")
        )
