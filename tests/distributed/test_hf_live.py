"""Exports straight from the live, sharded model (no temporary DCP checkpoint).

* :func:`export_model_to_hf` writes the same Hugging Face folder as the offline converter
  (:func:`export_dcp_to_hf`) run on a DCP save of the same model: the same files, the same json
  files, every tensor bit for bit (bitwise is the right bar: the same weights go through the same
  ``to_hf`` and cast code, only the route differs -- a file round trip vs gathered shards);
  single process (llama3, deepseek_v3) and under llama3 fsdp=2 x tp=2, deepseek_v3 fsdp=2 x
  ep=2 (experts on ep) and llama3 pp=2 x fsdp=2 (a file's writer is on the other stage).
  Negative control: one weight changed after the DCP save is caught, and only that tensor.
* :func:`export_consolidated` under pp=2 x fsdp=2 (gathered to rank 0, no temp DCP) equals
  the consolidated export of the single-process model, bit for bit.
* No temporary DCP is written: ``dcp.save`` is made to fail during the live exports, and no
  ``*.dcp.tmp`` / ``.metadata`` / ``*.tmp`` is left anywhere.
"""

from __future__ import annotations

import contextlib
import os
from unittest import mock

import pytest
import torch

from tools.forkserver import run_distributed

GLOBAL_BS, SEQ = 4, 16
SHARD_BYTES = 150_000  # several shard files, more than ranks, groups split across files
DTYPE = "bfloat16"  # deepseek's keep_in_fp32 keys stay float32


def _plan(name: str, degrees: dict):
    from tests.distributed.parallel_harness import harness_plan

    return harness_plan(name, degrees, GLOBAL_BS, SEQ)


@contextlib.contextmanager
def _no_dcp_save():
    """Any DCP save inside is a failure (the live exports must not write one)."""
    import torch.distributed.checkpoint as dcp

    def refuse(*_a, **_k):
        raise AssertionError("a live export wrote a DCP checkpoint")

    with mock.patch.object(dcp, "save", refuse), mock.patch.object(dcp.state_dict_saver, "save", refuse):
        yield


def _export_both(parts, name, args, root, *, consolidated=False):
    """DCP save + offline conversion into root/offline, and the live export into root/live."""
    import torch.distributed.checkpoint as dcp

    from trainer.checkpoint.export import export_consolidated
    from trainer.checkpoint.hf_live import export_model_to_hf
    from trainer.checkpoint.hf_write import export_dcp_to_hf
    from trainer.checkpoint.state import model_state_dict, run_dcp

    kw = dict(dtype=DTYPE, max_shard_bytes=SHARD_BYTES)
    run_dcp(dcp.save, {"model": model_state_dict(parts)}, checkpoint_id=os.path.join(root, "dcp"))
    export_dcp_to_hf(os.path.join(root, "dcp"), os.path.join(root, "offline"), name, args, **kw)
    with _no_dcp_save():
        export_model_to_hf(parts, os.path.join(root, "live", "hf"), name, args, **kw)
        if consolidated:
            export_consolidated(parts, os.path.join(root, "live", "model.pt"), DTYPE)


def _layout_worker(rank, world_size, name, degrees, root, consolidated):
    from tests.distributed.parallel_harness import build_layout_model, build_layout_stages

    torch.manual_seed(0)
    plan = _plan(name, degrees)
    plan.parallel_dims.build_mesh("cpu")
    parts = build_layout_stages(plan).modules if plan.parallel_dims.pp > 1 else [build_layout_model(plan)]
    _export_both(parts, name, plan.model_args, root, consolidated=consolidated)
    return sorted(os.listdir(os.path.join(root, "live", "hf")))


