"""Real DeviceMesh builds on the fake backend: huge worlds in one process, group counts, and
equivalence with torchtitan 0.2.2's ParallelDims (the `peer` extra) for every shared name."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from parallel_dims import ParallelDims

TORCHTITAN_NAMES = ("pp", "batch", "loss", "dp_replicate", "fsdp", "cp", "tp", "ep", "efsdp", "etp")


def _fake_world(rank: int, world_size: int) -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


@pytest.fixture(autouse=True)
def _cleanup():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _build(rank: int, **degrees) -> ParallelDims:
    full = dict(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=1, etp=1) | degrees
    _fake_world(rank, full["world_size"])
    pd = ParallelDims(**full)
    pd.build_mesh("cpu")
    return pd


@pytest.mark.parametrize("rank", [0, 17, 131071, 77777])
def test_build_131072_ranks(rank):
    pd = _build(rank, pp=8, dp_replicate=4, dp_shard=256, cp=2, tp=8, ep=64, world_size=131072)
    # build_mesh already asserted every group against the layout layer; check a few by hand
    tp = pd.get_mesh("tp").mesh.tolist()
    assert tp == list(range(rank - rank % 8, rank - rank % 8 + 8))
    assert pd.get_mesh("pp").mesh.tolist() == [rank % 16384 + 16384 * i for i in range(8)]
    assert pd.get_mesh(["dp_replicate", "fsdp"]).shape == (4, 512)
    assert pd.get_mesh("sparse").shape == (8, 4, 64, 64, 1)
    counts = pd.process_group_count()
    # 11 named 1-D axes besides world; etp is size 1 -> placeholder. All others are distinct
    # rank sets: pp, dp_replicate, dp_shard, cp, tp, efsdp, ep, fsdp, batch, loss, plus world.
    assert counts == {"created": 10, "placeholder": 1, "distinct_real_rank_sets": 11}


def test_group_count_dedupes_rank_sets():
    # etp == tp, cp == 1 (fsdp == dp_shard), dp_replicate == 1 (batch == loss == dp_shard)
    pd = _build(3, dp_shard=4, tp=2, ep=2, etp=2, world_size=8)
    c = pd.process_group_count()
    assert c["distinct_real_rank_sets"] == 5  # world, dp_shard, tp, efsdp, ep
    assert c["created"] == 4  # the world group is the default group
    assert c["placeholder"] >= 1  # pp, dp_replicate, cp share one singleton placeholder
    names = {n: pd.get_optional_mesh(n) for n in ("etp", "tp")}
    assert names["etp"].get_group() is names["tp"].get_group()
    assert pd.get_mesh("fsdp").get_group() is pd.get_mesh("dp_shard").get_group()
    assert pd.get_mesh("loss").get_group() is pd.get_mesh("batch").get_group()


def test_optional_and_errors():
    pd = _build(0, dp_shard=4, ep=2, world_size=4)
    assert pd.get_optional_mesh("tp") is None
    # torchtitan's helper: enabled 1-D meshes only (efsdp of size 1 and tp are not in it)
    assert set(pd.get_all_one_dimensional_meshes()) == {"dp_shard", "fsdp", "batch", "loss", "efsdp", "ep"}
    assert pd.get_optional_mesh(["dp_replicate", "fsdp"]) is None
    assert pd.get_mesh("efsdp").size() == 2
    with pytest.raises(ValueError, match=r"Mesh 'tp' is not available: tp \(size 1\) disabled"):
        pd.get_mesh("tp")
    with pytest.raises(ValueError, match="Invalid mesh dim: 'tpp'"):
        pd.get_mesh("tpp")
    with pytest.raises(ValueError, match="overlap"):
        pd.get_mesh(["fsdp", "dp_shard"])
    # efsdp exists at size 1 when ep > 1: experts are always FSDP-wrapped
    pd = _build(0, dp_shard=2, ep=2, world_size=2)
    assert pd.get_mesh("efsdp").size() == 1


def test_name_registry_refuses_clashes():
    pd = _build(1, dp_shard=2, cp=2, tp=2, world_size=8)
    dp_cp = pd.flatten(["dp_shard", "cp"], "dp_cp")
    assert dp_cp.mesh.tolist() == pd.get_mesh("fsdp").mesh.tolist()
    assert dp_cp.get_group() is pd.get_mesh("fsdp").get_group()  # same ranks, same group
    assert pd.flatten(["dp_shard", "cp"], "dp_cp") is dp_cp
    with pytest.raises(ValueError, match="cannot name a flattened mesh 'tp'"):
        pd.flatten(["dp_shard", "cp"], "tp")
    with pytest.raises(ValueError, match="cannot name a flattened mesh 'dp_cp'"):
        pd.flatten(["cp", "tp"], "dp_cp")
    # torch's own flatten shares the namespace and cannot silently shadow our meshes
    with pytest.raises(ValueError):
        pd.get_mesh("dense")["cp", "tp"]._flatten("fsdp")


def test_backend_override_and_world_size_mismatch():
    _fake_world(0, 8)
    pd = ParallelDims(dp_replicate=1, dp_shard=4, cp=1, tp=2, pp=1, ep=1, etp=1, world_size=8)
    pd.build_mesh("cpu", backend_override={"tp": "fake"})
    assert dist.get_backend(pd.get_mesh("tp").get_group()) == "fake"
    with pytest.raises(ValueError, match="backend_override names unknown axes"):
        ParallelDims(1, 4, 1, 2, 1, 1, 1, 8).build_mesh("cpu", backend_override={"bogus": "fake"})
    pd = ParallelDims(1, -1, 1, 2, 1, 1, 1, 16)
    with pytest.raises(ValueError, match="configured for world_size=16 but the process group has 8"):
        pd.build_mesh("cpu")


CONFIGS = [
    dict(world_size=8, dp_shard=-1),
    dict(world_size=8, dp_replicate=2, dp_shard=2, tp=2),
    dict(world_size=16, dp_shard=2, cp=2, tp=2, pp=2, ep=4),
    dict(world_size=16, dp_shard=4, tp=2, pp=2, ep=2, etp=2),
    dict(world_size=32, dp_replicate=2, dp_shard=2, cp=2, tp=2, pp=2, ep=8),
    dict(world_size=64, dp_replicate=2, dp_shard=4, cp=2, tp=4, ep=8, etp=4),
    dict(world_size=4096, pp=4, dp_shard=-1, cp=2, tp=8, ep=64),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_same_ranks_as_torchtitan(cfg):
    # skips, naming the import error, where torchtitan (the `peer` extra) is missing or broken
    titan_module = pytest.importorskip("torchtitan.distributed.parallel_dims", exc_type=ImportError)
    TitanDims = titan_module.ParallelDims

    full = dict(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=1, etp=1) | cfg
    world = full["world_size"]
    for rank in sorted({0, 1, world // 2 + 1, world - 1}):
        ours = _build(rank, **full)
        our_groups = {n: ours._meshes[n].mesh.tolist() for n in TORCHTITAN_NAMES}
        our_hsdp = ours._mesh_nd(("dp_replicate", "fsdp")).mesh.tolist()
        our_epetp = ours._mesh_nd(("ep", "etp")).mesh.tolist()
        _fake_world(rank, world)
        titan = TitanDims(**full)
        titan.build_mesh()
        for name in TORCHTITAN_NAMES:
            theirs = titan._meshes[name].mesh.tolist()
            assert our_groups[name] == theirs, f"{name} differs on rank {rank}: {our_groups[name]} vs {theirs}"
        assert our_hsdp == titan._global_meshes["dense"]["dp_replicate", "fsdp"].mesh.tolist()
        assert our_epetp == titan._global_meshes["sparse"]["ep", "etp"].mesh.tolist()
        for name in TORCHTITAN_NAMES:
            assert (ours.get_optional_mesh(name) is None) == (titan.get_optional_mesh(name) is None), name
        assert ours.fsdp_gradient_divide_factor == titan.fsdp_gradient_divide_factor
        assert ours.seq_len_divisor == titan.seq_len_divisor
        assert ours.non_data_parallel_size == titan.non_data_parallel_size
