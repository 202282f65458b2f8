"""Every parameter of a model and how the real parallelize code shards it, as integers.

:func:`model_inventory` builds the model once on the meta device (no memory) and lists its
parameters with the facts the appliers use: which FSDP group wraps it
(``models/parallel/fsdp.py``: each block, each block's routed experts when they have their own
mesh, the embeddings, norm + output as one group), which dimension tensor parallelism splits
(read from what the model declares: ``tp_colwise`` / ``tp_rowwise`` of the attention and the
feed-forward modules, ``models/parallel/tensor_parallel.py``), and for routed experts the
expert-parallel and expert-TP dimensions (``models/parallel/expert_parallel.py``: ``Shard(0)`` on
ep, ``w1``/``w3`` ``Shard(1)`` and ``w2`` ``Shard(2)`` on etp).

:func:`rank_shards` then gives, for one rank of one layout, every parameter's local shard:
DTensor sharding follows ``torch.chunk`` (the first ranks get ``ceil(n/k)`` rows), and FSDP2 pads
dim 0 of the (TP/EP-local) tensor to a multiple of its shard-mesh size and keeps the padded
chunk (``_get_dim0_padded_size`` in ``torch/distributed/fsdp/_fully_shard``): a parameter's
storage is the padded chunk, its local tensor (what AdamW's ``zeros_like`` copies) the unpadded
one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

__all__ = [
    "GroupSummary",
    "ParamInfo",
    "ParamShard",
    "block_group",
    "chunk_len",
    "model_inventory",
    "rank_shards",
    "stage_summary",
]

# models/parallel/expert_parallel.py apply_expert_parallel: the etp-sharded dim of each weight
# the hidden dim etp splits; LoRA's expert adapters (models/parallel/lora_experts.py): w1/w3's B
# along its rows, w2's A along its columns, the other factor replicated over etp (None)
_ETP_DIM = {"w1": 1, "w3": 1, "w2": 2, "w1_lora_a": None, "w1_lora_b": 1, "w3_lora_a": None, "w3_lora_b": 1}
_ETP_DIM |= {"w2_lora_a": 2, "w2_lora_b": None}


def chunk_len(n: int, k: int, i: int) -> int:
    """Length of chunk ``i`` of ``torch.chunk`` of ``n`` rows into ``k`` (DTensor ``Shard``)."""
    if k == 1:
        return n
    c = math.ceil(n / k)
    return max(0, min(c, n - i * c))


@dataclass(frozen=True)
class ParamInfo:
    fqn: str
    shape: tuple[int, ...]
    layer: int | None  # transformer layer (an MTP depth k: n_layers + k), None for embeddings / head
    group: str  # FSDP group: "layers.<i>", "layers.<i>.experts", "mtp.<k>", "tok_embeddings", "head"
    tp_dim: int | None  # dimension TP splits (None: replicated over tp)
    expert: bool  # a routed expert weight (ep/etp sharded, expert FSDP mesh)
    moe_layer: bool  # lives in a MoE block
    # the TP role a block declares for the module (``block.tp_roles``: "embedding", "norm",
    # "replicated_linear"; models/parallel/tensor_parallel.py), None for the block's own modules
    role: str | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ParamShard:
    info: ParamInfo
    local_shape: tuple[int, ...]  # TP/EP-local shape (what FSDP shards)
    fsdp_size: int  # shard-mesh size of its FSDP group (1: no sharding)
    fsdp_group: str | None  # group name, None when FSDP does not wrap it
    fsdp_mesh: str | None  # "fsdp" or "efsdp" (+ "dp_replicate" under HSDP)
    local_numel: int  # this rank's unpadded shard
    padded_numel: int  # this rank's storage (FSDP padded chunk)

    @property
    def tp_local_numel(self) -> int:
        return math.prod(self.local_shape)

    @property
    def padded_unsharded_numel(self) -> int:
        """Rows padded to a multiple of the FSDP shard size (the reduce-scatter input, the
        all-gather output)."""
        return self.padded_numel * self.fsdp_size


def _block_infos(prefix: str, i: int, block) -> list[ParamInfo]:
    """The parameters of one block (``prefix``: its module path, also its FSDP group)."""
    tp_dims: dict[str, int] = {}
    att = block.attention
    for n in att.tp_colwise:
        tp_dims[f"attention.{n}.weight"] = 0
    tp_dims[f"attention.{att.tp_rowwise}.weight"] = 1
    ffns = []
    if block.moe_enabled:
        if block.moe.shared_experts is not None:
            ffns.append(("moe.shared_experts", block.moe.shared_experts))
    else:
        ffns.append(("feed_forward", block.feed_forward))
    for ffn_prefix, ffn in ffns:
        for n in ffn.tp_colwise:
            tp_dims[f"{ffn_prefix}.{n}.weight"] = 0
        tp_dims[f"{ffn_prefix}.{ffn.tp_rowwise}.weight"] = 1
    # modules around the block with a TP role (tensor_parallel._role_plan): the embedding copy is
    # vocabulary-sharded (dim 0) like tok_embeddings; norms and replicated linears stay whole
    roles = getattr(block, "tp_roles", {})
    infos = []
    for name, p in block.named_parameters():
        expert = block.moe_enabled and name.startswith("moe.experts.")
        role = roles.get(name.rsplit(".", 1)[0])
        tp_dim = None if expert else (0 if role == "embedding" else tp_dims.get(name))
        group = f"{prefix}.experts" if expert else prefix
        infos.append(ParamInfo(f"{prefix}.{name}", tuple(p.shape), i, group, tp_dim, expert, block.moe_enabled, role))
    return infos


def block_group(args, layer: int) -> str:
    """The FSDP group (module path) of block ``layer``: ``layers.<i>``, or ``mtp.<k>`` for
    DeepSeek-V3's MTP depth ``k`` (layer ``n_layers + k``)."""
    return f"layers.{layer}" if layer < args.n_layers else f"mtp.{layer - args.n_layers}"


