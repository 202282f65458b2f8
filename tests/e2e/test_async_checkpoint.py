"""Asynchronous checkpoints (``checkpoint.async_mode = async``) end to end on CPU: resume from a
background save is bitwise the uninterrupted run (llama3 and deepseek_v3, pipeline and
expert-parallel layouts) and matches under another layout; SIGKILL at every point of a save
(kill drills, and at random moments) never loses the newest complete checkpoint nor loads a
partial one; a write that fails mid-run stops the job with one line and exit 1.

Every run is ranks forked from tools/forkserver.py's server. A kill's claim is what the trainer
left on disk and what the resume loads, not what the launcher does, so the rank processes
themselves are SIGKILLed (``ForkedJob.kill``; with one rank killed, the launcher stops the other
with SIGTERM and then SIGKILL, as torchrun's agent does): no torchrun and no fresh interpreter
per rank (measured, Intel Xeon AMX host under load: the five kills and the failing write 84.1 ->
61.2 CPU s). Killing torchrun's workers (their own sessions, torchrun's failure summary) is
tests/e2e/test_train.py's claim. The failing write's claim is the trainer's handling of it (its
line, its exit code, what stays on disk): its full disk is a wrapper script that patches ``open``
in rank 1 before it runs train.py. The uninterrupted references, the resumes and the layout runs
are forked too (their claim is the math; bitwise the torchrun run, tests/e2e/test_launcher.py).
Every run has 2 layers (llama3: 2 blocks; deepseek_v3: 1 dense + 1 MoE block, so ep=2 still
shards experts): a save writes, stages and publishes every parameter and Adam state of every
block whatever the depth."""

from __future__ import annotations

import os
import random
import shutil
import time
from pathlib import Path

import pytest

from .helpers import FAST, ROOT, ForkedJob, _env, drill_env, metric_records, read_metrics, run_forked

TWO_LAYERS = ["--model.n_layers", "2"]
LLAMA = ["--config", "llama3.toml", *FAST, *TWO_LAYERS]
DEEPSEEK = ["--config", "deepseek_v3.toml", *FAST, *TWO_LAYERS]
ASYNC = ["--checkpoint.enable", "true", "--checkpoint.async_mode", "async", "--lr_scheduler.warmup_steps", "2"]

# The drill job: 5 steps on fsdp=2, saving in the background at 2, 4 and 5 (the last step;
# llama3.toml keeps the newest 2). A drill holds the step-4 save at one of its points; the run
# is killed there and resumed from step-2: steps 3-5 compared.
LAST = 5
DRILL_JOB = [*LLAMA, *ASYNC, "--training.steps", str(LAST), "--checkpoint.interval", "2"]


def _pairs(records):
    return [(r["step"], r["loss"], r["grad_norm"]) for r in records]


def _ref_pairs(ref: dict[int, dict], lo: int, hi: int):
    return [(s, ref[s]["loss"], ref[s]["grad_norm"]) for s in range(lo, hi + 1)]


def _ok(res):
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    return res


@pytest.fixture(scope="module")
def drill_reference(tmp_path_factory):
    """DRILL_JOB run without interruption (its saves in the background too): its metrics."""
    ref = tmp_path_factory.mktemp("drill_reference")
    res = _ok(run_forked(2, *DRILL_JOB, "--job.dump_folder", str(ref)))
    # every save was published, its write time in the line of the step it was noticed at
    assert sorted(os.listdir(ref / "checkpoint")) == ["step-4", f"step-{LAST}"]
    assert "ckpt stall" in res.stdout and "ckpt write" in res.stdout, res.stdout[-2000:]
    records = [rec for rec in _all(ref)]
    stalls = [r["checkpoint_stall_s"] for r in records if "checkpoint_stall_s" in r]
    writes = [r["checkpoint_write_s"] for r in records if "checkpoint_write_s" in r]
    assert len(stalls) == 3 and len(writes) == 3, records  # saves at 2, 4, 5; the last one's write
    assert "loss" not in records[-1] and "checkpoint_write_s" in records[-1]  # in its own record
    print(f"\nasync drill job: stall per save {stalls}, background write {writes}")
    return read_metrics(ref)


