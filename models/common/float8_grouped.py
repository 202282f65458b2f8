"""Float8 grouped GEMMs for the routed experts (``model.converters = ["float8_experts"]``).

One recipe, torchao's float8 grouped-GEMM recipe (its only one): dynamic **rowwise** e4m3
scaling with scales rounded down to a power of two, a bf16 GEMM output, and for each of the three
GEMMs of a grouped ``x @ w.T`` (tokens sorted by expert, ``offsets`` the group ends):

* output ``x @ w_t``: ``x`` scaled per token (its row, over the contraction dim), the weight per
  output column of each expert (over the contraction dim);
* input gradient ``g @ w_t.T``: ``g`` per token, the weight per input column of each expert;
* weight gradient ``x_e.T @ g_e`` per expert ``e``: both operands scaled per column over that
  expert's tokens only.

Three implementations of that one recipe, picked by :func:`float8_grouped_backend`:

* ``"torchao"`` (CUDA sm90+): torchao's ``_to_fp8_rowwise_then_scaled_grouped_mm`` (triton
  quantization kernels, ``torch._scaled_grouped_mm``), with no host sync. Its groups must be
  multiples of 16 rows: :func:`align_token_groups` copies the tokens into a buffer whose groups
  are padded with zero rows (a static size, no host read) and :func:`unalign` reads them back.
* ``"scaled_mm"`` (every device with float8 ``torch._scaled_mm``, CPU included): the same
  quantization in plain torch and one rowwise ``torch._scaled_mm`` per expert. It reads the group
  sizes on the host (one ``.tolist()`` per call); on CPU that is free, and it is what CPU runs.
* ``"emulated"`` (``float8.emulate``): the same quantization, the GEMMs on the dequantized
  operands in float32 (GPUs without float8 GEMMs; numerics only).

The three agree up to the GEMMs' summation order (tests/unit/test_float8_experts.py runs
torchao's function on CPU with its CUDA kernels replaced by its own torch references and checks
this module's results against it).
"""

from __future__ import annotations

import torch

__all__ = [
    "BACKEND_NOTES",
    "FLOAT8_GROUP_ALIGN",
    "align_token_groups",
    "float8_experts_forward",
    "float8_grouped_backend",
    "float8_grouped_mm",
    "quantize_rowwise",
    "unalign",
]

FLOAT8 = torch.float8_e4m3fn
FLOAT8_MAX = torch.finfo(FLOAT8).max  # 448
AMAX_EPS = 1e-12  # torchao's floor on an amax (an all-zero row gets a finite scale)
FLOAT8_GROUP_ALIGN = 16  # torch._scaled_grouped_mm: every group a multiple of 16 rows (16 bytes)
OUT_DTYPE = torch.bfloat16  # torch._scaled_grouped_mm writes bf16 only; every backend does the same

# what the trainer's start-up line says of each backend
BACKEND_NOTES = {
    "torchao": "torchao's scaled grouped GEMM",
    "scaled_mm": "one torch._scaled_mm per expert",
    "emulated": "emulated in float32, numerics only",
}