@lru_cache(maxsize=16)
def _inventory(model: str, flavor: str, overrides: tuple) -> tuple[tuple[ParamInfo, ...], object]:
    import dataclasses

    import torch

    from models.registry import get_model_spec

    spec = get_model_spec(model, flavor)
    args = dataclasses.replace(spec.args, **dict(overrides))
    args.validate()
    with torch.device("meta"):
        m = spec.model_cls(args)
    infos: list[ParamInfo] = []
    for name, p in m.tok_embeddings.named_parameters():
        infos.append(ParamInfo(f"tok_embeddings.{name}", tuple(p.shape), None, "tok_embeddings", 0, False, False))
    for lid, block in m.layers.items():
        infos.extend(_block_infos(f"layers.{lid}", int(lid), block))
    # DeepSeek-V3's MTP depths: blocks of layer id n_layers + k after the main ones (an FSDP
    # group each, on the last pipeline stage, stage_layers), with their own modules' TP roles
    for k, block in (getattr(m, "mtp", None) or {}).items():
        infos.extend(_block_infos(f"mtp.{k}", args.n_layers + int(k), block))
    for name, p in m.norm.named_parameters():
        infos.append(ParamInfo(f"norm.{name}", tuple(p.shape), None, "head", None, False, False))
    for name, p in m.output.named_parameters():
        infos.append(ParamInfo(f"output.{name}", tuple(p.shape), None, "head", 0, False, False))
    return tuple(infos), args


_INVENTORIES: dict = {}


def model_inventory(model: str, flavor: str, **overrides):
    """``(params, args)``: the model's parameters as :class:`ParamInfo` (meta build, cached)
    and its args with ``overrides`` (e.g. ``max_seq_len``, ``vocab_size``, ``n_layers``)."""
    # (the planner asks for it per layout and rank: looked up by the overrides as passed
    # before sorting them)
    k = (model, flavor, *overrides.items())
    hit = _INVENTORIES.get(k)
    if hit is None:
        if len(_INVENTORIES) >= 64:
            _INVENTORIES.clear()
        hit = _INVENTORIES[k] = _inventory(model, flavor, tuple(sorted(overrides.items())))
    return hit


