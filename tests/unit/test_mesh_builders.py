"""The two mesh builders (``layout`` on torch >= 2.13, ``portable`` on torch 2.11 .. 2.15) build
identical meshes from identical process groups; the builder choice (``MESHTRAIN_MESH_BUILDER``)
and the supported torch range are enforced with one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.distributed.device_mesh import DeviceMesh
from torch.testing._internal.distributed.fake_pg import FakeStore

import parallel_dims.builders as builders_module
from parallel_dims import MESH_BUILDER_ENV, ParallelDims, layout_builder_available, resolve_mesh_builder
from parallel_dims._torch_support import unsupported_torch_message
from parallel_dims.layout import ONE_D_AXES

REPO = Path(__file__).resolve().parents[2]
BUILDERS = ["layout", "portable"] if layout_builder_available() else ["portable"]
needs_both = pytest.mark.skipif(
    len(BUILDERS) < 2, reason=f"torch {torch.__version__} has no layout builder to compare with"
)


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv(MESH_BUILDER_ENV, raising=False)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _fake_world(rank: int, world_size: int) -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def _ranks(group) -> list[int]:
    return dist.get_process_group_ranks(group)


def _describe_mesh(mesh: DeviceMesh | None):
    """Everything a consumer can observe of a mesh: names, ranks, and each dim's group."""
    if mesh is None:
        return None
    return (
        mesh.mesh_dim_names,
        mesh.mesh.tolist(),
        mesh.get_coordinate(),
        [(_ranks(mesh.get_group(d)), dist.get_backend(mesh.get_group(d))) for d in range(mesh.ndim)],
    )


def _snapshot(rank: int, builder: str, degrees: dict) -> dict:
    """Build on the fake backend with ``builder`` and record every mesh, group and count."""
    _fake_world(rank, degrees["world_size"])
    before = set(c10d._world.pg_map)
    pd = ParallelDims(**degrees, mesh_builder=builder)
    pd.build_mesh("cpu")
    assert pd.mesh_builder == builder
    new = [pg for pg in c10d._world.pg_map if pg not in before]
    rank_sets = [tuple(sorted(c10d._world.pg_group_ranks[pg])) for pg in new]
    real = [s for s in rank_sets if len(s) > 1]
    snap = {
        "one_d": {n: _describe_mesh(pd.get_mesh(n) if n == "world" else pd._meshes[n]) for n in ONE_D_AXES},
        "optional": {n: pd.get_optional_mesh(n) is not None for n in ONE_D_AXES},
        "dense": _describe_mesh(pd.get_mesh("dense")),
        "sparse": _describe_mesh(pd.get_mesh("sparse")),
        "dense_fsdp": _describe_mesh(pd.dense_fsdp_mesh),
        "expert_fsdp": _describe_mesh(pd.expert_fsdp_mesh),
        "fsdp_trivial": [_describe_mesh(pd.fsdp_mesh_for(p, allow_trivial=True)) for p in ("dense", "expert")],
        "hsdp": _describe_mesh(pd.get_optional_mesh(["dp_replicate", "fsdp"])),
        "ep_etp": _describe_mesh(DeviceMesh._concatenate([pd._meshes["ep"], pd._meshes["etp"]])),
        "fsdp_tp": _describe_mesh(DeviceMesh._concatenate([pd._meshes["fsdp"], pd._meshes["tp"]])),
        "efsdp_ep": _describe_mesh(DeviceMesh._concatenate([pd._meshes["efsdp"], pd._meshes["ep"]])),
        "counts": pd.process_group_count(),
        "new_real_groups": sorted(real),
        "new_placeholders": len(rank_sets) - len(real),
        # groups shared between meshes with the same rank set (e.g. etp is tp when etp == tp)
        "sharing": sorted(
            (a, b)
            for a in ONE_D_AXES
            for b in ONE_D_AXES
            if a < b and _mesh(pd, a).get_group() is _mesh(pd, b).get_group()
        ),
    }
    # no duplicate rank sets, and every real group was created by one of its members
    assert len(real) == len(set(real)), f"{builder}: duplicate process groups {real}"
    assert all(rank in s for s in rank_sets), f"{builder}: rank {rank} created a foreign group"
    return snap


def _mesh(pd: ParallelDims, name: str) -> DeviceMesh:
    return pd.world_mesh if name == "world" else pd._meshes[name]


LAYOUTS = [
    dict(world_size=8, dp_shard=2, cp=2, tp=2, ep=4),  # ep folds over cp and tp
    dict(world_size=8, dp_replicate=2, dp_shard=2, tp=2, ep=2, etp=2),  # HSDP, etp == tp
    dict(world_size=16, dp_shard=2, cp=2, tp=2, pp=2, ep=4),
    dict(world_size=16, dp_shard=4, tp=2, pp=2, ep=2, etp=2),
    dict(world_size=16, dp_replicate=2, dp_shard=2, cp=2, tp=2, ep=8),  # HSDP, ep over dp_shard x cp x tp
    dict(world_size=12, dp_shard=3, tp=4, ep=6),  # ep=6 folds over part of dp_shard: no common refinement
    dict(world_size=24, dp_replicate=2, dp_shard=3, cp=2, tp=2, ep=3),
    dict(world_size=8, dp_replicate=8),  # DDP only: fsdp is size 1
    dict(world_size=4, tp=4),  # nothing but tp: every data-parallel axis is a placeholder
    dict(world_size=64, dp_replicate=2, dp_shard=4, cp=2, tp=4, ep=8, etp=4),
]


