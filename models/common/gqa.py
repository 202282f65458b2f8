"""Grouped-query attention (GQA), the attention of Llama 3 and Qwen3: ``n_heads`` query heads
share ``kv_heads`` key/value heads of width ``head_dim``, RoPE on queries and keys, and the
shared kernel choice (``AttentionCore``) for the product.

Two options say where the models differ, so each builds this one module:

* ``qk_norm``: RMSNorm (one gain of width ``head_dim``, shared by all heads) on each query and
  key head before RoPE (Qwen3);
* ``rope_layout``: ``"interleaved"`` rotates channel pairs ``2i, 2i + 1`` (Meta's layout, the
  Llama checkpoints; the Hugging Face adapter permutes ``wq``/``wk`` rows) and ``"half_split"``
  rotates channels ``i, i + head_dim / 2`` (``transformers``' ``rotate_half``, Qwen3's
  checkpoints, which then map with no permutation).

Head counts are read from the projected tensors, not from the config: under tensor
parallelism ``wq``/``wk``/``wv`` are column-sharded and each rank sees only its share of heads
(the query/KV ratio is unchanged); the q/k norms act per head, so they stay replicated.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from models.common.attention import AttentionCore, kv_repeats, repeat_kv
from models.common.decoder import DecoderAttention
from models.common.norms import RMSNorm
from models.common.rope import apply_rotary_emb, apply_rotary_emb_half_split

__all__ = ["ROPE_LAYOUTS", "GQAArgs", "GroupedQueryAttention"]

ROPE_LAYOUTS = ("interleaved", "half_split")


class GQAArgs(Protocol):
    """What :class:`GroupedQueryAttention` reads from a model's args (fields or properties)."""

    dim: int
    n_heads: int
    kv_heads: int
    head_dim: int
    norm_eps: float
    attn_mask_type: str
    attn_type: str


class GroupedQueryAttention(DecoderAttention):
    """Grouped-query attention; parameters ``wq``, ``wk``, ``wv``, ``wo`` and, with ``qk_norm``,
    ``q_norm`` / ``k_norm`` (the state-dict names every GQA model and its adapter use)."""

    tp_colwise = ("wq", "wk", "wv")

    def __init__(self, args: GQAArgs, *, qk_norm: bool = False, rope_layout: str = "interleaved") -> None:
        super().__init__()
        if rope_layout not in ROPE_LAYOUTS:
            raise ValueError(f"rope_layout must be one of {ROPE_LAYOUTS}, got {rope_layout!r}.")
        self.head_dim = args.head_dim
        self.rope_layout = rope_layout
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=args.norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=args.norm_eps)
        self.core = AttentionCore(args.attn_mask_type, args.attn_type)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: Any = None, cache: Any = None) -> torch.Tensor:
        bs, s, _ = x.shape
        q = self.wq(x).view(bs, s, -1, self.head_dim)
        k = self.wk(x).view(bs, s, -1, self.head_dim)
        v = self.wv(x).view(bs, s, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        if self.rope_layout == "half_split":
            q = apply_rotary_emb_half_split(q, rope)
            k = apply_rotary_emb_half_split(k, rope)
        else:
            q = apply_rotary_emb(q, rope)
            k = apply_rotary_emb(k, rope)
        n_rep = kv_repeats(q, k)
        if cache is not None:  # inference: this rank's KV heads, unrepeated, join the cached ones
            k, v = cache.update(k, v)
        k = repeat_kv(k, n_rep)
        v = repeat_kv(v, n_rep)
        if cache is not None:
            out = cache.attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None)
        else:
            out = self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)
        out = out.transpose(1, 2).reshape(bs, s, -1)
        return self.wo(out)
