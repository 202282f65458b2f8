"""Estimates of one layout of a job: memory and step time per rank.

Estimates, per rank (the worst rank: coordinate 0 of every axis, first and last pipeline
stage) -- every assumption is also printed with the result:

* memory: fp32 parameters and gradients (FSDP2's padded chunks), AdamW's two fp32 states
  (unpadded), the compute-dtype copies FSDP gathers (the three largest groups when resharding
  after forward: the current one, the prefetched one and the kept last block or head; every
  group otherwise), unsharded gradients (two groups in flight; all of them
  while gradient accumulation or pipeline micro-batches defer the reduce-scatter),
  activations (:mod:`tools.planner.activations`) times the micro-batches a schedule keeps in
  flight (1F1B-like: min(m, pp) on the first stage; GPipe / LoopedBFS: all m; interleaved:
  its warm-up chunks), the logits and loss buffers; ``fits`` when the total is at most the
  GPU's memory minus the reserve;
* time: compute = the matmul FLOPs of the busiest rank (:mod:`tools.planner.compute`: its
  pipeline stage, its TP/CP/EP share, the trainer's FLOPs-per-token accounting, checked exactly
  against fake-backend runs) / (peak x efficiency), with float8 on (``choice.float8``) the
  converted linears' and routed experts' float8 GEMM FLOPs at the float8 peak and the rest at
  the parameter dtype's (:mod:`tools.planner.float8`), the recomputed forward under full AC
  reported apart (times ``Hardware.recompute_cost``), plus, under TP, the profile's host
  overhead per block and micro-batch (``Hardware.tp_block_overhead_s``, 0 on GPUs), and
  under CP its counterpart (``Hardware.cp_block_overhead_s``);
  optimizer = the per-parameter work of a mixed-precision step over the rank's local (unpadded)
  parameter shards -- the parameter and gradient casts (with a compute dtype other than float32),
  the gradient norm, clipping and fused AdamW -- memory-bound at
  :func:`tools.planner.hardware.step_bytes_per_param` bytes each, after the backward;
  elementwise = the memory-bound activation work (norms, RoPE, SwiGLU's gate, residual adds, MoE
  dispatch and combine, the loss's log-softmax: :mod:`tools.planner.elementwise`) over the
  memory bandwidth, part of the busy time;
  communication = every collective
  of :func:`tools.planner.collectives.predict_collectives` priced by the ring model of
  :mod:`tools.planner.hardware` (inter-node figures for an axis whose groups cross nodes,
  ``RankLayout.crosses_nodes``); FSDP's all-gathers, reduce-scatters and HSDP all-reduces
  overlap with compute except the first all-gather and the last reduce-scatter (exposed: the
  larger of those two and what exceeds the compute time; all of them on hardware without
  overlap, ``Hardware.comm_overlap`` false: a CPU host); TP, CP, EP, PP and loss
  collectives are exposed (not overlapped); pipeline bubble = the textbook fraction of the
  schedule (``bubble_fraction``) of the busy time.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from functools import cached_property, lru_cache

from models.parallel.pipeline.plan import bubble_fraction as bubble_fraction_of

from .activations import activation_bytes
from .choice import DTYPE_BYTES, LayoutChoice, grad_accum_steps, selective_every, stage_layers
from .collectives import predict_collectives
from .compute import rank_matmul_flops
from .elementwise import elementwise_bytes
from .hardware import GIB, Hardware, collective_seconds, elementwise_seconds, optimizer_seconds, step_bytes_per_param
from .inventory import cached_layout, fsdp_meshes, model_inventory, stage_summary

__all__ = [
    "FSDP_OVERLAPPED",
    "Estimate",
    "Job",
    "estimate",
    "memory_for_rank",
]

FSDP_OVERLAPPED = ("fsdp", "efsdp", "dp_replicate")


@dataclass(frozen=True)
class Job:
    model: str
    flavor: str
    world_size: int
    gpus_per_node: int
    seq_len: int
    global_batch: int
    hardware: Hardware
    efficiency: float = 0.5  # achieved fraction of peak FLOP/s for the compute
    param_dtype: str = "bfloat16"
    reduce_dtype: str = "float32"
    tf32: bool = False  # float32 matmuls on TF32 tensor cores (training.enable_tf32)
    # model args a trainer config changes ((name, value) pairs: n_layers, vocab_size,
    # max_seq_len, mtp_layers; trainer.plan.model_overrides), over the flavor's
    model_overrides: tuple = ()
    # model.converters "float8" / "float8_experts": models.parallel.float8.Float8Options (None: off)
    float8: object = None
    # model.converters "lora": models.parallel.lora.LoRAOptions (None: off; tools/planner/lora.py)
    lora: object = None
    # optimizer.name, and Muon's optimizer.muon_distribution / muon_ns_steps (tools/planner/muon.py)
    optimizer: str = "AdamW"
    # the [[optimizer.param_groups]] routing: (pattern, optimizer or None) per table, in order
    # (trainer.optim.groups.choose; () = the default: Muon takes the hidden matrices)
    param_groups: tuple = ()
    muon_distribution: str = "round_robin"
    muon_ns_steps: int = 5

    @cached_property  # (frozen: kept in the instance's __dict__, outside the fields)
    def overrides(self) -> dict:
        return {**_overrides(self.model, self.flavor, self.seq_len), **dict(self.model_overrides)}


@lru_cache(maxsize=64)
def _overrides_cached(model: str, flavor: str, seq_len: int) -> tuple:
    from models.registry import get_model_spec

    args = get_model_spec(model, flavor).args
    # trainer.plan.model_overrides: the RoPE table covers seq_len
    return (("max_seq_len", max(args.max_seq_len, seq_len)),)


def _overrides(model: str, flavor: str, seq_len: int) -> dict:
    return dict(_overrides_cached(model, flavor, seq_len))


@dataclass
class Estimate:
    degrees: object
    choice: LayoutChoice
    memory: dict[str, float]  # bytes
    fits: bool
    time: dict | None  # seconds: compute, recompute, comm {axis: s}, bubble, total (None: not priced)
    tokens_per_s_per_gpu: float
    crosses_nodes: list[str]
    bubble_fraction: float
    grad_accum: int
    notes: list[str] = field(default_factory=list)

    def as_json(self) -> dict:
        d = self.degrees
        c = self.choice
        return {
            "degrees": {k: v for k, v in d.as_dict().items()} | {"efsdp": d.efsdp},
            "schedule": c.schedule,
            "n_microbatches": c.n_microbatches,
            "local_batch_size": c.local_batch,
            "grad_accum_steps": self.grad_accum,
            "ac": c.ac,
            "fsdp_reshard_after_forward": c.reshard,
            "memory_gib": {k: round(v / GIB, 3) for k, v in self.memory.items()},
            "fits": self.fits,
            "step_time_s": {
                "compute": round(self.time["compute"], 6),
                "recompute": round(self.time["recompute"], 6),
                "tp_overhead": round(self.time["tp_overhead"], 6),
                "cp_overhead": round(self.time["cp_overhead"], 6),
                "optimizer": round(self.time["optimizer"], 6),
                "elementwise": round(self.time["elementwise"], 6),
                "comm": {k: round(v, 6) for k, v in self.time["comm"].items()},
                "bubble": round(self.time["bubble"], 6),
                "total": round(self.time["total"], 6),
            },
            "tokens_per_s_per_gpu": round(self.tokens_per_s_per_gpu, 2),
            "crosses_nodes": self.crosses_nodes,
            "bubble_fraction": round(self.bubble_fraction, 4),
        }


_MESH_NAMES = ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep", "etp", "efsdp", "fsdp", "loss")


@lru_cache(maxsize=4096)
def _crossing(degrees, gpus_per_node: int) -> dict[str, bool]:
    layout = cached_layout(degrees)
    return {n: layout.size(n) > 1 and layout.crosses_nodes(n, gpus_per_node) for n in _MESH_NAMES}


@lru_cache(maxsize=4096)
def _per_node(degrees, gpus_per_node: int) -> dict[str, int]:
    """Members per node of each mesh's groups (the fewest over its groups and nodes): the NICs a
    group that crosses nodes uses at once."""
    import numpy as np

    layout = cached_layout(degrees)
    out = {}
    for n in _MESH_NAMES:
        nodes = layout.groups(n) // gpus_per_node
        # the fewest members of one group in one node, over every (group, node) pair at once:
        # one count of the distinct (row, node) keys (was a np.unique per group: most of a
        # 16,384-rank search's time)
        keys = np.arange(nodes.shape[0], dtype=np.int64)[:, None] * (int(nodes.max()) + 1) + nodes
        out[n] = int(np.unique(keys, return_counts=True)[1].min())
    return out


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


def memory_for_rank(job: Job, degrees, choice: LayoutChoice, rank: int) -> dict[str, float]:
    _, args = model_inventory(job.model, job.flavor, **job.overrides)
    layout = cached_layout(degrees)
    d = degrees
    pb, rb = DTYPE_BYTES[choice.param_dtype], DTYPE_BYTES[choice.reduce_dtype]
    stages, plan = stage_layers(args, d, choice, rank, layout)
    accum = grad_accum_steps(choice, d)
    m = choice.n_microbatches if d.pp > 1 else 1
    mb = choice.local_batch // m
    key = tuple(sorted(job.overrides.items()))
    padded, local, biggest, sharded = _rank_groups(job.model, job.flavor, key, d, rank, choice.mixed, tuple(stages))
    cast = sharded or (choice.mixed and pb != 4)
    unsharded_total = sum(biggest)
    keeps_all = d.pp > 1 or choice.reshard == "never" or not sharded
    if cast:
        gathered = unsharded_total * pb if keeps_all else (sum(biggest[:3])) * pb
    else:
        gathered = 0
    grads_unsharded = sum(biggest[:2]) * pb if sharded else 0
    if sharded and (accum > 1 or m > 1):
        grads_unsharded = unsharded_total * rb  # accumulated while the reduce-scatter waits
    act_bytes = DTYPE_BYTES[choice.param_dtype]
    held_layers = 0.0
    head_b = recompute = 0
    every = selective_every(choice)
    for layers, _embed, head in stages:
        est = _activations(
            job.model, job.flavor, key, layers, mb, job.seq_len, d.tp, d.cp, d.etp, act_bytes, choice.ac, head,
            every, choice.sequence_parallel,
        )  # fmt: skip
        held_layers += est.layers
        head_b += est.head
        recompute = max(recompute, est.recompute)
    layers_factor, logits_held = _in_flight(choice, d.pp, plan)
    activations = held_layers * layers_factor + head_b * logits_held + recompute
    # AdamW: 2 fp32 states; Muon: 1 (its momentum) for the matrices routed to it
    muon_local = _muon(job, d, choice, rank).local_numel if job.optimizer == "Muon" else 0
    params_b, grads_b, optimizer_b = 4 * padded, 4 * padded, 8 * local - 4 * muon_local
    if job.lora is not None:  # frozen base: gradients and optimizer state of the adapters only
        a_padded, a_local, a_groups = _adapter_shards(job, d, choice, rank, stages, layout)
        frozen_b = DTYPE_BYTES[job.lora.frozen_dtype]
        params_b, grads_b, optimizer_b = frozen_b * padded + 4 * a_padded, 4 * a_padded, 8 * a_local - 4 * muon_local
        gathered += sum(a_groups.values()) * pb if cast and keeps_all else 0
        biggest_a = sorted(a_groups.values(), reverse=True)
        grads_unsharded = sum(biggest_a[:2]) * pb if sharded else 0
        if sharded and (accum > 1 or m > 1):
            grads_unsharded = sum(biggest_a) * rb
    mem = {
        "params": params_b,
        "grads": grads_b,
        "optimizer": optimizer_b,
        "gathered_params": gathered,
        "unsharded_grads": grads_unsharded,
        "activations": activations,
    }
    mem["total"] = sum(mem.values())
    return mem


@lru_cache(maxsize=65536)
def _rank_groups(model, flavor, key: tuple, d, rank: int, mixed: bool, stages: tuple) -> tuple:
    """(padded and unpadded local elements ``rank`` stores, its FSDP groups' gathered (TP-local)
    elements largest first, whether a shard mesh has more than one rank) over its ``stages``:
    the part of :func:`memory_for_rank` that no AC, reshard or batch choice changes (cached: the
    search asks for it once per choice)."""
    _, args = model_inventory(model, flavor, **dict(key))
    dense_size, expert_size, _ = fsdp_meshes(d, args.has_experts, mixed)
    padded = local = 0
    gathered_groups: dict = {}
    for layers, embed, head in stages:
        for g in stage_summary(model, flavor, key, d, rank, mixed, layers, embed, head):
            padded += g.shard
            local += g.local
            gathered_groups[(g.name, layers.start)] = g.tp_local
    sharded = any(size is not None and size > 1 for size in (dense_size, expert_size))
    return padded, local, tuple(sorted(gathered_groups.values(), reverse=True)), sharded


def _adapter_shards(job: Job, d, choice: LayoutChoice, rank: int, stages, layout) -> tuple[int, int, dict]:
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


def _elementwise_bytes(job: Job, degrees, choice: LayoutChoice, rank: int) -> int:
    """Bytes of memory-bound activation work ``rank`` moves per step (:mod:`tools.planner.elementwise`):
    every micro-batch of every stage it holds."""
    _, args = model_inventory(job.model, job.flavor, **job.overrides)
    d = degrees
    stages, _ = stage_layers(args, d, choice, rank, cached_layout(d))
    m = choice.n_microbatches if d.pp > 1 else 1
    forwards = grad_accum_steps(choice, d) * m
    key = tuple(sorted(job.overrides.items()))
    per_mb = sum(
        _stage_elementwise(
            job.model,
            job.flavor,
            key,
            layers,
            choice.local_batch // m,
            choice.seq_len,
            d.tp,
            d.cp,
            d.etp,
            choice.sequence_parallel,
            DTYPE_BYTES[choice.param_dtype],
            choice.ac,
            head,
            selective_every(choice),
        )
        for layers, _embed, head in stages
    )
    return per_mb * forwards


@lru_cache(maxsize=65536)
def _stage_elementwise(model, flavor, key: tuple, layers, mb, seq_len, tp, cp, etp, sp, act_bytes, ac, head, every):
    """:func:`elementwise_bytes` of one stage and micro-batch (cached like :func:`_activations`)."""
    _, args = model_inventory(model, flavor, **dict(key))
    return elementwise_bytes(
        args, layers, mb, seq_len, tp=tp, cp=cp, etp=etp, sp=sp, act_bytes=act_bytes, ac=ac, head=head,
        selective_every=every,
    )  # fmt: skip


def estimate(job: Job, degrees, choice: LayoutChoice, time_if_oom: bool = True) -> Estimate:
    """Memory and step time of one layout. With ``time_if_oom=False`` a layout that does not
    fit gets no step time (``time`` None, 0 tokens/s): the search ranks those by memory only,
    and pricing their collectives was most of its cost."""
    _, args = model_inventory(job.model, job.flavor, **job.overrides)
    d = degrees
    layout = cached_layout(d)
    hw = job.hardware
    stride_pp = d.world_size // d.pp
    ranks = sorted({0, (d.pp - 1) * stride_pp})
    mems = [memory_for_rank(job, d, choice, r) for r in ranks]
    mem = max(mems, key=lambda x: x["total"])
    # the per-parameter work (casts, norm, clipping, AdamW) of the rank with the most local
    # parameters (AdamW: 8 bytes each)
    per_param = step_bytes_per_param(choice.param_dtype, choice.reduce_dtype)
    muons = [_muon(job, d, choice, r) for r in ranks] if job.optimizer == "Muon" else []
    locals_ = [(m["optimizer"] + 4 * (muons[i].local_numel if muons else 0)) / 8 for i, m in enumerate(mems)]
    optimizer = optimizer_seconds(max(locals_), hw, per_param)
    if muons:  # Newton-Schulz in float32 (TF32 with enable_tf32), after the backward
        optimizer += max(m.ns_flops for m in muons) / (
            hw.peak_flops("tf32" if job.tf32 else "float32") * job.efficiency
        )
    fits = mem["total"] <= hw.usable_gib * GIB
    if not fits and not time_if_oom:
        return Estimate(
            degrees=d, choice=choice, memory=mem, fits=False, time=None, tokens_per_s_per_gpu=0.0,
            crosses_nodes=[], bubble_fraction=0.0, grad_accum=grad_accum_steps(choice, d),
        )  # fmt: skip
    # compute: the busiest rank's matmul FLOPs (tools/planner/compute.py)
    tokens = job.global_batch * job.seq_len
    precision = "tf32" if choice.param_dtype == "float32" and job.tf32 else choice.param_dtype
    rate = hw.peak_flops(precision) * job.efficiency
    # float8: the converted linears' and experts' GEMMs at the float8 peak (tools/planner/float8.py)
    rate8 = hw.peak_flops("float8") * job.efficiency if choice.float8 is not None else rate
    flops = max(
        (rank_matmul_flops(job.model, job.flavor, d, choice, r, lora=job.lora, **job.overrides) for r in ranks),
        key=lambda f: f["total"],
    )
    f8 = flops["forward_float8"] + flops["backward_float8"]
    compute = (flops["forward"] + flops["backward"] - f8) / rate + f8 / rate8
    recompute = (
        (flops["recompute"] - flops["recompute_float8"]) / rate + flops["recompute_float8"] / rate8
    ) * hw.recompute_cost
    tp_overhead = cp_overhead = 0.0
    if (d.tp > 1 and hw.tp_block_overhead_s) or (d.cp > 1 and hw.cp_block_overhead_s):
        forwards = grad_accum_steps(choice, d) * (choice.n_microbatches if d.pp > 1 else 1)
        blocks = max(sum(len(layers) for layers, _, _ in stage_layers(args, d, choice, r, layout)[0]) for r in ranks)
        tp_overhead = hw.tp_block_overhead_s * blocks * forwards if d.tp > 1 else 0.0
        cp_overhead = hw.cp_block_overhead_s * blocks * forwards if d.cp > 1 else 0.0
    elementwise = elementwise_seconds(max(_elementwise_bytes(job, d, choice, r) for r in ranks), hw)
    busy = compute + recompute + tp_overhead + cp_overhead + elementwise
    # communication, from the busiest stage's rank
    crossing = _crossing(d, job.gpus_per_node)
    per_node = _per_node(d, job.gpus_per_node) if any(crossing.values()) else {}
    comm: dict[str, float] = {}
    fsdp_total = fsdp_first = 0.0
    # selective AC's per-op policy re-runs no collective: its records are no AC's (one
    # prediction serves both choices)
    same = (
        dataclasses.replace(choice, ac="none") if choice.ac == "selective" and not selective_every(choice) else choice
    )
    key = tuple(sorted(job.overrides.items()))
    records = max(
        (_collectives(job.model, job.flavor, d, same, r, key) for r in ranks),
        key=lambda recs: sum(x["count"] * x["bytes"] for x in recs),
    )
    for r in records:
        size = layout.size(r["mesh"])
        crosses = crossing.get(r["mesh"], False)
        one = collective_seconds(r["kind"], r["bytes"], size, crosses, hw, per_node.get(r["mesh"], 1) if crosses else 1)
        total = one * r["count"]
        if r["mesh"] in FSDP_OVERLAPPED:
            fsdp_total += total
            fsdp_first = max(fsdp_first, one)
            comm[r["mesh"]] = comm.get(r["mesh"], 0.0) + total
        else:
            comm[r["mesh"]] = comm.get(r["mesh"], 0.0) + total
    if muons:  # Muon's exchange (exposed: after the backward), the busiest rank's
        comm["muon"] = max(_muon_comm_seconds(m, crossing, per_node, hw) for m in muons)
    if not hw.comm_overlap:
        exposed_fsdp = fsdp_total
    else:
        exposed_fsdp = max(2 * fsdp_first, fsdp_total - busy) if fsdp_total else 0.0
    exposed_other = sum(v for k, v in comm.items() if k not in FSDP_OVERLAPPED)
    bubble_fraction = 0.0
    if d.pp > 1:
        _, plan = stage_layers(args, d, choice, 0, layout)
        bubble_fraction = plan.bubble_fraction or 0.0
        if plan.schedule == "ZBVZeroBubble":
            # the textbook ZB-V figure is 0 (F = B = W and enough micro-batches); with few
            # micro-batches the fill/drain remains: priced like the interleaved zero-bubble
            # schedule with its 2 stages per rank, (p-1) / (6m + p-1)
            bubble_fraction = bubble_fraction_of("InterleavedZeroBubble", d.pp, choice.n_microbatches, 2)
    work = busy + exposed_other
    bubble = work * bubble_fraction / (1 - bubble_fraction) if bubble_fraction < 1 else math.inf
    total = work + exposed_fsdp + bubble + optimizer
    time = {
        "compute": compute,
        "recompute": recompute,
        "tp_overhead": tp_overhead,
        "cp_overhead": cp_overhead,
        "optimizer": optimizer,
        "elementwise": elementwise,
        "comm": comm,
        "comm_exposed_fsdp": exposed_fsdp,
        "comm_exposed_other": exposed_other,
        "bubble": bubble,
        "total": total,
    }
    return Estimate(
        degrees=d,
        choice=choice,
        memory=mem,
        fits=fits,
        time=time,
        tokens_per_s_per_gpu=tokens / total / d.world_size,
        crosses_nodes=[
            k for k, v in crossing.items() if v and k in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep", "etp")
        ],
        bubble_fraction=bubble_fraction,
        grad_accum=grad_accum_steps(choice, d),
    )


@lru_cache(maxsize=8192)
def _collectives(model, flavor, d, choice: LayoutChoice, rank: int, key: tuple) -> list:
    return predict_collectives(model, flavor, d, choice, rank, cached_layout(d), **dict(key))


def _muon(job: Job, d, choice: LayoutChoice, rank: int):
    from .muon import muon_cost

    stages, _ = stage_layers(
        model_inventory(job.model, job.flavor, **job.overrides)[1], d, choice, rank, cached_layout(d)
    )
    return muon_cost(
        job.model, job.flavor, job.overrides, d, rank, choice.mixed, stages, job.muon_distribution, job.muon_ns_steps,
        job.param_groups, job.lora,
    )  # fmt: skip


def _muon_comm_seconds(cost, crossing: dict, per_node: dict, hw: Hardware) -> float:
    """Muon's collectives over their groups (a group of several axes crosses nodes if one does)."""
    total = 0.0
    for r in cost.comm:
        crosses = any(crossing.get(a, False) for a in r["axes"])
        nodes = min((per_node.get(a, 1) for a in r["axes"] if crossing.get(a)), default=1)
        total += r["count"] * collective_seconds(r["kind"], r["bytes"], r["group_size"], crosses, hw, nodes)
    return total
