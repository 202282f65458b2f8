"""Training FLOPs per token of a decoder (the MFU numerator). No torch import."""

from __future__ import annotations


def model_flops_per_token(
    num_params: int, num_layers: int, attention_dim: int, seq_len: int, num_embedding_params: int = 0
) -> float:
    """Training FLOPs per token: 6 * (non-embedding params) for forward + backward matmuls,
    plus 12 * layers * attention_dim * seq_len for the attention score/value products
    (PaLM appendix B convention: causal masking is not discounted).

    For MoE pass the *active* parameters per token (shared + routed top-k experts);
    ``attention_dim`` is n_heads * head_dim (the q/k dim for MLA).
    """
    return 6.0 * (num_params - num_embedding_params) + 12.0 * num_layers * attention_dim * seq_len
