"""Llama 3 configuration and the published flavors."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from models.common.args import DecoderArgs, positive_int, positive_number

_positive_int = functools.partial(positive_int, "Llama3Args")


_positive_float = functools.partial(positive_number, "Llama3Args")


@dataclass
class Llama3Args(DecoderArgs):
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    # None means multi-head attention (as many KV heads as query heads).
    n_kv_heads: int | None = None
    vocab_size: int = 128256
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    # The SwiGLU width itself (config.json intermediate_size), for shapes Llama's sizing rule
    # does not produce (TinyLlama, transformers' LlamaConfig()); None = from dim, multiple_of and
    # ffn_dim_multiplier, as in every published Llama 3 flavor.
    hidden_dim: int | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    # Llama 3.1 long-context frequency rescaling (factor 8, low 1, high 4, original 8192).
    use_rope_scaling: bool = True
    max_seq_len: int = 8192
    # Attention masking of packed rows (models/common/attention.py, documents.py): causal or
    # block_causal (documents ended by eos_id cannot see each other), the kernel, and whether
    # RoPE positions restart at each document start.
    attn_mask_type: str = "causal"
    attn_type: str = "sdpa"
    eos_id: int | None = None
    document_positions: bool = False
    # The output head reuses tok_embeddings.weight (Llama 3.2 1B/3B).
    tie_word_embeddings: bool = False
    # Llama 3 RoPE scaling factor: 8 for Llama 3.1, 32 for Llama 3.2 (other values are Meta's).
    rope_scaling_factor: float = 8.0

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def attention_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def tp_kv_heads(self) -> int | None:
        return self.n_kv_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """Llama sizing: 2/3 of 4*dim (keeps SwiGLU's three matrices at the cost of a 4*dim
        MLP), times the optional multiplier, rounded up to ``multiple_of`` for matmul-friendly
        shapes; ``hidden_dim`` when set."""
        if self.hidden_dim is not None:
            return self.hidden_dim
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    def validate(self) -> None:
        self.check_attention()
        self.check_tie_word_embeddings()
        for name in ("dim", "n_layers", "n_heads", "vocab_size", "multiple_of", "max_seq_len"):
            _positive_int(name, getattr(self, name))
        if self.n_kv_heads is not None:
            _positive_int("n_kv_heads", self.n_kv_heads)
        if self.hidden_dim is not None:
            _positive_int("hidden_dim", self.hidden_dim)
        if self.dim % self.n_heads != 0:
            raise ValueError(
                f"Llama3Args.dim={self.dim} is not divisible by n_heads={self.n_heads}; pick "
                "n_heads dividing dim so every head has the same width."
            )
        if self.n_heads % self.kv_heads != 0:
            raise ValueError(
                f"Llama3Args.n_heads={self.n_heads} is not divisible by "
                f"n_kv_heads={self.kv_heads}; "
                "grouped-query attention needs an equal number of query heads per KV head."
            )
        if self.head_dim % 2 != 0:
            raise ValueError(
                f"Llama3Args head_dim = dim / n_heads = {self.head_dim} is odd; RoPE rotates "
                "channel pairs, so choose dim and n_heads giving an even head_dim."
            )
        if self.ffn_dim_multiplier is not None:
            _positive_float("ffn_dim_multiplier", self.ffn_dim_multiplier)
        _positive_float("norm_eps", self.norm_eps)
        _positive_float("rope_theta", self.rope_theta)
        if not isinstance(self.use_rope_scaling, bool):
            raise ValueError(f"Llama3Args.use_rope_scaling must be a bool, got {self.use_rope_scaling!r}.")
        _positive_float("rope_scaling_factor", self.rope_scaling_factor)


# Llama 3.2's small models (their published config.json): tied embeddings, RoPE scaling factor 32.
_LLAMA32 = dict(vocab_size=128256, rope_theta=500000.0, rope_scaling_factor=32.0, tie_word_embeddings=True)

llama3_flavors: dict[str, Llama3Args] = {
    "debugmodel": Llama3Args(
        dim=256,
        n_layers=6,
        n_heads=16,
        n_kv_heads=8,
        vocab_size=2048,
        multiple_of=256,
        rope_theta=500000.0,
        use_rope_scaling=True,
        max_seq_len=2048,
    ),
    # debugmodel in Llama 3.2's shape: tied embeddings, RoPE scaling factor 32 (CPU tests of the
    # tied head on every layout); 8 layers, so pp=4 gets two stages per rank (and the shapes
    # tell it from debugmodel)
    "debugmodel_tied": Llama3Args(
        dim=256,
        n_layers=8,
        n_heads=16,
        n_kv_heads=8,
        vocab_size=2048,
        multiple_of=256,
        rope_theta=500000.0,
        use_rope_scaling=True,
        rope_scaling_factor=32.0,
        tie_word_embeddings=True,
        max_seq_len=2048,
    ),
    # hidden 2048, 16 layers, 32 heads (8 KV), intermediate 8192 = 256 * ceil(1.5 * 5461 / 256)
    "1B": Llama3Args(
        dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5, multiple_of=256, **_LLAMA32
    ),
    # hidden 3072, 28 layers, 24 heads (8 KV), intermediate 8192 = 2/3 * 4 * 3072
    "3B": Llama3Args(
        dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim_multiplier=1.0, multiple_of=256, **_LLAMA32
    ),
    "8B": Llama3Args(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_dim_multiplier=1.3,
        multiple_of=1024,
        rope_theta=500000.0,
    ),
    "70B": Llama3Args(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_dim_multiplier=1.3,
        multiple_of=4096,
        rope_theta=500000.0,
    ),
    "405B": Llama3Args(
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_dim_multiplier=1.2,
        multiple_of=4096,
        rope_theta=500000.0,
    ),
}
