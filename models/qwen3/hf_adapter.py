"""Qwen3 <-> Hugging Face ``Qwen3ForCausalLM`` (dense flavors) and ``Qwen3MoeForCausalLM`` (MoE
flavors), the layout of the published ``Qwen/Qwen3-*`` folders.

Every tensor maps one to one with no permutation: our attention rotates the half-split pairs
that ``transformers`` rotates (``models/qwen3/model.py``), so ``q_proj``/``k_proj`` rows and the
``q_norm``/``k_norm`` gains keep their order. Routed experts are stacked ``w1``/``w3``
``[E, hidden, dim]`` and ``w2`` ``[E, dim, hidden]`` here and one ``mlp.experts.{e}.gate_proj``/
``up_proj``/``down_proj`` per expert on disk (same orientation; ``transformers`` >= 5 fuses them in
memory and converts on load/save). Qwen3 has no expert bias: ours loads as zeros and is refused
on export unless still zero (train with ``load_balance_coeff`` unset to export). With
``tie_word_embeddings`` (0.6B, 1.7B, 4B) the checkpoint holds ``model.embed_tokens.weight`` only
(``output.weight`` is :class:`~models.common.hf_adapter.Tied` to it).

The config check refuses what this model does not implement, by name: rope scaling,
sliding-window attention, attention biases, an activation other than SiLU, dense layers
in an MoE model (``mlp_only_layers``, ``decoder_sparse_step``). ``router_aux_loss_coef`` (and
``output_router_logits``, which switches it on in transformers' training) is a training choice,
not a shape: it is not checked; the export writes ours (``Qwen3Args.router_aux_loss_coef``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from models.common.hf_adapter import Absent, ConfigField, Entry, HFStateDictAdapter, rope_config
from models.common.hf_config import need
from models.common.hf_decoder import (
    block_entries,
    embedding_entries,
    final_entries,
    gqa_entries,
    hf_config_frame,
    routed_expert_entries,
    swiglu_entries,
    tie_problem,
)
from models.qwen3.args import Qwen3Args

__all__ = ["Qwen3HFAdapter"]

# The context length of the published Qwen3 configs (max_position_embeddings); our max_seq_len
# is only the training RoPE table length.
_QWEN3_CONTEXT = 40960
_DEFAULT_THETA = 10000.0  # transformers' Qwen3Config when config.json has no rope_theta
_MOE = ("Qwen3MoeForCausalLM", "qwen3_moe")


def _is_moe(config: Mapping[str, Any]) -> bool:
    return _MOE[0] in (config.get("architectures") or []) or config.get("model_type") == _MOE[1]


def _head_dim(config: Mapping[str, Any]) -> Any:
    """config.json's head_dim or, when it has none, transformers' default: 128 for Qwen3,
    hidden_size / num_attention_heads for Qwen3-MoE."""
    if config.get("head_dim") is not None or not _is_moe(config):
        return config.get("head_dim", 128)
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    return hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None


class Qwen3HFAdapter(HFStateDictAdapter):
    model_name = "qwen3"
    hf_architectures = ("Qwen3ForCausalLM", _MOE[0])
    hf_model_types = ("qwen3", _MOE[1])
    config_fields_read = frozenset(
        {
            "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "intermediate_size", "vocab_size", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
            "tie_word_embeddings", "num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
            "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "output_router_logits",
            "router_aux_loss_coef", "layer_types",
            # sliding-window settings, which act only with use_sliding_window (refused when true)
            "sliding_window", "max_window_layers",
        }
    )  # fmt: skip
    required_values = (
        ("hidden_act", "silu", "silu"),
        ("attention_bias", False, False),
        ("use_sliding_window", False, False),
        ("attention_dropout", 0.0, 0.0),
    )

    args: Qwen3Args

    def __init__(self, args: Qwen3Args) -> None:
        super().__init__(args)
        moe = args.n_routed_experts > 0
        self.hf_architecture = "Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"
        self.model_type = "qwen3_moe" if moe else "qwen3"

    def _entries(self) -> Iterable[Entry]:
        a = self.args
        dim = a.dim
        yield from embedding_entries(a.vocab_size, dim)
        for i in range(a.n_layers):
            o, h = f"layers.{i}.", f"model.layers.{i}."
            attention = gqa_entries(o, h, dim, a.n_heads, a.kv_heads, a.head_dim, rope_rows=False, qk_norm=True)
            yield from block_entries(o, h, dim, attention, self._ffn_entries(o, h))
        yield from final_entries(a.vocab_size, dim, a.tie_word_embeddings)

    def _ffn_entries(self, o: str, h: str) -> Iterable[Entry]:
        a = self.args
        e = a.n_routed_experts
        if not e:
            yield from swiglu_entries(o + "feed_forward.", h + "mlp.", a.dim, a.hidden_dim)
            return
        yield Absent(
            o + "moe.expert_bias",
            (e,),
            torch.float32,
            0.0,
            "Qwen3-MoE checkpoints have no expert bias, and this one is non-zero; train with load_balance_coeff "
            "unset to export to Hugging Face.",
        )
        yield from routed_expert_entries(o, h, a.dim, e, a.moe_inter_dim)

    def hf_config(self, dtype: str = "bfloat16") -> dict:
        a = self.args
        body: dict[str, Any] = {
            "hidden_size": a.dim,
            "intermediate_size": a.hidden_dim,
            "num_hidden_layers": a.n_layers,
            "num_attention_heads": a.n_heads,
            "num_key_value_heads": a.n_kv_heads,
            "head_dim": a.head_dim,
            "vocab_size": a.vocab_size,
            "rms_norm_eps": a.norm_eps,
            "rope_theta": a.rope_theta,
            "rope_scaling": None,
            "max_position_embeddings": max(a.max_seq_len, _QWEN3_CONTEXT),
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": a.n_layers,
            "initializer_range": 0.02,
        }
        config = hf_config_frame(self, body, dtype)
        if a.n_routed_experts:
            config.update(
                {
                    "moe_intermediate_size": a.moe_inter_dim,
                    "num_experts": a.n_routed_experts,
                    "num_experts_per_tok": a.n_activated_experts,
                    "norm_topk_prob": a.norm_topk_prob,
                    "decoder_sparse_step": 1,
                    "mlp_only_layers": [],
                    "output_router_logits": False,
                    "router_aux_loss_coef": float(a.router_aux_loss_coef),
                }
            )
        if a.vocab_size == 151936:  # Qwen's tokenizer: <|endoftext|> 151643
            config["bos_token_id"] = 151643
            config["eos_token_id"] = 151643
        return config

    def _config_fields(self, config: Mapping[str, Any]) -> list[ConfigField]:
        a = self.args
        heads = config.get("num_attention_heads")
        kv = config.get("num_key_value_heads")
        head_dim = _head_dim(config)
        theta, _ = rope_config(config)
        theta = _DEFAULT_THETA if theta is None else theta
        out = [
            ConfigField("hidden_size", config.get("hidden_size"), a.dim, "dim"),
            ConfigField("num_hidden_layers", config.get("num_hidden_layers"), a.n_layers, "n_layers"),
            ConfigField("num_attention_heads", heads, a.n_heads, "n_heads"),
            ConfigField("num_key_value_heads", heads if kv is None else kv, a.n_kv_heads, "n_kv_heads"),
            ConfigField("head_dim", head_dim, a.head_dim, "head_dim"),
            ConfigField("intermediate_size", config.get("intermediate_size"), a.hidden_dim, "hidden_dim"),
            ConfigField("vocab_size", config.get("vocab_size"), a.vocab_size, "vocab_size"),
            ConfigField("rms_norm_eps", config.get("rms_norm_eps"), a.norm_eps, "norm_eps", shape=False),
            ConfigField("rope_theta", theta, a.rope_theta, "rope_theta", shape=False),
        ]
        if a.n_routed_experts:
            out += [
                ConfigField(
                    "num_experts",
                    # transformers >= 5 writes num_local_experts (num_experts is its alias)
                    config.get("num_experts", config.get("num_local_experts")),
                    a.n_routed_experts,
                    "n_routed_experts",
                ),
                ConfigField(
                    "num_experts_per_tok",
                    config.get("num_experts_per_tok"),
                    a.n_activated_experts,
                    "n_activated_experts",
                ),
                ConfigField(
                    "moe_intermediate_size", config.get("moe_intermediate_size"), a.moe_inter_dim, "moe_inter_dim"
                ),
                ConfigField(
                    "norm_topk_prob",
                    config.get("norm_topk_prob", False),
                    a.norm_topk_prob,
                    "norm_topk_prob",
                    shape=False,
                ),
            ]
        return out

    def _config_problems(self, config: Mapping[str, Any]) -> list[tuple[str, Any, Any, str]]:
        out: list[tuple[str, Any, Any, str]] = []
        _, scaling = rope_config(config)
        if scaling is not None:
            out.append(("rope_scaling", scaling, None, "our Qwen3 has plain RoPE (no scaling)"))
        kinds = set(config.get("layer_types") or ["full_attention"])
        if kinds != {"full_attention"}:
            out.append(
                ("layer_types", sorted(kinds), ["full_attention"], "our Qwen3 has full attention in every layer")
            )
        out += tie_problem(config, self.args.tie_word_embeddings)
        if self.args.n_routed_experts:
            sparse_step = config.get("decoder_sparse_step", 1)
            if sparse_step != 1:
                out.append(("decoder_sparse_step", sparse_step, 1, "our Qwen3-MoE routes every layer"))
            dense_layers = config.get("mlp_only_layers") or []
            if dense_layers:
                out.append(("mlp_only_layers", dense_layers, [], "our Qwen3-MoE routes every layer"))
        return out

    @classmethod
    def _derive_args(cls, config: Mapping[str, Any]) -> Qwen3Args:
        theta, _ = rope_config(config)  # scaling: refused by the check that follows
        heads = need(config, "num_attention_heads")
        kv = config.get("num_key_value_heads")
        moe = _is_moe(config)
        args = Qwen3Args(
            dim=need(config, "hidden_size"),
            n_layers=need(config, "num_hidden_layers"),
            n_heads=heads,
            n_kv_heads=heads if kv is None else kv,
            head_dim=_head_dim(config),
            hidden_dim=need(config, "intermediate_size"),
            vocab_size=need(config, "vocab_size"),
            norm_eps=float(need(config, "rms_norm_eps")),
            rope_theta=float(_DEFAULT_THETA if theta is None else theta),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        )
        if not moe:
            return args
        experts = config.get("num_experts", config.get("num_local_experts"))
        if experts is None:
            raise ValueError("it has no 'num_experts', which sets the model's shape")
        return dataclasses.replace(
            args,
            n_routed_experts=experts,
            n_activated_experts=need(config, "num_experts_per_tok"),
            moe_inter_dim=need(config, "moe_intermediate_size"),
            norm_topk_prob=bool(config.get("norm_topk_prob", False)),
            # the load-balancing loss's weight (transformers' default when absent)
            router_aux_loss_coef=float(config.get("router_aux_loss_coef", 0.001)),
        )
