"""Every valid layout of a job, estimated (:mod:`tools.planner.estimate`) and ranked.


Validity comes from the code the trainer runs, never from rules restated here:
``parallel_dims.validate_degrees`` (through ``ParallelDims``), the model rules
(``parallel_dims.check_model_layout`` on ``models.registry.model_rules``: heads and KV heads vs
tp, experts vs ep, seq_len vs cp and tp, layers vs pp, experts need sequence parallel under tp),
the batch rules (``check_model_layout`` on the batch sizes and
``trainer.config.gradient_accumulation_steps``) and the
pipeline rules (``models.parallel.pipeline.plan_stages``: stage counts per schedule,
micro-batch counts), and with float8 routed experts the converter's refusal of an etp degree at
which no expert converts (``models.parallel.float8.check_float8_experts``'s rule,
:func:`tools.planner.float8.float8_experts_refusal`). ``trainer.plan.plan_job`` runs the same
checks; the tests feed emitted layouts back through it.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache

from .choice import LayoutChoice
from .estimate import DIRECT, FSDP_OVERLAPPED, Estimate, Job, estimate, unpriced
from .float8 import float8_experts_refusal
from .hardware import GIB
from .inventory import model_inventory

__all__ = [
    "AC_MODES",
    "SCHEDULES",
    "PlanResult",
    "enumerate_choices",
    "enumerate_degrees",
    "enumerate_layouts",
    "losing_reason",
    "plan_layouts",
    "ranking_digest",
    "smallest_world_size",
    "summarize_losers",
]

AC_MODES = ("none", "selective", "full")
SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble")


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _check(fn) -> bool:
    try:
        fn()
        return True
    except ValueError:
        return False


@lru_cache(maxsize=65536)
def _valid_accum(global_batch: int, local_batch: int, batch: int) -> bool:
    """Whether the trainer accepts this batch split (``gradient_accumulation_steps``)."""
    from trainer.config import gradient_accumulation_steps

    return _check(lambda: gradient_accumulation_steps(global_batch, local_batch, batch))


@lru_cache(maxsize=65536)
def _valid_stages(n_layers: int, pp: int, schedule: str, m: int, local_batch: int) -> bool:
    """Whether the pipeline code accepts this schedule and micro-batch count (``plan_stages``)."""
    from models.parallel.pipeline.plan import plan_stages

    return _check(lambda: plan_stages(n_layers, pp, schedule, m, local_batch))


def enumerate_degrees(job: Job, args):
    """Every set of degrees valid for the model on ``job.world_size`` ranks (the layout and
    model rules, checked by the real code)."""
    from models.registry import model_rules
    from parallel_dims import ParallelDims, check_model_layout

    w = job.world_size
    rules = model_rules(args, job.seq_len, True)
    moe_fqns = tuple(job.float8.moe_fqns) if job.float8 is not None else ()
    key = tuple(sorted(job.overrides.items()))
    seen = []
    for tp in _divisors(w):
        for cp in _divisors(w // tp):
            for pp in _divisors(w // (tp * cp)):
                rest = w // (tp * cp * pp)
                for dp_rep in _divisors(rest):
                    dp_shard = rest // dp_rep
                    block = dp_shard * cp * tp
                    eps = _divisors(block) if args.has_experts else [1]
                    etps = sorted({1, tp}) if args.has_experts else [1]
                    for ep in eps:
                        for etp in etps:
                            if block % (ep * etp):
                                continue
                            try:
                                pd = ParallelDims(
                                    dp_replicate=dp_rep, dp_shard=dp_shard, cp=cp, tp=tp, pp=pp,
                                    ep=ep, etp=etp, world_size=w,
                                )  # fmt: skip
                                check_model_layout(pd.degrees, rules)
                            except ValueError:
                                continue
                            if moe_fqns and float8_experts_refusal(job.model, job.flavor, key, moe_fqns, etp):
                                continue
                            seen.append(pd.degrees)
    return seen


def enumerate_choices(job: Job, degrees, args, ac_modes=AC_MODES, schedules=SCHEDULES):
    """The schedule / micro-batch / AC / reshard choices valid for ``degrees``."""
    from parallel_dims.model_rules import ModelRules, check_model_layout

    d = degrees
    batch = d.dp_replicate * d.dp_shard
    if not _check(lambda: check_model_layout(d, ModelRules(global_batch_size=job.global_batch))):
        return
    per_rank = job.global_batch // batch
    base = _base_choice(job)
    for lb in _divisors(per_rank):
        if not _valid_accum(job.global_batch, lb, batch):
            continue
        pipe: list[tuple[str | None, int | None]] = [(None, None)]
        if d.pp > 1:
            pipe = []
            for sched in schedules:
                for m in sorted({d.pp, 2 * d.pp, 4 * d.pp, lb} & set(_divisors(lb))):
                    if _valid_stages(args.n_layers, d.pp, sched, m, lb):
                        pipe.append((sched, m))
        reshards = ("default", "never") if d.pp == 1 and d.dp_shard * d.cp > 1 else ("default",)
        for sched, m in pipe:
            for ac in ac_modes:
                for reshard in reshards:
                    yield _choice(base, lb, sched, m, ac, reshard)


def _base_choice(job: Job) -> dict:
    """The fields every choice of ``job`` shares, as a :class:`LayoutChoice`'s ``__dict__``."""
    return dict(
        LayoutChoice(
            global_batch=job.global_batch,
            local_batch=1,
            seq_len=job.seq_len,
            param_dtype=job.param_dtype,
            reduce_dtype=job.reduce_dtype,
            float8=job.float8,
            lora=job.lora,
        ).__dict__
    )