def fsdp_meshes(degrees, has_moe: bool, mixed: bool) -> tuple[int | None, int | None, bool]:
    """(dense shard size or None, expert shard size or None, experts wrapped separately) as
    ``models/parallelize.py`` + ``ParallelDims.fsdp_mesh_for`` decide them: a mesh exists
    with HSDP or a shard axis > 1 (experts also whenever ep > 1), or as the size-1 mesh when
    mixed precision is on; experts get their own group when ep, etp or tp > 1."""
    d = degrees
    fsdp = d.dp_shard * d.cp
    dense = fsdp if (d.dp_replicate > 1 or fsdp > 1 or mixed) else None
    separate = has_moe and (d.ep > 1 or d.etp > 1 or d.tp > 1)
    expert = None
    if separate:
        efsdp = d.efsdp
        expert = efsdp if (d.dp_replicate > 1 or efsdp > 1 or d.ep > 1 or mixed) else None
    return dense, expert, separate


def rank_shards(
    params, degrees, layout, rank: int, mixed: bool, layers=None, embed=True, head=True, has_moe: bool | None = None
):
    """This rank's :class:`ParamShard` of every parameter it holds: ``layers`` (an iterable
    of layer indices, None = all) plus the embeddings / head when ``embed`` / ``head``;
    ``has_moe``: whether the model has routed experts (None: whether ``params`` has some)."""
    d = degrees
    if has_moe is None:
        has_moe = any(p.expert for p in params)
    dense, expert, separate = fsdp_meshes(d, has_moe, mixed)
    coord = {n: layout.coordinate(n, rank) for n in ("tp", "fsdp", "ep", "etp", "efsdp")}
    keep = None if layers is None else set(layers)
    out = []
    for p in params:
        if p.layer is None:
            if (p.group == "tok_embeddings" and not embed) or (p.group == "head" and not head):
                continue
        elif keep is not None and p.layer not in keep:
            continue
        shape = list(p.shape)
        if p.expert:
            if d.ep > 1 or d.etp > 1:
                shape[0] = chunk_len(shape[0], d.ep, coord["ep"])
                if d.etp > 1:
                    leaf = p.fqn.rsplit(".", 1)[-1]
                    k = _ETP_DIM[leaf]
                    if k is not None:
                        shape[k] = chunk_len(shape[k], d.etp, coord["etp"])
            size, group, mesh_name, c = expert, p.group, "efsdp", coord["efsdp"]
            if not separate:
                size, group, mesh_name, c = dense, p.group.rsplit(".", 1)[0], "fsdp", coord["fsdp"]
        else:
            if p.tp_dim is not None and d.tp > 1:
                shape[p.tp_dim] = chunk_len(shape[p.tp_dim], d.tp, coord["tp"])
            size, group, mesh_name, c = dense, p.group, "fsdp", coord["fsdp"]
        rest = math.prod(shape[1:])
        if size is None:
            local = padded = math.prod(shape)
            group = mesh_name = None
            size = 1
        else:
            local = chunk_len(shape[0], size, c) * rest
            padded = math.ceil(shape[0] / size) * rest
        out.append(ParamShard(p, tuple(shape), size, group, mesh_name, local, padded))
    return out


@lru_cache(maxsize=16)
def _flops(model: str, flavor: str, seq_len: int, overrides: tuple) -> tuple[float, int]:
    import dataclasses

    import torch

    from models.registry import get_model_spec

    spec = get_model_spec(model, flavor)
    args = dataclasses.replace(spec.args, **dict(overrides))
    with torch.device("meta"):
        m = spec.model_cls(args)
    return spec.flops_per_token(m, seq_len), m.output.weight.numel()


def model_flops(model: str, flavor: str, seq_len: int, **overrides) -> tuple[float, int]:
    """(training FLOPs per token by the trainer's formula, ``model.flops_per_token``; output
    projection parameters)."""
    return _flops(model, flavor, seq_len, tuple(sorted(overrides.items())))


