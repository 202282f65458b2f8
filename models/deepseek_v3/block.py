"""DeepSeek-V3's blocks: multi-head latent attention (MLA) and the pre-norm block whose FFN is
dense for the first ``n_dense_layers`` layers and the shared MoE (``models/common/moe.py``)
after. The model (``model.py``) stacks them; the multi-token-prediction depths (``mtp.py``)
extend the block.

MLA lives here, not in ``models/common``: DeepSeek-V3 is the only model that builds it, and it
reads DeepSeek's own args (the latent ranks, the decoupled rope width, YaRN's softmax scale).
The one reader outside this folder, the start-up kernels line (``models/kernels.py``), asks
any attention through the ``DecoderAttention`` contract (:meth:`Attention.narrow_value_heads`)
instead of importing this class, so shared code depends on no model's folder. A second model
built on MLA would move it to ``models/common/mla.py`` with an args protocol, as
``models/common/moe.py`` did for the MoE."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from models.common.attention import AttentionCore, value_head_plan
from models.common.decoder import DecoderAttention, DecoderBlock
from models.common.feed_forward import FeedForward
from models.common.moe import MoE
from models.common.norms import RMSNorm
from models.common.rope import (
    YarnRopeScaling,
    apply_rotary_emb,
    yarn_softmax_scale,
)
from models.deepseek_v3.args import DeepSeekV3Args

__all__ = ["Attention", "TransformerBlock", "yarn_scaling"]


def yarn_scaling(args: DeepSeekV3Args) -> YarnRopeScaling:
    return YarnRopeScaling(
        factor=args.rope_factor,
        original_seq_len=args.original_seq_len,
        beta_fast=args.beta_fast,
        beta_slow=args.beta_slow,
    )


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


class Attention(DecoderAttention):
    """Multi-head latent attention.

    Keys/values are produced from a ``kv_lora_rank``-wide latent (``wkv_a`` -> ``kv_norm`` ->
    ``wkv_b``), and position information travels in a separate ``qk_rope_head_dim`` slice:
    queries get a per-head rotated slice, keys share one rotated slice across heads (decoupled
    RoPE), so the latent itself stays position-free. Head counts are read from tensor shapes
    because TP shards ``wq``/``wq_b``/``wkv_b`` column-wise and ``wo`` row-wise; the low-rank
    parts (``wq_a``, ``wkv_a`` and the norms) stay replicated."""

    tp_grad_syncs = ("k_pe_grad_sync",)

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
        self.wkv_b = nn.Linear(self.kv_lora_rank, args.n_heads * (self.qk_nope_head_dim + self.v_head_dim), bias=False)
        self.wo = nn.Linear(args.n_heads * self.v_head_dim, args.dim, bias=False)
        self.softmax_scale = yarn_softmax_scale(self.qk_head_dim, yarn_scaling(args), args.mscale, args.max_seq_len)
        self.core = AttentionCore(args.attn_mask_type, args.attn_type)
        # Heads come out of wkv_b and of wq (or wq_b after the query latent).
        self.tp_colwise = ("wkv_b", "wq" if self.q_lora_rank == 0 else "wq_b")
        # The decoupled rope key is computed by replicated weights but read by this rank's
        # heads only; tensor parallelism sets this to an all-reduce of its gradient.
        self.k_pe_grad_sync: Callable[[torch.Tensor], torch.Tensor] = _identity

    def narrow_value_heads(self) -> tuple[str, int, int] | None:
        """MLA's values (``v_head_dim``) may be narrower than its queries and keys
        (``qk_head_dim``); the kernels line reports their padding plan under "MLA"."""
        return ("MLA", self.qk_head_dim, self.v_head_dim) if self.v_head_dim < self.qk_head_dim else None

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: Any = None, cache: Any = None) -> torch.Tensor:
        bs, s, _ = x.shape
        q = self.wq(x) if self.q_lora_rank == 0 else self.wq_b(self.q_norm(self.wq_a(x)))
        q = q.view(bs, s, -1, self.qk_head_dim)
        q_nope, q_pe = torch.split(q, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        q = torch.cat([q_nope, apply_rotary_emb(q_pe, rope)], dim=-1)

        kv, k_pe = torch.split(self.wkv_a(x), [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
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
        if cache is not None:
            # inference: the cache holds this rank's heads' full keys and values (not the latent)
            k, v = cache.update(k, v)
            out = cache.attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), self.softmax_scale)
            return self.wo(out.transpose(1, 2).reshape(bs, s, -1))
        # Values are narrower than queries and keys (v_head_dim < qk_head_dim). Kernels that take
        # that (cuDNN attention, the memory-efficient kernel, FlexAttention) get them as they
        # are; where the fastest kernel needs one head dim (FlashAttention on CUDA, the flash
        # kernel on CPU, where unpadded values would fall to the math path), zero columns pad v
        # to the q/k head dim: they give zero output columns, leave the others exact, and are
        # sliced off below. value_head_plan decides per device and dtype (a constant under
        # torch.compile); models/kernels.py reports it at start-up.
        plan = value_head_plan(self.core, q.device, q.dtype, self.qk_head_dim, self.v_head_dim, q.requires_grad)
        if plan.pad:
            v = F.pad(v, (0, self.qk_head_dim - self.v_head_dim))
        with plan.priority():
            out = self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, scale=self.softmax_scale)
        out = out[..., : self.v_head_dim].transpose(1, 2).reshape(bs, s, -1)
        return self.wo(out)


class TransformerBlock(DecoderBlock):
    """Pre-norm residual block whose FFN is dense (``feed_forward``) for the first
    ``n_dense_layers`` layers and MoE (``moe``) after; only the one in use is registered, and
    ``moe_enabled`` says which (the forward is :class:`DecoderBlock`'s)."""

    def __init__(self, layer_id: int, args: DeepSeekV3Args) -> None:
        super().__init__(layer_id)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.moe_enabled = layer_id >= args.n_dense_layers
        if self.moe_enabled:
            self.moe = MoE(args)
        else:
            self.feed_forward = FeedForward(args.dim, args.inter_dim)
