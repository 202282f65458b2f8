"""The Hugging Face layout of the decoder parts every model shares, for the model adapters
(``models/<name>/hf_adapter.py``): each function yields the :mod:`~models.common.hf_adapter`
entries of one shared part, in the order the adapters list them, so an adapter writes only
what is its own (MLA, rope permutation, expert bias, MTP copies) between these.

* :func:`embedding_entries` and :func:`final_entries`: ``tok_embeddings`` and, at the end,
  ``norm`` and the output head (``lm_head``, or :class:`Tied` to the embedding with
  ``tie_word_embeddings``);
* :func:`block_entries`: one decoder block (``models/common/decoder.DecoderBlock``): the two
  norms around the attention's and the FFN's entries;
* :func:`gqa_entries`: the shared grouped-query attention (``models/common/gqa.py``), its
  ``wq``/``wk`` rows permuted (:class:`RopeRows`) when our rotary layout is interleaved and
  the checkpoint's half-split, plus the q/k norms when there are;
* :func:`swiglu_entries`: a ``FeedForward`` (``w1``/``w2``/``w3`` <-> ``gate_proj``/
  ``down_proj``/``up_proj``), dense or shared expert;
* :func:`routed_expert_entries`: the shared MoE's router and stacked experts
  (``models/common/moe.py``; one checkpoint tensor per expert);
* :func:`hf_config_frame` and :func:`tie_problem`: the ``config.json`` fields every export
  writes first and last, and the tied-head check of a config.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from models.common.hf_adapter import Entry, HFStateDictAdapter, Plain, RopeRows, Stacked, Tied, same_value

__all__ = [
    "block_entries",
    "embedding_entries",
    "final_entries",
    "gqa_entries",
    "hf_config_frame",
    "routed_expert_entries",
    "swiglu_entries",
    "tie_problem",
]


def embedding_entries(vocab_size: int, dim: int) -> Iterable[Entry]:
    yield Plain("tok_embeddings.weight", "model.embed_tokens.weight", (vocab_size, dim))


def final_entries(vocab_size: int, dim: int, tie_word_embeddings: bool) -> Iterable[Entry]:
    """The final norm and the output head (tied to the embedding or its own ``lm_head``)."""
    yield Plain("norm.weight", "model.norm.weight", (dim,))
    if tie_word_embeddings:
        yield Tied("output.weight", "tok_embeddings.weight", "lm_head.weight", (vocab_size, dim))
    else:
        yield Plain("output.weight", "lm_head.weight", (vocab_size, dim))


def block_entries(o: str, h: str, dim: int, attention: Iterable[Entry], ffn: Iterable[Entry]) -> Iterable[Entry]:
    """Our block ``o`` (``"layers.{i}."``) and checkpoint layer ``h`` (``"model.layers.{i}."``):
    ``attention_norm``, the attention's entries, ``ffn_norm``, the FFN's entries."""
    yield Plain(o + "attention_norm.weight", h + "input_layernorm.weight", (dim,))
    yield from attention
    yield Plain(o + "ffn_norm.weight", h + "post_attention_layernorm.weight", (dim,))
    yield from ffn


def gqa_entries(
    o: str, h: str, dim: int, n_heads: int, kv_heads: int, head_dim: int, *, rope_rows: bool, qk_norm: bool
) -> Iterable[Entry]:
    """The shared GQA of block ``o`` <-> ``h + "self_attn."``. ``rope_rows``: our interleaved
    rotary rows of ``wq``/``wk`` are the checkpoint's half-split ones permuted per head;
    otherwise (``rope_layout="half_split"``) every tensor maps as it is."""
    a, s = o + "attention.", h + "self_attn."
    q, k = (n_heads * head_dim, dim), (kv_heads * head_dim, dim)
    if rope_rows:
        yield RopeRows(a + "wq.weight", s + "q_proj.weight", q, n_heads)
        yield RopeRows(a + "wk.weight", s + "k_proj.weight", k, kv_heads)
    else:
        yield Plain(a + "wq.weight", s + "q_proj.weight", q)
        yield Plain(a + "wk.weight", s + "k_proj.weight", k)
    yield Plain(a + "wv.weight", s + "v_proj.weight", k)
    yield Plain(a + "wo.weight", s + "o_proj.weight", (dim, n_heads * head_dim))
    if qk_norm:
        yield Plain(a + "q_norm.weight", s + "q_norm.weight", (head_dim,))
        yield Plain(a + "k_norm.weight", s + "k_norm.weight", (head_dim,))


def swiglu_entries(ours: str, hf: str, dim: int, hidden: int) -> Iterable[Entry]:
    """A ``FeedForward`` at ``ours`` (e.g. ``"layers.0.feed_forward."``) <-> the checkpoint's
    SwiGLU MLP at ``hf`` (e.g. ``"model.layers.0.mlp."``)."""
    yield Plain(ours + "w1.weight", hf + "gate_proj.weight", (hidden, dim))
    yield Plain(ours + "w2.weight", hf + "down_proj.weight", (dim, hidden))
    yield Plain(ours + "w3.weight", hf + "up_proj.weight", (hidden, dim))


def routed_expert_entries(o: str, h: str, dim: int, experts: int, hidden: int) -> Iterable[Entry]:
    """The shared MoE's router gate and stacked experts of block ``o`` <-> ``h + "mlp."``
    (one ``experts.{j}`` MLP per expert on disk, same orientation: no transposition). The
    expert bias, which checkpoints hold or not, is the adapter's own entry."""
    yield Plain(o + "moe.router.gate.weight", h + "mlp.gate.weight", (experts, dim))
    for ours, theirs, shape in (
        ("w1", "gate_proj", (experts, hidden, dim)),
        ("w2", "down_proj", (experts, dim, hidden)),
        ("w3", "up_proj", (experts, hidden, dim)),
    ):
        yield Stacked(
            o + f"moe.experts.{ours}", tuple(h + f"mlp.experts.{j}.{theirs}.weight" for j in range(experts)), shape
        )


def hf_config_frame(adapter: HFStateDictAdapter, fields: Mapping[str, Any], dtype: str) -> dict[str, Any]:
    """``config.json`` as ``adapter`` exports it: the architecture and model type first, the
    model's ``fields`` in its order, then the tied head, ``use_cache`` and the dtype."""
    return {
        "architectures": [adapter.hf_architecture],
        "model_type": adapter.model_type,
        **fields,
        "tie_word_embeddings": adapter.args.tie_word_embeddings,
        "use_cache": True,
        "torch_dtype": dtype,
    }


def tie_problem(config: Mapping[str, Any], tie_word_embeddings: bool) -> list[tuple[str, Any, Any, str]]:
    """A config whose ``tie_word_embeddings`` differs from ours (a model that can tie)."""
    tied = config.get("tie_word_embeddings", False)
    if same_value(tied, tie_word_embeddings):
        return []
    return [("tie_word_embeddings", tied, tie_word_embeddings, "tie_word_embeddings")]
