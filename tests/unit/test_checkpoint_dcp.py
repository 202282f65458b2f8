"""DCP step checkpoints (trainer/checkpoint/dcp.py, state.py) and consolidated exports
(trainer/checkpoint/export.py): round trips of the whole train state, crash safety, retention,
resharding across layouts, seed checkpoints, and clear errors for unusable folders."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import trainer.checkpoint.dcp as ckpt
from trainer.checkpoint.dcp import CheckpointFolder, save_seed_checkpoint
from trainer.checkpoint.errors import CheckpointError, read_failure
from trainer.checkpoint.export import export_checkpoint, export_consolidated
from trainer.checkpoint.state import checkpoint_keys
from trainer.config import load_config
from trainer.data.batching import PackedDataLoader
from trainer.data.sources import SyntheticSource
from trainer.data.tokenizer import ByteTokenizer
from trainer.optim.optimizers import build_lr_scheduler, build_optimizer

CFG = load_config(["--config", "llama3.toml"])


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.ff = nn.Linear(8, 8)

    def forward(self, x):
        return x + self.ff(self.norm(x))


class Net(nn.Module):
    """Pipeline-splittable like the real models: stages keep the original FQNs."""

    def __init__(self, layers=(0, 1), embed=True, head=True):
        super().__init__()
        self.tok_embeddings = nn.Embedding(259, 8) if embed else None
        self.layers = nn.ModuleDict({str(i): Block() for i in layers})
        self.output = nn.Linear(8, 259, bias=False) if head else None

    def forward(self, x):
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for layer in self.layers.values():
            h = layer(h)
        return self.output(h) if self.output is not None else h


@pytest.fixture
def gloo(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def loader():
    return PackedDataLoader(
        SyntheticSource(0),
        ByteTokenizer(),
        seq_len=16,
        global_batch_size=2,
        local_batch_size=2,
        batch_rank=0,
        batch_degree=1,
    )


def train_state(seed=0):
    torch.manual_seed(seed)
    model = Net()
    opt = build_optimizer([model], CFG)
    sched = build_lr_scheduler(opt, CFG)
    data = loader()
    for _ in range(3):
        x, _ = next(data)
        model(x).float().pow(2).mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return model, opt, sched, data


def same_params(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_save_load_roundtrip(gloo, tmp_path):
    model, opt, sched, data = train_state()
    mgr = CheckpointFolder(str(tmp_path / "ckpt"), keep_latest_k=3)
    path = mgr.save(3, [model], opt, sched, data, extra={"tokens_seen": 96})
    assert path.endswith("step-3") and mgr.latest_step() == 3
    expected_rand = torch.rand(3)
    expected_batch = next(data)[0]

    torch.manual_seed(123)
    model2 = Net()
    opt2 = build_optimizer([model2], CFG)
    sched2 = build_lr_scheduler(opt2, CFG)
    data2 = loader()
    extra = mgr.load([model2], opt2, sched2, data2)
    assert extra == {"step": 3, "tokens_seen": 96}
    assert same_params(model, model2)
    a, b = opt.optimizers[0], opt2.optimizers[0]
    assert torch.equal(b.state[model2.output.weight]["exp_avg_sq"], a.state[model.output.weight]["exp_avg_sq"])
    assert float(b.state[model2.output.weight]["step"]) == 3.0
    assert sched2.last_step == 3 and opt2.param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"])
    assert torch.equal(torch.rand(3), expected_rand)  # rank 0's RNG restored
    assert torch.equal(next(data2)[0], expected_batch)  # data resumes at the next step


def test_exclude_from_loading(gloo, tmp_path):
    model, opt, sched, data = train_state()
    mgr = CheckpointFolder(str(tmp_path))
    mgr.save(3, [model], opt, sched, data)
    model2, data2 = Net(), loader()
    opt2 = build_optimizer([model2], CFG)
    sched2 = build_lr_scheduler(opt2, CFG)
    mgr.load([model2], opt2, sched2, data2, exclude=["optimizer", "lr_scheduler", "dataloader"])
    assert same_params(model, model2)
    assert not opt2.optimizers[0].state and sched2.last_step == 0
    assert data2.state_dict()["sample_index"] == 0
    with pytest.raises(ValueError, match="cannot exclude"):
        mgr.load([model2], exclude=["model"])


def test_crash_mid_save_keeps_previous_checkpoint(gloo, tmp_path, monkeypatch):
    model, opt, sched, data = train_state()
    folder = tmp_path / "ckpt"
    mgr = CheckpointFolder(str(folder), keep_latest_k=0)
    mgr.save(1, [model], opt, sched, data)
    real_save = ckpt.dcp.save

    def crashing_save(*args, **kwargs):
        real_save(*args, **kwargs)  # shards and metadata written into step-2.tmp ...
        raise RuntimeError("node failure")  # ... but the rename never happens

    monkeypatch.setattr(ckpt.dcp, "save", crashing_save)
    with torch.no_grad():
        model.output.weight.add_(1.0)
    with pytest.raises(RuntimeError, match="node failure"):
        mgr.save(2, [model], opt, sched, data)
    monkeypatch.setattr(ckpt.dcp, "save", real_save)
    assert os.path.isdir(folder / "step-2.tmp") and not os.path.exists(folder / "step-2")
    assert mgr.latest_step() == 1
    fresh = Net()
    assert mgr.load([fresh])["step"] == 1
    assert torch.allclose(fresh.output.weight, model.output.weight - 1.0, atol=1e-6)
    mgr.save(3, [model], opt, sched, data)
    assert sorted(os.listdir(folder)) == ["step-1", "step-3"]  # stale .tmp purged


def test_keep_latest_k_and_missing_steps(gloo, tmp_path):
    model = Net()
    mgr = CheckpointFolder(str(tmp_path / "c"), keep_latest_k=2)
    assert mgr.load([model]) is None  # nothing to resume from
    for step in (5, 10, 15, 20):
        mgr.save(step, [model])
    assert mgr.list_steps() == [15, 20]
    mgr.save(20, [model])  # re-saving a step replaces it
    assert mgr.list_steps() == [15, 20]
    with pytest.raises(CheckpointError, match=r"no complete checkpoint for step 5 .* available steps: \[15, 20\]"):
        mgr.load([model], step=5)
    assert mgr.load([model], step=15)["step"] == 15


def test_pipeline_parts_load_into_a_different_layout(gloo, tmp_path):
    torch.manual_seed(0)
    stage0, stage1 = Net(layers=(0,), head=False), Net(layers=(1,), embed=False)
    opt = build_optimizer([stage0, stage1], CFG)
    (stage1(stage0(torch.tensor([[1, 2, 3]]))).sum()).backward()
    opt.step()
    mgr = CheckpointFolder(str(tmp_path))
    mgr.save(1, [stage0, stage1], opt)
    keys = checkpoint_keys(mgr.step_dir(1))
    assert {
        "model.tok_embeddings.weight",
        "model.layers.0.ff.weight",
        "model.layers.1.ff.weight",
        "model.output.weight",
        "optimizer.state.layers.1.ff.weight.exp_avg",
    } <= keys
    whole = Net()
    opt_whole = build_optimizer([whole], CFG)
    mgr.load([whole], opt_whole)
    assert torch.equal(whole.layers["1"].ff.weight, stage1.layers["1"].ff.weight)
    assert torch.equal(whole.tok_embeddings.weight, stage0.tok_embeddings.weight)
    assert torch.equal(
        opt_whole.optimizers[0].state[whole.layers["1"].ff.weight]["exp_avg"],
        opt.optimizers[1].state[stage1.layers["1"].ff.weight]["exp_avg"],
    )


def test_wrapper_prefixes_are_not_saved(gloo, tmp_path):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = Net()
    model.layers["0"] = checkpoint_wrapper(model.layers["0"])
    mgr = CheckpointFolder(str(tmp_path))
    mgr.save(1, [model])
    keys = checkpoint_keys(mgr.step_dir(1))
    assert "model.layers.0.ff.weight" in keys and not any("_checkpoint_wrapped_module" in k for k in keys)
    plain = Net()
    mgr.load([plain])
    assert torch.equal(plain.layers["0"].ff.weight, model.layers["0"]._checkpoint_wrapped_module.ff.weight)


def test_model_mismatch_is_a_clear_error(gloo, tmp_path):
    mgr = CheckpointFolder(str(tmp_path))
    mgr.save(1, [Net(layers=(0,))])
    with pytest.raises(CheckpointError, match=r"lacks 4 model weights, e.g. \['layers.1"):
        mgr.load([Net(layers=(0, 1))])


def test_seed_checkpoint_without_process_group_then_load_sharded(tmp_path):
    torch.manual_seed(7)
    seed_model = Net()
    path = save_seed_checkpoint(seed_model, str(tmp_path / "ckpt"))
    assert path.endswith("step-0") and not dist.is_initialized()
    assert not any(k.startswith(("optimizer", "train_state")) for k in checkpoint_keys(path))

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))
        model = Net()
        fully_shard(model, mesh=mesh)
        opt = build_optimizer([model], CFG)
        extra = CheckpointFolder(str(tmp_path / "ckpt")).load([model], opt)
        assert extra == {"step": 0}
        loaded = {k: v.full_tensor() for k, v in model.state_dict().items()}
        assert all(torch.equal(loaded[k], v) for k, v in seed_model.state_dict().items())
        # and a sharded (DTensor) model exports plain consolidated weights
        out = export_consolidated([model], str(tmp_path / "fsdp.pt"))
        full = torch.load(out, weights_only=True)
        assert all(torch.equal(full[k], v) for k, v in seed_model.state_dict().items())
    finally:
        dist.destroy_process_group()


def test_export_consolidated_and_from_checkpoint(gloo, tmp_path):
    torch.manual_seed(1)
    model = Net()
    out = export_consolidated([model], str(tmp_path / "export" / "model.pt"), dtype="bfloat16")
    state = torch.load(out, weights_only=True)
    assert state.keys() == model.state_dict().keys()
    assert all(v.dtype == torch.bfloat16 for v in state.values())
    assert torch.equal(state["output.weight"], model.output.weight.detach().to(torch.bfloat16))

    mgr = CheckpointFolder(str(tmp_path / "ckpt"))
    mgr.save(4, [Net(layers=(0,), head=False), Net(layers=(1,), embed=False)])
    from_dcp = torch.load(export_checkpoint(mgr.step_dir(4), str(tmp_path / "from_dcp.pt")), weights_only=True)
    assert set(from_dcp) == set(model.state_dict()) and from_dcp["output.weight"].dtype == torch.float32
    with pytest.raises(ValueError, match="export dtype must be one of"):
        export_consolidated([model], str(tmp_path / "x.pt"), dtype="int8")


def test_unreadable_checkpoint_folder_is_a_clear_error(tmp_path, monkeypatch):
    # (the tests run as root, for whom chmod 000 does not deny reads: simulate the OS error)
    (tmp_path / "step-3").mkdir()

    def denied(path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(ckpt.os, "listdir", denied)
    with pytest.raises(CheckpointError, match=r"checkpoint folder .* is not readable \(permission denied\): fix"):
        CheckpointFolder(str(tmp_path)).load([Net()])


def test_read_failures_are_classified_and_bugs_are_not():
    from torch.distributed.checkpoint.api import CheckpointException

    assert read_failure(PermissionError(13, "Permission denied", "/c/x"), "shard file") == (
        "permission denied reading /c/x"
    )
    assert read_failure(EOFError(), ".metadata") == "truncated or corrupt .metadata"
    wrapped = CheckpointException("load", {1: (RuntimeError("PytorchStreamReader failed reading zip archive"), None)})
    assert read_failure(wrapped, "shard file") == "truncated or corrupt shard file"
    # anything else is a bug: no reason, so the caller re-raises it with its traceback
    assert read_failure(RuntimeError("size mismatch for layers.0"), "shard file") is None
    assert read_failure(TypeError("bad"), ".metadata") is None


def test_resave_after_a_crash_between_the_renames(gloo, tmp_path):
    """A crash after step-N was moved to step-N.old but before it was removed: saving step N
    again replaces the stale .old (trainer/checkpoint/folders.py), and a later save purges it."""
    model = Net()
    mgr = CheckpointFolder(str(tmp_path / "c"))
    mgr.save(2, [model])
    os.rename(mgr.step_dir(2), mgr.step_dir(2) + ".old")
    mgr.save(2, [model])
    assert sorted(os.listdir(tmp_path / "c")) == ["step-2"] and mgr.load([Net()])["step"] == 2
