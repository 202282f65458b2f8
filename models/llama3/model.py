"""Llama 3 decoder (grouped-query attention, SwiGLU, RoPE with Llama 3.1 scaling).

The embeddings, layer loop, norm, output, pipeline-stage and context-parallel handling and the
seeded init are the shared shell (``models/common/decoder.py``); this file only builds the
RoPE table and the blocks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from models.common.attention import AttentionCore, kv_repeats, repeat_kv
from models.common.decoder import Decoder, DecoderAttention, DecoderBlock
from models.common.feed_forward import FeedForward
from models.common.norms import RMSNorm
from models.common.rope import Llama3RopeScaling, RotaryEmbedding, apply_rotary_emb
from models.llama3.args import Llama3Args


class Attention(DecoderAttention):
    """Grouped-query attention.

    Head counts are read from the projected tensors, not from the config: under tensor
    parallelism ``wq``/``wk``/``wv`` are column-sharded and each rank sees only its share of
    heads (the query/KV ratio is unchanged)."""

    tp_colwise = ("wq", "wk", "wv")

    def __init__(self, args: Llama3Args) -> None:
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        self.core = AttentionCore(args.attn_mask_type, args.attn_type)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: Any = None) -> torch.Tensor:
        bs, s, _ = x.shape
        q = self.wq(x).view(bs, s, -1, self.head_dim)
        k = self.wk(x).view(bs, s, -1, self.head_dim)
        v = self.wv(x).view(bs, s, -1, self.head_dim)
        q = apply_rotary_emb(q, rope)
        k = apply_rotary_emb(k, rope)
        n_rep = kv_repeats(q, k)
        k = repeat_kv(k, n_rep)
        v = repeat_kv(v, n_rep)
        out = self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)
        out = out.transpose(1, 2).reshape(bs, s, -1)
        return self.wo(out)


class TransformerBlock(DecoderBlock):
    """Pre-norm residual block: ``h = x + attn(norm(x)); out = h + ffn(norm(h))`` (the
    forward is :class:`DecoderBlock`'s)."""

    def __init__(self, layer_id: int, args: Llama3Args) -> None:
        super().__init__(layer_id)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)


class Llama3(Decoder):
    args: Llama3Args

    def build_rope(self, args: Llama3Args) -> RotaryEmbedding:
        return RotaryEmbedding(
            args.head_dim,
            args.max_seq_len,
            args.rope_theta,
            Llama3RopeScaling(scale_factor=args.rope_scaling_factor) if args.use_rope_scaling else None,
        )

    def build_block(self, layer_id: int, args: Llama3Args) -> TransformerBlock:
        return TransformerBlock(layer_id, args)
