"""A rank's collectives for every batch split at once (:class:`CollectiveTemplate`): what
:func:`tools.planner.collectives.predict_collectives` returns, as terms whose bytes and counts
are scaled by the split's numbers (micro-batch tokens, forwards, gradient syncs, gathers), so
the search prices a rank's collectives once per (degrees, rank, schedule, AC, reshard) and
each of their batch splits by arithmetic (tools/planner/batch.py)."""

from __future__ import annotations

from dataclasses import dataclass

from .schedule_order import rank_split_backward_casts

__all__ = ["CollectiveTemplate"]

# bytes of a template term (CollectiveTemplate.terms): b itself; b x the micro-batch's CP-local
# tokens t; b x t / tp under sequence parallel (each tp rank's sequence shard); b x the bytes of
# the dtype a Partial gradient is held in (the compute or the reduce dtype: see below)
_CONST, _T, _TN, _GB = 0, 1, 2, 3


@dataclass(frozen=True, slots=True)
class CollectiveTemplate:
    """What one rank issues in a step for every batch split at once: each term is ``(kind, mesh,
    bytes type, b, stage id, per forward, per gradient sync, per gather of a group resharded
    after forward, per gather of another group, per step)`` (the counts of each per-layout
    number, see :meth:`records`); the search prices it once per (degrees, rank, schedule, AC,
    reshard) and :meth:`records` gives each batch split's records."""

    terms: tuple
    pp: bool
    s_local: int  # CP-local tokens of one sequence
    shards: int  # tp under sequence parallel, else 1
    pb: int
    rb: int
    gb_rule: str  # "": the compute dtype; "accum" / "casts": see _build_template's TP part
    schedule: str | None
    pp_degree: int
    stages_per_rank: int
    pp_rank: int
    # the terms' bytes x counts summed per (bytes type, stage id): ((type, stage id, per forward,
    # per sync, per resharded gather, per gather, per step), ...), for :meth:`total_bytes`
    weights: tuple = ()

    def _numbers(self, accum: int, m: int, mb: int) -> tuple:
        """(count multipliers: per forward, sync, resharded gather, gather, step; byte scales
        per type; the gradient dtype's bytes or None; the split-backward casts or None)."""
        pp = self.pp
        # gradient reductions per FSDP group per step: per accumulation step pipelined; a group
        # resharded after forward is gathered m + 1 times per accumulation step pipelined,
        # without pp for the forward and again for the backward
        counts = (accum * m, accum if pp else 1, accum * (m + 1) if pp else accum * 2, accum, 1)
        t = mb * self.s_local
        gb = casts = None
        if self.gb_rule == "accum":
            gb = self.rb if accum > 1 else self.pb
        elif self.gb_rule == "casts":
            casts = rank_split_backward_casts(self.schedule, self.pp_degree, self.stages_per_rank, m, self.pp_rank)
        return counts, (1, t, t // self.shards), gb, casts

    def total_bytes(self, accum: int, m: int, mb: int) -> int:
        """``sum(count * bytes)`` of :meth:`records` (the search's busiest-rank test), from
        :attr:`weights` without building the records."""
        (cf, cs, cflag, cg, c1), scale, gb, casts = self._numbers(accum, m, mb)
        total = 0
        for typ, sid, f, s, flag, g, one in self.weights:
            if typ != _GB:
                unit = scale[typ]
            elif gb is not None:
                unit = gb
            else:
                unit = self.rb if casts is None or casts[sid] else self.pb
            total += unit * (f * cf + s * cs + flag * cflag + g * cg + one * c1)
        return total

    def records(self, accum: int, m: int, mb: int) -> list:
        """``[((mesh, kind, bytes), count)]`` sorted, counts > 0, for ``accum`` accumulation
        steps of ``m`` micro-batches (1 without pp) of ``mb`` sequences."""
        (per_forward, per_sync, per_flag, per_gather, _), scale, gb, casts = self._numbers(accum, m, mb)
        rec: dict = {}
        for kind, mesh, typ, b, sid, f, s, flag, g, one in self.terms:
            if typ != _GB:
                nb = scale[typ] * b
            elif gb is not None:
                nb = gb * b
            else:
                nb = (self.rb if casts is None or casts[sid] else self.pb) * b
            k = (mesh, kind, nb)
            rec[k] = rec.get(k, 0) + f * per_forward + s * per_sync + flag * per_flag + g * per_gather + one
        return sorted((k, c) for k, c in rec.items() if c)
