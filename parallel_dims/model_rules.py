"""Layout rules that need the model or the batch (heads vs tp, experts vs ep, sequence length vs
cp and tp, layers vs pipeline stages, global batch vs the batch degree). Pure functions of the
validated degrees: each raises a ValueError that names the rule and a value that fits."""

from __future__ import annotations

from .layout import Degrees

__all__ = ["check_model_layout"]


def _divisors_of(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def check_model_layout(
    d: Degrees,
    *,
    n_heads: int | None = None,
    n_kv_heads: int | None = None,
    n_experts: int | None = None,
    seq_len: int | None = None,
    n_layers: int | None = None,
    pp_stages: int | None = None,
    global_batch_size: int | None = None,
    local_batch_size: int | None = None,
    sequence_parallel: bool = True,
) -> None:
    """Rules that need the model or the batch: see :meth:`ParallelDims.check_model`."""
    if n_heads is not None and n_heads % d.tp:
        raise ValueError(
            f"tp={d.tp} does not divide n_heads={n_heads}: tensor parallelism splits attention "
            f"heads; legal tp values for this model: {_divisors_of(n_heads)}"
        )
    if n_kv_heads is not None and n_kv_heads % d.tp:
        raise ValueError(
            f"tp={d.tp} does not divide n_kv_heads={n_kv_heads}: each tp rank needs whole "
            f"key/value heads (GQA); legal tp values: {_divisors_of(n_kv_heads)}"
        )
    if n_experts is not None and n_experts % d.ep:
        raise ValueError(
            f"ep={d.ep} does not divide n_routed_experts={n_experts}: each ep rank owns an "
            f"equal share of the experts; legal ep values: {_divisors_of(n_experts)}"
        )
    sp_factor = d.tp if sequence_parallel else 1
    divisor = sp_factor * (2 * d.cp if d.cp > 1 else 1)
    if seq_len is not None and seq_len % divisor:
        parts = []
        if d.cp > 1:
            parts.append("2*cp (load-balanced context-parallel chunks)")
        if sp_factor > 1:
            parts.append("tp (sequence parallel splits the sequence across tp ranks)")
        formula = "2*cp*tp" if d.cp > 1 and sp_factor > 1 else ("2*cp" if d.cp > 1 else "tp")
        raise ValueError(
            f"seq_len={seq_len} is not divisible by {divisor} = {formula}: "
            f"{' times '.join(parts)}; use a multiple of {divisor}"
        )
    stages = pp_stages if pp_stages is not None else d.pp
    if n_layers is not None and n_layers < stages:
        raise ValueError(
            f"n_layers={n_layers} is fewer than the {stages} pipeline stages (pp={d.pp}); every "
            f"stage needs at least one layer: use pp <= {n_layers}"
        )
    if global_batch_size is not None:
        batch = d.dp_replicate * d.dp_shard
        if global_batch_size % batch:
            raise ValueError(
                f"global_batch_size={global_batch_size} is not divisible by the batch degree "
                f"dp_replicate*dp_shard = {batch}; use a multiple of {batch}"
            )
        if local_batch_size is not None and (global_batch_size // batch) % local_batch_size:
            per_rank = global_batch_size // batch
            raise ValueError(
                f"local_batch_size={local_batch_size} does not divide the {per_rank} samples each "
                f"batch rank gets (global_batch_size={global_batch_size} / batch degree {batch}); "
                f"legal local_batch_size values: {_divisors_of(per_rank)}"
            )
