"""Automatic restarts (trainer/lifecycle/restarts.py, docs/long_runs.md) through the launcher,
as users type it: ``python train.py --nproc_per_node N --max_restarts K``. Real launches (the
claim is the elastic agent's: processes killed, restarted, their exit codes), so few of them.

* the drill: 4 processes (fsdp=4), ``--max_restarts 2``, checkpoints every 2 steps, a random
  rank SIGKILLed as a random step from 3 to 6 starts, in the first start only (e.g.
  ``kill@4:rank=2:restart=0``, named in every assertion): the agent restarts all four once,
  they resume from the newest checkpoint before it, redo the steps past it and finish; exit
  0, exactly one restart line naming the rank, SIGKILL, the step and the checkpoint; a
  ``restart`` row counting the redone steps; the loss curve (the last row of each step)
  bitwise the uninterrupted run's on the same layout (its ranks forked:
  tests/e2e/test_launcher.py proves a forked run bitwise the torchrun run). The whole output
  of the launch (every start's workers print through it) is in each assertion's message;
* restarts spent, and a group that cannot form: 2 processes, ``--max_restarts 1``, rank 1
  killed in the first start and hung before joining its group in the second: one restart
  line, rank 0's one line naming rank 1 as missing within ``comm.init_timeout_seconds``, then
  one ``gave up after 1 restart`` line naming the second start's failure, exit 3;
* no orphans: the launcher SIGKILLed once its 2 workers train: both are gone within seconds
  (trainer/lifecycle/parent_death.py; before it they trained on, orphaned);
* no process a worker forked, to kill: a run with background checkpoints (async) starts no
  process from its workers (an audit hook in every worker, tests/e2e/fork_audit/), so the
  "process a worker forked" case of "no hangs, no orphans" has nothing to kill in such a run
  (docs/long_runs.md, "A process a worker started");
* a child a worker spawns (torch's checkpoint process on CUDA) lives as long as its worker and
  ends within a second of it (trainer/lifecycle/parent_death.py ``follow_parent``).

Bad input under ``--max_restarts 2`` is not restarted: tests/e2e/test_train_launcher.py (its
launches of the workers' user error carry the flag)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest

from .helpers import FAST, ROOT, _descendants, _env, _rank_of, all_records, metric_records, read_metrics, run_forked
from .test_train_launcher import _kill_job, launch

pytestmark = pytest.mark.e2e

DRILL = ["--config", "llama3.toml", "--model.n_layers", "2", *FAST, "--training.steps", "6",
         "--checkpoint.enable", "true", "--checkpoint.interval", "2"]  # fmt: skip


def _restart_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("restart ")]


def _explain(run, folder, fault: str) -> str:
    """The whole story of a launch for an assertion message: the fault, the exit code, every
    line the launcher and every start's workers printed, and metrics.jsonl."""
    rows = (folder / "metrics.jsonl").read_text() if (folder / "metrics.jsonl").exists() else "(none)\n"
    return (
        f"fault {fault}; exit code {run.returncode}\n--- stdout ---\n{run.stdout}--- stderr ---\n{run.stderr}"
        f"--- metrics.jsonl ---\n{rows}"
    )


def test_a_killed_rank_is_restarted_and_the_loss_curve_is_the_uninterrupted_runs(tmp_path):
    rng = random.Random()
    rank, at = rng.randrange(4), rng.randint(3, 6)
    resumed = (at - 1) // 2 * 2  # checkpoints at 2, 4, 6: the newest complete one before step ``at``
    fault = f"kill@{at}:rank={rank}:restart=0"
    drill = tmp_path / "drill"
    run = launch(4, "--max_restarts", "2", *DRILL, "--job.dump_folder", str(drill), "--debug.fault", fault)
    out, story = run.stdout + run.stderr, _explain(run, drill, fault)
    assert run.returncode == 0, story
    want_line = f"restart 1/2: rank {rank} died (SIGKILL) at step {at}; resuming from step-{resumed}"
    assert _restart_lines(out) == [want_line], story
    assert "error:" not in out and "gave up" not in out, story

    rows = all_records(drill)
    events = [r for r in rows if "restart" in r]
    want_event = {"step": resumed, "restart": 1, "resumed_from": resumed, "redone_steps": at - 1 - resumed}
    assert events == [{**events[0], **want_event}], (events, story)
    steps = [r["step"] for r in metric_records(drill)]
    assert steps == [*range(1, at), *range(resumed + 1, 7)], (steps, story)

    reference = run_forked(4, *DRILL, "--job.dump_folder", str(tmp_path / "reference"))
    assert reference.returncode == 0, reference.stderr
    got = {step: row["loss"] for step, row in read_metrics(drill).items()}  # the last row of a step
    want = {step: row["loss"] for step, row in read_metrics(tmp_path / "reference").items()}
    assert got == want and len(got) == 6, (fault, got, want)


