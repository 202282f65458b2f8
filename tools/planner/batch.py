"""The search's pricing of many layouts at once: :class:`BatchPricer` gives
:func:`tools.planner.estimate.estimate` its parts (memory, FLOPs, elementwise bytes, collective
times) reusing what the choices of one set of degrees share, instead of pricing each layout
from scratch.

What each part depends on, within one set of degrees (the job's dtypes, sequence length,
converters and LoRA are the same for every choice the search makes):

* a rank's stages, parameter shards and FSDP groups, micro-batch size and accumulation
  (:class:`tools.planner.rank_memory.RankContext`): its (schedule, micro-batches, local
  batch), not the AC or reshard choice; its activations per micro-batch: its stages' layer
  ranges, the micro-batch size and the AC choice;
* its matmul FLOPs: its stages' layer ranges and the AC choice (the tokens of a step, local
  batch x accumulation, are the same for every batch split; with LoRA also the forwards per
  step);
* its elementwise bytes: its stages, micro-batch size, forwards per step and AC choice;
* its collectives: its stages, the schedule, AC and reshard choices, and the batch split only
  through the split's numbers (micro-batch tokens, forwards, gradient syncs, FSDP gathers):
  one :class:`tools.planner.collective_template.CollectiveTemplate` per (rank, schedule, AC,
  reshard) gives every split's records (:func:`tools.planner.collectives.predict_collectives`
  itself is that template's records of one split);
* one collective's time: (kind, bytes, group size, whether it crosses nodes, members per node).

The memory of every choice of a set of degrees is priced in one pass per rank
(:meth:`BatchPricer.memories`), the consecutive choices that share a context and activation
sums looked up once; ``memory_from_context`` is still called once per (choice, rank).

Every cached value is what the same function returns for the same inputs, so the estimates
are those of pricing each layout alone, to the bit (tests/unit/test_planner_fast.py compares
the two paths).
"""

from __future__ import annotations

import dataclasses

from .choice import LayoutChoice, grad_accum_steps
from .collectives import collective_template, template_key
from .estimate import FSDP_OVERLAPPED, Job, Pricer, _elementwise_bytes, _mesh_sizes
from .hardware import collective_seconds
from .rank_memory import activation_sums, context_activations, memory_from_context, rank_context

__all__ = ["BatchPricer"]


