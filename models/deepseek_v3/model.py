"""DeepSeek-V3 decoder: multi-head latent attention (MLA) and fine-grained MoE FFNs
(``block.py``), optionally followed by multi-token-prediction depths (``mtp.py``).

The embeddings, layer loop, norm, output, pipeline-stage and context-parallel handling and the
seeded init are the shared shell (``models/common/decoder.py``); this file builds the YaRN
RoPE table, the blocks and the MTP depths, and resets the MoE balancing buffers at init.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from models.common.decoder import Decoder
from models.common.flops import model_flops_per_token
from models.common.init import full_init_tensor, write_full_into
from models.common.rope import RotaryEmbedding
from models.deepseek_v3.args import DeepSeekV3Args
from models.deepseek_v3.block import Attention, TransformerBlock, yarn_scaling
from models.deepseek_v3.mtp import MTPBlock

__all__ = ["Attention", "DeepSeekV3", "TransformerBlock"]


class DeepSeekV3(Decoder):
    """``mtp``: with ``args.mtp_layers = D > 0`` an ``nn.ModuleDict`` of the D MTP depths
    (``"0"`` .. ``"D-1"``; a pipeline keeps it on the last stage only), else None.

    ``forward(tokens, doc_tokens=None, mtp_tokens=None)``: with MTP depths and ``mtp_tokens``
    ``[bs, s, D]`` (column ``k-1``: the token ids ``t_{i+k}`` depth ``k`` embeds, built before the
    cp shard by ``trainer/mtp.py``) the last stage returns the logits of the main model and of
    every depth concatenated along the sequence: ``[bs, (1 + D) * s, vocab]`` (one call of the
    output head; with ``labels`` and the chunked loss, the per-token losses ``[bs, (1 + D) * s]``);
    without ``mtp_tokens`` the main logits only (inference, parity checks)."""

    args: DeepSeekV3Args

    def __init__(self, args: DeepSeekV3Args) -> None:
        super().__init__(args)
        self.mtp: nn.ModuleDict | None = None
        if args.mtp_layers > 0:
            self.mtp = nn.ModuleDict({str(k): MTPBlock(args.n_layers + k, args) for k in range(args.mtp_layers)})

    def build_rope(self, args: DeepSeekV3Args) -> RotaryEmbedding:
        return RotaryEmbedding(args.qk_rope_head_dim, args.max_seq_len, args.rope_theta, yarn_scaling(args))

    def build_block(self, layer_id: int, args: DeepSeekV3Args) -> TransformerBlock:
        return TransformerBlock(layer_id, args)

    def blocks(self) -> list[nn.Module]:
        return [*self.layers.values(), *(self.mtp.values() if self.mtp is not None else ())]

    def forward(
        self,
        tokens: torch.Tensor,
        doc_tokens: torch.Tensor | None = None,
        mtp_tokens: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        *,
        cache: Any = None,
    ) -> torch.Tensor:
        if cache is not None:  # inference with a KV cache (models/common/decoder.py): no MTP depths
            return self.cached_forward(tokens, cache)
        if self.mtp is None or self.output is None or mtp_tokens is None:
            return super().forward(tokens, doc_tokens, labels)
        h, rope, mask = self.trunk(tokens, doc_tokens)
        depth = len(self.mtp)
        # the whole local sequence: under sequence parallelism h is this rank's sequence shard, and
        # each MTP embedding, like the main one, takes the whole local sequence and shards it
        want = [h.shape[0], self.local_seq_len(tokens), depth]
        if list(mtp_tokens.shape) != want:
            raise ValueError(
                f"mtp_tokens must be [bs, s, mtp_layers] = {want} token ids, got {tuple(mtp_tokens.shape)}"
            )
        outs = [self.norm(h)]
        for k, block in enumerate(self.mtp.values()):
            h, normed = block(h, mtp_tokens[..., k], rope, mask)
            outs.append(normed)
        # chunked loss: labels [bs, s, 1 + D] (trainer/mtp.py), per-token losses [bs, (1 + D) * s]
        return self.head(torch.cat(outs, dim=1), labels)

    def embedding_copies(self) -> list[nn.Parameter]:
        """The MTP depths' copies of ``tok_embeddings.weight`` this model (or stage) holds."""
        return [block.embed_tokens.weight for block in self.mtp.values()] if self.mtp is not None else []

    def init_weights(self, seed: int) -> None:
        """The shell's seeded init, the MTP embedding copies drawn as ``tok_embeddings.weight``
        (so every copy starts equal to it, on every layout), then the MoE balancing buffers
        back to zero."""
        super().init_weights(seed)
        fqn = "tok_embeddings.weight"
        for block in self.mtp.values() if self.mtp is not None else ():
            weight = block.embed_tokens.weight
            rule = self.init_rule()(fqn, block.embed_tokens, "weight")
            with torch.no_grad():
                write_full_into(weight, full_init_tensor(rule, weight.shape, seed, fqn))
        for moe in self.moe_layers():
            moe.reset_buffers()

    def flops_per_token(self, seq_len: int) -> float:
        """The shell's count, plus per MTP depth its block's attention and one more use of the
        output head (the embedding copies are lookups: no FLOPs)."""
        if self.mtp is None:
            return super().flops_per_token(seq_len)
        depth = len(self.mtp)
        emb = self.tok_embeddings.weight.numel()
        return model_flops_per_token(
            self.active_params() + depth * emb,  # the head, once more per depth
            self.args.n_layers + depth,
            self.args.attention_dim,
            seq_len,
            (1 + depth) * emb,  # the embedding and its copies
        )