def test_restarts_spent_and_a_group_that_cannot_form_end_in_one_line_each(tmp_path):
    """``--max_restarts 1``; start 0: rank 1 killed at step 3 (restart line); start 1: rank 1
    hangs before joining its group (``hang@0``), so rank 0 ends within
    ``comm.init_timeout_seconds`` with one line naming rank 1, and the restart being spent the
    launcher gives up in one line naming *that* start's failure (rank 0's exit 3 before its
    first step), not the first one."""
    fault = "kill@3:rank=1:restart=0,hang@0:rank=1:restart=1"
    run = launch(2, "--max_restarts", "1", *DRILL, "--comm.init_timeout_seconds", "15",
                 "--job.dump_folder", str(tmp_path), "--debug.fault", fault)  # fmt: skip
    out, story = run.stdout + run.stderr, _explain(run, tmp_path, fault)
    assert run.returncode == 3, story
    assert _restart_lines(out) == ["restart 1/1: rank 1 died (SIGKILL) at step 3; resuming from step-2"], story
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: the workers' start after restart 1 could not form its group: rank 1 of 2 did not join within "
        "comm.init_timeout_seconds = 15 s (hung or gone while starting: see its output); rank 0 waited"
    ], story
    ends = [line for line in out.splitlines() if line.startswith("gave up")]
    assert ends == [
        "gave up after 1 restart: rank 0 exited with code 3 before its first step; the newest checkpoint is step-2 "
        "(its output is above)"
    ], story
    assert "Traceback" not in out and "[W" not in out, story


def _alive(pid: int) -> bool:
    """Running: not gone, not a zombie (an orphan's zombie waits for a reaper that may never
    come in a container, and is dead all the same)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_killed_launcher_takes_its_workers_with_it(tmp_path):
    """Once its 2 workers train (step 1 of 50 printed), the launcher is SIGKILLed: both workers
    are gone within 10 s (measured: 0.1-0.2 s). Negative control, by hand: without
    ``die_with_launcher`` in train.py they were still training 20 s later (step 21, orphaned)."""
    cmd = [sys.executable, "train.py", "--nproc_per_node", "2", "--max_restarts", "1", *DRILL,
           "--training.steps", "50", "--job.dump_folder", str(tmp_path)]  # fmt: skip
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(), start_new_session=True
    )
    workers, lines = [], []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.split()[:2] == ["step", "1/50"]:
                break
        workers = [pid for pid in _descendants(proc.pid) if _rank_of(pid) is not None]
        assert len(workers) == 2, (workers, "".join(lines))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        killed, deadline = time.monotonic(), time.monotonic() + 10
        while any(map(_alive, workers)) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = [pid for pid in workers if _alive(pid)]
        assert not left, f"workers {left} outlived their launcher by {time.monotonic() - killed:.1f} s"
    finally:
        _kill_job(proc)
        for pid in workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_workers_start_no_process_of_their_own(tmp_path):
    """2 processes under ``--max_restarts 1``, 4 steps, checkpoints every 2 steps written in the
    background (``checkpoint.async_mode = async``: a thread; the other kinds of process a
    worker could start in torch, DataLoader workers, a checkpoint process, inductor's compile
    workers, are absent or refused here: docs/long_runs.md). Every worker runs the audit hook of
    tests/e2e/fork_audit/sitecustomize.py: each rank notes that it loaded it (so the test is not
    vacuous) and nothing else: no fork, no exec, no spawned interpreter. Negative controls: the
    same hook in a plain interpreter that runs ``subprocess.run(["true"])`` notes it (below); by
    hand, ``--compile.enable true`` notes the compiler processes inductor starts (g++, ``python
    -c`` probes)."""
    audit = tmp_path / "audit.log"
    env = {**_env(), "PYTHONPATH": str(ROOT / "tests/e2e/fork_audit"), "MESHTRAIN_FORK_AUDIT": str(audit)}
    probe = subprocess.run([sys.executable, "-c", "import subprocess; subprocess.run(['true'])"],
                           env={**env, "RANK": "7"}, capture_output=True, text=True)  # fmt: skip
    assert probe.returncode == 0, probe.stderr
    noted = audit.read_text().splitlines()
    assert [line.split()[4] for line in noted] == ["loaded", "subprocess.Popen", "_posixsubprocess.fork_exec"], noted
    audit.unlink()

    args = [
        *DRILL,
        "--training.steps",
        "4",
        "--checkpoint.async_mode",
        "async",
        "--job.dump_folder",
        str(tmp_path / "run"),
    ]
    cmd = [sys.executable, "train.py", "--nproc_per_node", "2", "--max_restarts", "1", *args]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "saved checkpoint" in run.stdout + run.stderr and (tmp_path / "run/checkpoint/step-4").is_dir(), run.stdout
    noted = audit.read_text().splitlines()
    assert sorted((line.split()[1], line.split()[4]) for line in noted) == [("0", "loaded"), ("1", "loaded")], noted


SPAWNING_WORKER = """import os, sys, time
from trainer.lifecycle.parent_death import die_with_launcher