@dataclass(frozen=True)
class GroupSummary:
    """One FSDP group (or the unwrapped parameters, ``name`` None) of one rank's stage."""

    name: str | None
    mesh: str | None  # "fsdp" / "efsdp"
    size: int  # shard-mesh size
    unsharded: int  # sum of padded unsharded numels (all-gather output, reduce-scatter input)
    shard: int  # sum of padded local numels (storage)
    local: int  # sum of unpadded local numels (what AdamW copies)
    tp_local: int  # sum of TP/EP-local numels (the gathered compute copy)


@lru_cache(maxsize=65536)
def shard_key(model, flavor, overrides: tuple, degrees, rank: int, mixed: bool) -> tuple:
    """What :func:`rank_shards` reads of a layout and a rank: the FSDP meshes
    (:func:`fsdp_meshes`), the tp, ep and etp degrees and the rank's coordinates on tp, fsdp,
    ep, etp and efsdp. Two (degrees, rank) with the same key get the same shards (the
    data-parallel, CP and PP degrees matter only through it)."""
    layout = cached_layout(degrees)
    d = degrees
    meshes = fsdp_meshes(d, _has_moe(model, flavor, overrides), mixed)
    coords = tuple(layout.coordinate(n, rank) for n in ("tp", "fsdp", "ep", "etp", "efsdp"))
    return meshes, d.tp, d.ep, d.etp, coords


@lru_cache(maxsize=16)
def _has_moe(model: str, flavor: str, overrides: tuple) -> bool:
    return any(p.expert for p in _inventory(model, flavor, overrides)[0])


_SUMMARIES: dict = {}


@lru_cache(maxsize=65536)
def stage_summary(model, flavor, overrides: tuple, degrees, rank, mixed, layers, embed, head) -> tuple:
    """:func:`rank_shards` summed per FSDP group (cached: planning asks for the same stage of
    the same degrees many times, and of many degrees with the same :func:`shard_key`). Blocks
    of one kind (the same parameters, names, shapes and roles under their own prefix) are
    sharded alike: each kind is summed once per shard key and the sums added block by block,
    in the inventory's order (:func:`_blocks`)."""
    skey = shard_key(model, flavor, overrides, degrees, rank, mixed)
    k = (model, flavor, overrides, skey, layers, embed, head)
    hit = _SUMMARIES.get(k)
    if hit is None:
        if len(_SUMMARIES) >= 65536:
            _SUMMARIES.clear()
        hit = _SUMMARIES[k] = _stage_summary(model, flavor, overrides, degrees, rank, mixed, layers, embed, head, skey)
    return hit


def _stage_summary(model, flavor, overrides: tuple, degrees, rank, mixed, layers, embed, head, skey) -> tuple:
    params, _ = _inventory(model, flavor, overrides)
    blocks = _blocks(model, flavor, overrides)
    groups: dict = {}

    def add(name, mesh, size, unsharded, shard, local, tp_local):
        g = groups.setdefault(name, [mesh, size, 0, 0, 0, 0])
        g[2] += unsharded
        g[3] += shard
        g[4] += local
        g[5] += tp_local

    if blocks is None:  # blocks not contiguous in the inventory: parameter by parameter
        for s in rank_shards(params, degrees, cached_layout(degrees), rank, mixed, layers, embed, head):
            add(s.fsdp_group, s.fsdp_mesh, s.fsdp_size, s.padded_unsharded_numel, s.padded_numel, s.local_numel,
                s.tp_local_numel)  # fmt: skip
    else:
        spans, kinds, has_moe = blocks
        layout = cached_layout(degrees)
        outer = [p for p in params if p.layer is None]
        for s in rank_shards(outer, degrees, layout, rank, mixed, (), embed, False, has_moe):
            add(s.fsdp_group, s.fsdp_mesh, s.fsdp_size, s.padded_unsharded_numel, s.padded_numel, s.local_numel,
                s.tp_local_numel)  # fmt: skip
        for layer in sorted((i for i in layers if i in spans), key=lambda i: spans[i][0]):
            prefix = spans[layer][2]
            for rel, *vals in _kind_summary(model, flavor, overrides, kinds[layer], degrees, rank, mixed, skey):
                add(None if rel is None else prefix + rel, *vals)
        for s in rank_shards(outer, degrees, layout, rank, mixed, (), False, head, has_moe):
            add(s.fsdp_group, s.fsdp_mesh, s.fsdp_size, s.padded_unsharded_numel, s.padded_numel, s.local_numel,
                s.tp_local_numel)  # fmt: skip
    return tuple(GroupSummary(name, *vals) for name, vals in groups.items())


