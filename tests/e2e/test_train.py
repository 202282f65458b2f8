"""train.py end to end on CPU: learning and outputs (torchrun, as the README runs it), kill and
resume (ranks killed, forked and under torchrun, resumed on forked ranks), resharding and
pipeline checkpoints, activation checkpointing, profiling, errors, a hung rank.

Two launchers (tests/e2e/helpers.py): torchrun where the claim involves the launcher or the
processes (the README run, SIGKILL / SIGSTOP of workers, what reaches stderr under torchrun),
ranks forked from tools/forkserver.py's server where the claim is the math or a message (bitwise
the torchrun run: tests/e2e/test_launcher.py). Most runs use ``--model.n_layers 2`` (each test
says why that still proves its property)."""

from __future__ import annotations

import math
import os
import random
import re
import shutil
import signal
import textwrap
import time
from pathlib import Path

import pytest

from .helpers import (
    FAST,
    ROOT,
    ForkedJob,
    Job,
    _env,
    drill_env,
    metric_records,
    read_metrics,
    run_forked,
    run_train,
    run_until,
)

LLAMA = ["--config", "llama3.toml", *FAST]
TWO_LAYERS = ["--model.n_layers", "2"]


def test_short_run_learns_and_writes_outputs(tmp_path):
    """The one full torchrun training run, as the README launches it (4 processes, fsdp=4): the
    loss falls, every output is written (metrics for every step, TensorBoard events, the resolved
    config, checkpoints with keep_latest_k), and the run says so on stdout.

    2 layers, 20 steps (warm-up 4): measured loss 8.10 at step 1 -> 5.24 at step 20, a drop of
    2.87 against the asserted 1.5 (1.9x; the 6-layer 40-step run this replaces fell by 4.78).
    Every output path is the same whatever the depth."""
    out = tmp_path / "run"
    res = run_train(
        4,
        *LLAMA,
        *TWO_LAYERS,
        "--training.steps",
        "20",
        "--job.dump_folder",
        str(out),
        "--metrics.enable_tensorboard",
        "true",
        "--checkpoint.enable",
        "true",
        "--checkpoint.interval",
        "10",
        "--checkpoint.keep_latest_k",
        "1",
        "--lr_scheduler.warmup_steps",
        "4",
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    m = read_metrics(out)
    assert sorted(m) == list(range(1, 21))
    first, last = m[1]["loss"], m[20]["loss"]
    assert last < first - 1.5, (first, last)  # ln(2048) = 7.6 -> well below
    assert all(math.isfinite(r["grad_norm"]) and r["tps"] > 0 for r in m.values())
    assert list((out / "tb").glob("events.out.tfevents.*")), "no TensorBoard event file"
    assert (out / "config.toml").read_text().count("[parallelism]") == 1
    ckpts = sorted(p.name for p in (out / "checkpoint").iterdir())
    assert ckpts == ["step-20"], ckpts  # keep_latest_k=1 removed step-10
    assert "step 20/20" in res.stdout and "resolved config:" not in res.stdout  # its path, not the whole
    assert f"config: {out / 'config.toml'} (the resolved config" in res.stdout
    # a quiet start: at most 25 lines before step 1 (torchrun's own banner included), and no
    # line twice (each warning once, from rank 0; before, every rank printed the warm-up warning
    # and FSDP's view warning, and the resolved config took ~125 lines)
    startup = re.split(r"step +1/20", res.stdout)[0].splitlines() + res.stderr.splitlines()
    assert len(startup) <= 25, "\n".join(startup)
    ours = [line for line in startup if line.strip() and "torch/distributed/run.py" not in line]
    assert len(ours) == len(set(ours)), "\n".join(ours)
    # the lr column is the rate each step's update ran at: the schedule's closed form at the
    # step's index (warm-up 1/4, 2/4, 3/4 of the peak, the peak at step 4, then cosine to the
    # floor at step 20), not the next step's rate
    peak, floor = 8e-4, 0.1  # llama3.toml's optimizer.lr and lr_scheduler.min_lr_ratio
    assert [m[s]["lr"] for s in (1, 2, 3, 4)] == pytest.approx([peak / 4, peak / 2, 3 * peak / 4, peak], rel=1e-12)
    for s in range(5, 21):
        cosine = 0.5 * (1 + math.cos(math.pi * (s - 4) / 16))
        assert m[s]["lr"] == pytest.approx(peak * (floor + (1 - floor) * cosine), rel=1e-12), s
    assert m[20]["lr"] == pytest.approx(peak * floor, rel=1e-12)


def _steps(m, lo, hi):
    return [(m[s]["loss"], m[s]["grad_norm"]) for s in range(lo, hi + 1)]


def _near(a: dict[int, dict], b: dict[int, dict], steps, what) -> None:
    """Another layout, the same math: rel 1e-5 on the loss, 1e-4 on the grad norm."""
    for step in steps:
        assert b[step]["loss"] == pytest.approx(a[step]["loss"], rel=1e-5), (what, step)
        assert b[step]["grad_norm"] == pytest.approx(a[step]["grad_norm"], rel=1e-4), (what, step)


def _copy_checkpoint(src_run: Path, step: int, dst_run: Path) -> None:
    """The step-``step`` checkpoint of a run that never stopped: a run stopped after that save
    would have written the same files (same job, deterministic); crash-then-resume is the kill
    tests' claim."""
    shutil.copytree(src_run / "checkpoint" / f"step-{step}", dst_run / "checkpoint" / f"step-{step}")


# The two crash tests (a clean SIGKILL of every worker after a save, and rank 1 killed in the
# middle of a save) train the same job: 8 steps on fsdp=2, 2 layers, saving at 4 and 8
# (llama3.toml keeps the newest 2). The clean kill is of forked ranks, the kill mid-save of a
# torchrun worker (torchrun's report of it is asserted); the resumes and the uninterrupted
# reference run on forked ranks (their claim is the math). 2 layers: every parameter and Adam
# state of both blocks is sharded, saved and loaded as with 6, the shared reference makes the
# resumed steps' comparison bitwise.
def _checkpointed_job(steps: int, interval: int) -> list[str]:
    """LLAMA with 2 layers for ``steps`` steps, checkpointing every ``interval``, warm-up 2."""
    return [*LLAMA, *TWO_LAYERS, "--training.steps", str(steps), "--checkpoint.enable", "true",
            "--checkpoint.interval", str(interval), "--lr_scheduler.warmup_steps", "2"]  # fmt: skip


CRASH_JOB = _checkpointed_job(8, 4)


@pytest.fixture(scope="module")
def crash_job_reference(tmp_path_factory):
    """Steps 1-8 of CRASH_JOB run without interruption: step -> record."""
    ref = tmp_path_factory.mktemp("crash_job_reference")
    res = run_forked(2, *CRASH_JOB, "--job.dump_folder", str(ref))
    assert res.returncode == 0, res.stderr[-3000:]
    return read_metrics(ref)


def test_kill_and_resume_is_bitwise_identical(tmp_path, crash_job_reference):
    """SIGKILL both ranks right after the step-4 checkpoint is reported (4 more steps before the
    next save: the kill lands between saves; the run holds at the drill's ``begin`` point of the
    step-8 save, so a late kill still does); the resumed run loads step 4 and its steps 5-8 are
    bitwise those of the uninterrupted run. Forked ranks: the claim is what the killed ranks
    left on disk (the kill of a whole torchrun job, workers and then torchrun, is
    tests/e2e/test_lora_train.py's crash test; a torchrun worker killed alone, with torchrun's
    report of it, the next test)."""
    crash = tmp_path / "crash"
    # run_until returns once they are all gone, so nothing of this run overlaps the resume
    run_until(2, "saved checkpoint", *CRASH_JOB, "--job.dump_folder", str(crash), hold="begin:@8", forked=True)
    assert sorted(os.listdir(crash / "checkpoint")) == ["step-4"]
    logged = len(metric_records(crash))
    res = run_forked(2, *CRASH_JOB, "--job.dump_folder", str(crash))
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"resumed from {crash / 'checkpoint'} at step 4" in res.stdout, res.stdout[-2000:]
    resumed = metric_records(crash)[logged:]
    assert [r["step"] for r in resumed] == list(range(5, 9))
    assert [(r["loss"], r["grad_norm"]) for r in resumed] == _steps(crash_job_reference, 5, 8)  # bitwise


def test_rank_killed_while_a_checkpoint_is_written(tmp_path, crash_job_reference):
    """SIGKILL rank 1 while the step-8 checkpoint is being written (step-8.tmp holds shard
    files but no .metadata yet): rank 0, the rank that publishes, survives the kill and
    must not publish; the half-written save never gets a final name, step-4 stays the
    latest complete checkpoint and loads, and the resumed run's steps 5-8 are bitwise
    those of an uninterrupted run."""
    import torch

    from trainer.checkpoint.dcp import CheckpointFolder
    from trainer.checkpoint.export import export_checkpoint

    common = CRASH_JOB  # saves at 4 and 8 (the last step), synchronously
    run = tmp_path / "run"
    ckpt, tmp = run / "checkpoint", run / "checkpoint" / "step-8.tmp"

    # Rank 1 holds in the middle of the step-8 save, at the drill's write point: its shard
    # files written and fsynced, DCP's .metadata not (rank 0 writes it after gathering every
    # rank's write results, so it waits for rank 1 there). The kill lands in that state
    # whatever the load (it used to be timed: a poll for the first shard file and a kill within
    # the ~40 ms the write takes, which a loaded machine could miss).
    job = Job(2, *common, "--job.dump_folder", str(run), env=drill_env("write:1@8"))
    try:
        assert job.wait_for_output("checkpoint drill: write step 8 rank 1", 600), job.output[-3000:]
        pid = job.workers()[1]
        os.killpg(pid, signal.SIGKILL)  # torchrun started it in a session (process group) of its own
        # torchrun notices the dead rank, tears down rank 0 and reaps both before it exits
        job.proc.wait(timeout=120)
    finally:
        job.close()
    assert job.proc.returncode != 0
    out = job.output
    assert f"Signal 9 (SIGKILL) received by PID {pid}" in out, out[-3000:]  # torchrun's failure summary

    # the half-written save kept its temporary name: shards on disk, no DCP .metadata (the
    # coordinator writes it last, after every rank's write results), never renamed
    assert sorted(os.listdir(ckpt)) == ["step-4", "step-8.tmp"]
    assert any(n.endswith(".distcp") for n in os.listdir(tmp))
    assert not (tmp / ".metadata").exists(), "the kill landed after the shards were written"
    assert CheckpointFolder(str(ckpt)).list_steps() == [4]
    # step-4 is complete and loads (its model weights, consolidated by one process)
    weights = torch.load(export_checkpoint(str(ckpt / "step-4"), str(tmp_path / "step4.pt")), weights_only=True)
    assert len(weights) > 10 and all(torch.isfinite(t).all() for t in weights.values())

    logged = len(metric_records(run))
    res = run_forked(2, *common, "--job.dump_folder", str(run))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert f"resumed from {ckpt} at step 4" in res.stdout, res.stdout[-2000:]
    resumed = metric_records(run)[logged:]
    assert [r["step"] for r in resumed] == list(range(5, 9))
    assert [(r["loss"], r["grad_norm"]) for r in resumed] == _steps(crash_job_reference, 5, 8)  # bitwise
    # the resumed run's step-8 save replaced the stale step-8.tmp (keep_latest_k removing old
    # saves: test_short_run_learns_and_writes_outputs)
    assert sorted(os.listdir(ckpt)) == ["step-4", "step-8"]


def test_resume_under_a_different_layout(tmp_path):
    """A checkpoint saved with fsdp=4 (4 ranks) resumed with fsdp=2 x tp=2: the resumed steps
    equal the fsdp=4 run's within rel 1e-5 (loss) and 1e-4 (grad norm), same math in other
    reduction orders. Both runs forked, 2 layers, 4 steps, resumed from step 2: every weight and
    Adam state is re-cut from 1-D FSDP shards into 2-D FSDP x TP shards, and the data loader's
    position from 4 data-parallel ranks to 2, whatever the depth. Measured (steps 3-4): loss
    rel 6.2e-8, grad norm rel 7.8e-8."""
    common = _checkpointed_job(4, 2)
    ref, resharded = tmp_path / "ref", tmp_path / "reshard"
    res = run_forked(4, *common, "--job.dump_folder", str(ref))  # fsdp=4 all the way, saving at 2 and 4
    assert res.returncode == 0, res.stderr[-3000:]
    _copy_checkpoint(ref, 2, resharded)
    res = run_forked(4, *common, "--job.dump_folder", str(resharded), "--parallelism.tp", "2")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert f"resumed from {resharded / 'checkpoint'} at step 2" in res.stdout, res.stdout[-2000:]
    assert "mesh: world=4 pp=1 dp_replicate=1 dp_shard=2 cp=1 tp=2" in res.stdout  # really resharded
    a, b = read_metrics(ref), read_metrics(resharded)
    assert sorted(b) == [3, 4]
    _near(a, b, (3, 4), "fsdp=4 -> fsdp=2 x tp=2")


# The pipeline job: 4 layers on 2 processes, Interleaved1F1B when pp=2 (2 stages of 1 layer per
# rank: the stage FQN mapping of a looped schedule, not only one stage per rank; 4 layers is
# the least it takes), 4 steps saving at 2 and 4. Its pp=2 run is also the plain side of the
# activation-checkpointing comparison.
PIPELINE_JOB = [*LLAMA, "--model.n_layers", "4", "--training.steps", "4", "--checkpoint.enable", "true",
                "--checkpoint.interval", "2", "--lr_scheduler.warmup_steps", "2"]  # fmt: skip
PP = {
    1: ["--parallelism.pp", "1"],
    2: ["--parallelism.pp", "2", "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"],
}


@pytest.fixture(scope="module")
def pipeline_job_runs(tmp_path_factory):
    """PIPELINE_JOB run without interruption with pp=1 (fsdp=2) and with pp=2: pp -> its run
    folder. Each is the reference of the resume under its pp and the source of the step-2
    checkpoint resumed under the other."""
    runs = {}
    for pp in (1, 2):
        runs[pp] = tmp_path_factory.mktemp(f"pipeline_job_pp{pp}")
        res = run_forked(2, *PIPELINE_JOB, "--job.dump_folder", str(runs[pp]), *PP[pp])
        assert res.returncode == 0, res.stderr[-3000:]
        assert sorted(os.listdir(runs[pp] / "checkpoint")) == ["step-2", "step-4"]
    return runs


@pytest.mark.parametrize("save_pp, load_pp", [(2, 1), (1, 2)])
def test_pipeline_checkpoint_loads_without_pipeline_and_back(tmp_path, pipeline_job_runs, save_pp, load_pp):
    """The step-2 checkpoint of the save_pp run resumed under load_pp matches the load_pp run
    that never stopped (rel 1e-5 loss, 1e-4 grad norm). Measured (4 layers, steps 3-4): pp=2 ->
    pp=1 equal; pp=1 -> pp=2 loss equal, grad norm rel 8.1e-8."""
    run = tmp_path / "run"
    _copy_checkpoint(pipeline_job_runs[save_pp], 2, run)
    res = run_forked(2, *PIPELINE_JOB, "--job.dump_folder", str(run), *PP[load_pp])
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert f"resumed from {run / 'checkpoint'} at step 2" in res.stdout, res.stdout[-2000:]
    a, b = read_metrics(pipeline_job_runs[load_pp]), read_metrics(run)
    assert sorted(b) == [3, 4]
    _near(a, b, (3, 4), f"pp={save_pp} -> pp={load_pp}")


def test_pipeline_with_activation_checkpointing_is_bitwise_unchanged(tmp_path, pipeline_job_runs):
    """The pp=2 Interleaved1F1B pipeline job again with full activation checkpointing: bitwise
    the run without it (pipeline_job_runs[2]), all 4 steps. Bitwise holds: the same layout and
    schedule, AC only re-runs the same kernels on the same shapes."""
    res = run_forked(
        2, *PIPELINE_JOB, "--job.dump_folder", str(tmp_path), *PP[2], "--activation_checkpoint.mode", "full"
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert _steps(read_metrics(tmp_path), 1, 4) == _steps(read_metrics(pipeline_job_runs[2]), 1, 4)


# ---------------------------------------------------------------- stopping (trainer/runtime/stop.py)
# SIGINT / SIGTERM stop every rank at a step boundary with a checkpoint there; the resumed run
# continues the uninterrupted curve bitwise (the crash job's reference). The step a signal
# lands in is random (the assertion messages name it): every step must work. The runs hold
# before their last step until a stop is requested (the drill's ``last`` gate,
# trainer/checkpoint/drill.py): a signal that a loaded machine delivers late still stops the
# run (at step 7 at the latest) instead of landing after the last step or in it.
_STOPPED = re.compile(r"stopped at step (\d+) by (SIGINT|SIGTERM); checkpoint step-(\d+) saved in (\S+); "
                      r"run the same command to resume")  # fmt: skip


def _signal_after_step(job, first: int, signum: int, **kw) -> None:
    """Once step ``first`` is printed, send ``signum`` (torchrun: to torchrun alone, as a
    terminal's Ctrl-C reaches it; forked ranks: to every rank, as a scheduler does). The job
    runs with the ``last`` gate (``drill_env("last")``), so it cannot finish first."""
    assert job.wait_for_output(f"step {first}/8", 300), job.output[-3000:]
    if isinstance(job, ForkedJob):
        job.signal(signum, **kw)
    else:
        os.kill(job.proc.pid, signum)


def _resumes_bitwise(run: Path, stopped: int, reference) -> None:
    logged = len(metric_records(run))
    res = run_forked(2, *CRASH_JOB, "--job.dump_folder", str(run))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert f"resumed from {run / 'checkpoint'} at step {stopped}" in res.stdout, res.stdout[-2000:]
    resumed = metric_records(run)[logged:]
    assert [r["step"] for r in resumed] == list(range(stopped + 1, 9))
    assert [(r["loss"], r["grad_norm"]) for r in resumed] == _steps(reference, stopped + 1, 8)  # bitwise


def test_ctrl_c_under_torchrun_stops_at_a_step_with_a_checkpoint(tmp_path, crash_job_reference):
    """Ctrl-C in the terminal of a torchrun job (SIGINT to torchrun, which sends SIGINT to its
    workers): the workers stop at the next step boundary, save a synchronous checkpoint there,
    rank 0 prints the one line first (before torchrun's own report of the signal), and the same
    command resumes bitwise."""
    first = random.randint(1, 5)
    run = tmp_path / "run"
    job = Job(2, *CRASH_JOB, "--job.dump_folder", str(run), env=drill_env("last"))
    try:
        _signal_after_step(job, first, signal.SIGINT)
        job.proc.wait(timeout=120)
        job._finish()  # torchrun waited for its workers: the output is complete
    finally:
        job.close()
    out = job.output
    lines = [m for m in map(_STOPPED.search, out.splitlines()) if m]
    assert len(lines) == 1, (first, out[-3000:])
    stopped = int(lines[0].group(1))
    assert first <= stopped < 8 and lines[0].group(2) == "SIGINT" and int(lines[0].group(3)) == stopped, first
    assert "error:" not in out and out.count("Traceback") <= 1, out[-3000:]  # torchrun's own, if any
    if "Traceback" in out:
        assert out.index("stopped at step") < out.index("Traceback"), out[-3000:]
    assert f"step-{stopped}" in os.listdir(run / "checkpoint")
    _resumes_bitwise(run, stopped, crash_job_reference)


def test_sigterm_to_every_rank_finishes_the_background_save(tmp_path, crash_job_reference):
    """SIGTERM to every rank (a scheduler's preemption) with asynchronous checkpoints: every rank
    stops at the same step, the save of that step is written in the background and finished
    before the exit, one line, exit code 143 (128 + SIGTERM), and the resumed run is bitwise."""
    first = random.randint(1, 5)
    run = tmp_path / "run"
    job = ForkedJob(
        2, *CRASH_JOB, "--checkpoint.async_mode", "async", "--job.dump_folder", str(run), env=drill_env("last")
    )
    try:
        _signal_after_step(job, first, signal.SIGTERM)
        code = job.wait(timeout=120)
    finally:
        job.close()
    out = job.output
    assert code == 143, (first, code, out[-3000:])
    lines = [m for m in map(_STOPPED.search, out.splitlines()) if m]
    assert len(lines) == 1 and lines[0].group(2) == "SIGTERM", (first, out[-3000:])
    stopped = int(lines[0].group(1))
    assert first <= stopped < 8, first
    assert "Traceback" not in out and "error:" not in out, out[-3000:]
    assert f"step-{stopped}" in os.listdir(run / "checkpoint")
    # the end-of-run summary is printed at a stop too, once, before the stop line
    assert out.count("run summary (") == 1 and out.index("run summary (") < out.index(lines[0].group(0)), out[-3000:]
    assert f"  steps        1-{stopped} of 8 ({stopped} this launch)" in out, out[-3000:]
    _resumes_bitwise(run, stopped, crash_job_reference)


def test_a_second_ctrl_c_during_the_save_stops_at_once(tmp_path):
    """A second SIGINT (after trainer/runtime/stop.py's 3 s window) while the stop's checkpoint is being
    written (every rank held at the drill's ``write`` point: data files written, no .metadata)
    ends every rank at once with one line each naming the newest complete checkpoint, exit code
    130; the save cut short is never published (step-N.tmp), the newest complete one loads."""
    from trainer.checkpoint.dcp import CheckpointFolder
    from trainer.runtime.stop import REPEAT_WINDOW_S

    run = tmp_path / "run"
    # every save holds once its files are written; the run cannot reach its last step (and that
    # step's save) before the first SIGINT stops it, so the save held is the stop's
    env = drill_env("write,last")
    job = ForkedJob(2, *_checkpointed_job(8, 100), "--job.dump_folder", str(run), env=env)
    try:
        _signal_after_step(job, 2, signal.SIGINT)
        assert job.wait_for_output("checkpoint drill: write", 120), job.output[-3000:]
        time.sleep(REPEAT_WINDOW_S)
        job.signal(signal.SIGINT)
        code = job.wait(timeout=60)
    finally:
        job.close()
    out = job.output
    assert code == 130, (code, out[-3000:])
    assert out.count("stopped at once by a second signal (SIGINT)") == 2, out[-3000:]  # each rank, one line
    assert "Traceback" not in out, out[-3000:]
    (tmp,) = os.listdir(run / "checkpoint")
    assert tmp.endswith(".tmp") and CheckpointFolder(str(run / "checkpoint")).list_steps() == []


# ---------------------------------------------------------------- errors


# how each case is launched: "python" = `python train.py` (a fresh interpreter, its exit through
# trainer/lifecycle/shutdown.py), "torchrun" = what reaches stderr under torchrun, "forked" = the message
# itself (forked ranks print the same lines as torchrun's workers, tests/e2e/test_launcher.py)
@pytest.mark.parametrize(
    "launch, nproc, args, message",
    [
        ("python", 1, ["--training.stesp", "3"], "unknown key 'training.stesp'; did you mean 'training.steps'?"),
        ("forked", 1, ["--training.steps", "ten"], "training.steps expects an int, got 'ten'"),
        ("forked", 1, ["--parallelism.tp", "2"], "tp=2 does not divide world_size=1; legal tp values: 1"),
        ("forked", 2, ["--parallelism.tp", "2", "--training.seq_len", "63"], "seq_len=63 is not divisible by 2"),
        (
            "torchrun",
            2,
            ["--parallelism.cp", "2", "--training.seq_len", "66"],
            "seq_len=66 is not divisible by 4 = 2*cp: 2*cp (load-balanced context-parallel chunks)",
        ),
        ("forked", 1, ["--model.flavor", "debugmodle"], "debugmodle"),
    ],
)
def test_bad_config_gives_a_clear_error(tmp_path, launch, nproc, args, message):
    """A bad key, value or degree: our message on stderr, no traceback from our code."""
    run = run_forked if launch == "forked" else run_train
    res = run(nproc, *LLAMA, "--training.steps", "2", "--job.dump_folder", str(tmp_path), *args)
    assert res.returncode != 0
    assert message in res.stderr, res.stderr[-2000:]
    # the message is ours; no traceback from our code (torchrun may add its own summary)
    assert "trainer/" not in res.stderr and 'File "' + str(Path("train.py")) not in res.stderr, res.stderr[-3000:]


# Rank 1 joins late at the three places where gloo connects sockets (init_process_group, the
# groups of build_mesh, the background checkpoint writer's two groups): it sleeps after each and
# then leaves a mark. Rank 0 notes whether the mark was there when it went on (at the job plan,
# at the model build, at the resume, where both ranks then stop on bad input: a load_step that
# is not there).
_LATE_JOINER = textwrap.dedent(
    """
    import os, sys, time
    import torch.distributed as dist
    from parallel_dims import ParallelDims
    import trainer.checkpoint.async_save as async_save
    import trainer.startup as ts
    import trainer.trainer as tt
    from trainer.checkpoint.manager import CheckpointManager

    rank, marks = int(os.environ["RANK"]), sys.argv[1]

    def late(fn, mark, every=1):
        calls = []

        def wrapped(*args, **kwargs):
            out = fn(*args, **kwargs)
            calls.append(1)
            if rank == 1 and len(calls) % every == 0:
                time.sleep(1.5)
                open(os.path.join(marks, mark), "w").close()
            return out
        return wrapped

    def noting(fn, what, mark):
        def wrapped(*args, **kwargs):
            if rank == 0:
                print(f"{what}: {os.path.exists(os.path.join(marks, mark))}", flush=True)
            return fn(*args, **kwargs)
        return wrapped

    dist.init_process_group = late(dist.init_process_group, "joined")
    ParallelDims.build_mesh = late(ParallelDims.build_mesh, "meshes")
    async_save.host_group = late(async_save.host_group, "writer", every=2)  # after the second
    ts.plan_job = noting(ts.plan_job, "at the job plan, rank 1 had joined", "joined")
    tt.build_model_parts = noting(tt.build_model_parts, "at the model build, rank 1 had built its groups", "meshes")
    CheckpointManager.resume = noting(CheckpointManager.resume, "at the resume, rank 1 had its writer's groups", "writer")
    from trainer.lifecycle.rank import run_rank as main
    sys.exit(main(sys.argv[2:]))
    """
)


def test_no_rank_goes_on_before_every_rank_joined(tmp_path):
    """Regression (a flaky 'no traceback' failure of the seq_len=66 case above, 1 run in ~20
    under CPU load): rank 0 joined the gloo group, found the config error and exited while
    rank 1 was still connecting its sockets, and rank 1's init_process_group died with gloo's
    "Connection closed by peer" and a traceback. Now no rank goes on from joining (after
    init_process_group, after the meshes' groups, after the async checkpoint writer's groups)
    until every rank has: made deterministic here by a rank 1 that joins 1.5 s late at each
    (without the barriers rank 0 sees False, and used to exit before rank 1 finished). Both
    ranks then stop on bad input at the resume (async mode, a load_step that is not there):
    one line, exit 2. (Reproduced without the barriers by a rank 1 that sleeps inside gloo's
    connect, in its lookup of rank 0's address, while rank 0 stops on the bad input: rank 1's
    group creation fails with "Connection closed by peer" whenever gloo gives it the passive
    side of the connection, about half the runs; never with them.)"""
    script = tmp_path / "late_joiner.py"
    script.write_text(_LATE_JOINER)
    marks = tmp_path / "marks"
    marks.mkdir()
    from tools.forkserver import run_train as run_forked_script

    run = tmp_path / "run"
    args = [str(marks), *LLAMA, *TWO_LAYERS, "--training.steps", "2", "--lr_scheduler.warmup_steps", "1"]
    args += ["--job.dump_folder", str(run)]
    args += ["--checkpoint.enable", "true", "--checkpoint.async_mode", "async", "--checkpoint.load_step", "7"]
    res = run_forked_script(2, args, env=_env(), cwd=ROOT, timeout=300, script=script)
    out = res.stdout[-2000:] + res.stderr[-3000:]
    assert "at the job plan, rank 1 had joined: True" in res.stdout, out
    assert "at the model build, rank 1 had built its groups: True" in res.stdout, out
    assert "at the resume, rank 1 had its writer's groups: True" in res.stdout, out
    assert res.returncode == 2, res.stderr[-3000:]
    assert res.stderr.splitlines() == [
        f"error: no complete checkpoint for step 7 in {run / 'checkpoint'}; available steps: none "
        f"(set checkpoint.load_step = -1 for the latest)"
    ], res.stderr[-3000:]


def test_bad_model_layout_combination(tmp_path):
    """DeepSeek-V3 with ep=2 x tp=2 without sequence parallel: refused with a message that names
    the fix (forked: the message is the claim)."""
    res = run_forked(
        2,
        "--config",
        "deepseek_v3.toml",
        *FAST,
        "--training.steps",
        "2",
        "--job.dump_folder",
        str(tmp_path),
        "--parallelism.ep",
        "2",
        "--model.vocab_size",
        "2048",
        "--parallelism.dp_shard",
        "1",
        "--parallelism.tp",
        "2",
        "--parallelism.enable_sequence_parallel",
        "false",
    )
    assert res.returncode != 0
    assert "needs sequence parallel" in res.stderr, res.stderr[-2000:]


def test_non_finite_loss_stops_the_run_naming_the_step(tmp_path):
    """An absurd learning rate without clipping blows the weights up within a few steps: exit 1,
    the step named, no traceback (one forked process, the run's own exit code)."""
    res = run_forked(
        1,
        *LLAMA,
        "--training.steps",
        "6",
        "--job.dump_folder",
        str(tmp_path),
        "--parallelism.dp_shard",
        "1",
        "--optimizer.lr",
        "1e12",
        "--lr_scheduler.warmup_steps",
        "1",
        "--training.max_norm",
        "0",
    )
    assert res.returncode == 1, res.stdout[-2000:] + res.stderr[-2000:]
    assert "non-finite" in res.stderr and "at step " in res.stderr, res.stderr[-2000:]
    assert "Traceback" not in res.stderr


def test_profiling_writes_traces_at_the_configured_steps(tmp_path):
    """[profiling]: a Chrome trace per rank at every multiple of profile_freq, holding the
    step's matmuls; memory snapshots are CUDA-only and the CPU run says so instead. Forked
    ranks (each rank writes its own trace), 2 layers (the traces hold the same op kinds)."""
    import json

    res = run_forked(
        2,
        *LLAMA,
        *TWO_LAYERS,
        "--training.steps",
        "4",
        "--job.dump_folder",
        str(tmp_path),
        "--profiling.enable_profiling",
        "true",
        "--profiling.profile_freq",
        "2",
        "--profiling.profiler_warmup",
        "0",
        "--profiling.profiler_active",
        "1",
        "--profiling.enable_memory_snapshot",
        "true",
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    traces = tmp_path / "profile_traces"
    assert sorted(p.name for p in traces.iterdir()) == ["iteration_2", "iteration_4"]
    for folder in traces.iterdir():
        assert sorted(p.name for p in folder.iterdir()) == ["rank0_trace.json", "rank1_trace.json"]
        events = json.loads((folder / "rank0_trace.json").read_text())["traceEvents"]
        names = {e.get("name") for e in events}
        assert "aten::mm" in names and "Optimizer.step#AdamW.step" in names, sorted(names)[:50]
    assert "memory snapshots record the CUDA caching allocator" in res.stdout
    assert not (tmp_path / "memory_snapshot").exists()


def _pending_signals(pid: int) -> int:
    """The signals sent to ``pid`` and not yet delivered (a stopped process keeps them)."""
    mask = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("SigPnd:", "ShdPnd:")):
                mask |= int(line.split()[1], 16)
    return mask


def test_hung_rank_ends_the_job_within_the_train_timeout(tmp_path):
    """SIGSTOP one torchrun worker after training started: the other rank's next collective
    times out after comm.train_timeout_seconds (not the 300 s start-up timeout), it prints one
    line naming the option and exits, and torchrun tears the job down (SIGTERM to the stopped
    worker). The test then lets the stopped worker take that SIGTERM (SIGCONT) instead of
    waiting out torchrun's own 30 s grace before its SIGKILL (torchrun's behaviour, not the
    trainer's): the claim is timed from the stop to the error line. 2 layers: the timeout is
    a property of the process groups, not of the model."""
    timeout_s = 5
    job = Job(
        2,
        *LLAMA,
        *TWO_LAYERS,
        "--training.steps",
        "500",
        "--job.dump_folder",
        str(tmp_path),
        "--comm.train_timeout_seconds",
        str(timeout_s),
    )
    line = f"a collective did not finish within comm.train_timeout_seconds = {timeout_s} s"
    try:
        assert job.wait_for_output("step   3/500", 300), job.output[-3000:]
        workers = job.workers()
        os.kill(workers[1], signal.SIGSTOP)
        stopped = time.monotonic()
        assert job.wait_for_output(line, 120), job.output[-3000:]
        elapsed = time.monotonic() - stopped
        # rank 0 exits, torchrun notices and sends SIGTERM to the stopped rank 1 (pending)
        deadline = time.monotonic() + 60
        while not _pending_signals(workers[1]) & (1 << (signal.SIGTERM - 1)):
            assert time.monotonic() < deadline, f"torchrun did not stop rank 1:\n{job.output[-3000:]}"
            time.sleep(0.01)
        os.kill(workers[1], signal.SIGCONT)  # the pending SIGTERM ends it before it runs again
        job.proc.wait(timeout=60)
    finally:
        job.close()
    assert job.proc.returncode != 0
    assert "trainer/" not in job.output  # no traceback through our code (torchrun prints its own summary)
    # the 5 s timeout, and slack for a loaded box (the start-up timeout would be 300 s)
    assert elapsed < timeout_s + 25, f"the error came {elapsed:.0f} s after the stop"
