"""DeepSeek-V3 <-> Hugging Face ``DeepseekV3ForCausalLM`` / ``DeepseekV2ForCausalLM`` (the
on-disk layout of the published DeepSeek-V3 / V2-Lite folders: one tensor per routed expert).

Which ``transformers`` class a flavor is depends on its routing, because
``transformers``' two classes hard-code it:

* ``score_func="sigmoid"`` -> ``DeepseekV3ForCausalLM``: sigmoid scores, selection on scores +
  ``e_score_correction_bias`` (our ``moe.expert_bias``: the same quantity, added to the
  scores for the choice only, same sign), group score = sum of the two best, combine weights
  normalised iff ``norm_topk_prob`` (our ``route_norm``), times ``routed_scaling_factor``;
* ``score_func="softmax"`` -> ``DeepseekV2ForCausalLM`` (DeepSeek-V2 / V2-Lite; our 16B
  flavor): softmax scores, no expert bias (ours loads as zeros and is refused on export
  unless still zero), ``greedy`` or ``group_limited_greedy`` (group score = best expert),
  never normalised (``norm_topk_prob`` is ignored there, so ``route_norm`` must be False).

MLA names map one to one and need no permutation: DeepSeek checkpoints keep the rotary
slices of ``q``/``kv_a`` in the interleaved layout we use, and ``transformers`` rotates them
as such (``rope_interleave=True`` in V3, complex pairs in V2). Routed experts are stacked
``w1``/``w3`` ``[E, hidden, dim]`` and ``w2`` ``[E, dim, hidden]`` here and one
``experts.{e}.gate_proj``/``up_proj`` ``[hidden, dim]`` / ``down_proj`` ``[dim, hidden]`` per
expert there: the same orientation, no transposition. (``transformers`` >= 5 fuses them into
``gate_up_proj`` in memory and converts on load/save; checkpoints on disk are per expert.)

YaRN: our RoPE applies it only when ``max_seq_len > original_seq_len`` (the DeepSeek
reference), ``transformers`` whenever ``rope_scaling`` is yarn; so the exported config has
yarn exactly when ours applies it, with ``mscale = mscale_all_dim = args.mscale`` (cos/sin
unscaled, softmax scale times ``(0.1 mscale ln factor + 1)^2``, as ours).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from models.common.hf_adapter import (
    Absent,
    ConfigField,
    Copies,
    Entry,
    HFConfigMismatch,
    HFStateDictAdapter,
    Plain,
    Tied,
    rope_config,
    same_value,
)
from models.common.hf_config import need
from models.common.hf_decoder import (
    block_entries,
    embedding_entries,
    final_entries,
    hf_config_frame,
    routed_expert_entries,
    swiglu_entries,
)
from models.deepseek_v3.args import DeepSeekV3Args

__all__ = ["DeepSeekV3HFAdapter"]

# transformers' MLA latent norms (q_a_layernorm, kv_a_layernorm) are built with this eps
# whatever rms_norm_eps says; ours use norm_eps.
_HF_LATENT_NORM_EPS = 1e-6
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


class DeepSeekV3HFAdapter(HFStateDictAdapter):
    hf_architecture = "DeepseekV3ForCausalLM"
    model_type = "deepseek_v3"
    model_name = "deepseek_v3"
    hf_architectures = ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM")
    hf_model_types = ("deepseek_v3", "deepseek_v2")
    config_fields_read = frozenset(
        {
            "hidden_size", "num_hidden_layers", "first_k_dense_replace", "intermediate_size", "moe_intermediate_size",
            "num_attention_heads", "num_key_value_heads", "n_routed_experts", "num_local_experts", "n_shared_experts",
            "num_experts_per_tok", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
            "v_head_dim", "vocab_size", "routed_scaling_factor", "rms_norm_eps", "rope_theta", "rope_scaling",
            "rope_parameters", "n_group", "topk_group", "topk_method", "scoring_func", "norm_topk_prob",
            "rope_interleave", "moe_layer_freq", "max_position_embeddings", "tie_word_embeddings",
            # what transformers >= 5 derives: qk_rope_head_dim and qk_nope + qk_rope (checked)
            "head_dim", "qk_head_dim",
            # the multi-token-prediction layers (skipped on import, as transformers does), the
            # training-only balance loss (our aux_loss_coeff) and the reference code's EP degree
            "num_nextn_predict_layers", "aux_loss_alpha", "seq_aux", "ep_size", "output_router_logits",
        }
    )  # fmt: skip
    required_values = (
        ("hidden_act", "silu", "silu"),
        ("attention_bias", False, False),
        ("mlp_bias", False, False),
        ("attention_dropout", 0.0, 0.0),
    )

    args: DeepSeekV3Args

    def __init__(self, args: DeepSeekV3Args) -> None:
        # V2 (softmax routing, no expert bias) or V3 (sigmoid + bias), per flavor.
        self.v2 = args.score_func == "softmax"
        if self.v2:
            self.hf_architecture = "DeepseekV2ForCausalLM"
            self.model_type = "deepseek_v2"
        super().__init__(args)

    @property
    def uses_yarn(self) -> bool:
        return self.args.max_seq_len > self.args.original_seq_len

    # ------------------------------------------------------------------ state dict
    def _entries(self) -> Iterable[Entry]:
        a = self.args
        dim = a.dim
        emb, head = (a.vocab_size, dim), (a.vocab_size, dim)
        mtp = [f"model.layers.{a.n_layers + k}." for k in range(a.mtp_layers)]
        if mtp:  # the MTP layers store the embedding and the head again (the copies must be equal)
            yield Copies(
                "tok_embeddings.weight", ("model.embed_tokens.weight", *(h + "embed_tokens.weight" for h in mtp)), emb
            )
        else:
            yield from embedding_entries(a.vocab_size, dim)
        for i in range(a.n_layers):
            yield from self._layer_entries(f"layers.{i}.", f"model.layers.{i}.", i)
        if mtp:
            yield Plain("norm.weight", "model.norm.weight", (dim,))
            yield Copies("output.weight", ("lm_head.weight", *(h + "shared_head.head.weight" for h in mtp)), head)
        else:
            yield from final_entries(a.vocab_size, dim, tie_word_embeddings=False)
        for k, h in enumerate(mtp):
            o = f"mtp.{k}."
            # our copy of the embedding is the checkpoint's model.embed_tokens (and its copy)
            yield Tied(o + "embed_tokens.weight", "tok_embeddings.weight", h + "embed_tokens.weight", emb)
            yield Plain(o + "enorm.weight", h + "enorm.weight", (dim,))
            yield Plain(o + "hnorm.weight", h + "hnorm.weight", (dim,))
            yield Plain(o + "eh_proj.weight", h + "eh_proj.weight", (dim, 2 * dim))
            yield Plain(o + "shared_head.norm.weight", h + "shared_head.norm.weight", (dim,))
            yield from self._layer_entries(o, h, a.n_layers + k)

    def _layer_entries(self, o: str, h: str, i: int) -> Iterable[Entry]:
        """The decoder-layer tensors of our block ``o`` (layer id ``i``) and checkpoint layer ``h``."""
        return block_entries(o, h, self.args.dim, self._mla_entries(o, h), self._ffn_entries(o, h, i))

    def _mla_entries(self, o: str, h: str) -> Iterable[Entry]:
        a = self.args
        dim, heads, qk = a.dim, a.n_heads, a.qk_head_dim
        if a.q_lora_rank == 0:
            yield Plain(o + "attention.wq.weight", h + "self_attn.q_proj.weight", (heads * qk, dim))
        else:
            r = a.q_lora_rank
            yield Plain(o + "attention.wq_a.weight", h + "self_attn.q_a_proj.weight", (r, dim))
            yield Plain(o + "attention.q_norm.weight", h + "self_attn.q_a_layernorm.weight", (r,))
            yield Plain(o + "attention.wq_b.weight", h + "self_attn.q_b_proj.weight", (heads * qk, r))
        kv = a.kv_lora_rank
        yield Plain(
            o + "attention.wkv_a.weight", h + "self_attn.kv_a_proj_with_mqa.weight", (kv + a.qk_rope_head_dim, dim)
        )
        yield Plain(o + "attention.kv_norm.weight", h + "self_attn.kv_a_layernorm.weight", (kv,))
        yield Plain(
            o + "attention.wkv_b.weight",
            h + "self_attn.kv_b_proj.weight",
            (heads * (a.qk_nope_head_dim + a.v_head_dim), kv),
        )
        yield Plain(o + "attention.wo.weight", h + "self_attn.o_proj.weight", (dim, heads * a.v_head_dim))

    def _ffn_entries(self, o: str, h: str, i: int) -> Iterable[Entry]:
        a = self.args
        e = a.n_routed_experts
        if i < a.n_dense_layers:
            yield from swiglu_entries(o + "feed_forward.", h + "mlp.", a.dim, a.inter_dim)
            return
        if self.v2:
            yield Absent(
                o + "moe.expert_bias",
                (e,),
                torch.float32,
                0.0,
                "DeepSeek-V2 checkpoints (softmax routing) have no expert bias, and this one is non-zero; train "
                "with load_balance_coeff unset to export this flavor to Hugging Face.",
            )
        else:
            yield Plain(o + "moe.expert_bias", h + "mlp.gate.e_score_correction_bias", (e,))
        yield from routed_expert_entries(o, h, a.dim, e, a.moe_inter_dim)
        if a.n_shared_experts > 0:
            hidden = a.moe_inter_dim * a.n_shared_experts
            yield from swiglu_entries(o + "moe.shared_experts.", h + "mlp.shared_experts.", a.dim, hidden)

    def keep_in_fp32(self, hf_key: str) -> bool:
        return hf_key.endswith("e_score_correction_bias")

    def is_ignored_hf_key(self, hf_key: str) -> bool:
        """Besides rotary buffers: the multi-token-prediction layers (``model.layers.{n_layers +
        k}.*``) beyond the ``mtp_layers`` these args keep (with ``mtp_layers = 0`` a DeepSeek-V3
        folder loads without its MTP layer, as transformers loads it)."""
        if super().is_ignored_hf_key(hf_key):
            return True
        m = _LAYER.match(hf_key)
        return m is not None and int(m.group(1)) >= self.args.n_layers + self.args.mtp_layers

    def from_hf(self, hf_state_dict):
        scales = sorted(k for k in hf_state_dict if k.endswith("_scale_inv"))
        if scales:
            raise ValueError(
                f"from_hf: {scales[0]!r}: this is an FP8 block-quantized checkpoint (as DeepSeek publishes "
                "V3); dequantize it to bf16 first."
            )
        return super().from_hf(hf_state_dict)

    # ------------------------------------------------------------------ config.json
    def _unsupported(self) -> str | None:
        a = self.args
        if a.n_shared_experts == 0:
            return (
                "deepseek_v3 args with n_shared_experts=0 have no Hugging Face equivalent: transformers' "
                "DeepSeek-V2/V3 always run shared experts."
            )
        if self.v2 and a.route_norm:
            return (
                "deepseek_v3 args with score_func='softmax' and route_norm=True have no Hugging Face equivalent: "
                "transformers' DeepseekV2 (softmax routing) never normalises the top-k weights and DeepseekV3 "
                "routes with sigmoid."
            )
        return None

    def _rope_scaling(self) -> dict[str, Any] | None:
        a = self.args
        if not self.uses_yarn:
            return None
        return {
            "type": "yarn",
            "rope_type": "yarn",
            "factor": float(a.rope_factor),
            "original_max_position_embeddings": a.original_seq_len,
            "beta_fast": float(a.beta_fast),
            "beta_slow": float(a.beta_slow),
            "mscale": float(a.mscale),
            "mscale_all_dim": float(a.mscale),
        }

    def _routing(self) -> dict[str, Any]:
        a = self.args
        if self.v2:
            grouped = a.n_limited_groups < a.n_expert_groups
            return {
                "scoring_func": "softmax",
                "topk_method": "group_limited_greedy" if grouped else "greedy",
                "n_group": a.n_expert_groups,
                "topk_group": a.n_limited_groups,
                "norm_topk_prob": False,
                "routed_scaling_factor": float(a.route_scale),
                "moe_layer_freq": 1,
            }
        return {
            "scoring_func": "sigmoid",
            "topk_method": "noaux_tc",
            "n_group": a.n_expert_groups,
            "topk_group": a.n_limited_groups,
            "norm_topk_prob": a.route_norm,
            "routed_scaling_factor": float(a.route_scale),
        }

    def hf_config(self, dtype: str = "bfloat16") -> dict:
        problem = self._unsupported()
        if problem:
            raise HFConfigMismatch(problem)
        a = self.args
        body: dict[str, Any] = {
            "vocab_size": a.vocab_size,
            "hidden_size": a.dim,
            "intermediate_size": a.inter_dim,
            "moe_intermediate_size": a.moe_inter_dim,
            "num_hidden_layers": a.n_layers,
            "first_k_dense_replace": a.n_dense_layers,
            "num_attention_heads": a.n_heads,
            "num_key_value_heads": a.n_heads,
            "n_routed_experts": a.n_routed_experts,
            "n_shared_experts": a.n_shared_experts,
            "num_experts_per_tok": a.n_activated_experts,
            **self._routing(),
            "q_lora_rank": a.q_lora_rank or None,
            "kv_lora_rank": a.kv_lora_rank,
            "qk_nope_head_dim": a.qk_nope_head_dim,
            "qk_rope_head_dim": a.qk_rope_head_dim,
            "v_head_dim": a.v_head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": a.max_seq_len,
            "rms_norm_eps": a.norm_eps,
            "rope_theta": a.rope_theta,
            "rope_scaling": self._rope_scaling(),
            "attention_bias": False,
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
        }
        config = hf_config_frame(self, body, dtype)  # tie_word_embeddings: DeepSeek-V3 never ties
        if not self.v2:
            config["rope_interleave"] = True
            config["num_nextn_predict_layers"] = a.mtp_layers
        return config

    def _config_fields(self, config: Mapping[str, Any]) -> list[ConfigField]:
        a = self.args
        heads = config.get("num_attention_heads")
        kv_heads = config.get("num_key_value_heads")
        theta, _ = rope_config(config)
        return [
            ConfigField("hidden_size", config.get("hidden_size"), a.dim, "dim"),
            ConfigField("num_hidden_layers", config.get("num_hidden_layers"), a.n_layers, "n_layers"),
            ConfigField(
                "first_k_dense_replace", config.get("first_k_dense_replace"), a.n_dense_layers, "n_dense_layers"
            ),
            ConfigField("intermediate_size", config.get("intermediate_size"), a.inter_dim, "inter_dim"),
            ConfigField("moe_intermediate_size", config.get("moe_intermediate_size"), a.moe_inter_dim, "moe_inter_dim"),
            ConfigField("num_attention_heads", heads, a.n_heads, "n_heads"),
            ConfigField("num_key_value_heads", heads if kv_heads is None else kv_heads, a.n_heads, "MLA: = n_heads"),
            ConfigField("n_routed_experts", config.get("n_routed_experts"), a.n_routed_experts, "n_routed_experts"),
            ConfigField("n_shared_experts", config.get("n_shared_experts"), a.n_shared_experts, "n_shared_experts"),
            ConfigField(
                "num_experts_per_tok", config.get("num_experts_per_tok"), a.n_activated_experts, "n_activated_experts"
            ),
            ConfigField("q_lora_rank", config.get("q_lora_rank") or 0, a.q_lora_rank, "q_lora_rank; null = 0"),
            ConfigField("kv_lora_rank", config.get("kv_lora_rank"), a.kv_lora_rank, "kv_lora_rank"),
            ConfigField("qk_nope_head_dim", config.get("qk_nope_head_dim"), a.qk_nope_head_dim, "qk_nope_head_dim"),
            ConfigField("qk_rope_head_dim", config.get("qk_rope_head_dim"), a.qk_rope_head_dim, "qk_rope_head_dim"),
            ConfigField("v_head_dim", config.get("v_head_dim"), a.v_head_dim, "v_head_dim"),
            ConfigField("vocab_size", config.get("vocab_size"), a.vocab_size, "vocab_size"),
            ConfigField(
                "routed_scaling_factor", config.get("routed_scaling_factor"), a.route_scale, "route_scale", shape=False
            ),
            ConfigField("rms_norm_eps", config.get("rms_norm_eps"), a.norm_eps, "norm_eps", shape=False),
            ConfigField("rope_theta", theta, a.rope_theta, "rope_theta", shape=False),
        ]

    def _config_problems(self, config: Mapping[str, Any]) -> list[tuple[str, Any, Any, str]]:
        a = self.args
        out: list[tuple[str, Any, Any, str]] = []
        if a.norm_eps != _HF_LATENT_NORM_EPS:
            out.append(
                ("rms_norm_eps", config.get("rms_norm_eps"), a.norm_eps, "transformers' MLA latent norms use 1e-6")
            )
        # routing
        groups, kept = config.get("n_group"), config.get("topk_group")
        if self.v2:
            method = config.get("topk_method", "greedy")
            if config.get("scoring_func", "softmax") != "softmax":
                out.append(("scoring_func", config.get("scoring_func"), "softmax", "score_func"))
            if method == "greedy":
                if a.n_limited_groups < a.n_expert_groups:
                    out.append(("topk_method", method, "group_limited_greedy", "n_limited_groups < n_expert_groups"))
            elif method == "group_limited_greedy":
                if not same_value(groups, a.n_expert_groups):
                    out.append(("n_group", groups, a.n_expert_groups, "n_expert_groups"))
                if not same_value(kept, a.n_limited_groups):
                    out.append(("topk_group", kept, a.n_limited_groups, "n_limited_groups"))
            else:
                out.append(("topk_method", method, "greedy", "transformers' DeepseekV2 routes greedy or grouped"))
            if config.get("moe_layer_freq", 1) != 1:
                out.append(
                    ("moe_layer_freq", config.get("moe_layer_freq"), 1, "every layer after the dense ones is MoE")
                )
        else:
            if config.get("scoring_func", "sigmoid") != "sigmoid":
                out.append(("scoring_func", config.get("scoring_func"), "sigmoid", "score_func"))
            if not same_value(groups, a.n_expert_groups):
                out.append(("n_group", groups, a.n_expert_groups, "n_expert_groups"))
            if not same_value(kept, a.n_limited_groups):
                out.append(("topk_group", kept, a.n_limited_groups, "n_limited_groups"))
            if not same_value(bool(config.get("norm_topk_prob", True)), a.route_norm):
                out.append(("norm_topk_prob", config.get("norm_topk_prob"), a.route_norm, "route_norm"))
            if config.get("rope_interleave", True) is not True:
                out.append(
                    ("rope_interleave", config.get("rope_interleave"), True, "our MLA rotates interleaved pairs")
                )
        # rope
        _, scaling = rope_config(config)
        ours = self._rope_scaling()
        if scaling is None or ours is None:
            if scaling is not None:
                out.append(
                    (
                        "rope_scaling",
                        scaling.get("rope_type"),
                        None,
                        f"our YaRN is on only when max_seq_len ({a.max_seq_len}) > original_seq_len "
                        f"({a.original_seq_len}); raise max_seq_len",
                    )
                )
            elif ours is not None:
                out.append(("rope_scaling", None, "yarn", "max_seq_len > original_seq_len turns YaRN on here"))
        elif scaling.get("rope_type") != "yarn":
            out.append(("rope_scaling.rope_type", scaling.get("rope_type"), "yarn", "only YaRN is supported"))
        else:
            orig = scaling.get("original_max_position_embeddings")
            factor = scaling.get("factor")
            if factor is None and orig:
                factor = config.get("max_position_embeddings", 0) / orig
            mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
            for field, theirs, mine in (
                ("factor", factor, a.rope_factor),
                ("original_max_position_embeddings", orig, a.original_seq_len),
                ("beta_fast", scaling.get("beta_fast") or 32, a.beta_fast),
                ("beta_slow", scaling.get("beta_slow") or 1, a.beta_slow),
                ("mscale_all_dim", mscale_all or 0, a.mscale),
            ):
                if not same_value(theirs, mine):
                    out.append((f"rope_scaling.{field}", theirs, mine, "YaRN"))
            attention_factor = scaling.get("attention_factor")
            if attention_factor is None and factor is not None:
                if mscale and mscale_all:
                    attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
                else:
                    attention_factor = _yarn_mscale(factor, 1.0)
            if attention_factor is not None and not math.isclose(attention_factor, 1.0, rel_tol=1e-9):
                out.append(("rope_scaling.attention_factor", attention_factor, 1.0, "mscale must equal mscale_all_dim"))
            if scaling.get("truncate", True) is not True:
                out.append(("rope_scaling.truncate", scaling.get("truncate"), True, "YaRN"))
        if config.get("tie_word_embeddings", False):
            out.append(("tie_word_embeddings", True, False, "not supported by our DeepSeek-V3"))
        for field, ours in (("head_dim", a.qk_rope_head_dim), ("qk_head_dim", a.qk_head_dim)):
            if field in config and not same_value(config[field], ours):
                out.append((field, config[field], ours, "transformers derives it from qk_rope/qk_nope_head_dim"))
        nextn = config.get("num_nextn_predict_layers") or 0
        if a.mtp_layers > nextn:
            out.append(
                (
                    "num_nextn_predict_layers",
                    nextn,
                    a.mtp_layers,
                    "mtp_layers: the checkpoint has fewer MTP layers than asked for",
                )
            )
        return out

    @classmethod
    def _derive_args(cls, config: Mapping[str, Any]) -> DeepSeekV3Args:
        v2 = "DeepseekV2ForCausalLM" in (config.get("architectures") or []) or config.get("model_type") == "deepseek_v2"
        theta, scaling = rope_config(config)
        grouped = config.get("topk_method") == "group_limited_greedy"
        groups = int(config.get("n_group") or 1) if (grouped or not v2) else 1
        kept = int(config.get("topk_group") or 1) if (grouped or not v2) else 1
        experts = config.get("n_routed_experts", config.get("num_local_experts"))
        if experts is None:
            raise ValueError("it has no 'n_routed_experts', which sets the model's shape")
        base = DeepSeekV3Args()
        rope: dict[str, Any] = {}
        if scaling is not None and scaling.get("rope_type") == "yarn":
            orig = need(scaling, "original_max_position_embeddings")
            rope = dict(
                rope_factor=float(need(scaling, "factor")),
                original_seq_len=int(orig),
                beta_fast=float(scaling.get("beta_fast") or 32),
                beta_slow=float(scaling.get("beta_slow") or 1),
                mscale=float(scaling.get("mscale_all_dim") or scaling.get("mscale") or 1.0),
                # YaRN is on only while max_seq_len > original_seq_len (the DeepSeek reference)
                max_seq_len=max(base.max_seq_len, int(orig) * 2),
            )
        elif scaling is None:
            # no YaRN: the context the checkpoint was made for; training longer turns YaRN on,
            # which the config check then refuses
            context = int(config.get("max_position_embeddings") or base.original_seq_len)
            rope = dict(original_seq_len=context, max_seq_len=min(base.max_seq_len, context))
        return DeepSeekV3Args(
            vocab_size=need(config, "vocab_size"),
            dim=need(config, "hidden_size"),
            inter_dim=need(config, "intermediate_size"),
            moe_inter_dim=need(config, "moe_intermediate_size"),
            n_layers=need(config, "num_hidden_layers"),
            n_dense_layers=int(config.get("first_k_dense_replace") or 0),
            n_heads=need(config, "num_attention_heads"),
            n_routed_experts=experts,
            n_shared_experts=int(config.get("n_shared_experts") or 0),
            n_activated_experts=need(config, "num_experts_per_tok"),
            n_expert_groups=groups,
            n_limited_groups=kept,
            score_func="softmax" if v2 else config.get("scoring_func", "sigmoid"),
            route_norm=False if v2 else bool(config.get("norm_topk_prob", True)),
            route_scale=float(config.get("routed_scaling_factor", 1.0)),
            q_lora_rank=int(config.get("q_lora_rank") or 0),
            kv_lora_rank=need(config, "kv_lora_rank"),
            qk_nope_head_dim=need(config, "qk_nope_head_dim"),
            qk_rope_head_dim=need(config, "qk_rope_head_dim"),
            v_head_dim=need(config, "v_head_dim"),
            rope_theta=float(10000.0 if theta is None else theta),
            norm_eps=float(need(config, "rms_norm_eps")),
            **rope,
        )
