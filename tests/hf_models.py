"""Small ``transformers`` models the Hugging Face tests compare against (unit, distributed and
e2e tiers): configs shaped like our debug flavors, and one way to fill their weights so that a
mapping error cannot hide behind equal values (norms off 1, expert score biases off 0, every
tensor distinct)."""

from __future__ import annotations

import torch

# Llama 3's RoPE: theta 500000 and the "llama3" frequency scaling, as transformers 5 spells it
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def llama_config(**overrides):
    """A ``LlamaConfig`` of llama3/debugmodel's shapes (vocab 2048, 6 layers, dim 256, 16 heads,
    8 KV heads), with ``overrides`` on top."""
    from transformers import LlamaConfig

    kwargs = dict(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=6,
        num_attention_heads=16,
        num_key_value_heads=8,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_theta": 500000.0, **LLAMA3_ROPE},
        max_position_embeddings=131072,
        tie_word_embeddings=False,
    )
    return LlamaConfig(**{**kwargs, **overrides})


def deepseek_v3_config(**overrides):
    """A ``DeepseekV3Config`` of deepseek_v3/debugmodel's shapes without YaRN (a max_seq_len of
    at most 4096), with ``overrides`` on top."""
    from transformers import DeepseekV3Config

    kwargs = dict(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=1024,
        moe_intermediate_size=256,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        num_attention_heads=16,
        num_key_value_heads=16,
        n_shared_experts=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=1.0,
        q_lora_rank=None,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return DeepseekV3Config(**{**kwargs, **overrides})


def randomize_hf_(model, seed: int) -> None:
    """Fill every parameter from one generator seeded ``seed``, in ``named_parameters`` order:
    norm weights 1 + 0.2 N(0, 1), everything else 0.05 N(0, 1); then DeepSeek's expert score
    correction biases (buffers) 0.05 N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=g))


def hf_model(config, seed: int = 1):
    """The transformers causal LM of ``config`` (Llama or DeepSeek-V3), randomized with
    :func:`randomize_hf_`, fp32, in eval mode."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, LlamaForCausalLM

    torch.manual_seed(0)
    cls = DeepseekV3ForCausalLM if isinstance(config, DeepseekV3Config) else LlamaForCausalLM
    model = cls(config)
    randomize_hf_(model, seed)
    return model.float().eval()
