"""Llama 3 decoder (grouped-query attention, SwiGLU, RoPE with Llama 3.1 scaling).

The embeddings, layer loop, norm, output, pipeline-stage and context-parallel handling and the
seeded init are the shared shell (``models/common/decoder.py``), the attention is the shared
GQA (``models/common/gqa.py``, interleaved RoPE, no q/k norm); this file only builds the RoPE
table and the blocks.
"""

from __future__ import annotations

from models.common.decoder import Decoder, DecoderBlock
from models.common.feed_forward import FeedForward
from models.common.gqa import GroupedQueryAttention
from models.common.norms import RMSNorm
from models.common.rope import Llama3RopeScaling, RotaryEmbedding
from models.llama3.args import Llama3Args


class TransformerBlock(DecoderBlock):
    """Pre-norm residual block: ``h = x + attn(norm(x)); out = h + ffn(norm(h))`` (the
    forward is :class:`DecoderBlock`'s)."""

    def __init__(self, layer_id: int, args: Llama3Args) -> None:
        super().__init__(layer_id)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = GroupedQueryAttention(args)
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
