"""Ctrl-C from the first instant of the launcher and of each worker: one line, exit code 130,
no traceback (issue 50, item 5; trainer/lifecycle/start_signals.py). It used to print 16-80 lines of
interleaved ``KeyboardInterrupt`` tracebacks while torch imported.

Each test waits for a state, never for a time:

* train.py's first line: the process is started with SIGINT blocked (as the launcher starts
  its workers), the signal is sent as soon as the process exists, and it stays pending until
  train.py's first line unblocks it, the earliest point any code of ours runs; for the
  launcher (``python train.py --nproc_per_node 2``) and one process (``python train.py``);
* the launcher importing torch: its memory maps hold libtorch;
* the workers starting: the launcher's children with a RANK exist (whatever they are doing,
  interpreter start included: the launcher starts them with the signal blocked), then the
  terminal's Ctrl-C goes to the launcher, whose agent sends it on to them.

The Ctrl-C of a running job (a stop at a step with a checkpoint) is
tests/e2e/test_train_launcher.py's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from trainer.lifecycle.start_signals import STARTING_LINE

from .helpers import ROOT, _descendants, _env, _rank_of, _stat
from .test_train_launcher import _kill_job

ARGS = ["--config", "llama3.toml", "--model.n_layers", "1", "--training.steps", "2", "--training.seq_len", "32",
        "--training.global_batch_size", "4", "--training.local_batch_size", "2"]  # fmt: skip
# what a process that handled the Ctrl-C says (the phase it was in decides which)
ONE_LINERS = (
    STARTING_LINE,
    "interrupted (SIGINT) before the workers started: nothing to save",
    "interrupted (SIGINT) before training began: nothing to save",
)
DEADLINE = 120.0


def _start(tmp_path, nproc: int | None, blocked: bool) -> subprocess.Popen:
    launcher = ["--nproc_per_node", str(nproc)] if nproc else []
    cmd = [sys.executable, "train.py", *launcher, *ARGS, "--job.dump_folder", str(tmp_path / "run")]

    def block() -> None:  # in the child, before exec: the mask survives exec
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})

    return subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(),
        start_new_session=True, preexec_fn=block if blocked else None,
    )  # fmt: skip


def _wait_for(state, proc: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not state():
        assert proc.poll() is None, f"the job ended before {what}: {proc.communicate()[0][-3000:]}"
        assert time.monotonic() < deadline, f"no {what} after {DEADLINE}s"
        time.sleep(0.005)


def _finish(proc: subprocess.Popen) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=DEADLINE)
    finally:
        _kill_job(proc)  # a job left running after a failed assertion
    return proc.returncode, out


def _one_line(code: int, out: str) -> str:
    lines = [line for line in out.splitlines() if line.strip()]
    assert code == 130 and len(lines) == 1 and lines[0] in ONE_LINERS, (code, out[-3000:])
    return lines[0]


@pytest.mark.parametrize("nproc", [2, None], ids=["launcher", "one_process"])
def test_ctrl_c_at_train_py_first_line(tmp_path, nproc):
    proc = _start(tmp_path, nproc, blocked=True)
    os.kill(proc.pid, signal.SIGINT)  # pending until train.py's first line
    assert _one_line(*_finish(proc)) == STARTING_LINE


def _maps_torch(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/maps") as f:
            return "libtorch" in f.read()
    except OSError:
        return False


def test_ctrl_c_while_the_launcher_imports_torch(tmp_path):
    proc = _start(tmp_path, 2, blocked=False)
    _wait_for(lambda: _maps_torch(proc.pid), proc, "libtorch in the launcher's memory")
    os.kill(proc.pid, signal.SIGINT)
    _one_line(*_finish(proc))


def test_ctrl_c_while_the_workers_start(tmp_path):
    proc = _start(tmp_path, 2, blocked=False)

    def workers() -> bool:
        ranks = set()
        for pid in _descendants(proc.pid):
            st = _stat(pid)
            if st is not None and st["ppid"] == proc.pid:
                ranks.add(_rank_of(pid))
        return ranks == {0, 1}

    _wait_for(workers, proc, "2 workers")
    os.kill(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: to the launcher, which sends it on
    code, out = _finish(proc)
    assert "Traceback" not in out, out[-3000:]
    _one_line(code, out)