def _differences(a: str, b: str) -> list[str]:
    """Files or tensors of folder ``a`` that differ from ``b`` (empty when equal)."""
    from safetensors.torch import load_file

    names = sorted(os.listdir(a))
    if names != sorted(os.listdir(b)):
        return [f"listing {names} vs {sorted(os.listdir(b))}"]
    out = []
    for n in names:
        pa, pb = os.path.join(a, n), os.path.join(b, n)
        if n.endswith(".json"):
            with open(pa, "rb") as fa, open(pb, "rb") as fb:
                if fa.read() != fb.read():
                    out.append(n)
            continue
        ta, tb = load_file(pa), load_file(pb)
        if sorted(ta) != sorted(tb):
            out.append(f"{n}: keys")
            continue
        out += [k for k in ta if ta[k].dtype != tb[k].dtype or not torch.equal(ta[k], tb[k])]
    return out


def _no_temp_files(root: str) -> None:
    for dirpath, dirnames, filenames in os.walk(os.path.join(root, "live")):
        for n in dirnames + filenames:
            assert not n.endswith(".tmp") and n != ".metadata", os.path.join(dirpath, n)


def _reference_model(name: str):
    from tests.distributed.parallel_harness import SEED

    spec = _plan(name, {}).model
    model = spec.model_cls(spec.args)
    model.init_weights(SEED)
    return model, spec.args


@pytest.mark.parametrize("name", ["llama3", "deepseek_v3"])
def test_live_hf_export_single_process(tmp_path, name):
    from trainer.checkpoint.hf_live import export_model_to_hf

    model, args = _reference_model(name)
    root = str(tmp_path)
    _export_both([model], name, args, root)
    live, offline = os.path.join(root, "live", "hf"), os.path.join(root, "offline")
    assert len([f for f in os.listdir(live) if f.endswith(".safetensors")]) >= 3
    assert _differences(live, offline) == []
    _no_temp_files(root)

    # negative control: a weight changed after the DCP save shows up, and only it
    key = "layers.0.attention.wq.weight" if name == "llama3" else "layers.0.attention.wo.weight"
    with torch.no_grad():
        model.state_dict()[key].view(-1)[5] += 1.0
    export_model_to_hf([model], os.path.join(root, "perturbed"), name, args, dtype=DTYPE, max_shard_bytes=SHARD_BYTES)
    diff = _differences(os.path.join(root, "perturbed"), offline)
    want = "model.layers.0.self_attn.q_proj.weight" if name == "llama3" else "model.layers.0.self_attn.o_proj.weight"
    assert diff == [want]


@pytest.mark.parametrize(
    "name, degrees",
    [
        ("llama3", dict(dp_shard=2, tp=2)),  # FSDP over TP: _StridedShard
        ("deepseek_v3", dict(dp_shard=2, ep=2)),  # experts sharded on ep, dense on fsdp
        ("llama3", dict(dp_shard=2, pp=2)),  # a file's writer may hold none of its groups
    ],
    ids=["llama3-fsdp2-tp2", "deepseek_v3-fsdp2-ep2", "llama3-pp2-fsdp2"],
)
def test_live_hf_export_under_layout(tmp_path, name, degrees):
    from tests.distributed.parallel_harness import world_size_of

    root = str(tmp_path)
    pp = degrees.get("pp", 1) > 1
    world = world_size_of(degrees)
    run_distributed(_layout_worker, world, name, degrees, root, pp, timeout=300)
    live, offline = os.path.join(root, "live", "hf"), os.path.join(root, "offline")
    assert len([f for f in os.listdir(live) if f.endswith(".safetensors")]) > world
    assert _differences(live, offline) == []
    _no_temp_files(root)
    if pp:
        # consolidated export under pp == the single-process model's, bit for bit
        from trainer.checkpoint.export import export_consolidated

        model, _ = _reference_model(name)
        ref = export_consolidated([model], os.path.join(root, "ref.pt"), DTYPE)
        got = torch.load(os.path.join(live, "..", "model.pt"), weights_only=True)
        want = torch.load(ref, weights_only=True)
        assert list(got) == list(want)
        for k in want:
            assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
