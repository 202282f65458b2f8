"""Estimates of one layout of a job: memory and step time per rank.

Estimates, per rank (the worst rank: coordinate 0 of every axis, first and last pipeline
stage) -- every assumption is also printed with the result:

* memory: the largest of the step's phases (:mod:`tools.planner.phases`: the loss backward's
  start, the blocks' backward, the optimizer step), each counting what is alive then, from
  these kinds: fp32 parameters and gradients (FSDP2's padded chunks), AdamW's two fp32 states
  (unpadded), the compute-dtype copies FSDP gathers (after the forward the head and the last
  block; in the backward the last block and the prefetched one, at its end the embeddings;
  every group under pp, ``reshard = never`` or without sharding), unsharded gradients (two
  groups in flight; the earlier micro-batches' accumulated while gradient accumulation or
  pipeline micro-batches defer the reduce-scatter), activations (:mod:`tools.planner.activations`)
  times the micro-batches a schedule keeps in flight (1F1B-like: min(m, pp) on the first stage;
  GPipe / LoopedBFS: all m; interleaved: its warm-up chunks), the logits and loss buffers and
  the loss backward's two float32 gradients; ``fits`` when the peak is at most the GPU's
  memory minus the reserve;
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

from .choice import DTYPE_BYTES, LayoutChoice, grad_accum_steps, selective_every, stage_layers
from .collectives import predict_collectives
from .compute import rank_matmul_flops
from .elementwise import elementwise_bytes
from .hardware import GIB, Hardware, collective_seconds, elementwise_seconds, optimizer_seconds, step_bytes_per_param
from .inventory import cached_layout, model_inventory
from .phases import peak_phase_name
from .rank_memory import _activations, _in_flight, _muon, memory_for_rank  # noqa: F401 (re-exported)

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
            "memory_gib": {k: round(v / GIB, 3) for k, v in self.memory.items() if k != "peak_phase"},
            "memory_peak_phase": peak_phase_name(self.memory),
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
    return {n: layout.size(n) > 1 and _node_facts(layout, n, gpus_per_node)[0] for n in _MESH_NAMES}


@lru_cache(maxsize=4096)
def _per_node(degrees, gpus_per_node: int) -> dict[str, int]:
    """Members per node of each mesh's groups (the fewest over its groups and nodes): the NICs a
    group that crosses nodes uses at once."""
    layout = cached_layout(degrees)
    return {n: _node_facts(layout, n, gpus_per_node)[1] for n in _MESH_NAMES}


@lru_cache(maxsize=4096)
def _mesh_sizes(degrees) -> dict[str, int]:
    layout = cached_layout(degrees)
    return {n: layout.size(n) for n in _MESH_NAMES}


_NODE_FACTS: dict = {}


def _node_facts(layout, name: str, gpus_per_node: int) -> tuple[bool, int]:
    """(whether a group of mesh ``name`` spans several nodes, as ``RankLayout.crosses_nodes``;
    the fewest members of one of its groups in one node). A mesh's groups are fixed by its
    (size, stride) modes and the world size (``RankLayout.groups``), so the facts are cached
    on those: the search's degrees share most of their meshes."""
    import numpy as np

    key = (tuple(layout.modes(name)), layout.degrees.world_size, gpus_per_node)
    hit = _NODE_FACTS.get(key)
    if hit is None:
        nodes = layout.groups(name) // gpus_per_node
        crosses = bool((nodes.min(axis=1) != nodes.max(axis=1)).any())
        # the fewest members of one group in one node, over every (group, node) pair at once:
        # one count of the distinct (row, node) keys
        keys = np.arange(nodes.shape[0], dtype=np.int64)[:, None] * (int(nodes.max()) + 1) + nodes
        hit = _NODE_FACTS[key] = (crosses, int(np.unique(keys, return_counts=True)[1].min()))
    return hit


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


