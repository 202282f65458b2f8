"""Background checkpoint saves (trainer/checkpoint/async_save.py, ``checkpoint.async_mode``) in
one gloo process: the staged copy is isolated from training, at most one save is in flight,
retention purges only complete checkpoints, the kill-drill spec parser and the ``last`` gate
(trainer/checkpoint/drill.py), the one-line failure messages, and the config checks of the new
options."""

from __future__ import annotations

import errno
import os
import threading
import types
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from tests.unit import test_checkpoint_manager as manager_tests
from tests.unit.test_checkpoint_dcp import Net, loader, same_params, train_state
from trainer.checkpoint import manager as manager_module
from trainer.checkpoint.async_save import (
    BackgroundSaver,
    CheckpointWriteFailed,
    DrillWriter,
    describe_failure,
    failure_line,
)
from trainer.checkpoint.dcp import CheckpointFolder
from trainer.checkpoint.drill import _wanted
from trainer.config import ConfigError, load_config
from trainer.optim.optimizers import build_lr_scheduler, build_optimizer
from trainer.plan import plan_job

ROOT = Path(__file__).resolve().parents[2]
# the one-rank gloo group fixture, the config and manager builders of the manager's tests
gloo = manager_tests.gloo
_cfg, _manager = manager_tests._cfg, manager_tests._manager


def _fresh(cfg, seed=7):
    torch.manual_seed(seed)
    model = Net()
    opt = build_optimizer([model], cfg)
    return model, opt, build_lr_scheduler(opt, cfg), loader()


def _gate_writes(monkeypatch):
    """Hold every background write until the returned event is set (the writer thread waits
    in DrillWriter.write_data, before any file is written)."""
    gate = threading.Event()
    real = DrillWriter.write_data

    def held(self, plan, planner):
        assert gate.wait(60), "the test never released the write"
        return real(self, plan, planner)

    monkeypatch.setattr(DrillWriter, "write_data", held)
    return gate


def test_staged_copy_is_isolated_from_training(gloo, tmp_path, monkeypatch):
    """The save of step 2 copies the state when it starts: weights and Adam moments changed in
    place right after (while the write is held back) are not what the checkpoint holds."""
    cfg = _cfg(tmp_path, "--checkpoint.interval", "2", "--checkpoint.async_mode", "async")
    model, opt, sched, data = train_state()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    adam = opt.optimizers[0].state[model.output.weight]
    exp_avg = adam["exp_avg"].clone()
    gate = _gate_writes(monkeypatch)
    lines: list[str] = []
    mgr = _manager(cfg, model, opt, sched, data, lines)
    out = mgr.after_step(2, last=False)
    assert mgr.saver.in_flight == 2 and "checkpoint_stall_s" in out and "checkpoint_write_s" not in out
    with torch.no_grad():  # training goes on: every tensor changes in place
        for p in model.parameters():
            p.add_(1.0)
        adam["exp_avg"].mul_(-3.0)
    gate.set()
    done = mgr.close()
    assert done["checkpoint_write_s"] > 0 and done["checkpoint_poll_stall_s"] >= 0
    assert lines[-1].startswith(f"saved checkpoint {os.path.join(mgr.folder, 'step-2')} (written in the background")
    assert CheckpointFolder(mgr.folder).list_steps() == [2]

    model2, opt2, sched2, data2 = _fresh(cfg)
    assert _manager(cfg, model2, opt2, sched2, data2).resume() == 2
    after = model2.state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before)  # bitwise the values at the save
    assert torch.equal(opt2.optimizers[0].state[model2.output.weight]["exp_avg"], exp_avg)
    # negative control: the live model really did change
    assert not same_params(model, model2)


