"""Pipeline stage planning: pure arithmetic on layer, rank and micro-batch counts.

Nothing here builds a module, touches a device or a process group (no torch import at all), so
a job planner can ask what a pipeline layout would be, and whether it is legal, before building
anything: :func:`plan_stages` answers with a :class:`StagePlan` or raises the ValueError that
:func:`~models.parallel.pipeline.split_model` / :func:`~models.parallel.pipeline.build_pipeline_schedule`
would raise for the same numbers.

The vocabulary: a pipeline of ``pp`` ranks runs ``num_stages`` stages, ``stages_per_rank`` on
every rank; stage ``i`` holds the transformer layers ``layer_ranges[i] = [start, end)``, stage 0
also the token embeddings and the last stage the final norm, output head and loss. Which stages
a rank runs depends on the schedule's style: ``loop`` (rank r runs r, r+pp, r+2pp, ...) or ``v``
(rank r runs r and 2pp-1-r, so rank 0 holds both ends).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "DEFAULT_STAGES_PER_RANK",
    "SCHEDULE_FACTS",
    "ScheduleFacts",
    "StagePlan",
    "bubble_fraction",
    "check_microbatches",
    "plan_stages",
    "resolve_num_stages",
    "schedule_facts",
    "stage_indices_for_rank",
    "stage_layer_ranges",
]


@dataclass(frozen=True)
class ScheduleFacts:
    """What planning needs to know about a schedule (the torch class lives in ``schedule.py``).

    ``stages_per_rank``: None for any number >= 2 (looped/interleaved schedules), else the exact
    number. ``style``: how stages map to ranks: ``loop`` (rank r owns r, r+pp, r+2pp, ...) or
    ``v`` (rank r owns r and 2pp-1-r, so the first and last stage share rank 0)."""

    stages_per_rank: int | None
    style: str
    min_microbatches_per_stage: bool = False  # torch's 1F1B needs n_microbatches >= stages
    interleaved_rounds: bool = False  # flex schedules need n_mb % max(1, n_mb // pp) == 0
    split_backward: bool = False  # zero-bubble: each backward runs as an input half, then a weight half


# The schedules we run (schedule.py maps each to its torch class; the key order is the order
# error messages list them in). DualPipeV is left out: it needs a user-supplied overlapped
# forward/backward callback to be more than ZBV.
SCHEDULE_FACTS: dict[str, ScheduleFacts] = {
    "GPipe": ScheduleFacts(1, "loop"),
    "1F1B": ScheduleFacts(1, "loop", min_microbatches_per_stage=True),
    "Interleaved1F1B": ScheduleFacts(None, "loop", interleaved_rounds=True),
    "LoopedBFS": ScheduleFacts(None, "loop"),
    "InterleavedZeroBubble": ScheduleFacts(None, "loop", interleaved_rounds=True, split_backward=True),
    "ZBVZeroBubble": ScheduleFacts(2, "v", split_backward=True),
}

DEFAULT_STAGES_PER_RANK = 2  # for multi-stage schedules when nothing else fixes the stage count


def schedule_facts(name: str) -> tuple[str, ScheduleFacts]:
    """Canonical name and facts; case-insensitive like torch's ``get_schedule_class``."""
    by_lower = {k.lower(): k for k in SCHEDULE_FACTS}
    canonical = by_lower.get(str(name).lower())
    if canonical is None:
        raise ValueError(f"unknown pipeline schedule {name!r}; legal schedules: {', '.join(SCHEDULE_FACTS)}")
    return canonical, SCHEDULE_FACTS[canonical]


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _split_point_index(point: int | str) -> int:
    """Split points are layer indices; the config spells them as FQNs (``layers.4``)."""
    if isinstance(point, bool):
        raise ValueError(f"pipeline split point {point!r} is not a layer index")
    if isinstance(point, int):
        return point
    match = re.fullmatch(r"\s*(?:layers\.)?(\d+)\s*", str(point))
    if match is None:
        raise ValueError(f"pipeline split point {point!r} is neither a layer index nor 'layers.<index>'")
    return int(match.group(1))