def _all(folder):
    from .helpers import all_records

    return all_records(folder)


def _resume_and_compare(run: Path, ref: dict[int, dict], from_step: int, job=DRILL_JOB, nproc=2, last=LAST):
    """Resume ``run`` (same job, no drill) on forked ranks: it must load step-``from_step`` and
    train the following steps bitwise like the uninterrupted run."""
    logged = len(metric_records(run)) if (run / "metrics.jsonl").exists() else 0
    res = _ok(run_forked(nproc, *job, "--job.dump_folder", str(run)))
    assert f"resumed from {run / 'checkpoint'} at step {from_step}" in res.stdout, res.stdout[-2000:]
    resumed = metric_records(run)[logged:]
    assert _pairs(resumed) == _ref_pairs(ref, from_step + 1, last)  # bitwise
    return res


def _folder_state(ckpt: Path, step: int) -> str:
    """Where the save of ``step`` was when the job died: the phase its folder shows."""
    final, tmp = ckpt / f"step-{step}", ckpt / f"step-{step}.tmp"
    if final.is_dir():
        return "published"
    if not tmp.is_dir():
        return "not started"
    names = os.listdir(tmp)
    if ".metadata" in names:
        return "metadata written, not renamed"
    if any(n.endswith(".distcp") for n in names):
        return "shards being written"
    return "staging"


# point -> (the rank held and killed alone, the folder state the drill leaves)
DRILLS = {
    "staging": (1, "staging"),
    "write": (1, "shards being written"),
    "publish": (0, "metadata written, not renamed"),  # only rank 0 publishes
}


# make test runs each point once and each way of killing at least once; MESHTRAIN_ALL_DRILLS=1
# runs all six combinations
_CASES = [("staging", "one rank"), ("write", "whole job"), ("publish", "one rank")]
if os.environ.get("MESHTRAIN_ALL_DRILLS") == "1":
    _CASES = [(point, who) for point in DRILLS for who in ("one rank", "whole job")]


@pytest.mark.parametrize(("point", "who"), _CASES)
def test_kill_drill_resumes_from_the_newest_complete_checkpoint(tmp_path, monkeypatch, drill_reference, point, who):
    rank, state = DRILLS[point]
    run = tmp_path / "run"
    ckpt = run / "checkpoint"
    spec = f"{point}:{rank}@4" if who == "one rank" else f"{point}:@4"
    monkeypatch.setenv("MESHTRAIN_CHECKPOINT_DRILL", spec)
    job = ForkedJob(2, *DRILL_JOB, "--job.dump_folder", str(run))
    monkeypatch.delenv("MESHTRAIN_CHECKPOINT_DRILL")
    try:
        marker = f"checkpoint drill: {point} step 4 rank {rank}"
        assert job.wait_for_output(marker, 600), job.output[-3000:]
        if who == "whole job" and point != "publish":  # every rank reaches the point: wait for both
            other = f"checkpoint drill: {point} step 4 rank {1 - rank}"
            assert job.wait_for_output(other, 600), job.output[-3000:]
        job.kill([rank] if who == "one rank" else None)
    finally:
        job.close()
    assert job.poll() not in (None, 0)
    # the save of step 4 is visibly incomplete, step-2 is the newest complete checkpoint
    assert _folder_state(ckpt, 4) == state, sorted(os.listdir(ckpt / "step-4.tmp"))
    assert sorted(os.listdir(ckpt)) == ["step-2", "step-4.tmp"]
    from trainer.checkpoint.dcp import CheckpointFolder

    assert CheckpointFolder(str(ckpt)).list_steps() == [2]
    _resume_and_compare(run, drill_reference, 2)
    # the resumed run rewrote step 4 from scratch (the stale .tmp was never loaded nor renamed)
    assert sorted(os.listdir(ckpt)) == ["step-4", f"step-{LAST}"]


RANDOM_KILLS = int(os.environ.get("MESHTRAIN_RANDOM_KILLS", "2"))


