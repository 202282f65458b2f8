"""DeepSeek-V3 configuration (MLA attention + fine-grained MoE) and the published flavors."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from models.common.args import DecoderArgs, non_negative_int, positive_int, positive_number

_positive_int = functools.partial(positive_int, "DeepSeekV3Args")


_non_negative_int = functools.partial(non_negative_int, "DeepSeekV3Args")


_positive_float = functools.partial(positive_number, "DeepSeekV3Args")


@dataclass
class DeepSeekV3Args(DecoderArgs):
    vocab_size: int = 129280
    dim: int = 7168
    inter_dim: int = 18432
    moe_inter_dim: int = 2048
    n_layers: int = 61
    n_dense_layers: int = 3
    n_heads: int = 128
    # MoE
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    n_activated_experts: int = 8
    n_expert_groups: int = 8
    n_limited_groups: int = 4
    score_func: str = "sigmoid"
    route_norm: bool = True
    route_scale: float = 2.5
    # Auxiliary-loss-free balancing: rate of the expert-bias update; None disables it.
    load_balance_coeff: float | None = 1e-3
    # Weight of the sequence-wise auxiliary balance loss; 0 disables it.
    aux_loss_coeff: float = 0.0
    # MLA
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    # RoPE / YaRN
    rope_theta: float = 10000.0
    rope_factor: float = 40.0
    original_seq_len: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    max_seq_len: int = 16384
    norm_eps: float = 1e-6
    # Attention masking of packed rows (models/common/attention.py, documents.py): causal or
    # block_causal (documents ended by eos_id cannot see each other), the kernel, and whether
    # RoPE positions restart at each document start.
    attn_mask_type: str = "causal"
    attn_type: str = "sdpa"
    eos_id: int | None = None
    document_positions: bool = False
    # Multi-token prediction depths (models/deepseek_v3/mtp.py): 0 = off; the published
    # DeepSeek-V3 has 1 (num_nextn_predict_layers).
    mtp_layers: int = 0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def experts_per_group(self) -> int:
        return self.n_routed_experts // self.n_expert_groups

    @property
    def num_experts(self) -> int:
        return self.n_routed_experts

    @property
    def attention_dim(self) -> int:
        return self.n_heads * self.qk_head_dim

    def validate(self) -> None:
        self.check_attention()
        for name in (
            "vocab_size", "dim", "inter_dim", "moe_inter_dim", "n_layers", "n_heads",
            "n_routed_experts", "n_activated_experts", "n_expert_groups", "n_limited_groups",
            "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
            "original_seq_len", "max_seq_len",
        ):  # fmt: skip
            _positive_int(name, getattr(self, name))
        for name in ("n_dense_layers", "n_shared_experts", "q_lora_rank", "mtp_layers"):
            _non_negative_int(name, getattr(self, name))
        if self.n_dense_layers > self.n_layers:
            raise ValueError(
                f"DeepSeekV3Args.n_dense_layers={self.n_dense_layers} exceeds n_layers="
                f"{self.n_layers}; at most every layer can be dense."
            )
        if self.qk_rope_head_dim % 2 != 0:
            raise ValueError(
                f"DeepSeekV3Args.qk_rope_head_dim={self.qk_rope_head_dim} is odd; RoPE rotates "
                "channel pairs, so it must be even."
            )
        if self.score_func not in ("sigmoid", "softmax"):
            raise ValueError(
                f"DeepSeekV3Args.score_func={self.score_func!r} is not supported; use 'sigmoid' or 'softmax'."
            )
        if not isinstance(self.route_norm, bool):
            raise ValueError(f"DeepSeekV3Args.route_norm must be a bool, got {self.route_norm!r}.")
        if self.n_routed_experts % self.n_expert_groups != 0:
            raise ValueError(
                f"DeepSeekV3Args.n_routed_experts={self.n_routed_experts} is not divisible by "
                f"n_expert_groups={self.n_expert_groups}; groups must have equal size."
            )
        if self.n_limited_groups > self.n_expert_groups:
            raise ValueError(
                f"DeepSeekV3Args.n_limited_groups={self.n_limited_groups} exceeds "
                f"n_expert_groups={self.n_expert_groups}; a token cannot be routed to more "
                "groups than exist."
            )
        reachable = self.n_limited_groups * self.experts_per_group
        if self.n_activated_experts > reachable:
            raise ValueError(
                f"DeepSeekV3Args.n_activated_experts={self.n_activated_experts} exceeds the "
                f"{reachable} experts reachable in n_limited_groups={self.n_limited_groups} groups "
                f"of {self.experts_per_group}; lower top-k or allow more groups."
            )
        _positive_float("route_scale", self.route_scale)
        if self.load_balance_coeff is not None:
            _positive_float("load_balance_coeff", self.load_balance_coeff)
        if (
            isinstance(self.aux_loss_coeff, bool)
            or not isinstance(self.aux_loss_coeff, (int, float))
            or self.aux_loss_coeff < 0
        ):
            raise ValueError(
                f"DeepSeekV3Args.aux_loss_coeff must be a number >= 0 (0 disables the loss), "
                f"got {self.aux_loss_coeff!r}."
            )
        _positive_float("rope_theta", self.rope_theta)
        if self.rope_theta <= 1:
            raise ValueError(f"DeepSeekV3Args.rope_theta must be > 1, got {self.rope_theta}.")
        if isinstance(self.rope_factor, bool) or not isinstance(self.rope_factor, (int, float)) or self.rope_factor < 1:
            raise ValueError(
                f"DeepSeekV3Args.rope_factor must be >= 1 (1 means no YaRN stretch), got {self.rope_factor!r}."
            )
        _positive_float("beta_fast", self.beta_fast)
        _positive_float("beta_slow", self.beta_slow)
        _positive_float("mscale", self.mscale)
        _positive_float("norm_eps", self.norm_eps)


deepseek_v3_flavors: dict[str, DeepSeekV3Args] = {
    # Small enough for CPU tests, but with 4 groups of 2 experts and 2 kept groups so grouped
    # routing actually masks experts, and a shared expert plus a dense first layer.
    "debugmodel": DeepSeekV3Args(
        vocab_size=2048,
        dim=256,
        inter_dim=1024,
        moe_inter_dim=256,
        n_layers=6,
        n_dense_layers=1,
        n_heads=16,
        n_routed_experts=8,
        n_shared_experts=1,
        n_activated_experts=2,
        n_expert_groups=4,
        n_limited_groups=2,
        score_func="sigmoid",
        route_norm=True,
        route_scale=1.0,
        q_lora_rank=0,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        max_seq_len=2048,
    ),
    "16B": DeepSeekV3Args(
        vocab_size=102400,
        dim=2048,
        inter_dim=10944,
        moe_inter_dim=1408,
        n_layers=27,
        n_dense_layers=1,
        n_heads=16,
        n_routed_experts=64,
        n_shared_experts=2,
        n_activated_experts=6,
        n_expert_groups=1,
        n_limited_groups=1,
        score_func="softmax",
        route_norm=False,
        route_scale=1.0,
        q_lora_rank=0,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        mscale=0.707,
        rope_factor=40.0,
        original_seq_len=4096,
    ),
    "671B": DeepSeekV3Args(
        vocab_size=129280,
        dim=7168,
        inter_dim=18432,
        moe_inter_dim=2048,
        n_layers=61,
        n_dense_layers=3,
        n_heads=128,
        n_routed_experts=256,
        n_shared_experts=1,
        n_activated_experts=8,
        n_expert_groups=8,
        n_limited_groups=4,
        score_func="sigmoid",
        route_norm=True,
        route_scale=2.5,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        rope_factor=40.0,
        original_seq_len=4096,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=1.0,
    ),
}
