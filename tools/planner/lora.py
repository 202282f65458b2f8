"""LoRA in the planner (``model.converters = ["lora"]``, models/parallel/lora.py): the adapters as
parameters of their own, sharded the way the converter and the appliers shard them, so that a
LoRA job's trainable parameters, gradients and optimizer state are the adapters' only.

Each adapted linear ``[out, in]`` gets ``A`` ``[r, in]`` and ``B`` ``[out, r]`` in its FSDP group:
under TP a column-wise base (``tp_dim`` 0) splits ``B`` along its rows and replicates ``A``, a
row-wise base (``tp_dim`` 1) splits ``A`` along its columns and replicates ``B``; FSDP shards
each along dim 0 like any parameter. Expert adapters (``lora.experts``) are ``[E, r, in]`` and
``[E, out, r]`` split along the expert dimension by ep. Which linears are adapted is the
converter's own rule (:func:`models.parallel.lora.lora_decisions` on a meta build).
"""

from __future__ import annotations

from functools import lru_cache

from .inventory import ParamInfo

__all__ = ["adapter_group_summary", "adapter_infos"]


@lru_cache(maxsize=16)
def _adapted(model: str, flavor: str, overrides: tuple, targets: tuple, experts: bool) -> tuple[frozenset, frozenset]:
    import dataclasses

    import torch

    from models.parallel.lora import LoRAOptions, lora_decisions
    from models.parallel.lora_experts import expert_modules
    from models.registry import get_model_spec

    spec = get_model_spec(model, flavor)
    args = dataclasses.replace(spec.args, **dict(overrides))
    with torch.device("meta"):
        m = spec.model_cls(args)
    linears = frozenset(f for f, why in lora_decisions(m, LoRAOptions(target_modules=targets)).items() if why is None)
    return linears, frozenset(f for f, _ in expert_modules(m)) if experts else frozenset()


def adapter_infos(params: tuple[ParamInfo, ...], model: str, flavor: str, overrides: tuple, opts) -> list[ParamInfo]:
    """The adapters of ``opts`` (a :class:`~models.parallel.lora.LoRAOptions`) on the model whose
    base parameters are ``params``, as :class:`ParamInfo` entries."""
    linears, experts = _adapted(model, flavor, overrides, tuple(opts.target_modules), bool(opts.experts))
    r = opts.rank
    out: list[ParamInfo] = []
    for p in params:
        owner, leaf = p.fqn.rsplit(".", 1)
        if leaf == "weight" and owner in linears:
            rows, cols = p.shape
            a_tp = 1 if p.tp_dim == 1 else None
            b_tp = 0 if p.tp_dim == 0 else None
            out.append(ParamInfo(f"{owner}.lora_a", (r, cols), p.layer, p.group, a_tp, False, p.moe_layer))
            out.append(ParamInfo(f"{owner}.lora_b", (rows, r), p.layer, p.group, b_tp, False, p.moe_layer))
        elif p.expert and owner in experts:
            e, rows, cols = p.shape
            out.append(ParamInfo(f"{p.fqn}_lora_a", (e, r, cols), p.layer, p.group, None, True, True))
            out.append(ParamInfo(f"{p.fqn}_lora_b", (e, rows, r), p.layer, p.group, None, True, True))
    return out


@lru_cache(maxsize=4096)
def adapter_group_summary(model, flavor, overrides: tuple, degrees, rank, mixed, layers, embed, head, opts) -> dict:
    """FSDP group -> [padded unsharded numel, padded shard numel] of the adapters ``rank`` holds
    in one stage (``layers``, with the embeddings / head): what FSDP gathers and reduces for them."""
    from .inventory import _inventory, cached_layout, rank_shards

    params, _ = _inventory(model, flavor, overrides)
    out: dict = {}
    infos = adapter_infos(params, model, flavor, overrides, opts)
    for s in rank_shards(infos, degrees, cached_layout(degrees), rank, mixed, layers, embed, head):
        g = out.setdefault(s.fsdp_group, [0, 0])
        g[0] += s.padded_unsharded_numel
        g[1] += s.padded_numel
    return out
