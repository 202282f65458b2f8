"""Normalization layers shared by the models."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned per-channel gain.

    The statistics are computed in float32 even for bf16 activations: the mean of squares over
    thousands of channels loses too many bits in bf16 and the error compounds through depth.
    The math is written with plain elementwise ops (no fused kernel) so that it also runs on
    sequence-sharded DTensors under tensor parallelism, where the reduction is over the
    unsharded last dimension.
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
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"
