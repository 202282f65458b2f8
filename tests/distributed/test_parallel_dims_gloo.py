"""8 real gloo ranks: build every mesh, then prove each group's members by communicating."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from parallel_dims import ParallelDims, resolve_mesh_builder
from parallel_dims.layout import ONE_D_AXES
from tools.forkserver import run_distributed


def _check_all_meshes(rank, world_size, degrees):
    pd = ParallelDims(world_size=world_size, **degrees)
    pd.build_mesh("cpu")
    seen = {}
    for name in ONE_D_AXES:
        mesh = pd._meshes[name]
        group = mesh.get_group()
        want = pd.layout.group(name, rank)
        # all_reduce of (1 << rank) over the group must give exactly the members' bits
        bits = torch.tensor([1 << rank], dtype=torch.int64)
        if len(want) > 1:
            dist.all_reduce(bits, group=group)
        members = [r for r in range(world_size) if int(bits.item()) >> r & 1]
        assert members == sorted(want), f"{name}: reduced over {members}, expected {sorted(want)}"
        # an all_gather confirms the order of ranks in the group
        if len(want) > 1:
            out = [torch.zeros(1, dtype=torch.int64) for _ in want]
            dist.all_gather(out, torch.tensor([rank]), group=group)
            assert [int(t) for t in out] == want, name
        seen[name] = want
    # 2-D meshes communicate over each of their dims with the right members
    hsdp = pd.get_optional_mesh(["dp_replicate", "fsdp"])
    if hsdp is not None:
        for dim in range(2):
            t = torch.tensor([1 << rank], dtype=torch.int64)
            dist.all_reduce(t, group=hsdp.get_group(dim))
            col = hsdp.mesh.select(1 - dim, hsdp.get_local_rank(1 - dim)).tolist()
            assert [r for r in range(world_size) if int(t) >> r & 1] == sorted(col)
    # a user flatten over two strides (dp_replicate skips dp_shard) gets a group of its ranks
    if pd.dp_replicate > 1 and pd.cp > 1:
        rep_cp = pd.flatten(["dp_replicate", "cp"], "rep_cp")
        t = torch.tensor([1 << rank], dtype=torch.int64)
        dist.all_reduce(t, group=rep_cp.get_group())
        assert [r for r in range(world_size) if int(t) >> r & 1] == sorted(rep_cp.mesh.tolist())
    return seen, pd.process_group_count(), pd.mesh_builder


LAYOUTS = [
    dict(dp_replicate=1, dp_shard=2, cp=2, tp=2, pp=1, ep=4, etp=1),
    dict(dp_replicate=2, dp_shard=2, cp=1, tp=2, pp=1, ep=2, etp=2),
    dict(dp_replicate=1, dp_shard=2, cp=1, tp=2, pp=2, ep=2, etp=1),
    dict(dp_replicate=2, dp_shard=-1, cp=2, tp=1, pp=1, ep=4, etp=1),
]


@pytest.mark.parametrize("degrees", LAYOUTS, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items() if v != 1))
def test_every_mesh_communicates_with_its_members(degrees):
    results = run_distributed(_check_all_meshes, 8, degrees)
    for name in ONE_D_AXES:
        # the groups seen by all ranks partition the world
        groups = {tuple(r[0][name]) for r in results}
        assert sorted(x for g in groups for x in g) == list(range(8)), name
    counts = [r[1] for r in results]
    assert all(c == counts[0] for c in counts)
    # every rank used the builder this process resolves (MESHTRAIN_MESH_BUILDER reaches them)
    assert {r[2] for r in results} == {resolve_mesh_builder()}
