"""Memory of one rank of one layout (the terms :func:`tools.planner.estimate.estimate` sums and
prints; see its module docstring), in two parts so the search can price many choices of one
set of degrees cheaply:

* :func:`rank_context`: what no AC or reshard choice changes (the rank's pipeline stages, its
  parameter shards and FSDP groups, micro-batch sizes, Muon's and LoRA's shares) for one
  (rank, schedule, micro-batch count, local batch);
* :func:`context_activations` (the AC choice) and :func:`memory_from_context` (the reshard
  choice; :func:`memory_parts` places each kind of bytes, :func:`tools.planner.phases.peak`
  takes the largest of the step's phases).

:func:`memory_for_rank` chains the three; :mod:`tools.planner.batch` reuses a context and its
activations over the choices that share them (the same arithmetic, so the same floats).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .activations import activation_bytes
from .choice import DTYPE_BYTES, LayoutChoice, grad_accum_steps, selective_every, stage_layers
from .inventory import cached_layout, fsdp_meshes, model_inventory, stage_summary
from .phases import MemoryParts, peak

__all__ = [
    "RankContext",
    "activation_sums",
    "context_activations",
    "memory_for_rank",
    "memory_from_context",
    "memory_parts",
    "rank_context",
]


def _in_flight(choice: LayoutChoice, pp: int, plan) -> tuple[float, int]:
    """(micro-batches of this rank's layers held at the activation peak, logits held)."""
    if pp == 1:
        return 1.0, 1
    m, v = choice.n_microbatches, plan.stages_per_rank
    if choice.schedule in ("GPipe", "LoopedBFS"):
        return float(m), m
    if v == 1:
        return float(min(m, pp)), 1
    # interleaved warm-up on the first rank: (v-1)*pp + 2*(pp-1) + 1 chunks of 1/v of its layers
    chunks = min(m * v, (v - 1) * pp + 2 * (pp - 1) + 1)
    return chunks / v, 1


@lru_cache(maxsize=65536)
def _activations(model, flavor, key: tuple, layers, mb, seq_len, tp, cp, etp, act_bytes, ac, head, every, sp):
    """:func:`activation_bytes` of one stage (cached: the search asks for the same stage of
    many layouts)."""
    _, args = model_inventory(model, flavor, **dict(key))
    return activation_bytes(
        args, layers, mb, seq_len, tp=tp, cp=cp, etp=etp, sp=sp, act_bytes=act_bytes, ac=ac, head=head,
        selective_every=every,
    )  # fmt: skip


@dataclass(slots=True)
class RankContext:
    """The part of one rank's memory that no AC or reshard choice changes."""

    stages: list
    plan: object
    accum: int
    m: int  # pipeline micro-batches per local batch (1 without pp)
    mb: int  # sequences per micro-batch
    key: tuple  # the job's model overrides, sorted
    padded: int
    local: int
    unsharded: tuple  # the FSDP groups' gathered (TP-local) elements: all, the largest 2 and 3
    named: tuple  # (head, head's shard, embeddings, last block, largest block) gathered elements (:func:`_rank_groups`)
    sharded: bool
    muon_local: int
    adapters: tuple | None  # LoRA: (padded, local, per-group gathered elements)


def rank_context(job, degrees, choice: LayoutChoice, rank: int, shares: dict | None = None) -> RankContext:
    """``shares``: a cache of the stage-dependent part by the stages' layer ranges (what a
    batch of choices of these degrees shares; None: none)."""
    _, args = model_inventory(job.model, job.flavor, **job.overrides)
    layout = cached_layout(degrees)
    d = degrees
    stages, plan = stage_layers(args, d, choice, rank, layout)
    m = choice.n_microbatches if d.pp > 1 else 1
    key = tuple(sorted(job.overrides.items()))
    skey = (rank, tuple(stages))
    shared = None if shares is None else shares.get(skey)
    if shared is None:
        padded, local, unsharded, sharded, named = _rank_groups(
            job.model, job.flavor, key, d, rank, choice.mixed, skey[1]
        )
        # AdamW: 2 fp32 states; Muon: 1 (its momentum) for the matrices routed to it
        muon_local = _muon(job, d, choice, rank).local_numel if job.optimizer == "Muon" else 0
        adapters = _adapter_shards(job, d, choice, rank, stages, layout) if job.lora is not None else None
        shared = (padded, local, unsharded, named, sharded, muon_local, adapters)
        if shares is not None:
            shares[skey] = shared
    padded, local, unsharded, named, sharded, muon_local, adapters = shared
    return RankContext(
        stages, plan, grad_accum_steps(choice, d), m, choice.local_batch // m, key, padded, local, unsharded, named,
        sharded, muon_local, adapters,
    )  # fmt: skip


def activation_sums(job, degrees, choice: LayoutChoice, stages, mb: int) -> tuple:
    """(layers' activations, head's, the largest recomputation, the logits, the loss backward's
    gradients) of one micro-batch of the rank's ``stages``, bytes."""
    d = degrees
    act_bytes = DTYPE_BYTES[choice.param_dtype]
    held_layers = 0.0
    head_b = recompute = logits = loss_grads = 0
    every = selective_every(choice)
    key = tuple(sorted(job.overrides.items()))
    for layers, _embed, head in stages:
        est = _activations(
            job.model, job.flavor, key, layers, mb, job.seq_len, d.tp, d.cp, d.etp, act_bytes, choice.ac, head,
            every, choice.sequence_parallel,
        )  # fmt: skip
        held_layers += est.layers
        head_b += est.head
        recompute = max(recompute, est.recompute)
        logits += est.logits
        loss_grads += est.loss_grads
    return held_layers, head_b, recompute, logits, loss_grads


def context_activations(job, degrees, choice: LayoutChoice, ctx: RankContext, sums: tuple | None = None) -> tuple:
    """The rank's activation parts (bytes): its stages' layers times the micro-batches in
    flight, the head's buffers and logits of the micro-batches held, the largest recomputation
    and the loss backward's gradients (one micro-batch's at a time); ``sums``:
    :func:`activation_sums`."""
    held_layers, head_b, recompute, logits, loss_grads = sums or activation_sums(
        job, degrees, choice, ctx.stages, ctx.mb
    )
    layers_factor, logits_held = _in_flight(choice, degrees.pp, ctx.plan)
    return held_layers * layers_factor, head_b * logits_held, recompute, logits * logits_held, loss_grads


def memory_parts(job, degrees, choice: LayoutChoice, ctx: RankContext, activations: tuple | None = None) -> MemoryParts:
    """What the rank holds, by kind (:class:`tools.planner.phases.MemoryParts`);
    ``activations``: :func:`context_activations` of the same choice, when the caller has it."""
    d = degrees
    pb, rb = DTYPE_BYTES[choice.param_dtype], DTYPE_BYTES[choice.reduce_dtype]
    sharded, m = ctx.sharded, ctx.m
    unsharded_total, largest2, _ = ctx.unsharded
    head, head_shard, embed, last_block, block = ctx.named
    cast = sharded or (choice.mixed and pb != 4)
    keeps_all = d.pp > 1 or choice.reshard == "never" or not sharded
    accumulating = ctx.accum > 1 or m > 1
    if not cast:
        g_loss = g_start = g_end = 0
    elif keeps_all:
        g_loss = g_start = g_end = unsharded_total * pb
    else:  # FSDP keeps the head and the last block after the forward; the backward prefetches one block
        g_loss, g_start, g_end = (head + last_block) * pb, (last_block + block) * pb, embed * pb
    # two groups' unsharded gradients in flight: at the blocks' backward start the head's and a
    # block's, at its end the embeddings' and the first block's
    u_start = (largest2 if keeps_all else head + block) * pb if sharded else 0
    u_end = (largest2 if keeps_all else embed + block) * pb if sharded else 0
    accumulated = (unsharded_total * rb if sharded else 4 * ctx.padded) if accumulating else 0
    if activations is None:
        activations = context_activations(job, d, choice, ctx)
    layers, head_b, recompute, logits, loss_grads = activations
    muon_local = ctx.muon_local
    params_b, grads_b, optimizer_b = 4 * ctx.padded, 4 * ctx.padded, 8 * ctx.local - 4 * muon_local
    head_grads = 4 * head_shard
    if job.lora is not None:  # frozen base: gradients and optimizer state of the adapters only
        a_padded, a_local, a_groups = ctx.adapters
        frozen_b = DTYPE_BYTES[job.lora.frozen_dtype]
        params_b, grads_b, optimizer_b = (
            frozen_b * ctx.padded + 4 * a_padded,
            4 * a_padded,
            8 * a_local - 4 * muon_local,
        )
        head_grads = 0
        extra = sum(a_groups.values()) * pb if cast and keeps_all else 0
        g_loss, g_start, g_end = g_loss + extra, g_start + extra, g_end + extra
        biggest_a = sorted(a_groups.values(), reverse=True)
        u_start = u_end = sum(biggest_a[:2]) * pb if sharded else 0
        accumulated = (sum(biggest_a) * rb if sharded else grads_b) if accumulating else 0
    return MemoryParts(
        params_b, grads_b, optimizer_b, head_grads, accumulated, sharded, g_loss, g_start, g_end, u_start, u_end,
        layers, head_b, loss_grads, recompute, logits,
    )  # fmt: skip


def memory_from_context(
    job, degrees, choice: LayoutChoice, ctx: RankContext, activations: tuple | None = None
) -> dict[str, float]:
    """The memory terms (bytes) of the rank's peak phase, their total and each phase's
    (:func:`tools.planner.phases.peak`); ``activations``: :func:`context_activations` of the
    same choice, when the caller has it."""
    return peak(memory_parts(job, degrees, choice, ctx, activations))


def memory_for_rank(job, degrees, choice: LayoutChoice, rank: int) -> dict[str, float]:
    return memory_from_context(job, degrees, choice, rank_context(job, degrees, choice, rank))


@lru_cache(maxsize=65536)
def _rank_groups(model, flavor, key: tuple, d, rank: int, mixed: bool, stages: tuple) -> tuple:
    """(padded and unpadded local elements ``rank`` stores, its FSDP groups' gathered (TP-local)
    elements (all of them, the largest two, the largest three), whether a shard mesh has more than one rank, and
    (the head's gathered and shard elements, the embeddings', the last block's, the largest
    block's) over its ``stages``:
    the part of :func:`memory_for_rank` that no AC, reshard or batch choice changes (cached: the
    search asks for it once per choice)."""
    _, args = model_inventory(model, flavor, **dict(key))
    dense_size, expert_size, _ = fsdp_meshes(d, args.has_experts, mixed)
    padded = local = head_g = head_shard = embed_g = 0
    gathered_groups: dict = {}
    per_layer: dict = {}
    for layers, embed, head in stages:
        for g in stage_summary(model, flavor, key, d, rank, mixed, layers, embed, head):
            padded += g.shard
            local += g.local
            gathered_groups[(g.name, layers.start)] = g.tp_local
            if g.name == "head":
                head_g, head_shard = head_g + g.tp_local, head_shard + g.shard
            elif g.name == "tok_embeddings":
                embed_g += g.tp_local
            elif g.name is not None and g.name.startswith("layers."):
                i = int(g.name.split(".")[1])  # a block's own group and its experts' group
                per_layer[i] = per_layer.get(i, 0) + g.tp_local
    sharded = any(size is not None and size > 1 for size in (dense_size, expert_size))
    biggest = sorted(gathered_groups.values(), reverse=True)
    last_block = per_layer[max(per_layer)] if per_layer else 0
    named = (head_g, head_shard, embed_g, last_block, max(per_layer.values(), default=0))
    return padded, local, (sum(biggest), sum(biggest[:2]), sum(biggest[:3])), sharded, named


def _adapter_shards(job, d, choice: LayoutChoice, rank: int, stages, layout) -> tuple[int, int, dict]:
    """(padded, local) adapter elements this rank stores, and per FSDP group the adapters'
    gathered (TP-local) elements."""
    from .inventory import rank_shards
    from .lora import adapter_infos

    params, _ = model_inventory(job.model, job.flavor, **job.overrides)
    key = tuple(sorted(job.overrides.items()))
    infos = adapter_infos(params, job.model, job.flavor, key, job.lora)
    padded = local = 0
    groups: dict = {}
    for layers, embed, head in stages:
        for s in rank_shards(infos, d, layout, rank, choice.mixed, layers, embed, head):
            padded += s.padded_numel
            local += s.local_numel
            groups[(s.info.group, layers.start)] = groups.get((s.info.group, layers.start), 0) + s.tp_local_numel
    return padded, local, groups


def _muon(job, d, choice: LayoutChoice, rank: int):
    from .muon import muon_cost

    stages, _ = stage_layers(
        model_inventory(job.model, job.flavor, **job.overrides)[1], d, choice, rank, cached_layout(d)
    )
    return muon_cost(
        job.model, job.flavor, job.overrides, d, rank, choice.mixed, stages, job.muon_distribution, job.muon_ns_steps,
        job.param_groups, job.lora,
    )  # fmt: skip