def _full(cfg: dict) -> dict:
    return dict(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=1, etp=1) | cfg


@needs_both
@pytest.mark.parametrize("cfg", LAYOUTS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_both_builders_build_identical_meshes_and_groups(cfg):
    degrees = _full(cfg)
    world = degrees["world_size"]
    ranks = range(world) if world <= 16 else sorted({0, 1, 5, world // 2 + 3, world - 1})
    for rank in ranks:
        layout = _snapshot(rank, "layout", degrees)
        portable = _snapshot(rank, "portable", degrees)
        for key in layout:
            assert layout[key] == portable[key], f"{key} differs on rank {rank}"


@pytest.mark.parametrize("builder", BUILDERS)
def test_size_one_axes_are_placeholders(builder):
    _fake_world(0, 4)
    pd = ParallelDims(1, 4, 1, 1, 1, 1, 1, 4, mesh_builder=builder)
    pd.build_mesh("cpu")
    for name in ("pp", "dp_replicate", "cp", "tp", "etp", "ep"):
        assert pd.get_optional_mesh(name) is None
        assert dist.get_backend(pd._meshes[name].get_group()) == "fake", name
    assert pd.process_group_count() == {"created": 0, "placeholder": 1, "distinct_real_rank_sets": 1}


@pytest.mark.parametrize("builder", BUILDERS)
def test_flatten_and_name_registry(builder):
    _fake_world(9, 16)
    pd = ParallelDims(dp_replicate=2, dp_shard=2, cp=2, tp=2, pp=1, ep=1, etp=1, world_size=16, mesh_builder=builder)
    pd.build_mesh("cpu")
    dp_cp = pd.flatten(["dp_shard", "cp"], "dp_cp")  # one stride: reuses the fsdp group
    assert dp_cp.mesh.tolist() == pd.get_mesh("fsdp").mesh.tolist() == [9, 11, 13, 15]
    assert dp_cp.get_group() is pd.get_mesh("fsdp").get_group()
    # two strides (dp_replicate skips dp_shard): a new group of exactly these ranks
    rep_cp = pd.flatten(["dp_replicate", "cp"], "rep_cp")
    assert rep_cp.mesh.tolist() == [1, 3, 9, 11]
    assert _ranks(rep_cp.get_group()) == [1, 3, 9, 11]
    assert rep_cp.get_group().group_name == pd._group_by_rank_set[(1, 3, 9, 11)]  # ours
    assert pd.get_mesh("rep_cp") is rep_cp
    with pytest.raises(ValueError, match="cannot name a flattened mesh 'tp'"):
        pd.flatten(["dp_shard", "cp"], "tp")
    with pytest.raises(ValueError, match="cannot name a flattened mesh 'rep_cp'"):
        pd.flatten(["cp", "tp"], "rep_cp")
    # torch's own flatten shares our namespace: the same ranks under the same name give our
    # mesh, other ranks under one of our names fail
    assert pd.get_mesh("dense")["dp_shard", "cp"]._flatten("fsdp") is pd.get_mesh("fsdp")
    with pytest.raises(ValueError):
        pd.get_mesh("dense")["cp", "tp"]._flatten("loss")
    # and the root mesh slices our names to our meshes (torch warns that this is deprecated)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        assert pd.world_mesh["tp"].mesh.tolist() == pd.get_mesh("tp").mesh.tolist()


def test_builder_env_var_is_honoured(monkeypatch):
    monkeypatch.setenv(MESH_BUILDER_ENV, "portable")
    assert ParallelDims(1, 2, 1, 1, 1, 1, 1, 2).mesh_builder == "portable"
    monkeypatch.setenv(MESH_BUILDER_ENV, " Portable ")
    assert resolve_mesh_builder() == "portable"
    for value in ("auto", ""):
        monkeypatch.setenv(MESH_BUILDER_ENV, value)
        assert resolve_mesh_builder() == ("layout" if layout_builder_available() else "portable")
    monkeypatch.delenv(MESH_BUILDER_ENV)
    assert resolve_mesh_builder() == ("layout" if layout_builder_available() else "portable")
    # an explicit argument wins over the environment
    monkeypatch.setenv(MESH_BUILDER_ENV, "portable")
    assert resolve_mesh_builder("auto") == ("layout" if layout_builder_available() else "portable")


def test_builder_env_var_is_used_by_build(monkeypatch):
    monkeypatch.setenv(MESH_BUILDER_ENV, "portable")
    _fake_world(0, 8)
    pd = ParallelDims(1, 4, 1, 2, 1, 1, 1, 8)
    pd.build_mesh("cpu")
    assert pd.mesh_builder == "portable"
    assert pd.get_mesh("tp").mesh.tolist() == [0, 1]


def test_bad_builder_values_are_rejected(monkeypatch):
    monkeypatch.setenv(MESH_BUILDER_ENV, "fast")
    with pytest.raises(ValueError) as err:
        ParallelDims(1, 2, 1, 1, 1, 1, 1, 2)
    message = str(err.value)
    assert message.startswith("MESHTRAIN_MESH_BUILDER='fast' is not a mesh builder; legal values: auto")
    assert "layout" in message and "portable" in message and "\n" not in message
    with pytest.raises(ValueError, match=r"mesh_builder=3 is not a mesh builder"):
        resolve_mesh_builder(3)


def test_layout_builder_refused_where_torch_lacks_it(monkeypatch):
    monkeypatch.setattr(builders_module, "layout_builder_available", lambda: False)
    monkeypatch.setenv(MESH_BUILDER_ENV, "layout")
    with pytest.raises(ValueError) as err:
        ParallelDims(1, 2, 1, 1, 1, 1, 1, 2)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("MESHTRAIN_MESH_BUILDER='layout' needs torch's layout-based DeviceMesh")
    assert f"torch {torch.__version__} lacks" in message and "MESHTRAIN_MESH_BUILDER=portable" in message
    monkeypatch.setenv(MESH_BUILDER_ENV, "auto")
    assert ParallelDims(1, 2, 1, 1, 1, 1, 1, 2).mesh_builder == "portable"


@pytest.mark.skipif(layout_builder_available(), reason="this torch has the layout builder")
def test_layout_builder_refused_on_this_torch(monkeypatch):
    monkeypatch.setenv(MESH_BUILDER_ENV, "layout")
    with pytest.raises(ValueError, match="needs torch's layout-based DeviceMesh"):
        ParallelDims(1, 2, 1, 1, 1, 1, 1, 2)


def _run(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, PYTHONPATH=str(REPO)) | (env or {})
    if env is None or "LOCAL_RANK" not in env:
        full_env.pop("LOCAL_RANK", None)
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=full_env, timeout=300
    )


@pytest.mark.parametrize("builder", BUILDERS)
def test_cli_names_the_builder(builder, monkeypatch, capsys):
    from parallel_dims.__main__ import main

    monkeypatch.setenv(MESH_BUILDER_ENV, builder)
    args = ["--world-size", "8", "--tp", "2", "--ep", "2"]
    assert main(args) == 0
    assert f"mesh builder: {builder} (torch {torch.__version__};" in capsys.readouterr().out
    assert main(args + ["--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["builder"] == builder and info["torch"] == str(torch.__version__)


def test_cli_rejects_bad_builder(monkeypatch, capsys):
    from parallel_dims.__main__ import main

    monkeypatch.setenv(MESH_BUILDER_ENV, "nope")
    assert main(["--world-size", "8"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1
    assert err.startswith("error: MESHTRAIN_MESH_BUILDER='nope' is not a mesh builder; legal values:")
    assert not dist.is_initialized()


OLD_TORCH_LINE = (
    'error: meshtrain needs torch >= 2.11 (found 2.9.1); install a supported torch: pip install "torch>=2.11,<2.16"'
)


@pytest.mark.parametrize("module", ["parallel_dims", "trainer.trainer"])
def test_old_torch_gets_one_line_at_import(module):
    result = _run(f"import torch; torch.__version__ = '2.9.1'; import {module}; print('imported')")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == OLD_TORCH_LINE
    assert result.stdout == ""


def test_old_torch_under_torchrun_prints_once_per_node():
    # every process exits with code 2; only local rank 0 prints the line
    result = _run("import torch; torch.__version__ = '2.9.1'; import parallel_dims", {"LOCAL_RANK": "1"})
    assert result.returncode == 2 and result.stderr == "" and result.stdout == ""


def test_missing_torch_gets_one_line_at_import():
    result = _run("import sys; sys.modules['torch'] = None; import parallel_dims")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (
        "error: meshtrain needs torch >= 2.11 (torch is not installed); install a supported "
        'torch: pip install "torch>=2.11,<2.16"'
    )


@pytest.mark.parametrize(
    "version, supported",
    [
        ("2.9.1", False),
        ("2.10.0+cu128", False),
        ("1.13.1", False),
        ("2.11.0+cu130", True),
        ("2.13.0+cpu", True),
        ("2.15.0", True),
        ("2.16.0.dev20260101+cu130", True),
        ("weird", True),
    ],
)
def test_supported_torch_versions(version, supported):
    message = unsupported_torch_message(version)
    assert (message is None) == supported
    if not supported:
        assert message.startswith(f"meshtrain needs torch >= 2.11 (found {version}); ")


def test_pyproject_states_the_supported_range():
    text = (REPO / "pyproject.toml").read_text()
    assert '"torch>=2.11,<2.16"' in text