die_with_launcher()  # as train.py's top does: it runs again, as __mp_main__, in a spawned child
if __name__ == "__main__":
    import multiprocessing as mp

    child = mp.get_context("spawn").Process(target=time.sleep, args=(60,))
    child.start()
    print(child.pid, flush=True)
    time.sleep(60)
"""


def test_a_spawned_child_of_a_worker_lives_with_it_and_dies_with_it(tmp_path):
    """A worker of an elastic agent (this test stands for the agent: ``TORCHELASTIC_RUN_ID`` and
    ``MESHTRAIN_LAUNCHER_PID`` set to its pid) starts a child with multiprocessing's spawn, as
    torch's checkpoint process of ``checkpoint.async_mode = async_with_pinned_mem`` is started;
    the child runs the worker's main module (train.py's top) again. It must (1) live on: before
    the fix the launcher check took the worker for a launcher that was gone and the child ended
    at once (``error: the launcher (pid ...) ended before rank ? started``), which would fail
    every such save under the launcher; (2) end within seconds of a SIGKILLed worker, with one
    line (measured: 0.5 s; before the fix, torch's checkpoint process outlived its SIGKILLed
    rank by 10+ minutes, orphaned: docs/long_runs.md)."""
    script = tmp_path / "worker.py"
    script.write_text(SPAWNING_WORKER)
    env = {
        **_env(),
        "PYTHONPATH": str(ROOT),
        "TORCHELASTIC_RUN_ID": "drill",
        "MESHTRAIN_LAUNCHER_PID": str(os.getpid()),
    }
    worker = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    child = None
    try:
        child = int(worker.stdout.readline())
        time.sleep(1.5)  # the launcher check runs at the child's start; the watcher's period is 0.5 s
        assert _alive(child), f"the spawned child ended on its own: {worker.stderr.read() if worker.poll() else ''}"
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait()
        killed, deadline = time.monotonic(), time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child), f"the spawned child outlived its worker by {time.monotonic() - killed:.1f} s"
        lines = worker.stderr.read().splitlines()  # the child's stderr is the worker's: closed once both ended
        assert lines == [f"error: rank ? (pid {worker.pid}) ended; its child process {child} ends with it"], lines
    finally:
        for pid in (worker.pid, child):
            if pid is not None and _alive(pid):
                os.kill(pid, signal.SIGKILL)
        worker.wait()
