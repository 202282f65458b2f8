"""Layout rules that need the model or the batch (heads vs tp, experts vs ep, sequence length vs
cp and tp, layers vs pipeline stages, global batch vs the batch degree). Pure functions of the
validated degrees: each raises a ValueError that names the rule and a value that fits.

The facts the rules read travel as ONE object, :class:`ModelRules`; a model's come straight from
the registry (``models.registry.model_rules(args, seq_len, sequence_parallel)``), the batch's
from the caller that resolved the batch. Fields left None are not checked.
"""

from __future__ import annotations

from dataclasses import dataclass

from .layout import Degrees

__all__ = ["ModelRules", "check_model_layout"]


@dataclass(frozen=True)
class ModelRules:
    """What the layout rules need to know about a model and a job (None: not checked)."""

    n_heads: int | None = None  # attention heads (tp splits them)
    n_kv_heads: int | None = None  # key/value heads tp must divide (GQA); None for MHA/MLA
    n_experts: int | None = None  # routed experts per MoE layer; 0 for a dense model
    n_layers: int | None = None  # transformer blocks (every pipeline stage needs one)
    seq_len: int | None = None  # training sequence length (split over cp and, under SP, tp)
    sequence_parallel: bool = True
    pp_stages: int | None = None  # pipeline stages (default: pp)
    global_batch_size: int | None = None
    local_batch_size: int | None = None
    vocab_size: int | None = None  # checked against tp when the embeddings are tied
    tied_embeddings: bool = False  # the output head reuses the embedding's weight


def _divisors_of(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def check_model_layout(d: Degrees, rules: ModelRules) -> None:
    """Raise a ValueError for the first rule ``rules`` breaks on the degrees ``d``."""
    r = rules
    if r.n_heads is not None and r.n_heads % d.tp:
        raise ValueError(
            f"tp={d.tp} does not divide n_heads={r.n_heads}: tensor parallelism splits attention "
            f"heads; legal tp values for this model: {_divisors_of(r.n_heads)}"
        )
    if r.n_kv_heads is not None and r.n_kv_heads % d.tp:
        raise ValueError(
            f"tp={d.tp} does not divide n_kv_heads={r.n_kv_heads}: each tp rank needs whole "
            f"key/value heads (GQA); legal tp values: {_divisors_of(r.n_kv_heads)}"
        )
    if r.n_experts and r.n_experts % d.ep:
        raise ValueError(
            f"ep={d.ep} does not divide n_routed_experts={r.n_experts}: each ep rank owns an "
            f"equal share of the experts; legal ep values: {_divisors_of(r.n_experts)}"
        )
    sp_factor = d.tp if r.sequence_parallel else 1
    divisor = sp_factor * (2 * d.cp if d.cp > 1 else 1)
    if r.seq_len is not None and r.seq_len % divisor:
        parts = []
        if d.cp > 1:
            parts.append("2*cp (load-balanced context-parallel chunks)")
        if sp_factor > 1:
            parts.append("tp (sequence parallel splits the sequence across tp ranks)")
        formula = "2*cp*tp" if d.cp > 1 and sp_factor > 1 else ("2*cp" if d.cp > 1 else "tp")
        raise ValueError(
            f"seq_len={r.seq_len} is not divisible by {divisor} = {formula}: "
            f"{' times '.join(parts)}; use a multiple of {divisor}"
        )
    if r.tied_embeddings and r.vocab_size is not None and r.vocab_size % d.tp:
        raise ValueError(
            f"tp={d.tp} does not divide vocab_size={r.vocab_size} of a model with tied embeddings (the embedding "
            f"and the head share one vocabulary-sharded tensor); set model.vocab_size to a multiple of {d.tp} "
            f"(e.g. {-(-r.vocab_size // d.tp) * d.tp}) or use tp=1"
        )
    stages = r.pp_stages if r.pp_stages is not None else d.pp
    if r.n_layers is not None and r.n_layers < stages:
        raise ValueError(
            f"n_layers={r.n_layers} is fewer than the {stages} pipeline stages (pp={d.pp}); every "
            f"stage needs at least one layer: use pp <= {r.n_layers}"
        )
    if r.n_experts == 0 and (d.ep > 1 or d.etp > 1):
        raise ValueError(
            f"ep={d.ep}, etp={d.etp} but this model has no experts: expert "
            f"parallelism applies to MoE models only; use ep=1 and etp=1"
        )
    if d.tp > 1 and r.n_experts and not r.sequence_parallel:
        raise ValueError(
            f"tp={d.tp} with a MoE model needs sequence parallel (each tp rank "
            f"routes its own tokens); set parallelism.enable_sequence_parallel = true"
        )
    if r.global_batch_size is not None:
        batch = d.dp_replicate * d.dp_shard
        if r.global_batch_size % batch:
            raise ValueError(
                f"global_batch_size={r.global_batch_size} is not divisible by the batch degree "
                f"dp_replicate*dp_shard = {batch}; use a multiple of {batch}"
            )
        if r.local_batch_size is not None and (r.global_batch_size // batch) % r.local_batch_size:
            per_rank = r.global_batch_size // batch
            raise ValueError(
                f"local_batch_size={r.local_batch_size} does not divide the {per_rank} samples each "
                f"batch rank gets (global_batch_size={r.global_batch_size} / batch degree {batch}); "
                f"legal local_batch_size values: {_divisors_of(per_rank)}"
            )