def quantize_rowwise(t: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` in e4m3 with one scale per slice along ``dim`` (the amax over ``dim``), the scale
    ``fp8_max / amax`` rounded down to a power of two (so dequantizing is exact in the exponent);
    returns (float8 data, the float32 multiplier that dequantizes it, keepdim-shaped)."""
    amax = t.detach().abs().amax(dim=dim, keepdim=True).to(torch.float64)
    scale = (FLOAT8_MAX / amax.clamp(min=AMAX_EPS)).to(torch.float32)
    scale = torch.exp2(torch.floor(torch.log2(scale)))
    data = (t.to(torch.float32) * scale).clamp(-FLOAT8_MAX, FLOAT8_MAX).to(FLOAT8)
    return data, scale.reciprocal()


def _column_major(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous().t()


def _gemm(a: torch.Tensor, a_inv: torch.Tensor, b: torch.Tensor, b_inv: torch.Tensor, emulate: bool) -> torch.Tensor:
    """``(a * a_inv) @ (b * b_inv)`` in bf16 from float8 ``a`` [m, k] (row-major, ``a_inv``
    [m, 1]) and ``b`` [k, n] (column-major, ``b_inv`` [1, n])."""
    if emulate:
        return ((a.to(torch.float32) * a_inv) @ (b.to(torch.float32) * b_inv)).to(OUT_DTYPE)
    return torch._scaled_mm(a, b, scale_a=a_inv, scale_b=b_inv, out_dtype=OUT_DTYPE)


class _Float8GroupedMM(torch.autograd.Function):
    """``x`` [T, K] (sorted by group, ``sizes`` rows each; rows past their sum are left alone
    and get zero gradients) times ``w_t`` [G, K, N] -> [T, N] bf16, one scaled GEMM per group."""

    @staticmethod
    def forward(ctx, x, w_t, sizes: list[int], emulate: bool):
        ctx.save_for_backward(x, w_t)
        ctx.sizes, ctx.emulate = sizes, emulate
        xq, x_inv = quantize_rowwise(x, dim=-1)
        wq, w_inv = quantize_rowwise(w_t, dim=-2)  # [G, 1, N]: per output column of each group
        out = x.new_zeros(x.shape[0], w_t.shape[2], dtype=OUT_DTYPE)
        start = 0
        for g, size in enumerate(sizes):
            if size:
                rows = slice(start, start + size)
                out[rows] = _gemm(xq[rows], x_inv[rows], _column_major(wq[g]), w_inv[g], emulate)
            start += size
        return out

    @staticmethod
    def backward(ctx, grad):
        x, w_t = ctx.saved_tensors
        sizes, emulate = ctx.sizes, ctx.emulate
        gq, g_inv = quantize_rowwise(grad, dim=-1)
        wq, w_inv = quantize_rowwise(w_t.transpose(-2, -1), dim=-2)  # [G, N, K]: per input column
        grad_x = torch.zeros(x.shape, dtype=OUT_DTYPE, device=x.device)
        grad_w = torch.zeros(w_t.shape[0], w_t.shape[2], w_t.shape[1], dtype=OUT_DTYPE, device=x.device)
        start = 0
        for g, size in enumerate(sizes):
            if size:
                rows = slice(start, start + size)
                grad_x[rows] = _gemm(gq[rows], g_inv[rows], _column_major(wq[g]), w_inv[g], emulate)
                # weight gradient [N, K] = g_e.T @ x_e, each operand scaled per column over the
                # group's tokens
                ge_q, ge_inv = quantize_rowwise(grad[rows], dim=0)
                xe_q, xe_inv = quantize_rowwise(x[rows], dim=0)
                grad_w[g] = _gemm(ge_q.t().contiguous(), ge_inv.view(-1, 1), _column_major(xe_q), xe_inv, emulate)
            start += size
        return grad_x.to(x.dtype), grad_w.transpose(-2, -1).to(w_t.dtype), None, None


def align_token_groups(
    x: torch.Tensor, counts: torch.Tensor, align: int = FLOAT8_GROUP_ALIGN
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens ``x`` [T, K] sorted by group (``counts`` [G] rows each; rows past their sum are
    padding) copied into a zero buffer whose groups start at multiples of ``align`` rows, on the
    device, no host read. The buffer has the static size ``T + G * align`` (enough for any
    counts). Returns (buffer, group end offsets in it (int32), each row's index in the buffer
    (``unalign`` reads it back), which rows of ``x`` are real tokens [T, 1])."""
    rows, groups = x.shape[0], counts.shape[0]
    counts = counts.to(device=x.device, dtype=torch.int64)
    padded = (counts + align - 1) // align * align
    ends, padded_ends = torch.cumsum(counts, 0), torch.cumsum(padded, 0)
    starts, padded_starts = ends - counts, padded_ends - padded
    r = torch.arange(rows, device=x.device)
    group = torch.searchsorted(ends, r, right=True)  # == groups for rows past the counts' sum
    valid = group < groups
    group = group.clamp(max=groups - 1)
    size = rows + groups * align
    # rows past the sum all go to the buffer's last row, past every group (its value is 0)
    dest = torch.where(valid, padded_starts[group] + (r - starts[group]), size - 1)
    valid = valid.unsqueeze(-1)
    buffer = x.new_zeros(size, x.shape[1]).index_copy(0, dest, torch.where(valid, x, 0))
    return buffer, padded_ends.to(torch.int32), dest, valid


def unalign(out: torch.Tensor, dest: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The rows of an aligned buffer's result back in the tokens' order (zeros for padding)."""
    return torch.where(valid, out.index_select(0, dest), 0)


def _torchao_grouped_mm(x: torch.Tensor, w_t: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm

    return _to_fp8_rowwise_then_scaled_grouped_mm(
        x, w_t, offsets, out_dtype=OUT_DTYPE, float8_dtype=FLOAT8, pad_token_groups_for_grouped_mm=False
    )


def float8_grouped_backend(device: torch.device, emulate: bool) -> str:
    """Which implementation runs the float8 expert GEMMs here (module docstring)."""
    if emulate:
        return "emulated"
    if device.type == "cuda" and torch.version.hip is None and torch.cuda.get_device_capability(device)[0] >= 9:
        return "torchao"
    return "scaled_mm"


def float8_grouped_mm(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    counts: torch.Tensor,
    backend: str,
    sizes: list[int] | None = None,
) -> torch.Tensor:
    """The SwiGLU experts ``(silu(x w1^T) * (x w3^T)) w2^T`` per group with float8 GEMMs, in
    ``x``'s dtype. ``x`` [T, dim] sorted by expert, ``counts`` [E] (rows past their sum give
    zero rows and zero gradients), ``w1``/``w3`` [E, hidden, dim], ``w2`` [E, dim, hidden] in
    ``x``'s dtype (float32 or bfloat16). ``sizes``: ``counts`` already read on the host, for the
    per-expert backends (read here when None)."""
    dtype = x.dtype
    if backend == "torchao":
        buffer, offsets, dest, valid = align_token_groups(x, counts)
        # The grouped GEMM never writes the rows past the last group (forward and input
        # gradient): they hold whatever memory held, NaN included. Masking h1 and h3 (not h)
        # keeps them out of both passes: where() passes no gradient to masked rows, whatever
        # arrives there from the w2 GEMM's input gradient.
        live = (torch.arange(buffer.shape[0], device=x.device) < offsets[-1]).unsqueeze(-1)
        h1 = torch.where(live, _torchao_grouped_mm(buffer, w1.transpose(-2, -1), offsets), 0)
        h3 = torch.where(live, _torchao_grouped_mm(buffer, w3.transpose(-2, -1), offsets), 0)
        out = _torchao_grouped_mm(torch.nn.functional.silu(h1) * h3, w2.transpose(-2, -1), offsets)
        return unalign(out, dest, valid).to(dtype)
    if sizes is None:
        sizes = counts.tolist()  # the one host read of this backend
    emulate = backend == "emulated"
    h1 = _Float8GroupedMM.apply(x, w1.transpose(-2, -1), sizes, emulate)
    h3 = _Float8GroupedMM.apply(x, w3.transpose(-2, -1), sizes, emulate)
    h = torch.nn.functional.silu(h1) * h3
    return _Float8GroupedMM.apply(h, w2.transpose(-2, -1), sizes, emulate).to(dtype)


def float8_experts_forward(
    x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, counts: torch.Tensor, emulate: bool
) -> torch.Tensor:
    """``GroupedExperts``' forward with float8 GEMMs, the counts checked like its other paths:
    on device for the sync-free torchao backend, on the host for the per-expert ones (which
    read the sizes anyway)."""
    backend = float8_grouped_backend(x.device, emulate)
    rows = x.shape[0]
    if rows == 0 and backend == "torchao":  # no token at all (an EP rank that received none):
        backend = "scaled_mm"  # its loop runs no GEMM and gives every weight its zero gradient
    if backend == "torchao":
        counts = counts.to(device=x.device)
        torch._assert_async(
            (counts.min() >= 0) & (counts.sum() <= rows),
            "GroupedExperts: num_tokens_per_expert must be non-negative and sum to at most the number of rows of x",
        )
    else:
        sizes = counts.tolist()
        if sum(sizes) > rows or min(sizes) < 0:
            raise ValueError(
                f"num_tokens_per_expert sums to {sum(sizes)} (min {min(sizes)}) but x has "
                f"{rows} rows; counts must be non-negative and cover at most the rows given."
            )
        return float8_grouped_mm(x, w1, w2, w3, counts, backend, sizes)
    return float8_grouped_mm(x, w1, w2, w3, counts, backend)