def test_kills_at_random_moments_of_a_background_save(tmp_path, drill_reference):
    """No drill point inside the save: SIGKILL (the whole job, or rank 1 alone) at a random delay
    after step-4.tmp appears, drawn over the reference run's longest background write (so most
    kills land while the save is in flight); classify what the folder shows, resume, and check
    the newest complete checkpoint loads and the resumed steps are bitwise. The workers hold at
    the drill's ``exit`` point instead of exiting (trainer/checkpoint/drill.py): a kill that a
    loaded machine delivers after the run finished still finds them, and sees every save
    published. MESHTRAIN_RANDOM_KILLS sets the repeats."""
    rng = random.Random(int(os.environ.get("MESHTRAIN_RANDOM_SEED", "0")))
    write_s = max(r["checkpoint_write_s"] for r in drill_reference.values() if "checkpoint_write_s" in r)
    hits: dict[str, int] = {}
    for i in range(RANDOM_KILLS):
        run = tmp_path / f"run{i}"
        ckpt, tmp = run / "checkpoint", run / "checkpoint" / "step-4.tmp"
        delay, ranks = rng.uniform(0.0, write_s), (None if i % 2 == 0 else [1])
        job = ForkedJob(2, *DRILL_JOB, "--job.dump_folder", str(run), env=drill_env("exit"))
        try:
            deadline = time.monotonic() + 600
            while not tmp.is_dir() and not (ckpt / "step-4").is_dir():
                assert job.poll() is None, f"the run ended before step 4:\n{job.output[-3000:]}"
                assert time.monotonic() < deadline
                time.sleep(0.0005)
            time.sleep(delay)
            state = _folder_state(ckpt, 4)  # the last look before the kill
            job.kill(ranks)
        finally:
            job.close()
        after = _folder_state(ckpt, 4)  # what the resume sees (the save may have moved on)
        hits[after] = hits.get(after, 0) + 1
        from trainer.checkpoint.dcp import CheckpointFolder

        newest = CheckpointFolder(str(ckpt)).latest_step()
        print(f"kill {i}: {delay:.2f}s after step-4.tmp, {'whole job' if ranks is None else 'rank 1'}: "
              f"{state} -> {after}; resumes at {newest}")  # fmt: skip
        if (ckpt / f"step-{LAST}").is_dir():
            # the run published its last save before the kill landed (a slow kill under load; it
            # then found the workers held at the exit point): complete, nothing to resume
            assert after == "published" and newest == LAST, (state, after, sorted(os.listdir(ckpt)))
            continue
        assert newest == (4 if after == "published" else 2), (state, after, sorted(os.listdir(ckpt)))
        _resume_and_compare(run, drill_reference, newest)
    print(f"random kills, folder state hit counts: {hits}")


# ---------------------------------------------------------------- a failing write

# run by each forked rank as its script: the full disk (in the rank named), then train.py itself
_FULL_DISK = """
import os, runpy, sys
_spec = os.environ.get("MESHTRAIN_TEST_FULL_DISK")  # "<path part>:<rank>"
if _spec:
    _part, _rank = _spec.rsplit(":", 1)
    if os.environ.get("RANK") == _rank:
        import builtins, errno, io
        _open = io.open

        def _full_open(file, mode="r", *args, **kwargs):
            if _part in str(file) and any(c in mode for c in "wax+"):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(file))
            return _open(file, mode, *args, **kwargs)

        io.open = builtins.open = _full_open
sys.argv[0] = {train!r}
runpy.run_path({train!r}, run_name="__main__")
"""


