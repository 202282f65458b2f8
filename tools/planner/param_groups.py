"""The parameters of one rank's stages as the collectives group them: the TP-split modules of a
block and the width of their column-wise projections, the tp-replicated weights whose gradients
come out Partial, and the sets of groups the grad-norm all-reduces run over
(``trainer/optim/grad_clip.py``). From the parameter inventory (:mod:`tools.planner.inventory`)."""

from __future__ import annotations

from functools import lru_cache

__all__ = ["grad_norm_all_reduces", "tp_colwise_modules", "tp_partial_adapter_grads", "tp_partial_grads"]


def _params(model, flavor, key):
    from .inventory import model_inventory

    return model_inventory(model, flavor, **dict(key))[0]


@lru_cache(maxsize=4096)
def tp_colwise_modules(
    model, flavor, key, layer: int, frozen_input: bool = False
) -> tuple[tuple[bool, tuple[int, ...]], ...]:
    """The TP-split modules of transformer layer ``layer`` (attention, dense or shared-expert
    feed-forward) whose input gradient the backward computes: whether its input stays a DTensor
    (every weight of the module TP-split: tensor_parallel._input_stays_dtensor) and the input
    width of each column-wise projection. ``frozen_input`` (LoRA, layer 0 on the stage with the
    frozen embedding): the attention's projections that read the block's input compute no input
    gradient (tools/planner/lora.py ``_ENTRY``), so a module whose input stays a DTensor has no
    input-gradient reduction and the others lose those projections' widths."""
    from .lora import _ENTRY

    # (the modules with a declared TP role around a block, MTP's, are not TP-split projections)
    params = [p for p in _params(model, flavor, key) if p.layer == layer and not p.expert and p.role is None]
    out = []
    for prefix in sorted({p.fqn.rsplit(".", 2)[0] for p in params if p.tp_dim == 0}):
        inside = [p for p in params if p.fqn.startswith(prefix + ".")]
        stays = all(p.tp_dim is not None for p in inside)
        entry = [frozen_input and p.fqn.rsplit(".", 1)[0].endswith(_ENTRY) for p in inside]
        if stays and any(entry):
            continue
        widths = tuple(p.shape[1] for p, e in zip(inside, entry) if p.tp_dim == 0 and not e)
        if widths:
            out.append((stays, widths))
    return tuple(out)


def _replicated_on_tp(p, sp: bool) -> bool:
    """Weights models/parallel/tensor_parallel.py makes Replicate DTensors on tp: the norms
    under sequence parallel (SequenceParallel), the MoE router gate, and under sequence parallel
    the modules a block declares as ``norm`` or ``replicated_linear`` (MTP's)."""
    if p.tp_dim is not None or p.expert:
        return False
    if p.role is not None:
        return sp and p.role in ("norm", "replicated_linear")
    name = p.fqn.rsplit(".", 1)[0]
    norm = name == "norm" or name.endswith(".attention_norm") or name.endswith(".ffn_norm")
    return (sp and norm) or name.endswith(".moe.router.gate")


@lru_cache(maxsize=4096)
def tp_partial_grads(model, flavor, key, layers, head: bool, sp: bool) -> tuple[int, ...]:
    """Element counts of this stage's tp-replicated weights (their gradients come out Partial)."""
    keep = set(layers)
    return tuple(
        p.numel
        for p in _params(model, flavor, key)
        if _replicated_on_tp(p, sp) and ((p.layer in keep) if p.layer is not None else (head and p.group == "head"))
    )


@lru_cache(maxsize=4096)
def tp_partial_adapter_grads(model, flavor, key, layers, opts) -> tuple[int, ...]:
    """Under LoRA (the base frozen: its tp-replicated norms and router gate have no gradient):
    element counts of this stage's adapter factors replicated over tp beside a TP-split base,
    the column-wise base's ``A`` and the row-wise base's ``B``; their gradients come out Partial
    (a product with the split factor's sharded activations) and are all-reduced like
    :func:`tp_partial_grads`'. An adapter of a replicated base (MLA's ``wkv_a``) sees the whole
    sequence and gets a whole gradient."""
    from .lora import adapter_infos

    params = _params(model, flavor, key)
    base = {p.fqn: p.tp_dim for p in params}
    keep = set(layers)
    return tuple(
        p.numel
        for p in adapter_infos(params, model, flavor, key, opts)
        if not p.expert
        and p.layer in keep
        and p.tp_dim is None
        and base[p.fqn.rsplit(".", 1)[0] + ".weight"] is not None
    )


def grad_norm_all_reduces(model, flavor, key, d, stages, dense_size, expert_size, separate, layout, rank):
    """The grad-norm all-reduces, as ``trainer/optim/grad_clip.py`` issues them: each gradient's sum
    of squares is partial over the groups of the mesh dimensions it is sharded on (size > 1);
    gradients with the same groups (compared by ranks) share one float32 all-reduce per
    group. Dense weights: FSDP's shard group, plus tp for TP-split weights (norms and the
    router gate are Replicate on tp); routed experts in their own FSDP group: efsdp, ep, and
    etp for the etp-split weights; otherwise in the dense FSDP group."""
    layers = tuple(sorted({i for layers, _, _ in stages for i in layers}))
    embed = any(e for _, e, _ in stages)
    head = any(h for _, _, h in stages)
    name_sets = _grad_norm_name_sets(
        model,
        flavor,
        key,
        layers,
        embed,
        head,
        separate,
        (dense_size or 1) > 1,
        (expert_size or 1) > 1,
        d.tp > 1,
        d.ep > 1,
        d.etp > 1,
    )
    if len(name_sets) < 2:  # nothing to merge
        return [name for names in name_sets for name in names]
    keys: dict = {}  # ranks of each group -> the mesh names, in first-seen order
    for names in name_sets:
        keys.setdefault(tuple(_group_ranks(d, n, rank, layout) for n in names), names)
    return [name for names in keys.values() for name in names]


_GROUP_RANKS: dict = {}


def _group_ranks(degrees, name: str, rank: int, layout) -> tuple[int, ...]:
    """``layout.group(name, rank)`` as a tuple, memoized per (degrees, name, rank)."""
    k = (degrees, name, rank)
    if k not in _GROUP_RANKS:
        if len(_GROUP_RANKS) > 65536:
            _GROUP_RANKS.clear()
        _GROUP_RANKS[k] = tuple(layout.group(name, rank))
    return _GROUP_RANKS[k]


@lru_cache(maxsize=4096)
def _grad_norm_name_sets(model, flavor, key, layers, embed, head, separate, fsdp, efsdp, tp, ep, etp):
    """The distinct tuples of mesh names the gradients of this rank's parameters are sharded
    over (size > 1), in parameter order."""
    from .inventory import _ETP_DIM

    keep = set(layers)
    out: dict = {}
    for p in _params(model, flavor, key):
        if p.layer is not None and p.layer not in keep:
            continue
        if p.layer is None and not ((p.group == "tok_embeddings" and embed) or (p.group == "head" and head)):
            continue
        if p.expert and separate:
            names = [n for n, on in (("efsdp", efsdp), ("ep", ep)) if on]
            if etp and _ETP_DIM.get(p.fqn.rsplit(".", 1)[-1]) is not None:
                names.append("etp")
        else:
            names = ["fsdp"] if fsdp else []
            if tp and p.tp_dim is not None and not p.expert:
                names.append("tp")
        out.setdefault(tuple(names), None)
    return tuple(out)
