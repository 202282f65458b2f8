"""DeepSeek-V3 multi-token prediction (MTP, DeepSeek-V3 report section 2.2).

Depth ``k`` (1..D) of the MTP chain predicts token ``t_{i+k+1}`` at position ``i`` from the
previous depth's hidden state ``h^{k-1}_i`` (``h^0``: the main model's last block output, before
the final norm) and the embedding of token ``t_{i+k}``:

    h'_i   = eh_proj([enorm(Emb(t_{i+k})); hnorm(h^{k-1}_i)])       (one Linear, 2*dim -> dim)
    h^k    = TRM_k(h')                                               (one decoder block)
    logits = OutHead(shared_head.norm(h^k))                          (the model's output head)

The report writes the concatenation as ``[RMSNorm(h); RMSNorm(Emb)]``; the published checkpoint
(and every implementation that loads it: DeepSeek's, vLLM's, Megatron's, torchtitan's) puts the
embedding half first, which is what ``eh_proj``'s columns are trained for, so we do too.

Embedding and output head are shared with the main model. The head is the main ``output`` (one
call over the main and every depth's normed states, see ``DeepSeekV3.forward``). The embedding is
a *copy* per depth (``mtp.{k}.embed_tokens``), drawn equal to ``tok_embeddings`` and kept equal by
summing the copies' gradients every step (``models/parallel/pipeline/tied.py``), exactly as the
published checkpoint stores it (``model.layers.{61 + k}.embed_tokens``): under pipeline
parallelism the MTP depths sit on the last stage, far from the first stage's embedding, and a
copy on every layout keeps parameter names, checkpoints and initial weights layout-independent.

The block is a :class:`~models.deepseek_v3.model.TransformerBlock` with layer id
``n_layers + k - 1`` (the checkpoint's layer index), so it is MoE exactly when a main layer of
that index would be (the 671B's layer 61 is). Its parallelism is every other block's: FSDP wraps
it (and its experts), EP shards its experts, CP swaps its attention core, AC wraps it, TP splits
its attention and feed-forward. The parts around the block declare their TP roles
(``MTPBlock.tp_roles``, applied by ``models/parallel/tensor_parallel.py``): the embedding copy
is vocabulary-sharded like ``tok_embeddings`` (same placements, so the copies' gradient sum stays
a sum of the same rows), the norms run on this rank's sequence shard, and ``eh_proj`` is one
replicated weight applied to this rank's sequence shard (its gradient summed over tp). The main
and the depths' normed states are DTensors there, so their concatenation along the sequence is
the global one, which the vocabulary-parallel head and loss take as it is.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from models.common.norms import RMSNorm
from models.deepseek_v3.args import DeepSeekV3Args
from models.deepseek_v3.block import TransformerBlock

__all__ = ["MTPBlock", "SharedHead"]


class SharedHead(nn.Module):
    """``shared_head.norm``: the final norm of one MTP depth (the head itself is the model's)."""

    def __init__(self, args: DeepSeekV3Args) -> None:
        super().__init__()
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)


class MTPBlock(TransformerBlock):
    """One MTP depth: its embedding copy, ``enorm``, ``hnorm``, ``eh_proj``, the decoder block's
    own modules (inherited) and ``shared_head.norm``.

    ``forward(h, tokens, rope, mask) -> (h_next, normed)``: ``h`` the previous depth's hidden
    states ``[bs, s, dim]``, ``tokens`` ``[bs, s]`` the token ids ``t_{i+k}`` (built before the
    context-parallel shard, ``trainer/mtp.py``); ``h_next`` feeds the next depth, ``normed`` the
    output head. The final norm runs inside the forward so that FSDP has the block's parameters
    gathered for it."""

    # tensor parallelism of the modules around the decoder block (models/parallel/tensor_parallel.py)
    tp_roles: ClassVar[dict[str, str]] = {
        "embed_tokens": "embedding",
        "enorm": "norm",
        "hnorm": "norm",
        "eh_proj": "replicated_linear",
        "shared_head.norm": "norm",
    }

    def __init__(self, layer_id: int, args: DeepSeekV3Args) -> None:
        super().__init__(layer_id, args)
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim)
        self.enorm = RMSNorm(args.dim, eps=args.norm_eps)
        self.hnorm = RMSNorm(args.dim, eps=args.norm_eps)
        self.eh_proj = nn.Linear(2 * args.dim, args.dim, bias=False)
        self.shared_head = SharedHead(args)

    def forward(  # type: ignore[override]
        self, h: torch.Tensor, tokens: torch.Tensor, rope: torch.Tensor, mask: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        emb = self.embed_tokens(tokens).to(h.dtype)
        if emb.shape[:2] != h.shape[:2]:
            # (under sequence parallelism the embedding hands back this rank's sequence shard,
            # as the main embedding does: tokens of the whole local sequence are right there)
            raise ValueError(
                f"MTP tokens {tuple(tokens.shape)} embed to {tuple(emb.shape[:2])}, which does not match the hidden "
                f"states {tuple(h.shape[:2])} (the MTP blocks run on this rank's local sequence)"
            )
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(h)], dim=-1))
        out = super().forward(x, rope, mask)
        return out, self.shared_head.norm(out)
