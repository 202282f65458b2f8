"""Qwen3 decoder (dense and MoE): grouped-query attention with a free head width and per-head
RMSNorm on queries and keys, SwiGLU or routed-expert FFNs, RoPE theta 1e6.

The embeddings, layer loop, norm, output, pipeline-stage and context-parallel handling and the
seeded init are the shared shell (``models/common/decoder.py``); the MoE is the shared one
(``models/common/moe.MoE``), configured by ``Qwen3Args``' routing properties.

Rotary layout: Qwen3 checkpoints rotate the two halves of each head (``transformers``'
``rotate_half``: channel ``i`` pairs with ``i + head_dim / 2``). This attention rotates the same
pairs, by reordering channels to the shared interleaved :func:`apply_rotary_emb` and back, so
every tensor of a checkpoint (the q/k norm gains included) maps one to one with no permutation.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from models.common.attention import AttentionCore, kv_repeats, repeat_kv
from models.common.decoder import Decoder, DecoderAttention, DecoderBlock
from models.common.feed_forward import FeedForward
from models.common.moe import MoE
from models.common.norms import RMSNorm
from models.common.rope import RotaryEmbedding, apply_rotary_emb
from models.qwen3.args import Qwen3Args


def apply_rotary_emb_half_split(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """RoPE on ``x`` [bs, s, heads, d] in the half-split layout (pair ``i`` is channels ``i``
    and ``i + d / 2``), through the interleaved :func:`apply_rotary_emb` on reordered channels."""
    d = x.shape[-1]
    interleaved = x.unflatten(-1, (2, d // 2)).transpose(-1, -2).flatten(-2)
    out = apply_rotary_emb(interleaved, rope)
    return out.unflatten(-1, (d // 2, 2)).transpose(-1, -2).flatten(-2)


class Attention(DecoderAttention):
    """GQA with ``head_dim`` independent of ``dim / n_heads`` and RMSNorm (one gain of width
    ``head_dim``, shared by all heads) on each query and key head before RoPE.

    Head counts are read from the projected tensors: under tensor parallelism ``wq``/``wk``/
    ``wv`` are column-sharded and each rank sees its share of heads; the norms act per head, so
    they stay replicated."""

    tp_colwise = ("wq", "wk", "wv")

    def __init__(self, args: Qwen3Args) -> None:
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        self.q_norm = RMSNorm(self.head_dim, eps=args.norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=args.norm_eps)
        self.core = AttentionCore(args.attn_mask_type, args.attn_type)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: Any = None) -> torch.Tensor:
        bs, s, _ = x.shape
        q = self.q_norm(self.wq(x).view(bs, s, -1, self.head_dim))
        k = self.k_norm(self.wk(x).view(bs, s, -1, self.head_dim))
        v = self.wv(x).view(bs, s, -1, self.head_dim)
        q = apply_rotary_emb_half_split(q, rope)
        k = apply_rotary_emb_half_split(k, rope)
        n_rep = kv_repeats(q, k)
        out = self.core(
            q.transpose(1, 2), repeat_kv(k, n_rep).transpose(1, 2), repeat_kv(v, n_rep).transpose(1, 2), mask
        )
        return self.wo(out.transpose(1, 2).reshape(bs, s, -1))


class TransformerBlock(DecoderBlock):
    """Pre-norm residual block; the FFN is a SwiGLU (dense flavors) or the shared MoE in every
    layer (MoE flavors). Only the one in use is registered."""

    def __init__(self, layer_id: int, args: Qwen3Args) -> None:
        super().__init__(layer_id)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.moe_enabled = args.n_routed_experts > 0
        if self.moe_enabled:
            self.moe = MoE(args)
        else:
            self.feed_forward = FeedForward(args.dim, args.hidden_dim)


class Qwen3(Decoder):
    args: Qwen3Args

    def build_rope(self, args: Qwen3Args) -> RotaryEmbedding:
        return RotaryEmbedding(args.head_dim, args.max_seq_len, args.rope_theta)

    def build_block(self, layer_id: int, args: Qwen3Args) -> TransformerBlock:
        return TransformerBlock(layer_id, args)

    def init_weights(self, seed: int) -> None:
        """The shell's seeded init, then the MoE balancing buffers back to zero."""
        super().init_weights(seed)
        for moe in self.moe_layers():
            moe.reset_buffers()