def test_at_most_one_save_in_flight(gloo, tmp_path, monkeypatch):
    """A save due while the previous one is still written waits for it (and publishes it) before
    it starts; the saver refuses a second start outright."""
    cfg = _cfg(tmp_path, "--checkpoint.interval", "1", "--checkpoint.async_mode", "async")
    model, opt, sched, data = train_state()
    gate = _gate_writes(monkeypatch)
    lines: list[str] = []
    mgr = _manager(cfg, model, opt, sched, data, lines)
    mgr.after_step(1, last=False)
    with pytest.raises(RuntimeError, match="save of step 1 still in flight"):
        mgr.saver.start(2, {"x": torch.zeros(1)}, str(tmp_path / "elsewhere"))
    # a non-blocking poll while the write is held: still in flight, nothing published
    assert mgr.saver.poll() is None and mgr.saver.in_flight == 1
    assert CheckpointFolder(mgr.folder).list_steps() == []
    # The manager times the save's stall on a clock of the test's, which moves 100 s exactly when
    # the blocking wait for step 1 returns: a stall timed across that wait reads >= 100, one timed
    # after it reads 0. (Timing the start on the wall clock, a CI run once saw a 0.5 s hiccup of
    # its own inside the step-2 start: an upper bound on wall time in a busy process is not a proof.)
    clock = [0.0]
    monkeypatch.setattr(manager_module, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    real_poll = mgr.saver.poll

    def poll(*, block=False):
        done = real_poll(block=block)
        clock[0] += 100.0 if block else 0.0
        return done

    monkeypatch.setattr(mgr.saver, "poll", poll)
    timer = threading.Timer(0.5, gate.set)
    timer.start()
    out = mgr.after_step(2, last=False)  # waits for step 1 (released after 0.5 s), then starts step 2
    timer.join()
    # it really waited (the saver's own wall-clock poll stall), and the wait is counted once: as
    # the step-1 save's poll stall, not in the stall of the step-2 save that started after it
    assert out["checkpoint_poll_stall_s"] >= 0.4 and out["checkpoint_stall_s"] == 0.0, out
    assert "checkpoint_write_s" in out  # step 1's write time, noticed at this step
    assert mgr.saver.in_flight == 2
    assert CheckpointFolder(mgr.folder).list_steps() == [1]
    mgr.close()
    assert CheckpointFolder(mgr.folder).list_steps() == [1, 2]
    assert mgr.saver.in_flight is None


def test_keep_latest_k_purges_only_complete_checkpoints(gloo, tmp_path, monkeypatch):
    """keep_latest_k = 1: publishing step 2 removes step 1 and a step-9.tmp left by a crash, but
    never the step-3.tmp being written (it is purged only by being published)."""
    cfg = _cfg(tmp_path, "--checkpoint.interval", "1", "--checkpoint.async_mode", "async",
               "--checkpoint.keep_latest_k", "1")  # fmt: skip
    model, opt, sched, data = train_state()
    gate = _gate_writes(monkeypatch)
    gate.set()
    mgr = _manager(cfg, model, opt, sched, data)
    folder = Path(mgr.folder)
    mgr.after_step(1, last=False)
    mgr.after_step(2, last=False)  # publishes step 1
    assert sorted(os.listdir(folder)) == ["step-1", "step-2.tmp"]
    mgr.saver._inflight.future.result(timeout=60)  # step 2's write ran while the gate was open
    (folder / "step-9.tmp").mkdir()  # a crash's leftover: never complete under its name
    (folder / "step-9.tmp" / "__0_0.distcp").write_bytes(b"partial")
    gate.clear()
    mgr.after_step(3, last=False)  # waits for step 2, publishes it (purging), starts step 3
    # step 2's publish purged step 1 and the crash's .tmp; step-3.tmp (started after) exists
    assert sorted(os.listdir(folder)) == ["step-2", "step-3.tmp"]
    # while step 3 is in flight, the purge a synchronous publish would run keeps it
    assert mgr.saver.in_flight == 3
    gate.set()
    mgr.close()
    assert sorted(os.listdir(folder)) == ["step-3"]


@pytest.mark.parametrize(
    "spec, point, step, rank, wanted",
    [
        ("write", "write", 4, 1, True),
        ("write", "staging", 4, 1, False),
        ("write:1", "write", 4, 1, True),
        ("write:1", "write", 4, 0, False),
        ("write:1@4", "write", 4, 1, True),
        ("write:1@4", "write", 8, 1, False),
        ("write:@4", "write", 4, 3, True),
        ("write:@4", "write", 6, 3, False),
        ("publish:0@10", "publish", 10, 0, True),
        ("stage", "staging", 4, 0, False),  # names match whole, not by prefix
        ("begin:@8", "begin", 8, 1, True),
        ("begin:@8", "begin", 4, 1, False),
        ("exit", "exit", 5, 0, True),
        ("write,last", "write", 3, 1, True),  # several points, comma-separated
        ("write,last", "last", 7, 0, True),
        ("write,last", "publish", 3, 0, False),
        ("staging:1@4, exit", "exit", 5, 1, True),
        ("staging:1@4, exit", "staging", 4, 0, False),
    ],
)
def test_drill_spec(spec, point, step, rank, wanted):
    assert _wanted(spec, point, step, rank) is wanted


def test_drill_point_does_nothing_when_unset(monkeypatch):
    from trainer.checkpoint.drill import drill_point, stop_gate

    monkeypatch.delenv("MESHTRAIN_CHECKPOINT_DRILL", raising=False)
    drill_point("write", 4, 0)  # returns at once
    drill_point("exit", 8, 0)
    assert stop_gate() is False
    monkeypatch.setenv("MESHTRAIN_CHECKPOINT_DRILL", "write:1@4")
    drill_point("write", 4, 0)  # another rank's drill
    drill_point("publish", 4, 1)
    drill_point("exit", 8, 1)
    assert stop_gate() is False


@pytest.mark.parametrize(
    "spec, gate",
    [("last", True), ("write,last", True), (" write , last ", True), ("write", False), ("lastly", False)],
)
def test_stop_gate_spec(monkeypatch, spec, gate):
    from trainer.checkpoint.drill import stop_gate

    monkeypatch.setenv("MESHTRAIN_CHECKPOINT_DRILL", spec)
    assert stop_gate() is gate


@pytest.mark.parametrize("spec", ["last:1", "last:@7", "write,last:0@7"])
def test_stop_gate_refuses_a_rank_or_step(monkeypatch, spec):
    """A gate held by some ranks only would leave them in a collective the others never join."""
    from trainer.checkpoint.drill import stop_gate

    monkeypatch.setenv("MESHTRAIN_CHECKPOINT_DRILL", spec)
    with pytest.raises(ValueError, match="'last' holds every rank"):
        stop_gate()


def test_the_last_gate_releases_every_rank_at_the_same_agreement(capfd):
    """Two ranks (threads) at the ``last`` gate, agreeing as trainer/runtime/stop.py does (a max over the
    ranks: here a barrier per agreement); the signal reaches rank 1 alone, after a few
    agreements. Both ranks leave at the same agreement with rank 1's signal, having run the same
    number of agreements (a rank that left earlier would leave the other in a collective alone)."""
    import signal as signals

    from trainer.checkpoint.drill import hold_until_stopped

    flags = [0, 0]  # each rank's noted signal (StopSignals.signum)
    seen = [0, 0]
    calls = [0, 0]
    barrier = threading.Barrier(2, action=lambda: seen.__setitem__(slice(None), [max(flags)] * 2))

    def agreed(rank):
        def agree():
            calls[rank] += 1
            if rank == 1 and calls[rank] == 5:
                flags[1] = int(signals.SIGTERM)
            barrier.wait(timeout=30)
            code = seen[rank]
            barrier.wait(timeout=30)  # every rank read this agreement's result
            return code or None

        return agree

    out: dict[int, int] = {}
    threads = [
        threading.Thread(target=lambda r=r: out.__setitem__(r, hold_until_stopped(agreed(r), 7, r))) for r in (0, 1)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert out == {0: signals.SIGTERM, 1: signals.SIGTERM}
    assert calls == [5, 5]
    err = capfd.readouterr().err
    assert "checkpoint drill: last step 7 rank 0" in err and "checkpoint drill: last step 7 rank 1" in err


def test_the_last_gate_waits_for_the_stop_signal_itself():
    """One process (no peers, trainer/runtime/stop.py's StopSignals without a group): the gate holds
    until a SIGTERM, sent by another thread a few agreements in, is noted; then it gives that
    signal, as the trainer's agreement at a step would."""
    import signal as signals

    from trainer.checkpoint.drill import hold_until_stopped
    from trainer.runtime.stop import StopSignals

    calls = []
    with StopSignals(None) as stop:

        def agreed():
            calls.append(1)
            if len(calls) == 3:
                threading.Thread(target=os.kill, args=(os.getpid(), signals.SIGTERM)).start()
            return stop.agreed()

        assert hold_until_stopped(agreed, 7, 0) == signals.SIGTERM
    assert len(calls) >= 3 and stop.signum == signals.SIGTERM  # held through the agreements before it


def _full(path):
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)


def test_describe_failure_names_the_file_and_the_cause():
    assert describe_failure(_full("/c/step-4.tmp/__1_0.distcp"), 1) == (
        "No space left on device writing /c/step-4.tmp/__1_0.distcp"
    )
    assert describe_failure(OSError(errno.EIO, "Input/output error"), 0) == (
        "Input/output error ([Errno 5] Input/output error)"
    )
    assert describe_failure(ValueError("bad"), 0) == "ValueError: bad"
    # DCP hands every rank's failure to every rank: each rank describes its own, or None
    wrapped = CheckpointException("save failed", {1: (_full("/c/step-4.tmp/__1_0.distcp"), None)})
    assert describe_failure(wrapped, 1) == "No space left on device writing /c/step-4.tmp/__1_0.distcp"
    assert describe_failure(wrapped, 0) is None


def test_failure_line_of_a_synchronous_save():
    wrapped = CheckpointException(
        "save failed", {0: (RuntimeError("peer"), None), 1: (_full("/c/step-4.tmp/__1_0.distcp"), None)}
    )
    assert failure_line(wrapped, 4) == (
        "checkpoint save of step 4 failed on rank 1: No space left on device writing /c/step-4.tmp/__1_0.distcp"
    )
    assert failure_line(_full("/c/step-4.tmp"), 4) == (
        "checkpoint save of step 4 failed: No space left on device writing /c/step-4.tmp"
    )
    # not about writing files: a bug, which keeps its traceback
    assert failure_line(CheckpointException("x", {0: (KeyError("k"), None)}), 4) is None
    assert failure_line(KeyError("k"), 4) is None


def _fail_writes(monkeypatch, rank_file="__0_0.distcp"):
    """Every DCP data file named ``rank_file`` fails to open, as on a full disk."""
    import torch.distributed.checkpoint.filesystem as fs

    real = fs.FileSystem.create_stream

    def create_stream(self, path, mode):
        if str(path).endswith(rank_file) and "w" in mode:
            raise _full(str(path))
        return real(self, path, mode)

    monkeypatch.setattr(fs.FileSystem, "create_stream", create_stream)


@pytest.mark.parametrize("mode", ["async", "disabled"])
def test_a_failed_write_stops_with_one_line_and_keeps_the_previous_checkpoint(gloo, tmp_path, monkeypatch, mode):
    cfg = _cfg(tmp_path, "--checkpoint.interval", "1", "--checkpoint.async_mode", mode)
    model, opt, sched, data = train_state()
    mgr = _manager(cfg, model, opt, sched, data)
    mgr.after_step(1, last=False)
    mgr.close() if mode == "async" else None
    assert CheckpointFolder(mgr.folder).list_steps() == [1]
    _fail_writes(monkeypatch)
    with pytest.raises(CheckpointWriteFailed) as info:
        mgr.after_step(2, last=False)
        mgr.after_step(3, last=False)  # async: noticed at the next step boundary at the latest
    tmp = os.path.join(mgr.folder, "step-2.tmp", "__0_0.distcp")
    assert str(info.value) == f"checkpoint save of step 2 failed on rank 0: No space left on device writing {tmp}"
    assert "\n" not in str(info.value)
    assert mgr.saver is None or mgr.saver.in_flight is None
    message = mgr.stopped_message(info.value)
    assert f"{mgr.folder}: its newest complete checkpoint, step-1, is intact" in message
    assert sorted(os.listdir(mgr.folder)) == ["step-1", "step-2.tmp"]  # nothing new published
    model2, opt2, sched2, data2 = _fresh(cfg)
    monkeypatch.undo()
    assert _manager(cfg, model2, opt2, sched2, data2).resume() == 1


def test_background_saver_refuses_disabled():
    with pytest.raises(ValueError, match="not 'disabled'"):
        BackgroundSaver("disabled", timeout_s=10)


def test_async_with_pinned_mem_on_cpu_is_a_config_error():
    cfg = load_config(["--config", "llama3.toml", "--checkpoint.enable", "true",
                       "--checkpoint.async_mode", "async_with_pinned_mem"])  # fmt: skip
    with pytest.raises(ConfigError, match="use checkpoint.async_mode = 'async'"):
        plan_job(cfg, 1, device_type="cpu")
    plan_job(cfg, 1, device_type="cuda")  # fine where there is CUDA
    off = load_config(["--config", "llama3.toml", "--checkpoint.enable", "false",
                       "--checkpoint.async_mode", "async_with_pinned_mem"])  # fmt: skip
    plan_job(off, 1, device_type="cpu")  # no checkpoints, nothing to stage: no error


def test_bad_async_options_exit_2_with_one_line(tmp_path):
    """train.py in one process forked from the launcher's server (tools/forkserver.py): the
    line and the exit code come through the same exit path as ``python train.py``'s
    (trainer/lifecycle/shutdown.py; a fresh interpreter stopping on bad input is
    tests/e2e/test_exit.py's), without an interpreter and a torch import per case (issue 49)."""
    from tools.forkserver import run_train

    for args, message in [
        (["--checkpoint.async_mode", "async_with_pinned_mem"], "async_with_pinned_mem' copies from CUDA"),
        (["--checkpoint.save_in_hf_every", "-1"], "checkpoint.save_in_hf_every must be >= 0"),
        (["--checkpoint.async_mode", "background"], "async_mode"),
    ]:
        argv = ["--config", "llama3.toml", "--job.dump_folder", str(tmp_path), "--checkpoint.enable", "true", *args]
        res = run_train(1, argv, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT, timeout=120)
        assert res.returncode == 2, (args, res.stderr[-2000:])
        assert message in res.stderr and "Traceback" not in res.stderr, (args, res.stderr[-2000:])
        assert len([ln for ln in res.stderr.splitlines() if ln.startswith("error")]) == 1, res.stderr


def test_the_stager_keeps_its_buffers_where_torch_allows():
    """torch 2.13 and 2.15 stage a second save into the first one's buffers (the stall of every
    later save is a copy, no allocation); torch 2.11's stager closes its cache after every stage,
    so there each save builds a new one (read in torch's staging.py of each version)."""
    from trainer.checkpoint.async_save import stager_keeps_buffers

    version = ".".join(torch.__version__.split(".")[:2])
    expected = {"2.11": False, "2.13": True, "2.15": True}
    if version not in expected:
        pytest.skip(f"torch {version}: not one of the versions whose staging.py was read")
    assert stager_keeps_buffers() is expected[version]
