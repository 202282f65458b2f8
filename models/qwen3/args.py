"""Qwen3 configuration (dense and MoE) and the published flavors.

One args class for both: ``n_routed_experts = 0`` is the dense model (every layer a SwiGLU of
``hidden_dim``), ``n_routed_experts > 0`` the MoE model (every layer routed: softmax router, top
``n_activated_experts``, renormalised when ``norm_topk_prob``, no shared expert), built from the
shared MoE (``models/common/moe.MoE``) through the routing properties below.

Flavor values are those of the published ``config.json`` files of the Hugging Face repositories
``Qwen/Qwen3-0.6B``, ``-1.7B``, ``-4B``, ``-8B``, ``-14B``, ``-32B``, ``-30B-A3B`` and ``-235B-A22B``
(hidden_size, intermediate_size, moe_intermediate_size,
num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim, vocab_size 151936,
rms_norm_eps 1e-6, rope_theta 1e6, num_experts, num_experts_per_tok, norm_topk_prob,
tie_word_embeddings: true for 0.6B, 1.7B and 4B, whose output head is the embedding,
router_aux_loss_coef 0.001 for the MoE models).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from models.common.args import DecoderArgs, positive_int, positive_number

_positive_int = functools.partial(positive_int, "Qwen3Args")


_positive_float = functools.partial(positive_number, "Qwen3Args")


@dataclass
class Qwen3Args(DecoderArgs):
    dim: int = 4096
    n_layers: int = 36
    n_heads: int = 32
    n_kv_heads: int = 8
    # Qwen3 sets the head width independently of dim / n_heads (128 in every published size).
    head_dim: int = 128
    # SwiGLU width of a dense layer (config.json intermediate_size).
    hidden_dim: int = 12288
    vocab_size: int = 151936
    norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    max_seq_len: int = 4096
    # MoE: 0 routed experts = the dense model.
    n_routed_experts: int = 0
    n_activated_experts: int = 8
    moe_inter_dim: int = 768
    norm_topk_prob: bool = True
    # Auxiliary-loss-free balancing (expert-bias update rate, models/common/moe.py); None
    # (the default, as Qwen3 trains) disables it.
    load_balance_coeff: float | None = None
    # Qwen3-MoE's load-balancing loss (transformers' router_aux_loss_coef; 0.001 in the published
    # MoE configs, 0 disables it): the Switch loss E * sum_e f_e * P_e per sequence, averaged over
    # the step's sequences and the MoE layers (see aux_loss_coeff and docs/models.md).
    router_aux_loss_coef: float = 0.0
    # The output head reuses tok_embeddings.weight (Qwen3 0.6B, 1.7B, 4B).
    tie_word_embeddings: bool = False
    # Attention masking of packed rows (models/common/attention.py, documents.py).
    attn_mask_type: str = "causal"
    attn_type: str = "sdpa"
    eos_id: int | None = None
    document_positions: bool = False

    # ------------------------------------------------------------------ the shared contract
    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads

    @property
    def attention_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def tp_kv_heads(self) -> int | None:
        return self.n_kv_heads

    @property
    def num_experts(self) -> int:
        return self.n_routed_experts

    @property
    def qk_norm(self) -> bool:
        """RMSNorm on every query and key head (what the planner's activation model reads)."""
        return True

    @property
    def ffn_hidden_dim(self) -> int:
        """The dense SwiGLU width (the name the planner reads)."""
        return self.hidden_dim

    # ------------------------------------------------------------------ what the shared MoE reads
    # (models/common/moe.MoE takes these by name; Qwen3's routing fixes them)
    @property
    def n_shared_experts(self) -> int:
        return 0

    @property
    def n_dense_layers(self) -> int:
        return 0 if self.n_routed_experts else self.n_layers

    @property
    def n_expert_groups(self) -> int:
        return 1

    @property
    def n_limited_groups(self) -> int:
        return 1

    @property
    def score_func(self) -> str:
        return "softmax"

    @property
    def route_norm(self) -> bool:
        return self.norm_topk_prob

    @property
    def route_scale(self) -> float:
        return 1.0

    @property
    def aux_loss_coeff(self) -> float:
        """The shared MoE's per-layer weight of DeepSeek's sequence-wise form ``sum_i f_i P_i``
        with ``f_i = E / (k T) * count_i``. Qwen3's (Switch) per-sequence loss of one layer is
        ``E * sum_i (count_i / T) * P_i = k * sum_i f_i P_i``, and the model averages it over its
        MoE layers (every layer is routed), so the coefficient is ``router_aux_loss_coef * k /
        n_layers``: one layer's value on one sequence is exactly transformers'
        ``load_balancing_loss_func`` on that layer's router logits of that sequence."""
        if not self.n_routed_experts:
            return 0.0
        return float(self.router_aux_loss_coef) * self.n_activated_experts / self.n_layers

    def validate(self) -> None:
        self.check_attention()
        self.check_tie_word_embeddings()
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "hidden_dim", "vocab_size", "max_seq_len"):
            _positive_int(name, getattr(self, name))
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"Qwen3Args.n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}; "
                "grouped-query attention needs an equal number of query heads per KV head."
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"Qwen3Args.head_dim={self.head_dim} is odd; RoPE rotates channel pairs, make it even.")
        _positive_float("norm_eps", self.norm_eps)
        _positive_float("rope_theta", self.rope_theta)
        if isinstance(self.n_routed_experts, bool) or not isinstance(self.n_routed_experts, int):
            raise ValueError(f"Qwen3Args.n_routed_experts must be an int >= 0, got {self.n_routed_experts!r}.")
        if self.n_routed_experts < 0:
            raise ValueError(f"Qwen3Args.n_routed_experts must be >= 0 (0 = dense), got {self.n_routed_experts}.")
        if self.n_routed_experts:
            _positive_int("n_activated_experts", self.n_activated_experts)
            _positive_int("moe_inter_dim", self.moe_inter_dim)
            if self.n_activated_experts > self.n_routed_experts:
                raise ValueError(
                    f"Qwen3Args.n_activated_experts={self.n_activated_experts} exceeds n_routed_experts="
                    f"{self.n_routed_experts}; a token cannot visit more experts than exist."
                )
            if not isinstance(self.norm_topk_prob, bool):
                raise ValueError(f"Qwen3Args.norm_topk_prob must be a bool, got {self.norm_topk_prob!r}.")
            if self.load_balance_coeff is not None:
                _positive_float("load_balance_coeff", self.load_balance_coeff)
        coef = self.router_aux_loss_coef
        if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not coef >= 0:
            raise ValueError(
                f"Qwen3Args.router_aux_loss_coef must be a number >= 0 (0 disables the load-balancing loss), "
                f"got {coef!r}."
            )
        if coef and not self.n_routed_experts:
            raise ValueError(
                f"Qwen3Args.router_aux_loss_coef={coef!r} needs routed experts (n_routed_experts > 0); "
                "a dense Qwen3 has no router: set it to 0."
            )


