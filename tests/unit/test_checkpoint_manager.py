"""The trainer's checkpoint policy (trainer/checkpoint/manager.py): when a save is due, what the
last step writes, and what a run resumes from (its own checkpoint, or initial weights)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from tests.unit.test_checkpoint_dcp import Net, loader, same_params, train_state
from trainer.checkpoint.dcp import CheckpointFolder
from trainer.checkpoint.errors import CheckpointError
from trainer.checkpoint.manager import CheckpointManager, check_initial_load
from trainer.config import load_config
from trainer.optim.optimizers import build_lr_scheduler, build_optimizer


@pytest.fixture
def gloo(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _cfg(tmp_path, *overrides):
    return load_config(["--config", "llama3.toml", "--job.dump_folder", str(tmp_path / "run"), *overrides])


def _manager(cfg, model, opt=None, sched=None, data=None, lines=None):
    return CheckpointManager(
        cfg,
        model_parts=[model],
        optimizer=opt,
        lr_scheduler=sched,
        dataloader=data,
        model_args=None,
        log=(lines.append if lines is not None else lambda _m: None),
    )


def test_should_save_every_interval_and_the_last_step(tmp_path):
    mgr = _manager(_cfg(tmp_path, "--checkpoint.interval", "2"), Net())
    assert mgr.should_save(4) and not mgr.should_save(3) and mgr.should_save(3, last=True)
    assert mgr.folder == os.path.join(str(tmp_path / "run"), "checkpoint")
    off = _manager(_cfg(tmp_path, "--checkpoint.interval", "2", "--checkpoint.enable", "false"), Net())
    assert not off.should_save(4) and not off.should_save(5, last=True)


def test_maybe_save_then_resume_the_whole_train_state(gloo, tmp_path):
    cfg = _cfg(tmp_path, "--checkpoint.interval", "2")
    model, opt, sched, data = train_state()
    lines: list[str] = []
    phases: list[str] = []

    def phase(what):
        phases.append(what)
        return torch.no_grad()  # any context manager

    mgr = _manager(cfg, model, opt, sched, data, lines)
    mgr.maybe_save(1, last=False, phase=phase)
    mgr.maybe_save(2, last=False, phase=phase)
    assert phases == ["checkpoint save at step 2"]
    assert lines == [f"saved checkpoint {os.path.join(mgr.folder, 'step-2')}"]
    assert CheckpointFolder(mgr.folder).list_steps() == [2]

    torch.manual_seed(5)
    model2 = Net()
    opt2 = build_optimizer([model2], cfg)
    sched2 = build_lr_scheduler(opt2, cfg)
    data2 = loader()
    lines.clear()
    assert _manager(cfg, model2, opt2, sched2, data2, lines).resume() == 2
    assert lines == [f"resumed from {mgr.folder} at step 2"]
    assert same_params(model, model2) and sched2.last_step == 3


def test_last_step_model_only_writes_consolidated_weights(gloo, tmp_path):
    cfg = _cfg(tmp_path, "--checkpoint.last_save_model_only", "true", "--checkpoint.export_dtype", "bfloat16")
    model = Net()
    lines: list[str] = []
    mgr = _manager(cfg, model, lines=lines)
    mgr.maybe_save(3, last=True)
    path = os.path.join(mgr.folder, "model-step-3.pt")
    assert lines == [f"exported consolidated weights to {path}"]
    assert sorted(os.listdir(mgr.folder)) == ["model-step-3.pt"]
    state = torch.load(path, weights_only=True)
    assert torch.equal(state["output.weight"], model.output.weight.detach().bfloat16())


def test_initial_load_from_a_dcp_folder(gloo, tmp_path):
    model, opt, sched, data = train_state()
    seed = CheckpointFolder(str(tmp_path / "seed")).save(7, [model], opt, sched, data)

    lines: list[str] = []
    fresh = Net()
    cfg = _cfg(tmp_path, "--checkpoint.initial_load_path", seed, "--checkpoint.initial_load_model_only", "true")
    assert _manager(cfg, fresh, lines=lines).resume() is None  # weights only: the run starts at step 0
    assert same_params(model, fresh) and lines == [f"loaded initial weights from {seed}"]

    cfg = _cfg(tmp_path, "--checkpoint.initial_load_path", seed, "--checkpoint.initial_load_model_only", "false")
    fresh = Net()
    opt2 = build_optimizer([fresh], cfg)
    sched2 = build_lr_scheduler(opt2, cfg)
    assert _manager(cfg, fresh, opt2, sched2, loader()).resume() == 7  # the whole train state

    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    cfg = _cfg(tmp_path, "--checkpoint.initial_load_path", str(tmp_path / "hf"))
    with pytest.raises(
        CheckpointError, match="checkpoint.initial_load_path: .*set checkpoint.initial_load_in_hf = true"
    ):
        _manager(cfg, Net()).resume()


def test_check_initial_load_is_skipped_without_hf_or_when_the_run_resumes(gloo, tmp_path):
    assert check_initial_load(_cfg(tmp_path), None) is None
    hf = ["--checkpoint.initial_load_path", str(tmp_path / "nope"), "--checkpoint.initial_load_in_hf", "true"]
    hf += ["--checkpoint.initial_load_model_only", "true"]
    cfg = _cfg(tmp_path, *hf)
    CheckpointFolder(cfg.resolve_path(cfg.checkpoint.folder)).save(1, [Net()])
    assert check_initial_load(cfg, None) is None  # resumes from step-1: the folder is not read