# ----------------------------------------------------------------------------- layers
def stage_layer_ranges(
    n_layers: int, num_stages: int, split_points: Sequence[int | str] | None = None
) -> list[tuple[int, int]]:
    """``[start, end)`` transformer-layer range of every stage.

    Explicit ``split_points`` are the layers where a new stage starts (so ``[4, 8]`` makes
    three stages: 0-3, 4-7, 8-end). Without them layers are spread evenly; when they do not
    divide evenly the extra layers go to the middle stages first, then the first stage, then the
    last: the last stage also runs the output projection and the loss over the vocabulary (for
    Llama 3 8B the output matmul alone is ~2.4 layers' worth of FLOPs) and the first stage the
    embedding lookup (almost free).
    """
    _positive_int("n_layers", n_layers)
    if split_points:
        points = [_split_point_index(p) for p in split_points]
        if len(points) + 1 != num_stages:
            raise ValueError(
                f"{len(points)} pipeline split points make {len(points) + 1} stages, but the "
                f"layout needs {num_stages} (pp x stages per rank); give {num_stages - 1} points"
            )
        bad = [p for p in points if not 0 < p < n_layers]
        if bad:
            raise ValueError(
                f"pipeline split points {bad} are out of range: each must be a layer index in "
                f"1..{n_layers - 1} (n_layers={n_layers}), where a new stage starts"
            )
        if any(b <= a for a, b in zip(points, points[1:])):
            raise ValueError(
                f"pipeline split points {points} must be strictly increasing (every stage needs at least one layer)"
            )
        bounds = [0, *points, n_layers]
        return [(bounds[i], bounds[i + 1]) for i in range(num_stages)]
    if n_layers < num_stages:
        raise ValueError(
            f"n_layers={n_layers} is fewer than the {num_stages} pipeline stages; every stage "
            f"needs at least one layer: lower pp or the stages per rank so that "
            f"pp x stages_per_rank <= {n_layers}"
        )
    base, extra = divmod(n_layers, num_stages)
    priority = list(range(1, num_stages - 1)) + [0, num_stages - 1]
    counts = [base] * num_stages
    for s in priority[:extra]:
        counts[s] += 1
    ranges, start = [], 0
    for c in counts:
        ranges.append((start, start + c))
        start += c
    return ranges


# ----------------------------------------------------------------------------- ranks
def stage_indices_for_rank(pp_rank: int, pp: int, num_stages: int, style: str = "loop") -> list[int]:
    """Stages owned by ``pp_rank``, in execution order (the order torch's schedules expect)."""
    if num_stages % pp:
        raise ValueError(f"{num_stages} stages do not divide over pp={pp} ranks")
    per_rank = num_stages // pp
    if style == "loop":
        return [pp_rank + k * pp for k in range(per_rank)]
    if style == "v":
        if per_rank != 2:
            raise ValueError(f"a V-shaped schedule needs exactly 2 stages per rank, got {per_rank}")
        return [pp_rank, num_stages - 1 - pp_rank]
    raise ValueError(f"unknown stage-to-rank style {style!r}; legal: loop, v")


def resolve_num_stages(
    schedule: str,
    pp: int,
    n_layers: int,
    split_points: Sequence[int | str] | None = None,
    stages_per_rank: int | None = None,
    layers_per_stage: int | None = None,
) -> int:
    """Total stage count from whichever of split points / layers per stage / stages per rank
    is given, checked against what the schedule can run."""
    canonical, facts = schedule_facts(schedule)
    return _resolve_num_stages(canonical, facts, pp, n_layers, split_points, stages_per_rank, layers_per_stage)


