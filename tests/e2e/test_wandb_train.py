"""train.py with ``metrics.enable_wandb`` in W&B's offline mode (no network), on 2 ranks (fsdp=2):
stopped by SIGTERM to every rank (a scheduler's preemption) after a few steps, then resumed by
the same command. One module fixture runs both launches; the tests read what they left:

* each launch wrote one W&B run (rank 0's; the other rank none), and the resumed launch
  continued the same run id, the one kept in the checkpoint folder;
* the two runs' history rows are metrics.jsonl's rows (merged per step; read back from the
  .wandb files with wandb's protobuf, tests/wandb_records.py), with no step twice;
* the run's config is the resolved config the launch wrote to config.toml;
* both runs ended (an exit record) and no wandb process outlived its rank.

Forked ranks (tools/forkserver.py, bitwise what torchrun starts: tests/e2e/test_launcher.py); the
smallest llama3 that trains (1 layer, 64-token windows), since the claim is the logging. The
rows' and config's details, resume vs fresh start and the error paths are unit-tested in
tests/unit/test_wandb_metrics.py."""

from __future__ import annotations

import os
import signal

import pytest

from tests.wandb_records import offline_runs, rows_by_step
from trainer.config import load_config
from trainer.reporting.wandb_log import RUN_ID_FILE

from .helpers import FAST, ForkedJob, _env, _stat, all_records, run_forked

pytest.importorskip("wandb")

STEPS = 6
JOB = ["--config", "llama3.toml", *FAST, "--model.n_layers", "1", "--training.steps", str(STEPS),
       "--lr_scheduler.warmup_steps", "1", "--checkpoint.enable", "--checkpoint.interval", "100",
       "--parallelism.dp_shard", "2", "--metrics.enable_wandb"]  # fmt: skip


def _wandb_env(home) -> dict:
    env = {k: v for k, v in _env().items() if not k.startswith("WANDB_")}
    env.update(WANDB_MODE="offline", WANDB_SILENT="true", HOME=str(home))
    for var, sub in (("WANDB_CONFIG_DIR", "cfg"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data")):
        env[var] = str(home / sub)
    return env


def _wandb_processes_of(pids: list[int]) -> list[int]:
    """Live wandb-core / wandb-symon processes started for one of ``pids`` (``--pid N``)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                args = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if not any("wandb" in os.path.basename(a) for a in args[:1]) or "--pid" not in args:
            continue
        target = args[args.index("--pid") + 1]
        st = _stat(int(name))
        if target.isdigit() and int(target) in pids and st is not None and st["state"] not in "ZX":
            found.append(int(name))
    return found


def _launch(run, env, stop_after: int | None = None) -> tuple[int, str, list[int], list[int]]:
    """(exit code, output, the ranks' pids, the wandb processes of each rank while it trained
    (with ``stop_after``: looked up once that step is printed, then SIGTERM to every rank; the
    ranks hold before their last step until it arrives, the drill's ``last`` gate
    (trainer/checkpoint/drill.py), so the run is still training however late this process looks))."""
    if stop_after is not None:
        env = dict(env, MESHTRAIN_CHECKPOINT_DRILL="last")
    job = ForkedJob(2, *JOB, "--job.dump_folder", str(run), env=env)
    during: list[int] = []
    try:
        pids = [pid for _, pid in sorted(job.workers().items())]
        if stop_after is not None:
            assert job.wait_for_output(f"step {stop_after}/{STEPS}", 300), job.output[-3000:]
            during = [len(_wandb_processes_of([pid])) for pid in pids]
            job.signal(signal.SIGTERM)
        code = job.wait(timeout=300)
    finally:
        job.close()
    return code, job.output, pids, during


@pytest.fixture(scope="module")
def stopped_and_resumed(tmp_path_factory):
    base = tmp_path_factory.mktemp("wandb_train")
    run, env = base / "run", _wandb_env(base / "home")
    first = _launch(run, env, stop_after=2)
    second = _launch(run, env)
    return run, first, second


def test_each_launch_ends_cleanly_with_nothing_left_running(stopped_and_resumed):
    run, (code1, out1, pids1, during), (code2, out2, pids2, _) = stopped_and_resumed
    assert during == [1, 0]  # while training: rank 0's W&B service, none for rank 1 (the check below bites)
    assert code1 == 143 and "stopped at step" in out1 and "by SIGTERM" in out1, out1[-3000:]
    assert code2 == 0 and "resumed from" in out2, out2[-3000:]
    for out in (out1, out2):
        assert "Traceback" not in out and "warning: W&B" not in out and "error:" not in out, out[-3000:]
    assert _wandb_processes_of(pids1 + pids2) == []
    assert [r.exit_code for r in offline_runs(str(run))] == [0, 0]  # both runs finished


def test_the_resumed_launch_continues_the_same_run(stopped_and_resumed):
    run, _, _ = stopped_and_resumed
    first, second = offline_runs(str(run))  # one run per launch: rank 1 logged none
    stored = (run / "checkpoint" / RUN_ID_FILE).read_text().strip()
    assert first.run_id == second.run_id == stored
    assert (first.resume, second.resume) == (False, True)
    stopped = max(first.history)
    assert sorted(second.history) == list(range(stopped + 1, STEPS + 1))  # appended, no step twice


def test_the_runs_hold_the_metrics_rows_and_the_resolved_config(stopped_and_resumed):
    run, _, _ = stopped_and_resumed
    first, second = offline_runs(str(run))
    assert {**first.history, **second.history} == rows_by_step(all_records(run))
    assert sorted({**first.history, **second.history}) == list(range(1, STEPS + 1))
    # the config.toml the resumed launch wrote, read back as the trainer reads a config
    resolved = load_config(["--config", str(run / "config.toml")]).to_dict()
    config = {k: v for k, v in second.config.items() if k != "_wandb"}
    assert config["metrics"]["enable_wandb"] is True and config["parallelism"]["data_parallel_shard_degree"] == 2
    assert config == resolved


def test_wandb_refusing_to_start_stops_every_rank_with_one_line(tmp_path):
    """Online mode without an API key (wandb refuses before any network): rank 0's one line,
    exit code 2, and rank 1 (which has no W&B run) does not wait in the first step."""
    env = dict(_wandb_env(tmp_path / "home"), WANDB_MODE="online")
    res = run_forked(2, *JOB, "--job.dump_folder", str(tmp_path / "run"), env=env, timeout=300)
    assert res.returncode == 2, res.stderr[-3000:]
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert errors == [errors[0]] and "W&B could not start the run (No API key configured" in errors[0], res.stderr
    assert "Traceback" not in res.stderr and "step 1/" not in res.stdout, res.stderr[-3000:]
    # nothing of the run that never started: no W&B id, no resolved config, no metrics
    run = tmp_path / "run"
    assert not (run / "checkpoint" / RUN_ID_FILE).exists() and not (run / "config.toml").exists()
    assert not (run / "metrics.jsonl").exists()
