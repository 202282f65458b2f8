"""The attention "core": the part of attention that mixes information across positions.

Everything before it (projections, RoPE, head repetition) and after it (output projection) is
per-token, so the core is the only piece context parallelism must replace. Every attention
module owns one as ``.core`` and calls it with already-rotated, already-repeated heads; the CP
applier swaps in a module with the same ``forward(q, k, v, scale=None)`` signature.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class CausalAttentionCore(nn.Module):
    """Causal softmax attention over ``q, k`` [bs, heads, s, d_qk] and ``v`` [bs, heads, s, d_v].

    Query and key heads must already match (GQA repetition happens before the core) so that a
    replacement core never needs to know the head grouping."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Expand ``[bs, s, kv_heads, d]`` to ``[bs, s, kv_heads * n_rep, d]`` so that query head
    ``h`` reads key/value head ``h // n_rep`` (the grouping Llama checkpoints use)."""
    if n_rep == 1:
        return x
    bs, s, kv_heads, d = x.shape
    return x.unsqueeze(3).expand(bs, s, kv_heads, n_rep, d).reshape(bs, s, kv_heads * n_rep, d)