def _resolve_num_stages(
    schedule: str,
    info: ScheduleFacts,
    pp: int,
    n_layers: int,
    split_points: Sequence[int | str] | None,
    stages_per_rank: int | None,
    layers_per_stage: int | None,
) -> int:
    if split_points and layers_per_stage is not None:
        raise ValueError("give either pipeline split_points or layers_per_stage, not both")
    if split_points:
        num_stages = len(split_points) + 1
        source = f"{len(split_points)} split points"
    elif layers_per_stage is not None:
        _positive_int("layers_per_stage", layers_per_stage)
        if n_layers % layers_per_stage:
            raise ValueError(
                f"layers_per_stage={layers_per_stage} does not divide n_layers={n_layers}; "
                "use a divisor or explicit split points"
            )
        num_stages = n_layers // layers_per_stage
        source = f"layers_per_stage={layers_per_stage}"
    else:
        if stages_per_rank is None:
            stages_per_rank = info.stages_per_rank or DEFAULT_STAGES_PER_RANK
        _positive_int("stages_per_rank", stages_per_rank)
        num_stages = pp * stages_per_rank
        source = f"stages_per_rank={stages_per_rank}"
    if split_points or layers_per_stage is not None:
        if stages_per_rank is not None and num_stages != pp * stages_per_rank:
            raise ValueError(
                f"{source} make {num_stages} stages but stages_per_rank={stages_per_rank} with "
                f"pp={pp} needs {pp * stages_per_rank}"
            )
    if num_stages % pp:
        raise ValueError(
            f"{source} make {num_stages} stages, which do not divide over pp={pp} ranks; the "
            f"stage count must be a multiple of pp"
        )
    per_rank = num_stages // pp
    if info.stages_per_rank is not None and per_rank != info.stages_per_rank:
        multi = [n for n, i in SCHEDULE_FACTS.items() if i.stages_per_rank != 1]
        hint = (
            f"use one of {', '.join(multi)} for several stages per rank"
            if info.stages_per_rank == 1
            else f"{schedule} needs exactly {info.stages_per_rank} stages per rank"
        )
        raise ValueError(
            f"schedule {schedule} runs {info.stages_per_rank} stage(s) per rank but {source} "
            f"with pp={pp} give {per_rank}; {hint}"
        )
    if info.stages_per_rank is None and per_rank < 2:
        single = [n for n, i in SCHEDULE_FACTS.items() if i.stages_per_rank == 1]
        raise ValueError(
            f"schedule {schedule} interleaves several stages per rank but {source} with pp={pp} "
            f"give {per_rank}; use {' or '.join(single)} for one stage per rank, or more stages"
        )
    return num_stages


