"""train.py end to end through torchrun on CPU: learning, outputs, resume, reshard, errors."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from .helpers import FAST, read_metrics, run_train, run_until

LLAMA = ["--config", "llama3.toml", *FAST]


def test_short_run_learns_and_writes_outputs(tmp_path):
    out = tmp_path / "run"
    res = run_train(
        4, *LLAMA, "--training.steps", "40", "--job.dump_folder", str(out),
        "--metrics.enable_tensorboard", "true", "--checkpoint.enable", "true",
        "--checkpoint.interval", "20", "--checkpoint.keep_latest_k", "1",
        "--lr_scheduler.warmup_steps", "4",
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
    assert "resolved config:" in res.stdout and "step     40" in res.stdout


def _steps(m, lo, hi):
    return [(m[s]["loss"], m[s]["grad_norm"]) for s in range(lo, hi + 1)]


def test_kill_and_resume_is_bitwise_identical(tmp_path):
    common = [*LLAMA, "--training.steps", "8", "--checkpoint.enable", "true",
              "--checkpoint.interval", "4", "--lr_scheduler.warmup_steps", "2"]
    ref, crash = tmp_path / "ref", tmp_path / "crash"
    res = run_train(2, *common, "--job.dump_folder", str(ref))
    assert res.returncode == 0, res.stderr[-3000:]
    # SIGKILL the job right after the step-4 checkpoint is reported
    run_until(2, "saved checkpoint", *common, "--job.dump_folder", str(crash))
    assert (crash / "checkpoint" / "step-4").is_dir()
    res = run_train(2, *common, "--job.dump_folder", str(crash))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resumed from" in res.stdout
    assert _steps(read_metrics(crash), 5, 8) == _steps(read_metrics(ref), 5, 8)  # bitwise


def test_resume_under_a_different_layout(tmp_path):
    common = [*LLAMA, "--training.steps", "8", "--checkpoint.enable", "true",
              "--checkpoint.interval", "4", "--lr_scheduler.warmup_steps", "2"]
    ref, resharded = tmp_path / "ref", tmp_path / "reshard"
    res = run_train(4, *common, "--job.dump_folder", str(ref))  # fsdp=4 all the way
    assert res.returncode == 0, res.stderr[-3000:]
    # save with fsdp=4 (steps 1-4) ...
    run_until(4, "saved checkpoint", *common, "--job.dump_folder", str(resharded))
    # ... resume with fsdp=2 x tp=2
    res = run_train(4, *common, "--job.dump_folder", str(resharded), "--parallelism.tp", "2")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    a, b = read_metrics(ref), read_metrics(resharded)
    for step in range(5, 9):
        assert b[step]["loss"] == pytest.approx(a[step]["loss"], rel=1e-5), step
        assert b[step]["grad_norm"] == pytest.approx(a[step]["grad_norm"], rel=1e-4), step


@pytest.mark.parametrize("save_pp, load_pp", [(2, 1), (1, 2)])
def test_pipeline_checkpoint_loads_without_pipeline_and_back(tmp_path, save_pp, load_pp):
    common = [*LLAMA, "--training.steps", "6", "--checkpoint.enable", "true",
              "--checkpoint.interval", "3", "--lr_scheduler.warmup_steps", "2"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    res = run_train(2, *common, "--job.dump_folder", str(ref), "--parallelism.pp", str(load_pp))
    assert res.returncode == 0, res.stderr[-3000:]
    run_until(2, "saved checkpoint", *common, "--job.dump_folder", str(run), "--parallelism.pp", str(save_pp))
    res = run_train(2, *common, "--job.dump_folder", str(run), "--parallelism.pp", str(load_pp))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert "resumed from" in res.stdout
    a, b = read_metrics(ref), read_metrics(run)
    for step in range(4, 7):
        assert b[step]["loss"] == pytest.approx(a[step]["loss"], rel=1e-5), step
        assert b[step]["grad_norm"] == pytest.approx(a[step]["grad_norm"], rel=1e-4), step


@pytest.mark.parametrize(
    "nproc, args, message",
    [
        (1, ["--training.stesp", "3"], "unknown key 'training.stesp'; did you mean 'training.steps'?"),
        (1, ["--training.steps", "ten"], "training.steps expects an int, got 'ten'"),
        (1, ["--parallelism.tp", "2"], "tp=2 does not divide world_size=1; legal tp values: 1"),
        (2, ["--parallelism.tp", "2", "--training.seq_len", "63"], "seq_len=63 is not divisible by 2"),
        (2, ["--parallelism.cp", "2", "--training.seq_len", "66"], "seq_len=66 is not divisible by 4 = 2*cp: 2*cp (load-balanced context-parallel chunks)"),
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
    res = run_train(2, "--config", "deepseek_v3.toml", *FAST, "--training.steps", "2",
                    "--job.dump_folder", str(tmp_path), "--parallelism.ep", "2",
                    "--model.vocab_size", "2048", "--parallelism.dp_shard", "1", "--parallelism.tp", "2",
                    "--parallelism.enable_sequence_parallel", "false")
    assert res.returncode != 0
    assert "needs sequence parallel" in res.stderr, res.stderr[-2000:]


def test_non_finite_loss_stops_the_run_naming_the_step(tmp_path):
    # an absurd learning rate without clipping blows the weights up within a few steps
    res = run_train(1, *LLAMA, "--training.steps", "6", "--job.dump_folder", str(tmp_path),
                    "--parallelism.dp_shard", "1", "--optimizer.lr", "1e12",
                    "--lr_scheduler.warmup_steps", "1", "--training.max_norm", "0")
    assert res.returncode == 1, res.stdout[-2000:] + res.stderr[-2000:]
    assert "non-finite" in res.stderr and "at step " in res.stderr, res.stderr[-2000:]
    assert "Traceback" not in res.stderr


def test_pipeline_with_activation_checkpointing_is_bitwise_unchanged(tmp_path):
    common = [*LLAMA, "--training.steps", "3", "--parallelism.pp", "2",
              "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"]
    plain, ac = tmp_path / "plain", tmp_path / "ac"
    for folder, extra in ((plain, []), (ac, ["--activation_checkpoint.mode", "full"])):
        res = run_train(2, *common, "--job.dump_folder", str(folder), *extra)
        assert res.returncode == 0, res.stderr[-3000:]
    assert _steps(read_metrics(ac), 1, 3) == _steps(read_metrics(plain), 1, 3)


def test_profiling_writes_traces_at_the_configured_steps(tmp_path):
    """[profiling]: a Chrome trace per rank at every multiple of profile_freq, holding the
    step's matmuls; memory snapshots are CUDA-only and the CPU run says so instead."""
    import json

    res = run_train(2, *LLAMA, "--training.steps", "4", "--job.dump_folder", str(tmp_path),
                    "--profiling.enable_profiling", "true", "--profiling.profile_freq", "2",
                    "--profiling.profiler_warmup", "0", "--profiling.profiler_active", "1",
                    "--profiling.enable_memory_snapshot", "true")
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