class BatchPricer(Pricer):
    """:class:`~tools.planner.estimate.Pricer` with caches over the choices of one set of
    degrees (:meth:`start` before each)."""

    def __init__(self, job: Job):
        self.job = job
        self._seconds: dict = {}  # the job's hardware: any degrees
        self.start(None)

    def start(self, degrees) -> None:
        self.d = degrees
        self._contexts: dict = {}
        self._bases: dict = {}  # (rank, schedule, micro-batches): a context and its stages' key
        self._shares: dict = {}
        self._activations: dict = {}
        self._flops: dict = {}
        self._elementwise: dict = {}
        self._comm: dict = {}
        self._one: dict = {}  # one collective's seconds by (kind, mesh, bytes)

    def _context(self, choice: LayoutChoice, rank: int):
        k = (rank, choice.schedule, choice.n_microbatches, choice.local_batch)
        hit = self._contexts.get(k)
        if hit is None:
            # the stages and their shards do not depend on the local batch (the pipeline plan
            # reads it only to check the micro-batch count, which the enumerated choices pass):
            # one context per (rank, schedule, micro-batches), the batch split's fields set
            base = self._bases.get(k[:3])
            if base is None:
                ctx = rank_context(self.job, self.d, choice, rank, self._shares)
                stages_key = tuple((layers.start, layers.stop, embed, head) for layers, embed, head in ctx.stages)
                self._bases[k[:3]] = (ctx, stages_key)
            else:
                ctx, stages_key = base
                ctx = dataclasses.replace(ctx, accum=grad_accum_steps(choice, self.d), mb=choice.local_batch // ctx.m)
            hit = self._contexts[k] = (k, ctx, stages_key)
        return hit

    def memory(self, job: Job, d, choice: LayoutChoice, rank: int) -> dict:
        _, ctx, stages_key = self._context(choice, rank)
        ak = (rank, stages_key, ctx.mb, choice.ac, choice.selective_ac_option)
        sums = self._activations.get(ak)
        if sums is None:
            sums = self._activations[ak] = activation_sums(job, d, choice, ctx.stages, ctx.mb)
        return memory_from_context(job, d, choice, ctx, context_activations(job, d, choice, ctx, sums))

    def memories(self, choices: list, ranks: list) -> list:
        """``[[memory of each of ranks] for each choice]``: :meth:`memory` of every choice of
        these degrees, the choices sharing a context (consecutive in
        :func:`tools.planner.search.enumerate_choices`' order) looked up once."""
        job, d = self.job, self.d
        per_rank = []
        for rank in ranks:
            out = []
            last = last_ak = acts = None
            for choice in choices:
                k = (rank, choice.schedule, choice.n_microbatches, choice.local_batch)
                if k != last:
                    _, ctx, stages_key = self._context(choice, rank)
                    last, acts = k, None
                ak = (rank, stages_key, ctx.mb, choice.ac, choice.selective_ac_option)
                if ak != last_ak or acts is None:
                    sums = self._activations.get(ak)
                    if sums is None:
                        sums = self._activations[ak] = activation_sums(job, d, choice, ctx.stages, ctx.mb)
                    last_ak = ak
                    # what the micro-batches in flight hold: the same for every choice of one
                    # context (schedule, micro-batches) and activation key
                    acts = context_activations(job, d, choice, ctx, sums)
                out.append(memory_from_context(job, d, choice, ctx, acts))
            per_rank.append(out)
        return list(zip(*per_rank))  # a tuple of the ranks' memories per choice

    def flops(self, job: Job, d, choice: LayoutChoice, rank: int) -> dict:
        _, ctx, stages_key = self._context(choice, rank)
        forwards = ctx.accum * ctx.m if job.lora is not None else 0
        fk = (rank, stages_key, choice.ac, choice.selective_ac_option, choice.local_batch * ctx.accum, forwards)
        hit = self._flops.get(fk)
        if hit is None:
            hit = self._flops[fk] = super().flops(job, d, choice, rank)
        return hit

    def elementwise(self, job: Job, d, choice: LayoutChoice, rank: int) -> int:
        _, ctx, stages_key = self._context(choice, rank)
        ek = (rank, stages_key, ctx.mb, grad_accum_steps(choice, d) * ctx.m, choice.ac, choice.selective_ac_option)
        hit = self._elementwise.get(ek)
        if hit is None:
            hit = self._elementwise[ek] = _elementwise_bytes(job, d, choice, rank)
        return hit

    def collective_seconds(self, kind: str, nbytes, size: int, crosses: bool, hw, per_node: int) -> float:
        k = (kind, nbytes, size, crosses, per_node)
        hit = self._seconds.get(k)
        if hit is None:
            hit = self._seconds[k] = collective_seconds(kind, nbytes, size, crosses, hw, per_node)
        return hit

    def comm(self, job: Job, d, choice: LayoutChoice, ranks: list, crossing: dict, per_node: dict) -> tuple:
        """:meth:`Pricer.comm` from the ranks' collective templates (priced once per schedule,
        AC and reshard choice; :class:`tools.planner.collectives.CollectiveTemplate`) scaled
        to the choice's batch split: the records :func:`predict_collectives` gives, in its
        order, so the same sums."""
        m = choice.n_microbatches if d.pp > 1 else 1
        accum = grad_accum_steps(choice, d)
        mb = choice.local_batch // m
        c = choice
        # (the job and the degrees are this pricer's: the rest of template_key and the split)
        ck = (
            c.schedule, c.ac, c.selective_ac_option, c.reshard, c.seq_len, c.param_dtype, c.reduce_dtype,
            c.sequence_parallel, c.loss_parallel, c.float8, c.lora, accum, m, mb,
        )  # fmt: skip
        hit = self._comm.get(ck)
        if hit is None:
            okey = tuple(sorted(job.overrides.items()))
            tkeys = [template_key(job.model, job.flavor, okey, d, choice, r) for r in ranks]
            best = best_bytes = None
            for r, tkey in zip(ranks, tkeys):
                tmpl = collective_template(job.model, job.flavor, d, choice, r, okey, tkey=tkey)
                nbytes = tmpl.total_bytes(accum, m, mb) if len(ranks) > 1 else 0
                if best is None or nbytes > best_bytes:  # the first of equals, as max()
                    best, best_bytes = tmpl, nbytes
            comm: dict[str, float] = {}
            fsdp_total = fsdp_first = 0.0
            for k, count in best.records(accum, m, mb):
                one = self._one.get(k)
                if one is None:
                    mesh, kind, nbytes = k
                    crosses = crossing.get(mesh, False)
                    one = self._one[k] = self.collective_seconds(
                        kind, nbytes, _mesh_sizes(d)[mesh], crosses, job.hardware,
                        per_node.get(mesh, 1) if crosses else 1,
                    )  # fmt: skip
                total = one * count
                mesh = k[0]
                if mesh in FSDP_OVERLAPPED:
                    fsdp_total += total
                    fsdp_first = max(fsdp_first, one)
                comm[mesh] = comm.get(mesh, 0.0) + total
            hit = self._comm[ck] = (comm, fsdp_total, fsdp_first)
        comm, fsdp_total, fsdp_first = hit
        return dict(comm), fsdp_total, fsdp_first
