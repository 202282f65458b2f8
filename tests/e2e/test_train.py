"""train.py end to end through torchrun on CPU: learning, outputs, resume, reshard, errors."""

from __future__ import annotations

import math
import os
import shutil
import time
from pathlib import Path

import pytest

from .helpers import FAST, Job, metric_records, read_metrics, run_train, run_until

LLAMA = ["--config", "llama3.toml", *FAST]


def test_short_run_learns_and_writes_outputs(tmp_path):
    out = tmp_path / "run"
    res = run_train(
        4,
        *LLAMA,
        "--training.steps",
        "40",
        "--job.dump_folder",
        str(out),
        "--metrics.enable_tensorboard",
        "true",
        "--checkpoint.enable",
        "true",
        "--checkpoint.interval",
        "20",
        "--checkpoint.keep_latest_k",
        "1",
        "--lr_scheduler.warmup_steps",
        "4",
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    m = read_metrics(out)
    assert sorted(m) == list(range(1, 41))
    first, last = m[1]["loss"], m[40]["loss"]
    assert last < first - 1.5, (first, last)  # ln(2048) = 7.6 -> well below
    assert all(math.isfinite(r["grad_norm"]) and r["tps"] > 0 for r in m.values())
    assert list((out / "tb").glob("events.out.tfevents.*")), "no TensorBoard event file"
    assert (out / "config.toml").read_text().count("[parallelism]") == 1
    ckpts = sorted(p.name for p in (out / "checkpoint").iterdir())
    assert ckpts == ["step-40"], ckpts  # keep_latest_k=1 removed step-20
    assert "resolved config:" in res.stdout and "step 40/40" in res.stdout


def _steps(m, lo, hi):
    return [(m[s]["loss"], m[s]["grad_norm"]) for s in range(lo, hi + 1)]


# The two crash tests (a clean SIGKILL of every worker after a save, and rank 1 killed in the
# middle of a save) train the same job: 10 steps on fsdp=2, saving at 4, 8 and 10 (llama3.toml
# keeps the newest 2). Its uninterrupted run is their shared reference: one launch, not two.
def _checkpointed_job(steps: int) -> list[str]:
    """LLAMA for ``steps`` steps, checkpointing every 4, warm-up 2."""
    return [*LLAMA, "--training.steps", str(steps), "--checkpoint.enable", "true", "--checkpoint.interval", "4",
            "--lr_scheduler.warmup_steps", "2"]  # fmt: skip


CRASH_JOB = _checkpointed_job(10)


@pytest.fixture(scope="module")
def crash_job_reference(tmp_path_factory):
    """Steps 1-10 of CRASH_JOB run without interruption: step -> (loss, grad_norm)."""
    ref = tmp_path_factory.mktemp("crash_job_reference")
    res = run_train(2, *CRASH_JOB, "--job.dump_folder", str(ref))
    assert res.returncode == 0, res.stderr[-3000:]
    return read_metrics(ref)


def test_kill_and_resume_is_bitwise_identical(tmp_path, crash_job_reference):
    crash = tmp_path / "crash"
    # SIGKILL both workers (then torchrun) right after the step-4 checkpoint is reported;
    # run_until returns once they are all gone, so nothing of this run overlaps the resume
    run_until(2, "saved checkpoint", *CRASH_JOB, "--job.dump_folder", str(crash))
    assert sorted(os.listdir(crash / "checkpoint")) == ["step-4"]
    logged = len(metric_records(crash))
    res = run_train(2, *CRASH_JOB, "--job.dump_folder", str(crash))
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"resumed from {crash / 'checkpoint'} at step 4" in res.stdout, res.stdout[-2000:]
    resumed = metric_records(crash)[logged:]
    assert [r["step"] for r in resumed] == list(range(5, 11))
    assert [(r["loss"], r["grad_norm"]) for r in resumed] == _steps(crash_job_reference, 5, 10)  # bitwise


def test_resume_under_a_different_layout(tmp_path):
    common = _checkpointed_job(8)
    ref, resharded = tmp_path / "ref", tmp_path / "reshard"
    res = run_train(4, *common, "--job.dump_folder", str(ref))  # fsdp=4 all the way, saving at 4 and 8
    assert res.returncode == 0, res.stderr[-3000:]
    # the step-4 checkpoint saved with fsdp=4 (steps 1-4) ... Taken from the reference run: a
    # second fsdp=4 run stopped after its step-4 save would write these very files (same job,
    # deterministic), and crash-then-resume is test_kill_and_resume_is_bitwise_identical's claim
    shutil.copytree(ref / "checkpoint" / "step-4", resharded / "checkpoint" / "step-4")
    # ... resumed with fsdp=2 x tp=2
    res = run_train(4, *common, "--job.dump_folder", str(resharded), "--parallelism.tp", "2")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert f"resumed from {resharded / 'checkpoint'} at step 4" in res.stdout, res.stdout[-2000:]
    assert "mesh: world=4 pp=1 dp_replicate=1 dp_shard=2 cp=1 tp=2" in res.stdout  # really resharded
    a, b = read_metrics(ref), read_metrics(resharded)
    assert sorted(b) == list(range(5, 9))
    for step in range(5, 9):
        assert b[step]["loss"] == pytest.approx(a[step]["loss"], rel=1e-5), step
        assert b[step]["grad_norm"] == pytest.approx(a[step]["grad_norm"], rel=1e-4), step


PIPELINE_JOB = [
    *LLAMA,
    "--training.steps",
    "6",
    "--checkpoint.enable",
    "true",
    "--checkpoint.interval",
    "3",
    "--lr_scheduler.warmup_steps",
    "2",
]


@pytest.fixture(scope="module")
def pipeline_job_runs(tmp_path_factory):
    """PIPELINE_JOB run without interruption on 2 processes with pp=1 (fsdp=2) and with pp=2,
    each saving at steps 3 and 6: pp -> its run folder. Each run is the reference of the
    resume under its pp and the source of the step-3 checkpoint resumed under the other."""
    runs = {}
    for pp in (1, 2):
        runs[pp] = tmp_path_factory.mktemp(f"pipeline_job_pp{pp}")
        res = run_train(2, *PIPELINE_JOB, "--job.dump_folder", str(runs[pp]), "--parallelism.pp", str(pp))
        assert res.returncode == 0, res.stderr[-3000:]
        assert sorted(os.listdir(runs[pp] / "checkpoint")) == ["step-3", "step-6"]
    return runs


@pytest.mark.parametrize("save_pp, load_pp", [(2, 1), (1, 2)])
def test_pipeline_checkpoint_loads_without_pipeline_and_back(tmp_path, pipeline_job_runs, save_pp, load_pp):
    run = tmp_path / "run"
    # the step-3 checkpoint of the save_pp run (its steps 1-3; a run stopped after that save
    # would have written the same files) ...
    shutil.copytree(pipeline_job_runs[save_pp] / "checkpoint" / "step-3", run / "checkpoint" / "step-3")
    # ... resumed under load_pp, against the load_pp run that never stopped
    res = run_train(2, *PIPELINE_JOB, "--job.dump_folder", str(run), "--parallelism.pp", str(load_pp))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert f"resumed from {run / 'checkpoint'} at step 3" in res.stdout, res.stdout[-2000:]
    a, b = read_metrics(pipeline_job_runs[load_pp]), read_metrics(run)
    assert sorted(b) == list(range(4, 7))
    for step in range(4, 7):
        assert b[step]["loss"] == pytest.approx(a[step]["loss"], rel=1e-5), step
        assert b[step]["grad_norm"] == pytest.approx(a[step]["grad_norm"], rel=1e-4), step


def test_rank_killed_while_a_checkpoint_is_written(tmp_path, crash_job_reference):
    """SIGKILL rank 1 while the step-8 checkpoint is being written (step-8.tmp holds shard
    files but no .metadata yet): rank 0, the rank that publishes, survives the kill and
    must not publish; the half-written save never gets a final name, step-4 stays the
    latest complete checkpoint and loads, and the resumed run's steps 5-10 are bitwise
    those of an uninterrupted run."""
    import torch

    from trainer.checkpoint.dcp import CheckpointFolder
    from trainer.checkpoint.export import export_checkpoint

    # CRASH_JOB saves at 4, 8 and 10 (the last step); llama3.toml keeps the newest 2
    common = CRASH_JOB
    run = tmp_path / "run"
    ckpt, tmp = run / "checkpoint", run / "checkpoint" / "step-8.tmp"

    job = Job(2, *common, "--job.dump_folder", str(run))
    try:
        assert job.wait_for_output("saved checkpoint", 600), job.output[-3000:]  # step-4 is complete
        # Wait for rank 0 to create step-8.tmp, then for the first shard file in it, and kill
        # rank 1 at once. From the first shard file to DCP's .metadata the ranks take 0.7 s
        # to 2.5 s (2 shared CPU cores, light to heavy load) to write ~70 MB of model and
        # Adam state and gather the write results; this loop looks every 0.2 ms, so the kill
        # lands mid-write (asserted below: no .metadata).
        deadline = time.monotonic() + 600
        while not (tmp.is_dir() and any(n.endswith(".distcp") for n in os.listdir(tmp))):
            assert job.proc.poll() is None, f"the run ended before step-8 was written:\n{job.output[-3000:]}"
            assert time.monotonic() < deadline, "no step-8 save within 600 s"
            time.sleep(0.0002)
        # torchrun notices the dead rank and tears down rank 0; kill() returns once every
        # process of the job is gone
        (pid,) = job.kill([1])
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
    res = run_train(2, *common, "--job.dump_folder", str(run))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert f"resumed from {ckpt} at step 4" in res.stdout, res.stdout[-2000:]
    resumed = metric_records(run)[logged:]
    assert [r["step"] for r in resumed] == list(range(5, 11))
    assert [(r["loss"], r["grad_norm"]) for r in resumed] == _steps(crash_job_reference, 5, 10)  # bitwise
    # the resumed run's step-8 save replaced the stale step-8.tmp; keep_latest_k=2 dropped step-4
    assert sorted(os.listdir(ckpt)) == ["step-10", "step-8"]


@pytest.mark.parametrize(
    "nproc, args, message",
    [
        (1, ["--training.stesp", "3"], "unknown key 'training.stesp'; did you mean 'training.steps'?"),
        (1, ["--training.steps", "ten"], "training.steps expects an int, got 'ten'"),
        (1, ["--parallelism.tp", "2"], "tp=2 does not divide world_size=1; legal tp values: 1"),
        (2, ["--parallelism.tp", "2", "--training.seq_len", "63"], "seq_len=63 is not divisible by 2"),
        (
            2,
            ["--parallelism.cp", "2", "--training.seq_len", "66"],
            "seq_len=66 is not divisible by 4 = 2*cp: 2*cp (load-balanced context-parallel chunks)",
        ),
        (1, ["--model.flavor", "debugmodle"], "debugmodle"),
    ],
)
def test_bad_config_gives_a_clear_error(tmp_path, nproc, args, message):
    res = run_train(nproc, *LLAMA, "--training.steps", "2", "--job.dump_folder", str(tmp_path), *args)
    assert res.returncode != 0
    assert message in res.stderr, res.stderr[-2000:]
    # the message is ours; no traceback from our code (torchrun may add its own summary)
    assert "trainer/" not in res.stderr and 'File "' + str(Path("train.py")) not in res.stderr


def test_bad_model_layout_combination(tmp_path):
    res = run_train(
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
    # an absurd learning rate without clipping blows the weights up within a few steps
    res = run_train(
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


def test_pipeline_with_activation_checkpointing_is_bitwise_unchanged(tmp_path):
    common = [
        *LLAMA,
        "--training.steps",
        "3",
        "--parallelism.pp",
        "2",
        "--parallelism.pipeline_parallel_schedule",
        "Interleaved1F1B",
    ]
    plain, ac = tmp_path / "plain", tmp_path / "ac"
    for folder, extra in ((plain, []), (ac, ["--activation_checkpoint.mode", "full"])):
        res = run_train(2, *common, "--job.dump_folder", str(folder), *extra)
        assert res.returncode == 0, res.stderr[-3000:]
    # bitwise: the same layout and schedule; AC only re-runs the same kernels on the same shapes
    assert _steps(read_metrics(ac), 1, 3) == _steps(read_metrics(plain), 1, 3)


def test_profiling_writes_traces_at_the_configured_steps(tmp_path):
    """[profiling]: a Chrome trace per rank at every multiple of profile_freq, holding the
    step's matmuls; memory snapshots are CUDA-only and the CPU run says so instead."""
    import json

    res = run_train(
        2,
        *LLAMA,
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


def test_hung_rank_ends_the_job_within_the_train_timeout(tmp_path):
    """SIGSTOP one rank after training started: the other rank's next collective times out
    after comm.train_timeout_seconds (not the 300 s start-up timeout) with one line naming the
    option, and torchrun then ends the job (its own grace period for the stopped worker
    is 30 s)."""
    import signal

    timeout_s = 5
    job = Job(
        2,
        *LLAMA,
        "--training.steps",
        "500",
        "--job.dump_folder",
        str(tmp_path),
        "--comm.train_timeout_seconds",
        str(timeout_s),
    )
    try:
        assert job.wait_for_output("step   3/500", 300), job.output[-3000:]
        os.kill(job.workers()[1], signal.SIGSTOP)
        stopped = time.monotonic()
        job.proc.wait(timeout=180)
        elapsed = time.monotonic() - stopped
    finally:
        job.close()
    assert job.proc.returncode != 0
    assert f"a collective did not finish within comm.train_timeout_seconds = {timeout_s} s" in job.output, job.output[
        -3000:
    ]
    assert "trainer/" not in job.output  # no traceback through our code (torchrun prints its own summary)
    # the 5 s timeout, torchrun's 30 s grace for the stopped worker, and slack for a loaded box
    assert elapsed < timeout_s + 30 + 25, f"the job took {elapsed:.0f} s to end"
