"""Llama 3 <-> Hugging Face ``LlamaForCausalLM`` (the layout of the published Llama 3.x
``model.safetensors`` folders).

Names map one to one; the only layout change is in ``wq``/``wk``: our attention rotates
adjacent channel pairs (Meta's interleaved layout, ``models/common/rope.py``) and
``transformers`` rotates the two halves of each head (``rotate_half``), so their rows are
permuted per head (:class:`~models.common.hf_adapter.RopeRows`), with ``n_heads`` for ``wq``
and ``n_kv_heads`` for ``wk``. Our Llama 3 rope scaling has Meta's low 1, high 4, original 8192
(``Llama3RopeScaling``'s defaults) and the factor of ``rope_scaling_factor`` (8 for Llama 3.1,
32 for 3.2); ``use_rope_scaling`` turns it on or off. With ``tie_word_embeddings`` (Llama 3.2
1B/3B) the checkpoint holds ``model.embed_tokens.weight`` only (``output.weight`` is
:class:`~models.common.hf_adapter.Tied` to it); a checkpoint that also stores ``lm_head.weight``
loads when it equals the embedding.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import fields
from typing import Any

from models.common.hf_adapter import ConfigField, Entry, HFStateDictAdapter, rope_config, same_value
from models.common.hf_config import need
from models.common.hf_decoder import (
    block_entries,
    embedding_entries,
    final_entries,
    gqa_entries,
    hf_config_frame,
    swiglu_entries,
    tie_problem,
)
from models.common.rope import Llama3RopeScaling
from models.llama3.args import Llama3Args

__all__ = ["Llama3HFAdapter"]

_LLAMA31_CONTEXT = 131072
_META_VOCAB = 128256
_DEFAULT_THETA = 10000.0  # transformers' LlamaConfig when config.json has no rope_theta  # Meta's Llama 3 tokenizer: <|begin_of_text|> 128000, <|end_of_text|> 128001


def _llama3_scaling(factor: float) -> dict[str, Any]:
    d = {f.name: f.default for f in fields(Llama3RopeScaling)}
    return {
        "rope_type": "llama3",
        "factor": float(factor),
        "low_freq_factor": float(d["low_freq_factor"]),
        "high_freq_factor": float(d["high_freq_factor"]),
        "original_max_position_embeddings": int(d["original_max_position_embeddings"]),
    }


class Llama3HFAdapter(HFStateDictAdapter):
    hf_architecture = "LlamaForCausalLM"
    model_type = "llama"
    model_name = "llama3"
    hf_architectures = ("LlamaForCausalLM",)
    hf_model_types = ("llama",)
    config_fields_read = frozenset(
        {
            "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "intermediate_size", "vocab_size", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
            "tie_word_embeddings",
        }
    )  # fmt: skip
    required_values = (
        ("hidden_act", "silu", "silu"),
        ("attention_bias", False, False),
        ("mlp_bias", False, False),
        ("attention_dropout", 0.0, 0.0),
    )

    args: Llama3Args

    def _entries(self) -> Iterable[Entry]:
        a = self.args
        dim, ffn = a.dim, a.ffn_hidden_dim
        yield from embedding_entries(a.vocab_size, dim)
        for i in range(a.n_layers):
            o, h = f"layers.{i}.", f"model.layers.{i}."
            attention = gqa_entries(o, h, dim, a.n_heads, a.kv_heads, a.head_dim, rope_rows=True, qk_norm=False)
            yield from block_entries(o, h, dim, attention, swiglu_entries(o + "feed_forward.", h + "mlp.", dim, ffn))
        yield from final_entries(a.vocab_size, dim, a.tie_word_embeddings)

    def hf_config(self, dtype: str = "bfloat16") -> dict:
        a = self.args
        body: dict[str, Any] = {
            "hidden_size": a.dim,
            "intermediate_size": a.ffn_hidden_dim,
            "num_hidden_layers": a.n_layers,
            "num_attention_heads": a.n_heads,
            "num_key_value_heads": a.kv_heads,
            "head_dim": a.head_dim,
            "vocab_size": a.vocab_size,
            "rms_norm_eps": a.norm_eps,
            "rope_theta": a.rope_theta,
            "rope_scaling": _llama3_scaling(a.rope_scaling_factor) if a.use_rope_scaling else None,
            # with Llama 3.1's scaling, the context it was made for (transformers warns when the
            # original 8192 is not below it); our max_seq_len is only the training table length
            "max_position_embeddings": max(a.max_seq_len, _LLAMA31_CONTEXT) if a.use_rope_scaling else a.max_seq_len,
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "mlp_bias": False,
            "initializer_range": 0.02,
            "pretraining_tp": 1,
        }
        config = hf_config_frame(self, body, dtype)
        if a.vocab_size == _META_VOCAB:
            config["bos_token_id"] = 128000
            config["eos_token_id"] = 128001
        return config

    def _config_fields(self, config: Mapping[str, Any]) -> list[ConfigField]:
        a = self.args
        heads = config.get("num_attention_heads")
        kv = config.get("num_key_value_heads")
        head_dim = config.get("head_dim")
        if head_dim is None and isinstance(config.get("hidden_size"), int) and isinstance(heads, int) and heads:
            head_dim = config["hidden_size"] // heads
        theta, _ = rope_config(config)
        theta = _DEFAULT_THETA if theta is None else theta
        return [
            ConfigField("hidden_size", config.get("hidden_size"), a.dim, "dim"),
            ConfigField("num_hidden_layers", config.get("num_hidden_layers"), a.n_layers, "n_layers"),
            ConfigField("num_attention_heads", heads, a.n_heads, "n_heads"),
            ConfigField("num_key_value_heads", heads if kv is None else kv, a.kv_heads, "n_kv_heads"),
            ConfigField("head_dim", head_dim, a.head_dim, "dim // n_heads"),
            ConfigField(
                "intermediate_size",
                config.get("intermediate_size"),
                a.ffn_hidden_dim,
                "ffn_hidden_dim from dim, multiple_of, ffn_dim_multiplier",
            ),
            ConfigField("vocab_size", config.get("vocab_size"), a.vocab_size, "vocab_size"),
            ConfigField("rms_norm_eps", config.get("rms_norm_eps"), a.norm_eps, "norm_eps", shape=False),
            ConfigField("rope_theta", theta, a.rope_theta, "rope_theta", shape=False),
        ]

    def _config_problems(self, config: Mapping[str, Any]) -> list[tuple[str, Any, Any, str]]:
        a = self.args
        out: list[tuple[str, Any, Any, str]] = []
        _, scaling = rope_config(config)
        ours = _llama3_scaling(a.rope_scaling_factor) if a.use_rope_scaling else None
        if scaling is None or ours is None:
            if (scaling is None) != (ours is None):
                out.append(("rope_scaling", scaling, ours, "use_rope_scaling; Llama 3.0 has none, 3.1+ has llama3"))
        else:
            theirs = {k: scaling.get(k) for k in ours}
            if any(not same_value(theirs[k], ours[k]) for k in ours):
                out.append(
                    (
                        "rope_scaling",
                        theirs,
                        ours,
                        "rope_scaling_factor sets the factor; low 1, high 4, original 8192 are fixed at Meta's values",
                    )
                )
        return out + tie_problem(config, a.tie_word_embeddings)

    @classmethod
    def _derive_args(cls, config: Mapping[str, Any]) -> Llama3Args:
        theta, scaling = rope_config(config)
        if scaling is not None and scaling.get("rope_type") != "llama3":
            raise ValueError(
                f"rope_scaling of rope_type {scaling.get('rope_type')!r} is not implemented by our llama3 (Meta's "
                "'llama3' scaling or none)"
            )
        heads = need(config, "num_attention_heads")
        kv = config.get("num_key_value_heads")
        return Llama3Args(
            dim=need(config, "hidden_size"),
            n_layers=need(config, "num_hidden_layers"),
            n_heads=heads,
            n_kv_heads=heads if kv is None else kv,
            vocab_size=need(config, "vocab_size"),
            hidden_dim=need(config, "intermediate_size"),
            norm_eps=float(need(config, "rms_norm_eps")),
            rope_theta=float(_DEFAULT_THETA if theta is None else theta),
            use_rope_scaling=scaling is not None,
            rope_scaling_factor=float(scaling["factor"]) if scaling is not None else Llama3Args.rope_scaling_factor,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        )