def _choice(base: dict, lb: int, sched, m, ac: str, reshard: str) -> LayoutChoice:
    """``LayoutChoice(**base, local_batch=lb, ...)`` (the same object: equal, same hash and
    repr) without the frozen dataclass's ``__init__``, which sets its 13 fields one by one
    through ``object.__setattr__`` (the search builds a choice per layout)."""
    c = object.__new__(LayoutChoice)
    c.__dict__.update(base, local_batch=lb, schedule=sched, n_microbatches=m, ac=ac, reshard=reshard)
    return c


def enumerate_layouts(job: Job, ac_modes=AC_MODES, schedules=SCHEDULES):
    """Every (degrees, choice) pair valid for ``job``."""
    _, args = model_inventory(job.model, job.flavor, **job.overrides)
    for degrees in enumerate_degrees(job, args):
        for choice in enumerate_choices(job, degrees, args, ac_modes, schedules):
            yield degrees, choice


@dataclass
class PlanResult:
    estimates: list[Estimate]  # best first: fitting layouts by tokens/s per GPU, then the rest
    pruned_oom: int  # layouts whose parameters, gradients and optimizer state alone do not fit

    @property
    def layouts(self) -> int:
        return len(self.estimates) + self.pruned_oom


def plan_layouts(
    job: Job, ac_modes=AC_MODES, schedules=SCHEDULES, prune_state: bool = True, reference: bool = False
) -> PlanResult:
    """Every valid layout of ``job``, estimated and ranked. Degrees whose training state
    (fp32 parameters, gradients, AdamW) alone exceeds the usable memory are counted as out of
    memory without estimating each of their choices (``prune_state`` False: estimated too, for
    ``--fit``, where CPU offload takes that state off the GPU). The layouts of one set of
    degrees are priced together (:class:`tools.planner.batch.BatchPricer`); ``reference``: each
    layout alone (:func:`estimate` as a single layout is priced; the same ranking, slower: the
    tests compare the two)."""
    from .batch import BatchPricer

    _, args = model_inventory(job.model, job.flavor, **job.overrides)
    usable = job.hardware.usable_gib * GIB
    ests: list[Estimate] = []
    pruned = 0
    pricer = DIRECT if reference else BatchPricer(job)
    for degrees in enumerate_degrees(job, args):
        choices = list(enumerate_choices(job, degrees, args, ac_modes, schedules))
        if not choices:
            continue
        if not reference:
            pricer.start(degrees)
        stride_pp = degrees.world_size // degrees.pp
        # the optimizer step's phase: parameters + gradients + optimizer state, a floor of the peak
        static = max(
            pricer.memory(job, degrees, choices[0], r)["phase_optimizer"]
            for r in sorted({0, (degrees.pp - 1) * stride_pp})
        )
        if static > usable and prune_state:
            pruned += len(choices)
            continue
        if reference:
            ests.extend(estimate(job, degrees, c, time_if_oom=False, pricer=pricer) for c in choices)
        else:
            ranks = sorted({0, (degrees.pp - 1) * stride_pp})  # as estimate() takes them
            for c, mems in zip(choices, pricer.memories(choices, ranks)):
                # estimate()'s busiest rank (max(): the first of equals) and its test of fit
                mem = mems[1] if len(mems) > 1 and mems[1]["total"] > mems[0]["total"] else mems[0]
                if mem["total"] <= usable:
                    ests.append(estimate(job, degrees, c, False, pricer, mems))
                else:
                    ests.append(unpriced(degrees, c, mem))
    ests.sort(key=lambda e: (not e.fits, -e.tokens_per_s_per_gpu if e.fits else e.memory["total"]))
    return PlanResult(ests, pruned)