@lru_cache(maxsize=16)
def _blocks(model: str, flavor: str, overrides: tuple):
    """({layer: (first, end index in the inventory, group prefix)}, {layer: kind}, whether the
    model has routed experts), or None when a block's parameters are not contiguous (or the
    embeddings and head do not come first and last) in the inventory."""
    params, _ = _inventory(model, flavor, overrides)
    spans: dict = {}
    for i, p in enumerate(params):
        if p.layer is not None:
            span = spans.setdefault(p.layer, [i, i])
            if span[1] != i:
                return None
            span[1] = i + 1
    outer = [i for i, p in enumerate(params) if p.layer is None]
    embeds = [i for i in outer if params[i].group == "tok_embeddings"]
    if embeds != list(range(len(embeds))) or any(i < len(embeds) for i in outer if i not in embeds):
        return None
    if any(i < max((b for _, b in spans.values()), default=0) for i in outer if i not in embeds):
        return None
    kinds: dict = {}
    seen: dict = {}
    out = {}
    for layer, (a, b) in spans.items():
        prefix = params[a].fqn.split(".", 2)
        prefix = f"{prefix[0]}.{prefix[1]}"
        sig = []
        for p in params[a:b]:
            if not (p.fqn.startswith(prefix + ".") and (p.group == prefix or p.group.startswith(prefix + "."))):
                return None
            sig.append((p.fqn[len(prefix) :], p.shape, p.group[len(prefix) :], p.tp_dim, p.expert, p.moe_layer, p.role))
        kinds[layer] = seen.setdefault(tuple(sig), layer)  # a kind: its first block
        out[layer] = (a, b, prefix)
    return out, kinds, any(p.expert for p in params)


_KINDS: dict = {}


def _kind_summary(model, flavor, overrides: tuple, kind: int, degrees, rank, mixed, skey) -> tuple:
    """:func:`stage_summary`'s per-group sums of block ``kind`` alone (group names relative to
    the block's prefix), in the order its parameters first name each group (cached by the
    shard key ``skey``)."""
    k = (model, flavor, overrides, kind, skey)
    hit = _KINDS.get(k)
    if hit is None:
        if len(_KINDS) >= 65536:
            _KINDS.clear()
        hit = _KINDS[k] = _kind_summary_of(model, flavor, overrides, kind, degrees, rank, mixed)
    return hit


def _kind_summary_of(model, flavor, overrides: tuple, kind: int, degrees, rank, mixed) -> tuple:
    params, _ = _inventory(model, flavor, overrides)
    spans, _, has_moe = _blocks(model, flavor, overrides)
    a, b, prefix = spans[kind]
    groups: dict = {}
    for s in rank_shards(params[a:b], degrees, cached_layout(degrees), rank, mixed, None, False, False, has_moe):
        rel = None if s.fsdp_group is None else s.fsdp_group[len(prefix) :]
        g = groups.setdefault(rel, [s.fsdp_mesh, s.fsdp_size, 0, 0, 0, 0])
        g[2] += s.padded_unsharded_numel
        g[3] += s.padded_numel
        g[4] += s.local_numel
        g[5] += s.tp_local_numel
    return tuple((rel, *vals) for rel, vals in groups.items())


@lru_cache(maxsize=4096)
def cached_layout(degrees):
    from parallel_dims.layout import RankLayout

    return RankLayout(degrees)
