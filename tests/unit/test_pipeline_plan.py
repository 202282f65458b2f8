"""Pipeline stage planning (models/parallel/pipeline/plan.py): property tests on pure numbers.

For random layer counts, pp degrees, schedules, micro-batch counts, split points and layers per
stage: a legal request gives a plan whose stages tile the layers in order, whose ranks run the
stages the schedule's style dictates, whose leftover layers sit in the middle stages, and whose
bubble fraction behaves; an illegal one raises a ValueError naming the rule it breaks, never a
plan. An independent oracle (:func:`_legal`) decides legality from the rules as documented.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from models.parallel.pipeline.plan import (
    DEFAULT_STAGES_PER_RANK,
    SCHEDULE_FACTS,
    StagePlan,
    bubble_fraction,
    plan_stages,
)

SCHEDULE_NAMES = list(SCHEDULE_FACTS)
LEGAL_LIST = "legal schedules: " + ", ".join(SCHEDULE_NAMES)
PROPS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _needs_min_microbatches(schedule: str) -> bool:
    return SCHEDULE_FACTS[schedule].min_microbatches_per_stage


def _needs_rounds(schedule: str) -> bool:
    return SCHEDULE_FACTS[schedule].interleaved_rounds


def _legal_microbatches(schedule: str, pp: int, num_stages: int, upto: int) -> list[int]:
    out = []
    for m in range(1, upto + 1):
        if _needs_min_microbatches(schedule) and m < num_stages:
            continue
        if _needs_rounds(schedule) and m % max(1, m // pp):
            continue
        out.append(m)
    return out


# ----------------------------------------------------------------------------- strategies
MODES = ("default", "stages_per_rank", "split_points", "layers_per_stage")  # what fixes the count


def _spell(draw, point: int):
    """A split point as the config may spell it: an int, ``layers.<i>`` or ``<i>``."""
    return draw(st.sampled_from([point, f"layers.{point}", str(point), f" layers.{point} "]))


@st.composite
def legal_requests(
    draw,
    with_microbatches: bool | None = None,
    modes: tuple[str, ...] = MODES,
    schedules: tuple[str, ...] = tuple(SCHEDULE_NAMES),
) -> dict:
    """Keyword arguments of a legal ``plan_stages`` call, plus what the test expects (under
    ``_expect``): the stage count per rank, the mode and the split points as ints."""
    schedule = draw(st.sampled_from(schedules))
    facts = SCHEDULE_FACTS[schedule]
    pp = draw(st.integers(2, 8))
    per_rank = facts.stages_per_rank or draw(st.integers(2, 4))
    num_stages = pp * per_rank
    mode = draw(st.sampled_from(modes))
    if mode == "default" and facts.stages_per_rank is None:
        per_rank, num_stages = DEFAULT_STAGES_PER_RANK, pp * DEFAULT_STAGES_PER_RANK
    kwargs: dict = {"schedule": draw(st.sampled_from([schedule, schedule.lower(), schedule.upper()]))}
    points = None
    if mode == "layers_per_stage":
        lps = draw(st.integers(1, 5))
        n_layers = lps * num_stages
        kwargs["layers_per_stage"] = lps
    else:
        n_layers = draw(st.integers(num_stages, num_stages + 40))
        if mode == "split_points":
            points = sorted(
                draw(st.sets(st.integers(1, n_layers - 1), min_size=num_stages - 1, max_size=num_stages - 1))
            )
            kwargs["split_points"] = [_spell(draw, p) for p in points]
        elif mode == "stages_per_rank":
            kwargs["stages_per_rank"] = per_rank
    if mode in ("split_points", "layers_per_stage") and draw(st.booleans()):
        kwargs["stages_per_rank"] = per_rank  # consistent, so still legal
    if with_microbatches is None:
        with_microbatches = draw(st.booleans())
    if with_microbatches:
        m = draw(st.sampled_from(_legal_microbatches(schedule, pp, num_stages, 4 * num_stages)))
        kwargs["n_microbatches"] = m
        if draw(st.booleans()):
            kwargs["local_batch_size"] = m * draw(st.integers(1, 4))
    kwargs.update(n_layers=n_layers, pp=pp)
    kwargs["_expect"] = dict(schedule=schedule, per_rank=per_rank, num_stages=num_stages, mode=mode, points=points)
    return kwargs


def _plan(request: dict) -> StagePlan:
    return plan_stages(**{k: v for k, v in request.items() if k != "_expect"})


# ----------------------------------------------------------------------------- invariants
def _assert_plan_invariants(plan: StagePlan) -> None:
    """What every plan must satisfy, whatever produced it."""
    n, pp, S = plan.n_layers, plan.pp, plan.num_stages
    # stages tile [0, n_layers): contiguous, in order, none empty; the ends hold the model's ends
    assert len(plan.layer_ranges) == S
    assert plan.layer_ranges[0][0] == 0  # stage 0: embeddings side, starts at layer 0
    assert plan.layer_ranges[-1][1] == n  # last stage: head side, ends at n_layers
    for (_, e0), (s1, _) in zip(plan.layer_ranges, plan.layer_ranges[1:]):
        assert e0 == s1
    assert all(e > s for s, e in plan.layer_ranges), plan.layer_ranges
    for layer in range(n):  # every layer in exactly one stage
        assert sum(s <= layer < e for s, e in plan.layer_ranges) == 1, (layer, plan.layer_ranges)
    owners = [plan.stage_of_layer(layer) for layer in range(n)]
    assert owners == sorted(owners) and set(owners) == set(range(S))
    # every stage on exactly one rank, every rank the same number of stages
    assert len(plan.rank_stages) == pp
    assert sorted(s for stages in plan.rank_stages for s in stages) == list(range(S))
    assert all(len(stages) == plan.stages_per_rank for stages in plan.rank_stages)
    assert S == pp * plan.stages_per_rank
    for r in range(pp):
        if plan.style == "loop":
            assert plan.stages_for_rank(r) == [r + k * pp for k in range(plan.stages_per_rank)]
        else:
            assert plan.style == "v"
            assert plan.stages_for_rank(r) == [r, 2 * pp - 1 - r]
    assert plan.rank_of_stage(0) == 0
    assert plan.rank_of_stage(S - 1) == (0 if plan.style == "v" else pp - 1)
    # what the schedule can run
    facts = SCHEDULE_FACTS[plan.schedule]
    if facts.stages_per_rank is not None:
        assert plan.stages_per_rank == facts.stages_per_rank
    else:
        assert plan.stages_per_rank >= 2
    if plan.n_microbatches is not None:
        m = plan.n_microbatches
        assert m >= plan.min_microbatches >= 1
        if facts.min_microbatches_per_stage:
            assert m >= S
        if facts.interleaved_rounds:
            assert plan.interleaved_rounds == max(1, m // pp) and m % plan.interleaved_rounds == 0
        if plan.local_batch_size is not None:
            assert plan.microbatch_size * m == plan.local_batch_size
        assert 0.0 <= plan.bubble_fraction < 1.0


# ----------------------------------------------------------------------------- legal plans
@PROPS
@given(legal_requests())
def test_legal_request_gives_a_consistent_plan(request):
    plan = _plan(request)
    expect = request["_expect"]
    _assert_plan_invariants(plan)
    assert plan.schedule == expect["schedule"]  # canonical, whatever the case it was given in
    assert plan.num_stages == expect["num_stages"]
    assert plan.stages_per_rank == expect["per_rank"]
    assert plan.style == SCHEDULE_FACTS[expect["schedule"]].style


@PROPS
@given(legal_requests())
def test_each_rank_gets_the_schedule_styles_stages(request):
    plan = _plan(request)
    pp, per_rank = request["pp"], request["_expect"]["per_rank"]
    for r in range(pp):
        stages = plan.stages_for_rank(r)
        assert len(stages) == per_rank
        if SCHEDULE_FACTS[plan.schedule].style == "v":
            assert stages == [r, 2 * pp - 1 - r]  # the V: rank 0 holds both ends
        else:
            assert stages == list(range(r, plan.num_stages, pp))


@PROPS
@given(legal_requests(modes=("split_points",)))
def test_split_points_start_the_stages(request):
    expect = request["_expect"]
    plan = _plan(request)
    assert [s for s, _ in plan.layer_ranges[1:]] == expect["points"]
    # the spelling does not matter: ints give the same plan
    as_ints = {**request, "split_points": expect["points"]}
    assert _plan(as_ints) == plan


@PROPS
@given(legal_requests(modes=("layers_per_stage",)))
def test_layers_per_stage_gives_equal_stages(request):
    plan = _plan(request)
    assert plan.layer_counts() == [request["layers_per_stage"]] * plan.num_stages


@PROPS
@given(legal_requests(modes=("default", "stages_per_rank")))
def test_even_split_puts_leftover_layers_in_the_middle_first(request):
    """Without split points or layers per stage the stages differ by at most one layer; the
    extra layers go to the middle stages (lowest first), then the first stage; the last stage,
    which also runs the output head and the loss, never gets one."""
    plan = _plan(request)
    counts, S = plan.layer_counts(), plan.num_stages
    base, extra = divmod(plan.n_layers, S)
    assert set(counts) <= {base, base + 1} and sum(counts) == plan.n_layers
    big = [c == base + 1 for c in counts]
    assert sum(big) == extra
    middle = big[1:-1]
    assert middle == sorted(middle, reverse=True)  # the bigger middle stages come first
    if big[0]:
        assert all(middle)  # the first stage only once every middle stage has one
    assert not big[-1] and counts[-1] == min(counts)


@PROPS
@given(st.sampled_from(SCHEDULE_NAMES), st.integers(2, 16), st.integers(1, 64), st.integers(1, 4))
def test_bubble_fraction_in_unit_interval_and_falls_with_microbatches(schedule, pp, m, v):
    facts = SCHEDULE_FACTS[schedule]
    v = facts.stages_per_rank or max(v, 2)
    b, b_more = bubble_fraction(schedule, pp, m, v), bubble_fraction(schedule, pp, m + 1, v)
    assert 0.0 <= b_more <= b < 1.0
    if schedule in ("GPipe", "1F1B"):
        assert b == pytest.approx((pp - 1) / (m + pp - 1))
        assert b_more < b  # strictly: more micro-batches always shrink the fill and drain
    if facts.stages_per_rank is None:  # interleaving cuts the bubble below the 1F1B one
        assert b < bubble_fraction("1F1B", pp, m)


@PROPS
@given(legal_requests(with_microbatches=True))
def test_plan_bubble_fraction_is_the_schedules(request):
    plan = _plan(request)
    assert plan.bubble_fraction == bubble_fraction(plan.schedule, plan.pp, plan.n_microbatches, plan.stages_per_rank)


def test_plan_is_frozen_and_examples():
    plan = plan_stages(6, 2, "Interleaved1F1B")
    assert plan.layer_ranges == ((0, 1), (1, 3), (3, 5), (5, 6))
    assert plan.rank_stages == ((0, 2), (1, 3))
    assert plan_stages(8, 2, "ZBVZeroBubble").rank_stages == ((0, 3), (1, 2))
    assert plan_stages(5, 2, "GPipe", split_points=["layers.1"]).layer_ranges == ((0, 1), (1, 5))
    plan = plan_stages(8, 2, "1F1B", n_microbatches=4, local_batch_size=8)
    assert (plan.microbatch_size, plan.min_microbatches) == (2, 2)
    assert plan.bubble_fraction == pytest.approx(1 / 5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.num_stages = 3


# ----------------------------------------------------------------------------- broken rules
def _bad(draw) -> dict:
    """A legal base request to break one rule of."""
    return draw(legal_requests(with_microbatches=False))


def _unknown_schedule(draw):
    r = _bad(draw)
    name = draw(st.text(st.characters(codec="ascii", categories=["L", "N"]), min_size=1, max_size=12))
    assume(name.lower() not in {n.lower() for n in SCHEDULE_NAMES})
    return {**r, "schedule": name}, [LEGAL_LIST, repr(name)]


def _pp_below_two(draw):
    pp = draw(st.integers(-3, 1))
    msg = "pp >= 2" if pp == 1 else "pp must be a positive int"
    return {**_bad(draw), "pp": pp}, [msg]


def _split_points_and_layers_per_stage(draw):
    r = _bad(draw)
    return {**r, "split_points": [1], "layers_per_stage": 1}, ["not both"]


def _layers_per_stage_not_dividing(draw):
    r = _bad(draw)
    lps = draw(st.integers(2, 9))
    n = draw(st.integers(1, 60).filter(lambda n: n % lps))
    r = {k: v for k, v in r.items() if k not in ("split_points", "stages_per_rank")}
    return {**r, "n_layers": n, "layers_per_stage": lps}, [f"layers_per_stage={lps} does not divide n_layers={n}"]


def _non_positive_count(draw):
    r = _bad(draw)
    r = {k: v for k, v in r.items() if k not in ("split_points", "layers_per_stage")}
    name = draw(st.sampled_from(["layers_per_stage", "stages_per_rank"]))
    return {**r, name: draw(st.integers(-3, 0))}, [f"{name} must be a positive int"]


def _stage_count_not_multiple_of_pp(draw):
    r = _bad(draw)
    pp, n = r["pp"], r["n_layers"]
    k = draw(st.integers(1, pp * 3).filter(lambda k: (k + 1) % pp))  # k points, k + 1 stages
    n = max(n, k + 1)
    r = {k_: v for k_, v in r.items() if k_ not in ("layers_per_stage", "stages_per_rank")}
    return {**r, "n_layers": n, "split_points": list(range(1, k + 1))}, [
        f"{k} split points make {k + 1} stages, which do not divide over pp={pp} ranks"
    ]


def _wrong_stages_per_rank_for_schedule(draw):
    r = _bad(draw)
    schedule = draw(st.sampled_from(SCHEDULE_NAMES))
    facts = SCHEDULE_FACTS[schedule]
    r = {k: v for k, v in r.items() if k not in ("split_points", "layers_per_stage")}
    if facts.stages_per_rank is None:
        spr, msg = 1, f"schedule {schedule} interleaves several stages per rank"
    else:
        spr = draw(st.integers(1, 5).filter(lambda s: s != facts.stages_per_rank))
        msg = f"schedule {schedule} runs {facts.stages_per_rank} stage(s) per rank"
    return {**r, "schedule": schedule, "stages_per_rank": spr}, [msg, f"give {spr}"]


def _split_points_disagree_with_stages_per_rank(draw):
    r = _bad(draw)
    pp = r["pp"]
    spr = draw(st.integers(1, 3))
    k = draw(st.integers(1, 3 * pp).filter(lambda k: k + 1 != pp * spr))
    r = {k_: v for k_, v in r.items() if k_ != "layers_per_stage"}
    return {**r, "n_layers": 4 * pp + k, "split_points": list(range(1, k + 1)), "stages_per_rank": spr}, [
        f"make {k + 1} stages but stages_per_rank={spr} with pp={pp} needs {pp * spr}"
    ]


def _with_points(draw, mutate):
    """A legal split-point request with its points changed by ``mutate(points, n_layers)``."""
    r = draw(legal_requests(with_microbatches=False, modes=("split_points",)))
    points = mutate(list(r["_expect"]["points"]), r["n_layers"], draw)
    return {**r, "split_points": points}


def _split_point_out_of_range(draw):
    def mutate(points, n, draw):
        i = draw(st.integers(0, len(points) - 1))
        points[i] = draw(st.sampled_from([0, n, n + draw(st.integers(0, 5))]))
        return points

    return _with_points(draw, mutate), ["out of range", "1.."]


def _split_points_not_increasing(draw):
    def mutate(points, n, draw):
        assume(len(points) >= 2)
        i = draw(st.integers(0, len(points) - 2))
        if draw(st.booleans()):
            points[i + 1] = points[i]  # a repeated point: an empty stage
        else:
            points[i], points[i + 1] = points[i + 1], points[i]
        return points

    return _with_points(draw, mutate), ["strictly increasing"]


def _split_point_unparsable(draw):
    def mutate(points, n, draw):
        i = draw(st.integers(0, len(points) - 1))
        points[i] = draw(st.sampled_from([f"layer{points[i]}", f"layers.{points[i]}.x", "x", "", "-1"]))
        return points

    return _with_points(draw, mutate), ["neither a layer index nor 'layers.<index>'"]


def _fewer_layers_than_stages(draw):
    r = draw(legal_requests(with_microbatches=False, modes=("default", "stages_per_rank")))
    S = r["_expect"]["num_stages"]
    n = draw(st.integers(1, S - 1))
    return {**r, "n_layers": n}, [f"n_layers={n} is fewer than the {S} pipeline stages"]


def _n_layers_not_positive(draw):
    # split points: with the other modes the stage count check fails first
    r = draw(legal_requests(with_microbatches=False, modes=("split_points",)))
    return {**r, "n_layers": draw(st.integers(-3, 0))}, ["n_layers must be a positive int"]


def _microbatches_do_not_divide_batch(draw):
    r = _bad(draw)
    S, pp, schedule = r["_expect"]["num_stages"], r["pp"], r["_expect"]["schedule"]
    m = draw(st.sampled_from(_legal_microbatches(schedule, pp, S, 4 * S)))
    assume(m > 1)
    lbs = draw(st.integers(1, 8 * m).filter(lambda b: b % m))
    return {**r, "n_microbatches": m, "local_batch_size": lbs}, [
        f"n_microbatches={m} does not divide the local batch of {lbs} sequences",
        "legal microbatch counts: 1",
    ]


def _too_few_microbatches(draw):
    needing = tuple(n for n in SCHEDULE_NAMES if _needs_min_microbatches(n))
    r = draw(legal_requests(with_microbatches=False, schedules=needing))
    S = r["_expect"]["num_stages"]
    m = draw(st.integers(1, S - 1))
    return {**r, "n_microbatches": m}, [f"needs n_microbatches >= the {S} pipeline stages"]


def _microbatches_not_whole_rounds(draw):
    r = draw(legal_requests(with_microbatches=False, schedules=tuple(filter(_needs_rounds, SCHEDULE_NAMES))))
    pp = r["pp"]
    m = draw(st.integers(2 * pp, 8 * pp).filter(lambda m: m % max(1, m // pp)))
    return {**r, "n_microbatches": m}, ["multiple of its rounds", f"= {m // pp}, got {m}"]


def _non_positive_microbatches(draw):
    r = _bad(draw)
    if draw(st.booleans()):
        return {**r, "n_microbatches": draw(st.integers(-3, 0))}, ["n_microbatches must be a positive int"]
    # the batch is checked before the schedule's micro-batch minimum
    lbs = draw(st.integers(-3, 0))
    return {**r, "n_microbatches": 1, "local_batch_size": lbs}, ["local_batch_size must be a positive int"]


BROKEN_RULES = {
    f.__name__.lstrip("_"): f
    for f in (
        _unknown_schedule,
        _pp_below_two,
        _split_points_and_layers_per_stage,
        _layers_per_stage_not_dividing,
        _non_positive_count,
        _stage_count_not_multiple_of_pp,
        _wrong_stages_per_rank_for_schedule,
        _split_points_disagree_with_stages_per_rank,
        _split_point_out_of_range,
        _split_points_not_increasing,
        _split_point_unparsable,
        _fewer_layers_than_stages,
        _n_layers_not_positive,
        _microbatches_do_not_divide_batch,
        _too_few_microbatches,
        _microbatches_not_whole_rounds,
        _non_positive_microbatches,
    )
}


@pytest.mark.parametrize("rule", list(BROKEN_RULES))
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_a_broken_rule_raises_naming_it(rule, data):
    request, substrings = BROKEN_RULES[rule](data.draw)
    with pytest.raises(ValueError) as info:
        _plan(request)
    for s in substrings:
        assert s in str(info.value), (s, str(info.value))


# ----------------------------------------------------------------------------- the oracle
_POINT = re.compile(r"\s*(?:layers\.)?(\d+)\s*")


def _legal(
    n_layers, pp, schedule, n_microbatches, local_batch_size, split_points, layers_per_stage, stages_per_rank
) -> bool:
    """The documented rules, written out independently of plan.py's control flow."""
    by_lower = {n.lower(): n for n in SCHEDULE_NAMES}
    if schedule.lower() not in by_lower or pp < 2:
        return False
    facts = SCHEDULE_FACTS[by_lower[schedule.lower()]]
    if split_points and layers_per_stage is not None:
        return False
    if split_points:
        parsed = []
        for p in split_points:
            if isinstance(p, int):
                parsed.append(p)
            elif _POINT.fullmatch(p):
                parsed.append(int(_POINT.fullmatch(p).group(1)))
            else:
                return False
        S = len(parsed) + 1
        if any(not 0 < p < n_layers for p in parsed) or parsed != sorted(set(parsed)):
            return False
    elif layers_per_stage is not None:
        if layers_per_stage < 1 or n_layers % layers_per_stage:
            return False
        S = n_layers // layers_per_stage
    else:
        spr = stages_per_rank if stages_per_rank is not None else (facts.stages_per_rank or 2)
        if spr < 1:
            return False
        S = pp * spr
    if stages_per_rank is not None and S != pp * stages_per_rank:
        return False
    if S % pp or n_layers < S or n_layers < 1:
        return False
    per_rank = S // pp
    if per_rank != (facts.stages_per_rank or per_rank) or per_rank < (2 if facts.stages_per_rank is None else 1):
        return False
    if n_microbatches is not None:
        m = n_microbatches
        if m < 1:
            return False
        if local_batch_size is not None and (local_batch_size < 1 or local_batch_size % m):
            return False
        if facts.min_microbatches_per_stage and m < S:
            return False
        if facts.interleaved_rounds and m % max(1, m // pp):
            return False
    elif local_batch_size is not None and local_batch_size < 1:
        return False
    return True


_SPELLINGS = st.one_of(
    st.integers(-1, 20),
    st.integers(0, 20).map(lambda i: f"layers.{i}"),
    st.integers(0, 20).map(str),
    st.sampled_from(["x", "layer3", "layers.", "layers.-1", " 2 "]),
)


@settings(max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    n_layers=st.integers(-1, 24),
    pp=st.sampled_from([0, 1, 2, 2, 2, 3, 4]),
    schedule=st.sampled_from(SCHEDULE_NAMES + ["gpipe", "interleaved1f1b", "Zigzag", "DualPipeV"]),
    n_microbatches=st.one_of(st.none(), st.none(), st.integers(-1, 12)),
    local_batch_size=st.one_of(st.none(), st.none(), st.integers(-1, 16)),
    split_points=st.one_of(
        st.none(),
        st.none(),
        st.lists(_SPELLINGS, max_size=7),
        st.sets(st.integers(1, 19), max_size=7).map(sorted),  # mostly legal ones
    ),
    layers_per_stage=st.one_of(st.none(), st.none(), st.integers(-1, 6)),
    stages_per_rank=st.one_of(st.none(), st.none(), st.integers(-1, 4)),
)
def test_plan_iff_legal_and_never_a_wrong_plan(**request):
    """Random requests, legal or not: a plan comes back exactly when the oracle calls the
    request legal, and every plan that comes back satisfies the invariants."""
    legal = _legal(**request)
    try:
        plan = plan_stages(**request)
    except ValueError:
        assert not legal, request
        return
    assert legal, (request, plan)
    _assert_plan_invariants(plan)


# ----------------------------------------------------------------------------- split_model
class _FakePD:
    def __init__(self, pp: int, rank: int) -> None:
        self.pp, self._rank = pp, rank

    def coordinate(self, name: str) -> int:
        return self._rank


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(legal_requests(with_microbatches=False), st.data())
def test_split_model_follows_the_plan(request, data):
    """split_model carves exactly the plan's stages (a tiny stand-in model: only the
    tok_embeddings / layers / norm / output structure matters)."""
    from torch import nn

    from models.parallel.pipeline import split_model

    class Tiny(nn.Module):
        def __init__(self, n: int) -> None:
            super().__init__()
            self.tok_embeddings, self.norm, self.output = nn.Identity(), nn.Identity(), nn.Identity()
            self.layers = nn.ModuleDict({str(i): nn.Identity() for i in range(n)})

    plan = _plan(request)
    rank = data.draw(st.integers(0, plan.pp - 1))
    split = split_model(Tiny(plan.n_layers), plan, _FakePD(plan.pp, rank))
    assert split.num_stages == plan.num_stages
    assert split.layer_ranges == list(plan.layer_ranges)
    assert split.stage_indices == plan.stages_for_rank(rank)
    for module, stage in zip(split.modules, split.stage_indices):
        start, end = plan.layer_ranges[stage]
        assert list(module.layers) == [str(i) for i in range(start, end)]
        assert (module.tok_embeddings is not None) == (stage == 0)
        assert (module.output is not None) == (stage == plan.num_stages - 1)
