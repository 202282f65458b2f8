"""Float8 training (``model.converters = ["float8"]`` for the linear layers, ``"float8_experts"``
for the MoE routed experts; ``models/parallel/float8.py``) in the planner: which weights run
their GEMMs in float8, how much of the backward does, and which all-gathered bytes shrink.

* Which linears convert (``Float8Options.linears``): the converter's own rule,
  ``float8_decisions`` on the meta model of the planned shapes (the output projection, MoE
  routers, ``float8.filter_fqns`` and any linear with a dimension not a multiple of 16 stay in
  the parameter dtype). :func:`converted_weights` lists their weights' FQNs; none when only the
  experts convert.
* Which routed experts convert (``Float8Options.moe_fqns`` non-empty): the converter's own rule,
  ``float8_expert_decisions`` on the meta model at the layout's etp degree (a module whose FQN
  contains one of ``moe_fqns``, with ``dim`` and the hidden size per etp rank multiples of 16).
  :func:`converted_expert_weights` lists their ``w1``/``w2``/``w3`` FQNs;
  :func:`float8_experts_refusal` is the trainer's refusal (``trainer.plan.plan_job``: no routed
  expert converts), which the search applies per etp degree.
* The GEMMs: a converted linear's forward, input-gradient and weight-gradient GEMMs run as
  ``torch._scaled_mm`` (priced at the part's float8 peak, ``Hardware.peak_flops_fp8``), except
  the weight gradient under ``rowwise_with_gw_hp`` (high precision by that recipe's definition):
  :func:`backward_float8_fraction`. A converted routed expert runs all three GEMMs of each of
  its weights (``x w1^T``, ``x w3^T``, ``h w2^T``) in float8 in forward, input gradient and
  weight gradient, whatever the linears' recipe (one rowwise recipe, no high-precision weight
  gradient). Attention, the output projection, the router and unconverted experts stay at the
  parameter dtype's rate; full AC's recomputed forward of a converted linear or expert is
  float8.
* FSDP float8 all-gather (tensorwise with ``enable_fsdp_float8_all_gather``, applied where the
  dense FSDP mesh really shards): FSDP2 gathers the converted linears' weights as float8, 1 byte
  per element, the rest of the group in the parameter dtype, in the same one all-gather per
  group (:func:`float8_gathered_numel`). Routed experts' weights are gathered in the parameter
  dtype even when they convert (plain tensors: the cast happens inside the GEMM). Not modelled:
  the 4-byte amax all-reduce per converted weight (or, with precomputed scales, one per step)
  and the smaller gathered copies in memory (the memory estimate keeps them in the parameter
  dtype: an upper bound).
"""

from __future__ import annotations

from functools import lru_cache

__all__ = [
    "backward_float8_fraction",
    "converted_expert_weights",
    "converted_weights",
    "float8_all_gather",
    "float8_experts_refusal",
    "float8_gathered_numel",
    "float8_keys",
]


def _meta_model(model: str, flavor: str, key: tuple):
    import dataclasses

    import torch

    from models.registry import get_model_spec

    spec = get_model_spec(model, flavor)
    args = dataclasses.replace(spec.args, **dict(key))
    with torch.device("meta"):
        return spec.model_cls(args)


@lru_cache(maxsize=64)
def converted_weights(model: str, flavor: str, key: tuple, filter_fqns: tuple[str, ...]) -> frozenset[str]:
    """Weight FQNs (``layers.0.attention.wq.weight``) of the linears the float8 converter swaps,
    for the flavor with the overrides ``key`` (the inventory's), by ``float8_decisions`` on a meta
    build of the model."""
    from models.parallel.float8 import Float8Options, float8_decisions

    decisions = float8_decisions(_meta_model(model, flavor, key), Float8Options(filter_fqns=tuple(filter_fqns)))
    return frozenset(f"{fqn}.weight" for fqn, why in decisions.items() if why is None)


@lru_cache(maxsize=64)
def _expert_decisions(model: str, flavor: str, key: tuple, moe_fqns: tuple[str, ...], etp: int) -> tuple:
    from models.parallel.float8 import Float8Options, float8_expert_decisions

    opts = Float8Options(linears=False, moe_fqns=tuple(moe_fqns))
    return tuple(float8_expert_decisions(_meta_model(model, flavor, key), opts, etp).items())


def converted_expert_weights(
    model: str, flavor: str, key: tuple, moe_fqns: tuple[str, ...], etp: int
) -> frozenset[str]:
    """Weight FQNs (``layers.1.moe.experts.w1``) of the routed experts whose grouped GEMMs the
    ``float8_experts`` converter runs in float8 at expert-TP degree ``etp``, by
    ``float8_expert_decisions`` on a meta build of the model (cached)."""
    return frozenset(
        f"{fqn}.{w}" for fqn, why in _expert_decisions(model, flavor, key, moe_fqns, etp) if why is None
        for w in ("w1", "w2", "w3")
    )  # fmt: skip


def float8_experts_refusal(model: str, flavor: str, key: tuple, moe_fqns: tuple[str, ...], etp: int) -> str | None:
    """Why the trainer refuses float8 routed experts at expert-TP degree ``etp`` (the model has
    none, or none converts: ``check_float8_experts``'s rule), None when some convert."""
    decisions = _expert_decisions(model, flavor, key, moe_fqns, etp)
    if not decisions:
        return f"the {model} model has no routed experts"
    if all(why is not None for _, why in decisions):
        fqn, why = decisions[0]
        return f"no routed-expert module converts at etp {etp} ({fqn}: {why})"
    return None


def float8_keys(opts) -> tuple[tuple[str, ...] | None, tuple[str, ...] | None]:
    """(the linears' ``filter_fqns``, None when no linear converts; the experts' ``moe_fqns``,
    None when no expert converts) of ``opts`` (a ``Float8Options`` or None): the hashable keys
    of the weight sums."""
    if opts is None:
        return None, None
    return (tuple(opts.filter_fqns) if opts.linears else None), (tuple(opts.moe_fqns) or None)


def backward_float8_fraction(opts) -> float:
    """Share of a converted linear's backward GEMM FLOPs (input + weight gradient, equal halves)
    that run in float8: all of them, or the input gradient's half under ``rowwise_with_gw_hp``.
    (A converted routed expert's backward is float8 whatever the recipe.)"""
    return 0.5 if opts.recipe == "rowwise_with_gw_hp" else 1.0


def float8_all_gather(opts) -> bool:
    """FSDP all-gathers the converted linears' weights in float8 (where the dense mesh shards);
    never the routed experts'."""
    return opts is not None and opts.linears and opts.recipe == "tensorwise" and opts.fsdp_float8_all_gather


@lru_cache(maxsize=65536)
def float8_gathered_numel(model, flavor, key: tuple, degrees, rank, mixed, layers, embed, head, filter_fqns) -> dict:
    """Per dense FSDP group of one rank's stage: the padded unsharded element count of its
    converted linears' weights (what the float8 all-gather carries at 1 byte per element; routed
    experts' weights are not among them, converted or not)."""
    from .inventory import _inventory, cached_layout, rank_shards

    params, _ = _inventory(model, flavor, key)
    names = converted_weights(model, flavor, key, filter_fqns)
    out: dict = {}
    for s in rank_shards(params, degrees, cached_layout(degrees), rank, mixed, layers, embed, head):
        if s.info.fqn in names and not s.info.expert and s.fsdp_mesh == "fsdp":
            out[s.fsdp_group] = out.get(s.fsdp_group, 0) + s.padded_unsharded_numel
    return out
