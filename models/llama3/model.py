"""Llama 3 decoder (grouped-query attention, SwiGLU, RoPE with Llama 3.1 scaling).

Module names are a contract with the parallelism code (FSDP/TP plans match on them, pipeline
splitting deletes ``layers`` entries and sets ``tok_embeddings``/``norm``/``output`` to None,
context parallelism swaps ``attention.core`` and sets ``cp_rank``/``cp_size``).
"""

from __future__ import annotations

import torch
from torch import nn

from models.common.attention import CausalAttentionCore, repeat_kv
from models.common.feed_forward import FeedForward
from models.common.init import init_parameters, standard_rule
from models.common.norms import RMSNorm
from models.common.rope import (
    Llama3RopeScaling,
    RotaryEmbedding,
    apply_rotary_emb,
    local_positions,
)
from models.llama3.args import Llama3Args


class Attention(nn.Module):
    """Grouped-query attention.

    Head counts are read from the projected tensors, not from the config: under tensor
    parallelism ``wq``/``wk``/``wv`` are column-sharded and each rank sees only its share of
    heads (the query/KV ratio is unchanged)."""

    def __init__(self, args: Llama3Args) -> None:
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        self.core = CausalAttentionCore()

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        bs, s, _ = x.shape
        q = self.wq(x).view(bs, s, -1, self.head_dim)
        k = self.wk(x).view(bs, s, -1, self.head_dim)
        v = self.wv(x).view(bs, s, -1, self.head_dim)
        q = apply_rotary_emb(q, rope)
        k = apply_rotary_emb(k, rope)
        local_q_heads, local_kv_heads = q.shape[2], k.shape[2]
        if local_q_heads % local_kv_heads != 0:
            raise ValueError(
                f"Local query heads ({local_q_heads}) are not a multiple of local KV heads "
                f"({local_kv_heads}); the tensor-parallel degree must divide n_kv_heads."
            )
        n_rep = local_q_heads // local_kv_heads
        k = repeat_kv(k, n_rep)
        v = repeat_kv(v, n_rep)
        out = self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        out = out.transpose(1, 2).reshape(bs, s, -1)
        return self.wo(out)


class TransformerBlock(nn.Module):
    """Pre-norm residual block: ``h = x + attn(norm(x)); out = h + ffn(norm(h))``."""

    def __init__(self, layer_id: int, args: Llama3Args) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama3(nn.Module):
    def __init__(self, args: Llama3Args) -> None:
        super().__init__()
        args.validate()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.rope = RotaryEmbedding(
            args.head_dim,
            args.max_seq_len,
            args.rope_theta,
            Llama3RopeScaling() if args.use_rope_scaling else None,
        )
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(i, args) for i in range(args.n_layers)}
        )
        self.norm: RMSNorm | None = RMSNorm(args.dim, eps=args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        # Set by the context-parallel applier; this rank holds the load-balanced chunks
        # ``cp_rank`` of ``cp_size`` of every sequence.
        self.cp_rank = 0
        self.cp_size = 1

    def local_positions(self, seqlen_local: int, device: torch.device) -> torch.Tensor:
        """Global positions of this rank's tokens (identity without context parallelism)."""
        return local_positions(
            seqlen_local, self.cp_rank, self.cp_size, self.args.max_seq_len, device
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens`` [bs, s] -> logits [bs, s, vocab]. On pipeline stages without
        ``tok_embeddings`` the input is hidden states [bs, s, dim]; without ``output`` the
        hidden states after the last local layer (normed if ``norm`` is kept) are returned."""
        h = _embed(self.tok_embeddings, tokens, self.args.dim)
        rope = self.rope(self.local_positions(tokens.shape[1], tokens.device))
        for layer in self.layers.values():
            h = layer(h, rope)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is None:
            return h
        return self.output(h)

    def init_weights(self, seed: int) -> None:
        """Seeded, layout-independent init (see ``models/common/init.py``); also rebuilds the
        RoPE table, which ``to_empty`` leaves as garbage."""
        init_parameters(self, seed, standard_rule(self.args.n_layers, self.args.dim))
        self.rope.reset_table()


def _embed(tok_embeddings: nn.Embedding | None, tokens: torch.Tensor, dim: int) -> torch.Tensor:
    if tok_embeddings is not None:
        if tokens.dim() != 2 or tokens.is_floating_point():
            raise ValueError(
                f"Expected integer token ids of shape [bs, s], got {tuple(tokens.shape)} "
                f"{tokens.dtype}. (Only pipeline stages without tok_embeddings take hidden states.)"
            )
        return tok_embeddings(tokens)
    if tokens.dim() != 3 or tokens.shape[-1] != dim:
        raise ValueError(
            f"This model has no tok_embeddings (a later pipeline stage), so it expects hidden "
            f"states [bs, s, {dim}], got {tuple(tokens.shape)}."
        )
    return tokens

