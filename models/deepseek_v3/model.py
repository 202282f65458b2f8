"""DeepSeek-V3 decoder: multi-head latent attention (MLA) and fine-grained MoE FFNs.

Same structural contract as ``models/llama3/model.py`` (module names for FSDP/TP plans,
pipeline deletion of ``layers`` entries and None ``tok_embeddings``/``norm``/``output``,
``attention.core`` for context parallelism, ``cp_rank``/``cp_size`` for positions).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from models.common.attention import CausalAttentionCore
from models.common.feed_forward import FeedForward
from models.common.init import init_parameters, standard_rule
from models.common.norms import RMSNorm
from models.common.rope import (
    RotaryEmbedding,
    YarnRopeScaling,
    apply_rotary_emb,
    local_positions,
    yarn_softmax_scale,
)
from models.deepseek_v3.args import DeepSeekV3Args
from models.deepseek_v3.moe import MoE, moe_layers


def _yarn(args: DeepSeekV3Args) -> YarnRopeScaling:
    return YarnRopeScaling(
        factor=args.rope_factor,
        original_seq_len=args.original_seq_len,
        beta_fast=args.beta_fast,
        beta_slow=args.beta_slow,
    )


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


class Attention(nn.Module):
    """Multi-head latent attention.

    Keys/values are produced from a ``kv_lora_rank``-wide latent (``wkv_a`` -> ``kv_norm`` ->
    ``wkv_b``), and position information travels in a separate ``qk_rope_head_dim`` slice:
    queries get a per-head rotated slice, keys share one rotated slice across heads (decoupled
    RoPE), so the latent itself stays position-free. Head counts are read from tensor shapes
    because TP shards ``wq``/``wq_b``/``wkv_b`` column-wise and ``wo`` row-wise."""

    def __init__(self, args: DeepSeekV3Args) -> None:
        super().__init__()
        self.q_lora_rank = args.q_lora_rank
        self.kv_lora_rank = args.kv_lora_rank
        self.qk_nope_head_dim = args.qk_nope_head_dim
        self.qk_rope_head_dim = args.qk_rope_head_dim
        self.qk_head_dim = args.qk_head_dim
        self.v_head_dim = args.v_head_dim
        if self.q_lora_rank == 0:
            self.wq = nn.Linear(args.dim, args.n_heads * self.qk_head_dim, bias=False)
        else:
            self.wq_a = nn.Linear(args.dim, self.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(self.q_lora_rank, eps=args.norm_eps)
            self.wq_b = nn.Linear(self.q_lora_rank, args.n_heads * self.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(args.dim, self.kv_lora_rank + self.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(self.kv_lora_rank, eps=args.norm_eps)
        self.wkv_b = nn.Linear(
            self.kv_lora_rank, args.n_heads * (self.qk_nope_head_dim + self.v_head_dim), bias=False
        )
        self.wo = nn.Linear(args.n_heads * self.v_head_dim, args.dim, bias=False)
        self.softmax_scale = yarn_softmax_scale(
            self.qk_head_dim, _yarn(args), args.mscale, args.max_seq_len
        )
        self.core = CausalAttentionCore()
        # The decoupled rope key is computed by replicated weights but read by this rank's
        # heads only; tensor parallelism sets this to an all-reduce of its gradient.
        self.k_pe_grad_sync: Callable[[torch.Tensor], torch.Tensor] = _identity

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        bs, s, _ = x.shape
        q = self.wq(x) if self.q_lora_rank == 0 else self.wq_b(self.q_norm(self.wq_a(x)))
        q = q.view(bs, s, -1, self.qk_head_dim)
        q_nope, q_pe = torch.split(q, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        q = torch.cat([q_nope, apply_rotary_emb(q_pe, rope)], dim=-1)

        kv, k_pe = torch.split(
            self.wkv_a(x), [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1
        )
        k_pe = self.k_pe_grad_sync(apply_rotary_emb(k_pe.unsqueeze(2), rope))  # [bs, s, 1, rope]
        kv = self.wkv_b(self.kv_norm(kv)).view(bs, s, -1, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = torch.split(kv, [self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        local_heads = k_nope.shape[2]
        if q.shape[2] != local_heads:
            raise ValueError(
                f"MLA query heads ({q.shape[2]}) and key/value heads ({local_heads}) differ; "
                "wq/wq_b and wkv_b must be sharded the same way under tensor parallelism."
            )
        k = torch.cat([k_nope, k_pe.expand(-1, -1, local_heads, -1)], dim=-1)
        if self.v_head_dim < self.qk_head_dim:
            # Fused attention kernels (FlashAttention on GPU, the flash kernel on CPU) need one
            # head dim for q, k and v; with MLA's narrower values SDPA would fall back to the
            # math path, which on CPU also upcasts bf16 to fp32. Zero columns of v give zero
            # output columns and leave the others exact; they are sliced off below.
            v = F.pad(v, (0, self.qk_head_dim - self.v_head_dim))

        out = self.core(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=self.softmax_scale
        )
        out = out[..., : self.v_head_dim].transpose(1, 2).reshape(bs, s, -1)
        return self.wo(out)


class TransformerBlock(nn.Module):
    """Pre-norm residual block whose FFN is dense (``feed_forward``) for the first
    ``n_dense_layers`` layers and MoE (``moe``) after; only the one in use is registered, and
    ``moe_enabled`` says which."""

    def __init__(self, layer_id: int, args: DeepSeekV3Args) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.moe_enabled = layer_id >= args.n_dense_layers
        if self.moe_enabled:
            self.moe = MoE(args)
        else:
            self.feed_forward = FeedForward(args.dim, args.inter_dim)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        ffn = self.moe if self.moe_enabled else self.feed_forward
        return h + ffn(self.ffn_norm(h))


class DeepSeekV3(nn.Module):
    def __init__(self, args: DeepSeekV3Args) -> None:
        super().__init__()
        args.validate()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.rope = RotaryEmbedding(
            args.qk_rope_head_dim, args.max_seq_len, args.rope_theta, _yarn(args)
        )
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(i, args) for i in range(args.n_layers)}
        )
        self.norm: RMSNorm | None = RMSNorm(args.dim, eps=args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        # Set by the context-parallel applier.
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
        if self.tok_embeddings is not None:
            if tokens.dim() != 2 or tokens.is_floating_point():
                raise ValueError(
                    f"Expected integer token ids of shape [bs, s], got {tuple(tokens.shape)} "
                    f"{tokens.dtype}. (Only pipeline stages without tok_embeddings take "
                    "hidden states.)"
                )
            h = self.tok_embeddings(tokens)
        else:
            if tokens.dim() != 3 or tokens.shape[-1] != self.args.dim:
                raise ValueError(
                    "This model has no tok_embeddings (a later pipeline stage), so it expects "
                    f"hidden states [bs, s, {self.args.dim}], got {tuple(tokens.shape)}."
                )
            h = tokens
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
        RoPE table and resets the MoE balancing buffers."""
        init_parameters(self, seed, standard_rule(self.args.n_layers, self.args.dim))
        self.rope.reset_table()
        for moe in moe_layers(self):
            moe.reset_buffers()