# the synchronous path's failure (mode disabled) is also proven, in one process, by
# tests/unit/test_async_save.py; MESHTRAIN_ALL_DRILLS=1 runs it here too
@pytest.mark.parametrize("mode", ["async", "disabled"] if os.environ.get("MESHTRAIN_ALL_DRILLS") == "1" else ["async"])
def test_a_failing_write_stops_the_job_with_one_line(tmp_path, drill_reference, mode):
    """Rank 1's shard of step 4 cannot be written (its disk is full, simulated in that process
    by a wrapper around train.py that fails the open, as ENOSPC): exit 1, one line naming the
    rank, the file and the cause; step-2 intact (the resumed run loads it and is bitwise), step 4
    never published."""
    from tools.forkserver import TRAIN_PY
    from tools.forkserver import run_train as run_forked_script

    script = tmp_path / "full_disk_train.py"
    script.write_text(_FULL_DISK.format(train=str(TRAIN_PY)))
    run = tmp_path / "run"
    ckpt = run / "checkpoint"
    job = [*DRILL_JOB, "--checkpoint.async_mode", mode]
    env = dict(_env(), MESHTRAIN_TEST_FULL_DISK=f"step-4.tmp{os.sep}__1_:1")
    argv = [*job, "--job.dump_folder", str(run)]
    res = run_forked_script(2, argv, env=env, cwd=ROOT, timeout=600, script=script)
    assert res.returncode == 1, res.stdout[-2000:] + res.stderr[-3000:]
    shard = ckpt / "step-4.tmp" / "__1_0.distcp"
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert errors == [
        f"error: checkpoint save of step 4 failed on rank 1: No space left on device writing {shard}; "
        f"training stopped. {ckpt}: its newest complete checkpoint, step-2, is intact. Fix the folder "
        f"(free space, permissions) and run the same command again to resume"
    ], res.stderr[-3000:]
    # no worker traceback (under torchrun, its own ChildFailedError summary followed)
    assert f'File "{ROOT}/trainer' not in res.stderr and f'File "{ROOT}/train.py' not in res.stderr, res.stderr
    assert sorted(os.listdir(ckpt)) == ["step-2", "step-4.tmp"]  # nothing new published
    last = max(r["step"] for r in metric_records(run))
    assert last < LAST, "the run went on training without checkpoints"
    _resume_and_compare(run, drill_reference, 2, job=job)


# ---------------------------------------------------------------- layouts

PP_JOB = [*LLAMA, *ASYNC, "--training.steps", "4", "--checkpoint.interval", "2"]
EP_JOB = [*DEEPSEEK, *ASYNC, "--training.steps", "4", "--checkpoint.interval", "2"]

# name -> (job, nproc, the layout saved and resumed bitwise, another layout resumed within tolerance)
LAYOUTS = {
    "llama3 pp=2": (PP_JOB, 2, ["--parallelism.pp", "2"], ["--parallelism.pp", "1"]),
    "deepseek_v3 fsdp=2 x ep=2": (EP_JOB, 2, ["--parallelism.ep", "2"], ["--parallelism.ep", "1"]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_resume_from_an_async_checkpoint(tmp_path, name):
    """The uninterrupted run saves in the background at 2 and 4; its step-2 checkpoint (a run
    stopped after that save writes the same files: same job, deterministic; the crash itself is
    the drills' claim) resumed on the same layout is bitwise the uninterrupted steps 3-4, and
    on another layout equal within the tolerance of test_train.py's different-layout test
    (rel 1e-5 loss, 1e-4 grad norm: same math, other reduction orders). All forked, 2 layers.
    Measured (steps 3-4): llama3 pp=2 -> pp=1 loss rel 0, grad norm 0; deepseek_v3 ep=2 -> ep=1
    loss 0, grad norm 0."""
    job, nproc, same, other = LAYOUTS[name]
    ref = tmp_path / "ref"
    res = _ok(run_forked(nproc, *job, *same, "--job.dump_folder", str(ref)))
    assert "in the background (async)" in res.stdout, res.stdout[-2000:]
    assert sorted(os.listdir(ref / "checkpoint")) == ["step-2", "step-4"]
    a = read_metrics(ref)
    for layout, exact in ((same, True), (other, False)):
        run = tmp_path / ("same" if exact else "other")
        shutil.copytree(ref / "checkpoint" / "step-2", run / "checkpoint" / "step-2")
        res = _ok(run_forked(nproc, *job, *layout, "--job.dump_folder", str(run)))
        assert f"resumed from {run / 'checkpoint'} at step 2" in res.stdout, res.stdout[-2000:]
        b = read_metrics(run)
        assert sorted(b) == [3, 4]
        if exact:
            assert _pairs(b[s] for s in (3, 4)) == _ref_pairs(a, 3, 4)  # bitwise
        else:
            for s in (3, 4):
                assert b[s]["loss"] == pytest.approx(a[s]["loss"], rel=1e-5), (name, s)
                assert b[s]["grad_norm"] == pytest.approx(a[s]["grad_norm"], rel=1e-4), (name, s)
