"""The order in which torch's pipeline schedules run their actions on each pp rank, read from
torch itself (stand-in stages), and what the order implies for FSDP2's gradient casts under a
split-backward schedule."""

from __future__ import annotations

from functools import lru_cache

from parallel_dims.torch_compat import compute_order_only

__all__ = ["rank_split_backward_casts", "schedule_order", "split_backward_casts"]


@lru_cache(maxsize=1024)
def split_backward_casts(schedule: str, pp: int, stages_per_rank: int, m: int) -> dict[int, bool] | None:
    """For a schedule that splits each backward into an input half (I) and a weight half (W):
    stage -> whether FSDP2 moves the stage's gradients into its reduce-dtype accumulator before
    the step's reduction, i.e. whether one of the stage's I actions runs after one of its W
    actions (see :func:`tools.planner.collectives.predict_collectives`). None for a schedule of whole backwards. The
    order is torch's own, computed from stand-in stages (building it reads only the stage
    counts and ranks): the compute actions of ``pipeline_order``, without the communication
    torch's constructor then inserts (``_prepare_schedule_with_comms``, seconds per schedule at
    pp 8 x 128 micro-batches, most of a search's time), which leaves each rank's compute order
    as it is (:func:`schedule_order` with ``comms``; tests/unit/test_planner.py compares both)."""
    from models.parallel.pipeline.plan import schedule_facts

    name, facts = schedule_facts(schedule)
    if not facts.split_backward:
        return None
    return _casts(schedule_order(name, pp, stages_per_rank, m).values())


@lru_cache(maxsize=65536)
def rank_split_backward_casts(schedule: str, pp: int, stages_per_rank: int, m: int, pp_rank: int):
    """:func:`split_backward_casts` restricted to the stages of pp rank ``pp_rank``, computed from
    that rank's actions alone (what the search asks: the first and the last stage's rank): torch's
    schedule builds each rank's actions on its own (``_calculate_single_rank_operations``), and
    the bubbles it then inserts (``_add_bubbles_to_actions``) add idle slots between a rank's
    actions without reordering them, so the rank's order, and the answer, is the same
    (tests/unit/test_planner_fast.py compares both over every schedule)."""
    from models.parallel.pipeline.plan import schedule_facts

    name, facts = schedule_facts(schedule)
    if not facts.split_backward:
        return None
    return _casts([schedule_order(name, pp, stages_per_rank, m, ranks=(pp_rank,))[pp_rank]])


def _casts(orders) -> dict[int, bool] | None:
    """stage -> whether one of its input-backward actions follows one of its weight-backward
    actions on the rank that runs it (None when no rank runs an input-backward half)."""
    from torch.distributed.pipelining.schedules import _ComputationType

    inp, weight = _ComputationType.BACKWARD_INPUT, _ComputationType.BACKWARD_WEIGHT
    out: dict[int, bool] = {}
    for actions in orders:
        seen_weight: set[int] = set()
        for a in actions:
            if a is None:
                continue
            if a.computation_type == weight:
                seen_weight.add(a.stage_index)
            elif a.computation_type == inp:
                out[a.stage_index] = out.get(a.stage_index, False) or a.stage_index in seen_weight
    return out or None


def schedule_order(name: str, pp: int, stages_per_rank: int, m: int, comms: bool = False, ranks=None) -> dict:
    """rank -> the actions torch's schedule ``name`` runs on that pp rank (None = idle), built
    from stand-in stages; ``comms``: as its runtime executes them, with the communication and
    FSDP unshard/reshard actions torch inserts (slow), else the compute actions only. ``ranks``
    (compute actions only): just these ranks' actions, in their order, without the idle slots
    (the other ranks' lists left empty)."""
    from types import SimpleNamespace

    from models.parallel.pipeline.schedule import SCHEDULES

    cls = SCHEDULES[name].cls
    if not comms:
        cls = compute_order_only(cls) if ranks is None else _only_ranks(cls, tuple(ranks))
    n = pp * stages_per_rank
    stand_ins = [SimpleNamespace(num_stages=n, group_size=pp, group_rank=0, stage_index=i, submod=None)
                 for i in range(stages_per_rank)]  # fmt: skip
    built = cls(stand_ins, m)
    if comms:
        return getattr(built, "pipeline_order_with_comms", None) or built.pipeline_order
    return built.pipeline_order


@lru_cache(maxsize=64)
def _only_ranks(schedule_cls: type, ranks: tuple) -> type:
    """A compute-order subclass of ``schedule_cls`` that builds the actions of ``ranks`` only
    and inserts no idle slots (no bubbles, no communication)."""
    base = compute_order_only(schedule_cls)

    def single(self, rank):
        return base._calculate_single_rank_operations(self, rank) if rank in ranks else []

    return type(
        f"_Ranks{schedule_cls.__name__}",
        (base,),
        {"_calculate_single_rank_operations": single, "_add_bubbles_to_actions": lambda self, n: self.pipeline_order},
    )
