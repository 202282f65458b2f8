"""LoRA in the planner (``model.converters = ["lora"]``, models/parallel/lora.py): the adapters as
parameters of their own, sharded the way the converter and the appliers shard them, so that a
LoRA job's trainable parameters, gradients and optimizer state are the adapters' only.

Each adapted linear ``[out, in]`` gets ``A`` ``[r, in]`` and ``B`` ``[out, r]`` in its FSDP group:
under TP a column-wise base (``tp_dim`` 0) splits ``B`` along its rows and replicates ``A``, a
row-wise base (``tp_dim`` 1) splits ``A`` along its columns and replicates ``B``; FSDP shards
each along dim 0 like any parameter. Expert adapters (``lora.experts``) are ``[E, r, in]`` and
``[E, out, r]`` split along the expert dimension by ep (and over etp like their weight's hidden
dim: w1/w3's B, w2's A; the other factor replicated, its gradient all-reduced over etp in every
backward: :func:`etp_replicated_factors`). Which linears are adapted is the
converter's own rule (:func:`models.parallel.lora.lora_decisions` on a meta build).
"""

from __future__ import annotations

from functools import lru_cache

from .inventory import ParamInfo

__all__ = ["adapter_group_summary", "adapter_infos", "etp_replicated_factors", "stage_lora_weights"]


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


@lru_cache(maxsize=4096)
def etp_replicated_factors(model, flavor, overrides: tuple, degrees, rank, layers, opts) -> tuple[int, ...]:
    """The EP-local element counts of the expert adapter factors replicated over etp that
    ``rank`` holds in ``layers`` (w1/w3's ``A`` ``[E/ep, r, dim]``, w2's ``B`` ``[E/ep, dim, r]``):
    each backward all-reduces each one's gradient over etp (its local gradient is a partial sum
    over the etp rank's hidden slice; models/parallel/lora_experts.py ``_factor``). Empty
    without expert adapters or etp."""
    from .inventory import _ETP_DIM, _inventory, cached_layout, rank_shards

    if not opts.experts or degrees.etp == 1:
        return ()
    params, _ = _inventory(model, flavor, overrides)
    infos = [p for p in adapter_infos(params, model, flavor, overrides, opts) if p.expert]
    shards = rank_shards(infos, degrees, cached_layout(degrees), rank, False, layers, False, False)
    return tuple(s.tp_local_numel for s in shards if _ETP_DIM[s.info.fqn.rsplit(".", 1)[-1]] is None)


# the linears that read a block's (normed) input first: in layer 0 on the stage that holds the
# embeddings, that input never requires a gradient under LoRA (embedding and norm are frozen)
_ENTRY = ("attention.wq", "attention.wk", "attention.wv", "attention.wq_a", "attention.wkv_a")


@lru_cache(maxsize=65536)
def stage_lora_weights(model, flavor, key: tuple, degrees, rank: int, layers, embed: bool, head: bool, opts, f8=None):
    """Element sums of one stage of ``rank`` for the compute model (tools/planner/compute.py):
    (TP-local numel of every adapter ``A`` + ``B`` of the adapted linears, of the ``B`` of the
    adapted last projections (the feed-forward's / shared experts' row-wise output), TP-local
    base numel of the adapted last projections that float8 does not convert, base numel of the
    linears reading the embedding that float8 does not convert (layer 0's attention input
    projections on the stage with the embeddings), the ``A`` numel of the adapted ones, and the local
    expert-merge size: sum over the rank's adapted expert weights of ``E_local x out_local x
    in_local x rank``). ``f8``: the float8 linears' ``filter_fqns`` or None."""
    from .float8 import converted_weights
    from .inventory import cached_layout, model_inventory, rank_shards

    params, args = model_inventory(model, flavor, **dict(key))
    layout = cached_layout(degrees)
    converted = converted_weights(model, flavor, key, f8) if f8 is not None else frozenset()
    aux = getattr(args, "aux_loss_coeff", 0) > 0
    base = {s.info.fqn: s for s in rank_shards(params, degrees, layout, rank, False, layers, embed, head)}
    linears, _ = _adapted(model, flavor, key, tuple(opts.target_modules), bool(opts.experts))

    def is_last(info) -> bool:  # compute.py's rule: nothing saves their output
        return info.tp_dim == 1 and (".feed_forward." in info.fqn or (".shared_experts." in info.fqn and not aux))

    def is_entry(info) -> bool:
        return embed and info.layer == 0 and info.fqn.rsplit(".", 1)[0].endswith(_ENTRY)

    adapters = last_b = last_base = entry_base = entry_a = merge = 0
    for fqn, s in base.items():
        if s.info.expert or len(s.info.shape) != 2 or fqn in converted:
            continue
        if is_entry(s.info):
            entry_base += s.tp_local_numel
        if is_last(s.info) and fqn.rsplit(".", 1)[0] in linears:
            last_base += s.tp_local_numel
    infos = adapter_infos(params, model, flavor, key, opts)
    for s in rank_shards(infos, degrees, layout, rank, False, layers, embed, head):
        info = s.info
        if info.expert:
            if info.fqn.endswith("_lora_b"):  # the merge bmm B @ A of the local experts
                merge += base[info.fqn[: -len("_lora_b")]].tp_local_numel * opts.rank
            continue
        adapters += s.tp_local_numel
        weight = base[info.fqn.rsplit(".", 1)[0] + ".weight"].info
        if info.fqn.endswith(".lora_b") and is_last(weight):
            last_b += s.tp_local_numel
        if info.fqn.endswith(".lora_a") and is_entry(weight):  # a plain GEMM, float8 base or not
            entry_a += s.tp_local_numel
    return adapters, last_b, last_base, entry_base, entry_a, merge