_PUBLISHED = dict(vocab_size=151936, norm_eps=1e-6, rope_theta=1000000.0, head_dim=128)

qwen3_flavors: dict[str, Qwen3Args] = {
    # CPU test sizes: GQA with head_dim (32) != dim / n_heads (256 / 16 = 16).
    "debugmodel": Qwen3Args(
        dim=256, n_layers=4, n_heads=16, n_kv_heads=8, head_dim=32, hidden_dim=768, vocab_size=2048, max_seq_len=2048
    ),
    # 8 experts top-2, every layer routed.
    "debugmodel_moe": Qwen3Args(
        dim=256,
        n_layers=4,
        n_heads=16,
        n_kv_heads=8,
        head_dim=32,
        hidden_dim=768,
        vocab_size=2048,
        max_seq_len=2048,
        n_routed_experts=8,
        n_activated_experts=2,
        moe_inter_dim=128,
        router_aux_loss_coef=0.001,
    ),
    # Qwen/Qwen3-0.6B, -1.7B, -4B config.json (tied embeddings)
    "0.6B": Qwen3Args(
        dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, hidden_dim=3072, tie_word_embeddings=True, **_PUBLISHED
    ),
    "1.7B": Qwen3Args(
        dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, hidden_dim=6144, tie_word_embeddings=True, **_PUBLISHED
    ),
    "4B": Qwen3Args(
        dim=2560, n_layers=36, n_heads=32, n_kv_heads=8, hidden_dim=9728, tie_word_embeddings=True, **_PUBLISHED
    ),
    # Qwen/Qwen3-8B, -14B, -32B config.json
    "8B": Qwen3Args(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, hidden_dim=12288, **_PUBLISHED),
    "14B": Qwen3Args(dim=5120, n_layers=40, n_heads=40, n_kv_heads=8, hidden_dim=17408, **_PUBLISHED),
    "32B": Qwen3Args(dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, hidden_dim=25600, **_PUBLISHED),
    # Qwen/Qwen3-30B-A3B, -235B-A22B config.json (128 experts, top 8, norm_topk_prob true)
    "30B-A3B": Qwen3Args(
        dim=2048,
        n_layers=48,
        n_heads=32,
        n_kv_heads=4,
        hidden_dim=6144,
        n_routed_experts=128,
        n_activated_experts=8,
        moe_inter_dim=768,
        router_aux_loss_coef=0.001,
        **_PUBLISHED,
    ),
    "235B-A22B": Qwen3Args(
        dim=4096,
        n_layers=94,
        n_heads=64,
        n_kv_heads=4,
        hidden_dim=12288,
        n_routed_experts=128,
        n_activated_experts=8,
        moe_inter_dim=1536,
        router_aux_loss_coef=0.001,
        **_PUBLISHED,
    ),
}