def ranking_digest(result: PlanResult) -> str:
    """sha256 of every estimate of ``result`` in rank order (degrees, choice, memory and time
    terms, tokens/s, as exact reprs) and the pruned count: equal digests, identical rankings
    (tests/unit/test_planner_fast.py, benchmarks/planner_search.py)."""
    import hashlib
    import json

    rows = [
        [e.degrees.as_dict(), repr(e.choice), e.fits, {k: repr(v) for k, v in e.memory.items()},
         None if e.time is None else repr(e.time), repr(e.tokens_per_s_per_gpu), e.crosses_nodes,
         repr(e.bubble_fraction), e.grad_accum]
        for e in result.estimates
    ]  # fmt: skip
    return hashlib.sha256(json.dumps([result.pruned_oom, rows]).encode()).hexdigest()


def losing_reason(e: Estimate, best: Estimate, job: Job) -> str:
    """Why ``e`` ranks below ``best``: out of memory, or the cost that grew the most."""
    if not e.fits:
        return "out of memory"
    deltas = {
        "pipeline bubble": e.time["bubble"] - best.time["bubble"],
        "activation recompute": e.time["recompute"] - best.time["recompute"],
        "compute": e.time["compute"] - best.time["compute"],
        "tensor-parallel host overhead": e.time["tp_overhead"] - best.time["tp_overhead"],
        "context-parallel host overhead": e.time["cp_overhead"] - best.time["cp_overhead"],
        "optimizer step": e.time["optimizer"] - best.time["optimizer"],
        "elementwise work": e.time["elementwise"] - best.time["elementwise"],
    }
    for axis in set(e.time["comm"]) | set(best.time["comm"]):
        mine = e.time["comm"].get(axis, 0.0)
        theirs = best.time["comm"].get(axis, 0.0)
        if axis in FSDP_OVERLAPPED:
            mine = mine if e.time["comm_exposed_fsdp"] else 0.0
            theirs = theirs if best.time["comm_exposed_fsdp"] else 0.0
            share_e = e.time["comm_exposed_fsdp"] / max(sum(e.time["comm"].get(a, 0) for a in FSDP_OVERLAPPED), 1e-30)
            share_b = best.time["comm_exposed_fsdp"] / max(
                sum(best.time["comm"].get(a, 0) for a in FSDP_OVERLAPPED), 1e-30
            )
            mine, theirs = mine * share_e, theirs * share_b
        crosses = axis in e.crosses_nodes or (axis == "fsdp" and "dp_shard" in e.crosses_nodes)
        deltas[f"{axis} communication{' across nodes' if crosses else ''}"] = mine - theirs
    reason, worst = max(deltas.items(), key=lambda kv: kv[1])
    return reason if worst > 0 else "same estimate, ranked lower"


def summarize_losers(result: PlanResult, job: Job, top: int) -> Counter:
    """How many layouts below the ``top`` lost for each reason."""
    ests = result.estimates
    if not ests or not ests[0].fits:
        return Counter({"out of memory": result.layouts})
    best = ests[0]
    reasons = Counter(losing_reason(e, best, job) for e in ests[top:])
    if result.pruned_oom:
        reasons["out of memory"] += result.pruned_oom
    return reasons


def smallest_world_size(job: Job, limit_factor: int = 64) -> int | None:
    """The smallest world size (a multiple of gpus per node above ``job.world_size``) on which
    some layout fits, searching only the least-memory choices (full AC; every degree, batch
    split and schedule still enumerated); None up to ``limit_factor`` x the world size."""
    w = job.world_size
    step = job.gpus_per_node
    start = (w // step + 1) * step
    for candidate in range(start, max(start, w * limit_factor) + 1, step):
        j = dataclasses.replace(job, world_size=candidate)
        for d, c in enumerate_layouts(j, ac_modes=("full",), schedules=("1F1B", "GPipe")):
            if estimate(j, d, c, time_if_oom=False).fits:
                return candidate
    return None