# ----------------------------------------------------------------------------- micro-batches
def check_microbatches(
    schedule: str, pp: int, num_stages: int, n_microbatches: int, local_batch_size: int | None
) -> int | None:
    """Check a micro-batch count against the local batch (when given) and what the schedule
    can run with ``num_stages`` stages on ``pp`` ranks; returns the micro-batch size (or None
    without a local batch)."""
    canonical, facts = schedule_facts(schedule)
    n_microbatches = _positive_int("n_microbatches", n_microbatches)
    mb = None
    if local_batch_size is not None:
        local_batch_size = _positive_int("local_batch_size", local_batch_size)
        if local_batch_size % n_microbatches:
            legal = [d for d in range(1, local_batch_size + 1) if local_batch_size % d == 0]
            raise ValueError(
                f"n_microbatches={n_microbatches} does not divide the local batch of "
                f"{local_batch_size} sequences; legal microbatch counts: "
                f"{', '.join(map(str, legal))}"
            )
        mb = local_batch_size // n_microbatches
    if facts.min_microbatches_per_stage and n_microbatches < num_stages:
        raise ValueError(
            f"schedule {canonical} needs n_microbatches >= the {num_stages} pipeline stages, "
            f"got {n_microbatches}; use at least {num_stages} (or GPipe)"
        )
    if facts.interleaved_rounds:
        rounds = max(1, n_microbatches // pp)
        if n_microbatches % rounds:
            raise ValueError(
                f"schedule {canonical} with pp={pp} needs n_microbatches to be a multiple of "
                f"its rounds max(1, n_microbatches // pp) = {rounds}, got {n_microbatches}; "
                f"use a multiple of pp={pp} or fewer than {2 * pp}"
            )
    return mb


def bubble_fraction(schedule: str, pp: int, n_microbatches: int, stages_per_rank: int = 1) -> float:
    """Idle fraction of a rank's step in the textbook cost model (forward F, input-backward B
    and weight-backward W each take the same time per stage chunk; no communication cost).

    GPipe / 1F1B: (p-1) / (m + p-1). Interleaved / looped with v stages per rank: the fill and
    drain shrink to one chunk, (p-1) / (v m + p-1). Zero-bubble (ZB-H1 style) fills the drain
    with deferred weight gradients, leaving (p-1) F-sized slots out of 3 v m: (p-1) / (3 v m +
    p-1). ZB-V with F = B = W is bubble-free in this model (0)."""
    canonical, _ = schedule_facts(schedule)
    p, m, v = pp, n_microbatches, stages_per_rank
    if canonical in ("GPipe", "1F1B"):
        return (p - 1) / (m + p - 1)
    if canonical in ("Interleaved1F1B", "LoopedBFS"):
        return (p - 1) / (v * m + p - 1)
    if canonical == "InterleavedZeroBubble":
        return (p - 1) / (3 * v * m + p - 1)
    return 0.0


# ----------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class StagePlan:
    """A legal pipeline layout (build one with :func:`plan_stages`).

    ``layer_ranges[s]``: the ``[start, end)`` transformer layers of stage ``s``;
    ``rank_stages[r]``: the stages pp rank ``r`` runs, in execution order. The micro-batch
    fields are None when the plan was made without a micro-batch count (``split_model`` splits
    before the schedule's micro-batch count is known)."""

    schedule: str  # canonical name
    pp: int
    n_layers: int
    num_stages: int
    stages_per_rank: int
    style: str  # "loop" or "v"
    layer_ranges: tuple[tuple[int, int], ...]
    rank_stages: tuple[tuple[int, ...], ...]
    min_microbatches: int  # the fewest micro-batches the schedule runs this layout with
    n_microbatches: int | None = None
    local_batch_size: int | None = None
    microbatch_size: int | None = None  # sequences per micro-batch (needs local_batch_size)
    interleaved_rounds: int | None = None  # max(1, m // pp) for the flex schedules
    bubble_fraction: float | None = None  # textbook idle fraction (see bubble_fraction)

    def stages_for_rank(self, pp_rank: int) -> list[int]:
        return list(self.rank_stages[pp_rank])

    def rank_of_stage(self, stage: int) -> int:
        for rank, stages in enumerate(self.rank_stages):
            if stage in stages:
                return rank
        raise ValueError(f"no stage {stage}: the plan has {self.num_stages} stages")

    def stage_of_layer(self, layer: int) -> int:
        for stage, (start, end) in enumerate(self.layer_ranges):
            if start <= layer < end:
                return stage
        raise ValueError(f"no layer {layer}: the plan has {self.n_layers} layers")

    def layer_counts(self) -> list[int]:
        return [end - start for start, end in self.layer_ranges]


def plan_stages(
    n_layers: int,
    pp: int,
    schedule: str = "1F1B",
    n_microbatches: int | None = None,
    local_batch_size: int | None = None,
    split_points: Sequence[int | str] | None = None,
    layers_per_stage: int | None = None,
    *,
    stages_per_rank: int | None = None,
) -> StagePlan:
    """The pipeline layout for ``n_layers`` transformer layers on ``pp`` ranks under
    ``schedule``, or a ValueError naming the rule the numbers break.

    The stage count comes from ``split_points`` (``len + 1``; layer indices or ``layers.<i>``),
    or ``n_layers / layers_per_stage``, or ``pp * stages_per_rank`` (default: the schedule's
    fixed count, else 2). With ``n_microbatches`` the micro-batch rules are checked too
    (divides ``local_batch_size`` when that is given, at least one per stage for 1F1B, whole
    rounds for the interleaved schedules) and the plan carries the bubble fraction. The checks
    run in the order ``split_model`` and ``build_pipeline_schedule`` run them, with the same
    messages."""
    canonical, facts = schedule_facts(schedule)
    _positive_int("pp", pp)
    if pp < 2:
        raise ValueError(f"pipeline parallelism needs pp >= 2, but pp={pp}; with pp=1 train the whole model")
    num_stages = _resolve_num_stages(canonical, facts, pp, n_layers, split_points, stages_per_rank, layers_per_stage)
    ranges = stage_layer_ranges(n_layers, num_stages, split_points)
    rank_stages = tuple(tuple(stage_indices_for_rank(r, pp, num_stages, facts.style)) for r in range(pp))
    per_rank = num_stages // pp
    mb = rounds = bubble = None
    if n_microbatches is not None:
        mb = check_microbatches(canonical, pp, num_stages, n_microbatches, local_batch_size)
        if facts.interleaved_rounds:
            rounds = max(1, n_microbatches // pp)
        bubble = bubble_fraction(canonical, pp, n_microbatches, per_rank)
    elif local_batch_size is not None:
        _positive_int("local_batch_size", local_batch_size)
    return StagePlan(
        schedule=canonical,
        pp=pp,
        n_layers=n_layers,
        num_stages=num_stages,
        stages_per_rank=per_rank,
        style=facts.style,
        layer_ranges=tuple(ranges),
        rank_stages=rank_stages,
        min_microbatches=num_stages if facts.min_microbatches_per_stage else 1,
        n_microbatches=n_microbatches,
        local_batch_size=local_batch_size,
        microbatch_size=mb,
        interleaved_rounds=rounds,
        bubble_fraction=bubble,
    )
