"""Qwen3 decoder (dense and MoE): grouped-query attention with a free head width and per-head
RMSNorm on queries and keys, SwiGLU or routed-expert FFNs, RoPE theta 1e6.

The embeddings, layer loop, norm, output, pipeline-stage and context-parallel handling and the
seeded init are the shared shell (``models/common/decoder.py``); the attention is the shared GQA
(``models/common/gqa.py``) with ``qk_norm`` (one RMSNorm gain of width ``head_dim`` on each
query and key head before RoPE); the MoE is the shared one (``models/common/moe.MoE``),
configured by ``Qwen3Args``' routing properties.

Rotary layout: Qwen3 checkpoints rotate the two halves of each head (``transformers``'
``rotate_half``: channel ``i`` pairs with ``i + head_dim / 2``). The attention rotates the same
pairs (``rope_layout="half_split"``: channels reordered to the shared interleaved
:func:`~models.common.rope.apply_rotary_emb` and back), so every tensor of a checkpoint (the q/k
norm gains included) maps one to one with no permutation.
"""

from __future__ import annotations

from models.common.decoder import Decoder, DecoderBlock
from models.common.feed_forward import FeedForward
from models.common.gqa import GroupedQueryAttention
from models.common.moe import MoE
from models.common.norms import RMSNorm
from models.common.rope import RotaryEmbedding
from models.qwen3.args import Qwen3Args


class TransformerBlock(DecoderBlock):
    """Pre-norm residual block; the FFN is a SwiGLU (dense flavors) or the shared MoE in every
    layer (MoE flavors). Only the one in use is registered."""

    def __init__(self, layer_id: int, args: Qwen3Args) -> None:
        super().__init__(layer_id)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = GroupedQueryAttention(args, qk_norm=True, rope_layout="half_split")
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
