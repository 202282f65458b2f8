"""SwiGLU feed-forward block used by the dense layers of both models and by MoE shared experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class FeedForward(nn.Module):
    """``w2(silu(w1(x)) * w3(x))``.

    The three projections stay separate ``nn.Linear`` modules (not one fused ``w13``) because the
    tensor-parallel plan shards ``w1``/``w3`` column-wise and ``w2`` row-wise by module name
    (declared below, in the same terms as ``models/common/decoder.DecoderAttention``)."""

    tp_colwise: tuple[str, ...] = ("w1", "w3")
    tp_rowwise: str = "w2"

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        if dim <= 0 or hidden_dim <= 0:
            raise ValueError(f"FeedForward needs positive dim and hidden_dim, got dim={dim}, hidden_dim={hidden_dim}.")
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
