"""Layout algebra: property tests over many degree combinations, plus an independent oracle."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from parallel_dims import RankLayout, validate_degrees
from parallel_dims.layout import ONE_D_AXES

POW2 = [1, 2, 4, 8, 16, 32, 64]


@st.composite
def layouts(draw, max_log2_world=17):
    """Valid degree combinations (powers of two and a few odd factors) up to 2**17 ranks."""
    factors = st.sampled_from([1, 1, 2, 2, 4, 8, 3, 5, 6])
    pp, dpr, cp, tp = (draw(factors) for _ in range(4))
    dps = draw(st.sampled_from([1, 2, 3, 4, 8, 16, 32, 64, 256]))
    world = pp * dpr * dps * cp * tp
    if world > 2**max_log2_world:
        dps = 1
        world = pp * dpr * cp * tp
    etp = draw(st.sampled_from([1, tp]))
    block = dps * cp * tp
    ep_choices = [e for e in range(1, block + 1) if block % (e * etp) == 0]
    ep = draw(st.sampled_from(ep_choices))
    return validate_degrees(dp_replicate=dpr, dp_shard=dps, cp=cp, tp=tp, pp=pp, ep=ep, etp=etp, world_size=world)


def _as_sets(groups: np.ndarray) -> set[frozenset]:
    return {frozenset(g) for g in groups.tolist()}


@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts(max_log2_world=10))
def test_every_axis_partitions_the_world_small(d):
    _check_partitions(d)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts(max_log2_world=17))
def test_every_axis_partitions_the_world_large(d):
    _check_partitions(d)


def _check_partitions(d):
    layout = RankLayout(d)
    world = d.world_size
    for name in ONE_D_AXES:
        groups = layout.groups(name)
        assert groups.shape == (world // layout.size(name), layout.size(name)), name
        flat = np.sort(groups.ravel())
        assert np.array_equal(flat, np.arange(world)), f"{name} does not partition the world"
    # dense and sparse views factor the same world: the pp and dp_replicate axes are one and
    # the same in both (they are defined once), and each sparse block re-factors a dense block.
    dense_block = _as_sets(_block_groups(layout, ("dp_shard", "cp", "tp")))
    sparse_block = _as_sets(_block_groups(layout, ("efsdp", "ep", "etp")))
    assert dense_block == sparse_block
    # every ep group lies inside one (pp, dp_replicate) slice
    slice_of = _slice_ids(layout)
    for g in layout.groups("ep"):
        assert len(set(slice_of[g].tolist())) == 1
    # loss = batch x cp, fsdp = dp_shard x cp, batch = dp_replicate x dp_shard
    assert layout.size("loss") == layout.size("batch") * d.cp
    for derived, parts in {
        "loss": ("dp_replicate", "dp_shard", "cp"),
        "fsdp": ("dp_shard", "cp"),
        "batch": ("dp_replicate", "dp_shard"),
    }.items():
        assert _as_sets(layout.groups(derived)) == _as_sets(_block_groups(layout, parts))
    if d.etp == d.tp:
        assert _as_sets(layout.groups("etp")) == _as_sets(layout.groups("tp"))


def _block_groups(layout: RankLayout, axes) -> np.ndarray:
    """Groups spanned by several axes together: ranks that agree on every other axis'
    coordinate (the complementary axes of the same view)."""
    world = layout.degrees.world_size
    others = [a for a in ("pp", "dp_replicate", "dp_shard", "cp", "tp") if a not in axes]
    if set(axes) & {"efsdp", "ep", "etp"}:
        others = ["pp", "dp_replicate"]
    key = np.zeros(world, dtype=np.int64)
    for axis in others:
        key = key * layout.size(axis) + _coords(layout, axis)
    order = np.argsort(key, kind="stable")
    size = math.prod(layout.size(a) for a in axes)
    return order.reshape(-1, size)


def _coords(layout: RankLayout, axis: str) -> np.ndarray:
    return np.asarray(layout._coord(axis, np.arange(layout.degrees.world_size)))


def _slice_ids(layout: RankLayout) -> np.ndarray:
    return _coords(layout, "pp") * layout.size("dp_replicate") + _coords(layout, "dp_replicate")


# ---------------------------------------------------------------------------------------------
# Independent oracle: enumerate coordinates from an order string, innermost axis last.
def oracle_groups(order: str, sizes: dict[str, int], axes: tuple[str, ...]) -> set[frozenset]:
    """Groups of the mesh spanned by ``axes`` when ranks are numbered with ``order`` (outer ->
    inner, e.g. 'pp,dp_replicate,dp_shard,cp,tp'), by brute-force enumeration."""
    names = order.split(",")
    groups: dict[tuple, set[int]] = {}
    for rank, coords in enumerate(itertools.product(*(range(sizes[n]) for n in names))):
        key = tuple(c for n, c in zip(names, coords) if n not in axes)
        groups.setdefault(key, set()).add(rank)
    return {frozenset(g) for g in groups.values()}


@settings(max_examples=400, deadline=None)
@given(layouts(max_log2_world=9))
def test_layout_matches_brute_force_oracle(d):
    layout = RankLayout(d)
    dense_order = "pp,dp_replicate,dp_shard,cp,tp"
    sparse_order = "pp,dp_replicate,efsdp,ep,etp"
    dense = dict(pp=d.pp, dp_replicate=d.dp_replicate, dp_shard=d.dp_shard, cp=d.cp, tp=d.tp)
    sparse = dict(pp=d.pp, dp_replicate=d.dp_replicate, efsdp=d.efsdp, ep=d.ep, etp=d.etp)
    expect = {
        "pp": oracle_groups(dense_order, dense, ("pp",)),
        "dp_replicate": oracle_groups(dense_order, dense, ("dp_replicate",)),
        "dp_shard": oracle_groups(dense_order, dense, ("dp_shard",)),
        "cp": oracle_groups(dense_order, dense, ("cp",)),
        "tp": oracle_groups(dense_order, dense, ("tp",)),
        "fsdp": oracle_groups(dense_order, dense, ("dp_shard", "cp")),
        "batch": oracle_groups(dense_order, dense, ("dp_replicate", "dp_shard")),
        "loss": oracle_groups(dense_order, dense, ("dp_replicate", "dp_shard", "cp")),
        "efsdp": oracle_groups(sparse_order, sparse, ("efsdp",)),
        "ep": oracle_groups(sparse_order, sparse, ("ep",)),
        "etp": oracle_groups(sparse_order, sparse, ("etp",)),
        "world": {frozenset(range(d.world_size))},
    }
    for name, groups in expect.items():
        assert _as_sets(layout.groups(name)) == groups, name
        # and the per-rank lookup agrees with the all-groups view, in mesh order
        for rank in (0, d.world_size - 1, d.world_size // 3):
            g = layout.group(name, rank)
            assert frozenset(g) in groups and rank in g
            assert g == sorted(g)
    # the sparse view's pp / dp_replicate are the dense ones
    assert oracle_groups(sparse_order, sparse, ("pp",)) == expect["pp"]
    assert oracle_groups(sparse_order, sparse, ("dp_replicate",)) == expect["dp_replicate"]


def test_tp_is_innermost_and_pp_outermost():
    d = validate_degrees(dp_replicate=2, dp_shard=2, cp=2, tp=2, pp=2, world_size=32)
    layout = RankLayout(d)
    assert layout.group("tp", 0) == [0, 1]
    assert layout.group("cp", 0) == [0, 2]
    assert layout.group("dp_shard", 0) == [0, 4]
    assert layout.group("dp_replicate", 0) == [0, 8]
    assert layout.group("pp", 0) == [0, 16]
    assert layout.group("fsdp", 1) == [1, 3, 5, 7]
    assert layout.mesh_of("dense", 0).shape == (2, 2, 2, 2, 2)
    assert layout.mesh_of(("dp_replicate", "fsdp"), 1).tolist() == [[1, 3, 5, 7], [9, 11, 13, 15]]


def test_ep_folds_over_tp_and_cp():
    d = validate_degrees(dp_shard=2, cp=2, tp=2, ep=4, world_size=8)
    layout = RankLayout(d)
    assert d.efsdp == 2
    assert layout.group("ep", 0) == [0, 1, 2, 3]  # spans tp and cp
    assert layout.group("efsdp", 0) == [0, 4]
    d = validate_degrees(dp_shard=2, tp=2, ep=2, etp=2, world_size=4)
    layout = RankLayout(d)
    assert layout.group("etp", 1) == layout.group("tp", 1) == [0, 1]
    assert layout.group("ep", 1) == [1, 3]
    assert layout.mesh_of(("ep", "etp"), 0).tolist() == [[0, 1], [2, 3]]


def test_distinct_rank_sets_dedupe():
    d = validate_degrees(dp_shard=4, tp=2, ep=2, etp=2, world_size=8)
    layout = RankLayout(d)
    canon = layout.distinct_rank_sets
    assert canon["etp"] == "tp"
    assert canon["fsdp"] == "dp_shard"  # cp == 1
    assert canon["batch"] == "dp_shard"  # dp_replicate == 1
    assert canon["loss"] == "dp_shard"
    # world, dp_shard (fsdp, batch, loss), tp (etp), efsdp, ep
    assert layout.rank_sets_per_rank() == 5


def test_composability_check():
    d = validate_degrees(dp_shard=2, cp=2, tp=2, world_size=8)
    layout = RankLayout(d)
    layout.check_composable(("dp_replicate", "fsdp"))
    with pytest.raises(ValueError, match="overlap"):
        layout.check_composable(("fsdp", "cp"))
    with pytest.raises(ValueError, match="must be listed outer to inner"):
        layout.check_composable(("tp", "dp_shard"))
    with pytest.raises(ValueError, match="unknown mesh name 'bogus'"):
        layout.check_composable(("bogus",))


def test_crosses_nodes():
    d = validate_degrees(dp_shard=4, tp=8, world_size=32)
    layout = RankLayout(d)
    assert not layout.crosses_nodes("tp", gpus_per_node=8)
    assert layout.crosses_nodes("dp_shard", gpus_per_node=8)
    assert not layout.crosses_nodes("dp_shard", gpus_per_node=32)
