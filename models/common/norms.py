"""Normalization layers shared by the models."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["RMSNorm", "rms_norm", "rms_norm_path"]

# Where torch has a fused RMSNorm kernel: aten::_fused_rms_norm (and its backward) has a CUDA
# kernel in torch 2.11-2.15 and no CPU one (on CPU the op is a composite of the same elementwise
# ops as ours: pow, mean, add, rsqrt, mul). DTensor has sharding rules for both ops in every
# supported torch (torch/distributed/tensor/_ops/_math_ops.py: any dim but the normalized one
# sharded, the weight replicated), so sequence-parallel inputs take the fused kernel too.
FUSED_DEVICE_TYPES = ("cuda",)


def rms_norm_path(device_type: str, x_dtype: torch.dtype, weight_dtype: torch.dtype) -> str:
    """``"fused"`` (``F.rms_norm``) or ``"op_by_op"`` for an input of ``x_dtype`` on
    ``device_type`` and a gain of ``weight_dtype``.

    Fused only where torch has the kernel and the dtypes match: with a gain of another dtype
    ``F.rms_norm`` falls back to its composite with a warning, and its output dtype would be the
    input's where ours promotes (bf16 activations times an fp32 gain give fp32)."""
    return "fused" if device_type in FUSED_DEVICE_TYPES and x_dtype == weight_dtype else "op_by_op"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, fused: bool | None = None) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dim, statistics in float32.

    ``fused=None`` picks by :func:`rms_norm_path`; ``True`` / ``False`` force a path (the
    tests compare them). Both compute the mean of squares and ``rsqrt`` in float32 for bf16 /
    fp16 inputs; they differ in rounding only: the fused op multiplies by the gain in float32
    and rounds once, the op-by-op version rounds the normalized tensor to the input dtype and
    then the product (within 3 units of the last place of the output; the same in float32 up to
    the kernel's summation order)."""
    if fused is None:
        fused = rms_norm_path(x.device.type, x.dtype, weight.dtype) == "fused"
    if fused:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return normed.type_as(x) * weight


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned per-channel gain.

    The statistics are computed in float32 even for bf16 activations: the mean of squares over
    thousands of channels loses too many bits in bf16 and the error compounds through depth.
    On CUDA the forward and backward are torch's fused kernels (``F.rms_norm`` ->
    ``aten::_fused_rms_norm``: one kernel each way, float32 accumulation), also on
    sequence-sharded DTensors under tensor parallelism; elsewhere (CPU, which has no fused
    kernel, or a gain whose dtype differs from the input's) plain elementwise ops.
    :func:`rms_norm_path` says which runs.
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        if dim <= 0:
            raise ValueError(f"RMSNorm dim must be a positive int, got {dim}.")
        if eps <= 0:
            raise ValueError(f"RMSNorm eps must be > 0 to avoid division by zero, got {eps}.")
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"