class Pricer:
    """Where :func:`estimate` gets its parts: straight from their functions (the default);
    :class:`tools.planner.batch.BatchPricer` reuses them over the choices of one set of degrees
    (the same functions on the same inputs: the same floats)."""

    def memory(self, job: Job, d, choice: LayoutChoice, rank: int) -> dict:
        return memory_for_rank(job, d, choice, rank)

    def flops(self, job: Job, d, choice: LayoutChoice, rank: int) -> dict:
        return rank_matmul_flops(job.model, job.flavor, d, choice, rank, lora=job.lora, **job.overrides)

    def elementwise(self, job: Job, d, choice: LayoutChoice, rank: int) -> int:
        return _elementwise_bytes(job, d, choice, rank)

    def collectives(self, job: Job, d, choice: LayoutChoice, rank: int, key: tuple) -> list:
        return _collectives(job.model, job.flavor, d, choice, rank, key)

    def collective_seconds(self, kind: str, nbytes, size: int, crosses: bool, hw: Hardware, per_node: int) -> float:
        return collective_seconds(kind, nbytes, size, crosses, hw, per_node)

    def comm(self, job: Job, d, choice: LayoutChoice, ranks: list, crossing: dict, per_node: dict) -> tuple:
        """(seconds per mesh, FSDP's total and its largest single collective) of the busiest
        rank's collectives (the most bytes) of ``ranks``."""
        key = tuple(sorted(job.overrides.items()))
        records = max(
            (self.collectives(job, d, choice, r, key) for r in ranks),
            key=lambda recs: sum(x["count"] * x["bytes"] for x in recs),
        )
        comm: dict[str, float] = {}
        fsdp_total = fsdp_first = 0.0
        sizes = _mesh_sizes(d)
        for r in records:
            crosses = crossing.get(r["mesh"], False)
            one = self.collective_seconds(
                r["kind"], r["bytes"], sizes[r["mesh"]], crosses, job.hardware,
                per_node.get(r["mesh"], 1) if crosses else 1,
            )  # fmt: skip
            total = one * r["count"]
            if r["mesh"] in FSDP_OVERLAPPED:
                fsdp_total += total
                fsdp_first = max(fsdp_first, one)
            comm[r["mesh"]] = comm.get(r["mesh"], 0.0) + total
        return comm, fsdp_total, fsdp_first


DIRECT = Pricer()


def unpriced(degrees, choice: LayoutChoice, mem: dict) -> Estimate:
    """The estimate of a layout that does not fit, unpriced (what :func:`estimate` returns
    with ``time_if_oom=False``): its memory, no step time, 0 tokens/s."""
    return Estimate(
        degrees=degrees, choice=choice, memory=mem, fits=False, time=None, tokens_per_s_per_gpu=0.0,
        crosses_nodes=[], bubble_fraction=0.0, grad_accum=grad_accum_steps(choice, degrees),
    )  # fmt: skip


def estimate(
    job: Job, degrees, choice: LayoutChoice, time_if_oom: bool = True, pricer: Pricer = DIRECT, mems=None
) -> Estimate:
    """Memory and step time of one layout. With ``time_if_oom=False`` a layout that does not
    fit gets no step time (``time`` None, 0 tokens/s): the search ranks those by memory only,
    and pricing their collectives was most of its cost. ``mems``: the memory of the first and
    the last pipeline rank when the caller has it (``pricer.memory``'s)."""
    d = degrees
    hw = job.hardware
    stride_pp = d.world_size // d.pp
    ranks = sorted({0, (d.pp - 1) * stride_pp})
    if mems is None:
        mems = [pricer.memory(job, d, choice, r) for r in ranks]
    mem = max(mems, key=lambda x: x["total"])
    fits = mem["total"] <= hw.usable_gib * GIB
    if not fits and not time_if_oom:
        return unpriced(d, choice, mem)
    _, args = model_inventory(job.model, job.flavor, **job.overrides)
    layout = cached_layout(d)
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
    # compute: the busiest rank's matmul FLOPs (tools/planner/compute.py)
    tokens = job.global_batch * job.seq_len
    precision = "tf32" if choice.param_dtype == "float32" and job.tf32 else choice.param_dtype
    rate = hw.peak_flops(precision) * job.efficiency
    # float8: the converted linears' and experts' GEMMs at the float8 peak (tools/planner/float8.py)
    rate8 = hw.peak_flops("float8") * job.efficiency if choice.float8 is not None else rate
    flops = max((pricer.flops(job, d, choice, r) for r in ranks), key=lambda f: f["total"])
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
    elementwise = elementwise_seconds(max(pricer.elementwise(job, d, choice, r) for r in ranks), hw)
    busy = compute + recompute + tp_overhead + cp_overhead + elementwise
    # communication, from the busiest stage's rank
    crossing = _crossing(d, job.gpus_per_node)
    per_node = _per_node(d, job.gpus_per_node) if any(crossing.values()) else {}
    # selective AC's per-op policy re-runs no collective: its records are no AC's (one
    # prediction serves both choices)
    same = (
        dataclasses.replace(choice, ac="none") if choice.ac == "selective" and not selective_every(choice) else choice
    )
    comm, fsdp_total, fsdp_first = pricer.comm(job, d, same, ranks, crossing, per_node)
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


def _muon_comm_seconds(cost, crossing: dict, per_node: dict, hw: Hardware) -> float:
    """Muon's collectives over their groups (a group of several axes crosses nodes if one does)."""
    total = 0.0
    for r in cost.comm:
        crosses = any(crossing.get(a, False) for a in r["axes"])
        nodes = min((per_node.get(a, 1) for a in r["axes"] if crossing.get(a)), default=1)
        total += r["count"] * collective_seconds(r["kind"], r["bytes"], r["group_size"], crosses, hw, nodes)
    return total
