"""Float8 training (``model.converters = ["float8"]``, ``models/parallel/float8.py``) in the
planner: which weights run their GEMMs in float8, how much of the backward does, and which
all-gathered bytes shrink.

* Which linears convert: the converter's own rule, ``float8_decisions`` on the meta model of the
  planned shapes (the output projection, MoE routers, ``float8.filter_fqns`` and any linear with
  a dimension not a multiple of 16 stay in the parameter dtype; routed experts are grouped GEMMs,
  not linears, and stay too). :func:`converted_weights` lists their weights' FQNs.
* The GEMMs: a converted linear's forward, input-gradient and weight-gradient GEMMs run as
  ``torch._scaled_mm`` (priced at the part's float8 peak, ``Hardware.peak_flops_fp8``), except
  the weight gradient under ``rowwise_with_gw_hp`` (high precision by that recipe's definition):
  :func:`backward_float8_fraction`. Attention, the output projection, the router and the experts
  stay at the parameter dtype's rate; full AC's recomputed forward of a converted linear is float8.
* FSDP float8 all-gather (tensorwise with ``enable_fsdp_float8_all_gather``, applied where the
  dense FSDP mesh really shards): FSDP2 gathers the converted weights as float8, 1 byte per
  element, the rest of the group in the parameter dtype, in the same one all-gather per group
  (:func:`float8_gathered_numel`). Not modelled: the 4-byte amax all-reduce per converted weight
  (or, with precomputed scales, one per step) and the smaller gathered copies in memory (the
  memory estimate keeps them in the parameter dtype: an upper bound).
"""

from __future__ import annotations

from functools import lru_cache

__all__ = ["backward_float8_fraction", "converted_weights", "float8_all_gather", "float8_gathered_numel"]


@lru_cache(maxsize=64)
def converted_weights(model: str, flavor: str, key: tuple, filter_fqns: tuple[str, ...]) -> frozenset[str]:
    """Weight FQNs (``layers.0.attention.wq.weight``) of the linears the float8 converter swaps,
    for the flavor with the overrides ``key`` (the inventory's), by ``float8_decisions`` on a meta
    build of the model."""
    import dataclasses

    import torch

    from models.parallel.float8 import Float8Options, float8_decisions
    from models.registry import get_model_spec

    spec = get_model_spec(model, flavor)
    args = dataclasses.replace(spec.args, **dict(key))
    with torch.device("meta"):
        m = spec.model_cls(args)
    decisions = float8_decisions(m, Float8Options(filter_fqns=tuple(filter_fqns)))
    return frozenset(f"{fqn}.weight" for fqn, why in decisions.items() if why is None)


def backward_float8_fraction(opts) -> float:
    """Share of a converted linear's backward GEMM FLOPs (input + weight gradient, equal halves)
    that run in float8: all of them, or the input gradient's half under ``rowwise_with_gw_hp``."""
    return 0.5 if opts.recipe == "rowwise_with_gw_hp" else 1.0


def float8_all_gather(opts) -> bool:
    """FSDP all-gathers the converted weights in float8 (where the dense mesh shards)."""
    return opts is not None and opts.recipe == "tensorwise" and opts.fsdp_float8_all_gather


@lru_cache(maxsize=65536)
def float8_gathered_numel(model, flavor, key: tuple, degrees, rank, mixed, layers, embed, head, filter_fqns) -> dict:
    """Per dense FSDP group of one rank's stage: the padded unsharded element count of its
    converted weights (what the float8 all-gather carries at 1 byte per element)."""
    from .inventory import _inventory, cached_layout, rank_shards

    params, _ = _inventory(model, flavor, key)
    names = converted_weights(model, flavor, key, filter_fqns)
    out: dict = {}
    for s in rank_shards(params, degrees, cached_layout(degrees), rank, mixed, layers, embed, head):
        if s.info.fqn in names and s.fsdp_mesh == "fsdp":
            out[s.fsdp_group] = out.get(s.fsdp_group, 0) + s.padded_unsharded_numel
    return out
