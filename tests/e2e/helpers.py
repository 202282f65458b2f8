"""Run train.py for real and read what it wrote.

Two ways to start a run, for two kinds of property:

* ``run_train`` / ``Job``: torchrun (``python train.py`` for one process), exactly as users
  launch it. For what involves the launcher or the processes themselves: exit codes and what
  reaches stderr under torchrun, kills, hangs, signals, interpreter start-up (a
  ``sitecustomize`` on PYTHONPATH).
* ``run_forked``: the same train.py on ranks forked from a server that imported torch and the
  trainer once (tools/forkserver.py), 1.5 CPU seconds less per rank and no torchrun process. For
  the math (layouts, resume, data, numerics), where the launcher is not part of the claim.
  tests/e2e/test_launcher.py proves a forked run is bitwise the torchrun run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Small enough for CI on 2 cores, big enough to learn something.
FAST = [
    "--training.seq_len",
    "64",
    "--training.global_batch_size",
    "8",
    "--training.local_batch_size",
    "2",
    "--metrics.log_freq",
    "1",
    "--metrics.enable_tensorboard",
    "false",
]


def _env():
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def train_cmd(nproc: int, *args: str) -> list[str]:
    if nproc == 1:
        return [sys.executable, "train.py", *args]
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    return [torchrun, "--standalone", f"--nproc_per_node={nproc}", "train.py", *args]


def run_train(nproc: int, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    from tools.forkserver import log_run

    log_run("torchrun", nproc, "train.py", list(args), _env())
    return subprocess.run(
        train_cmd(nproc, *args), cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=_env()
    )


def run_forked(nproc: int, *args: str, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """``run_train`` on forked ranks (module docstring): the same stdout, stderr and metrics; the
    exit code is the first failing rank's own (torchrun reports 1 for any failure)."""
    from tools.forkserver import run_train as run_train_forked

    return run_train_forked(nproc, list(args), env=env or _env(), cwd=ROOT, timeout=timeout)


def run_compare_loss(*args: str) -> subprocess.CompletedProcess:
    """``python -m tools.compare_loss ARGS --launcher fork`` run in this process: what the tool
    prints captured as a subprocess's output would be, its layouts' ranks forked from this
    worker's launcher server (started here if there is none, and left running for the next
    forked run). That saves the tool's own interpreter, torch import and server (~5 CPU s a
    call). For the comparisons whose claim is the math; tests/e2e/test_compare_loss.py proves
    the tool as a process (its entry point, exit codes, torchrun launcher). With
    ``--comm-mode local_tensor`` the tool starts each layout's one ``python train.py`` itself
    (it refuses ``--launcher fork`` there), and no server is needed."""
    import contextlib
    import io

    from tools.compare_loss.cli import main
    from tools.forkserver import server_running, start_server

    local = "--comm-mode" in args and args[args.index("--comm-mode") + 1] == "local_tensor"
    fork = "--launcher" in args and args[args.index("--launcher") + 1] == "fork"
    assert fork or local, "in-process runs fork their ranks (or simulate them in one train.py)"
    if fork:
        start_server()
    running = server_running()
    out, err = io.StringIO(), io.StringIO()
    cwd = os.getcwd()
    os.chdir(ROOT)  # the tool resolves its paths as `python -m` from the repository does
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as exc:  # argparse's own errors
                code = exc.code if isinstance(exc.code, int) else 2
    finally:
        os.chdir(cwd)
    assert server_running() == running, "the tool stopped its caller's launcher server"  # it stops only its own
    return subprocess.CompletedProcess(["tools.compare_loss", *args], code, out.getvalue(), err.getvalue())


# ------------------------------------------------------------------ processes via /proc
#
# torchrun starts every worker with start_new_session=True, so killing torchrun's process
# group leaves the workers running (they even finish the run if their stdout pipe stays
# open). A crash test must find the workers and kill them itself.


def _stat(pid: int) -> dict | None:
    """Fields of /proc/<pid>/stat, or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    rest = text[text.rindex(")") + 2 :].split()  # comm may hold spaces and parentheses
    return {"state": rest[0], "ppid": int(rest[1]), "pgrp": int(rest[2]), "starttime": int(rest[19])}


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process on the machine."""
    parents = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st is not None:
                parents[int(name)] = st["ppid"]
    return parents


def _descendants(pid: int) -> list[int]:
    parents = _parents()
    found, frontier = [], {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier}
        found += sorted(frontier)
    return found


def _rank_of(pid: int) -> int | None:
    """The RANK torchrun gave this process (None for anything that is not a worker)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"RANK="):
            return int(item[5:])
    return None


def _is_dead(pid: int, starttime: int) -> bool:
    """Exited: no /proc entry, the pid now names another process, or a zombie whose threads
    have all exited (a zombie holds no memory, files or sockets; only its exit status)."""
    st = _stat(pid)
    if st is None or st["starttime"] != starttime:
        return True
    if st["state"] not in "ZX":
        return False
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return True
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                text = f.read()
        except OSError:
            continue
        if text[text.rindex(")") + 2] not in "ZX":
            return False
    return True


class Job:
    """train.py started in the background (in its own session), its output drained by a
    thread, and its worker processes visible, so that a test can crash it for real."""

    def __init__(self, nproc: int, *args: str, env: dict | None = None):
        from tools.forkserver import log_run

        self.nproc = nproc
        log_run("torchrun", nproc, "train.py", list(args), env or _env())
        self.proc = subprocess.Popen(
            train_cmd(nproc, *args),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env or _env(),
            start_new_session=True,
        )
        self._start_reader(self.proc.stdout)

    def _start_reader(self, stream) -> None:
        self._stream = stream
        self._lines: list[str] = []
        self._changed = threading.Condition()
        self._eof = False
        self._finished = False  # every process of the job is gone and the output read
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self._stream:
            with self._changed:
                self._lines.append(line)
                self._changed.notify_all()
        with self._changed:
            self._eof = True
            self._changed.notify_all()

    @property
    def output(self) -> str:
        with self._changed:
            return "".join(self._lines)

    def wait_for_output(self, marker: str, timeout: float) -> bool:
        """True as soon as a line holding ``marker`` was printed; False if the output ended
        (the job exited) or ``timeout`` passed first."""
        deadline = time.monotonic() + timeout
        checked = 0
        with self._changed:
            while True:
                if any(marker in line for line in self._lines[checked:]):
                    return True
                checked = len(self._lines)
                left = deadline - time.monotonic()
                if self._eof or left <= 0:
                    return False
                self._changed.wait(left)

    def poll(self) -> int | None:
        """The launcher's exit code once it ended, else None."""
        return self.proc.poll()

    def workers(self) -> dict[int, int]:
        """rank -> pid of every live worker. With torchrun they are its children (each in a
        session of its own); a 1-process run is its own worker. Asserts there are nproc."""
        if self.nproc == 1:
            candidates = [self.proc.pid]
        else:
            candidates = [p for p, pp in _parents().items() if pp == self.proc.pid]
        found = {}
        for pid in candidates:
            st = _stat(pid)
            rank = 0 if self.nproc == 1 else _rank_of(pid)
            if st is not None and st["state"] not in "ZX" and rank is not None:
                found[rank] = pid
        assert sorted(found) == list(range(self.nproc)), (
            f"expected {self.nproc} live workers (ranks 0..{self.nproc - 1}) under pid {self.proc.pid}, "
            f"found {found}:\n{self.output[-3000:]}"
        )
        return found

    def _tree(self) -> dict[int, int]:
        """pid -> start time of the launcher and everything below it, to recognise them later
        even if their pids are reused."""
        tree = {}
        for pid in [self.proc.pid, *_descendants(self.proc.pid)]:
            st = _stat(pid)
            if st is not None:
                tree[pid] = st["starttime"]
        return tree

    def kill(self, ranks: list[int] | None = None, timeout: float = 120) -> list[int]:
        """SIGKILL the workers of ``ranks`` (default: all), each with its own process group.
        With every rank killed, torchrun is killed too; with some, torchrun is left to notice
        and tear down the rest, as it would after a real crash. Returns the killed pids, once
        every process of the job is gone (see ``_wait_gone``)."""
        workers = self.workers()
        tree = self._tree()
        ranks = sorted(workers) if ranks is None else ranks
        killed = []
        for rank in ranks:
            pid = workers[rank]
            st = _stat(pid)
            assert st is not None and st["state"] not in "ZX", f"rank {rank} (pid {pid}) already ended"
            # a worker leads a process group of its own (its session): kill the group, so that
            # anything the worker started dies with it. Raises if the process is already gone.
            if st["pgrp"] == pid:
                os.killpg(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        if len(ranks) == len(workers):
            # torchrun polls its workers every 0.1 s: give it a moment to reap the dead ones
            # (else they linger as zombies until init reaps them), then kill it too
            deadline = time.monotonic() + 2
            while any(_stat(pid) is not None for pid in killed) and time.monotonic() < deadline:
                time.sleep(0.01)
            self._killpg_launcher()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.close()
            raise AssertionError(
                f"the launcher did not exit within {timeout}s after ranks {ranks} were killed:\n{self.output[-3000:]}"
            ) from None
        self._wait_gone(tree, timeout)
        return killed

    def _killpg_launcher(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _wait_gone(self, tree: dict[int, int], timeout: float) -> None:
        """Until every process of ``tree`` is gone from /proc. A zombie has exited and holds
        nothing (no memory, files or sockets), so zombies are only waited for a while, for
        init to reap them; a process still running after ``timeout`` fails the test."""
        start = time.monotonic()
        while True:
            alive = [pid for pid, t in tree.items() if not _is_dead(pid, t)]
            listed = [pid for pid, t in tree.items() if (_stat(pid) or {}).get("starttime") == t]
            now = time.monotonic()
            if not alive and (not listed or now - start > 10):
                break
            if now - start > timeout:
                raise AssertionError(f"processes {alive} of the job still run {timeout}s after the kill")
            time.sleep(0.01)
        self._finish()

    def _finish(self) -> None:
        self._reader.join(timeout=10)  # every writer of the pipe is dead: the output is complete
        self.proc.stdout.close()
        self._finished = True

    def close(self) -> None:
        """Cleanup, without assertions: kill whatever is left of the job (workers first)."""
        if self._finished:
            return
        if self.proc.poll() is None:  # not reaped yet, so its pid still names the launcher
            tree = self._tree()
            for pid in tree:
                if pid != self.proc.pid:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            self._killpg_launcher()
            self.proc.wait()
            self._wait_gone(tree, 60)
        else:  # it ended by itself; torchrun reaps its workers before it exits
            self._finish()


def drill_env(spec: str) -> dict:
    """The run's environment with ``MESHTRAIN_CHECKPOINT_DRILL=spec``: the run holds at that
    state (trainer/checkpoint/drill.py), so a test that kills or stops it waits for a state,
    never for a time, and finds it there however slow the machine is."""
    return dict(_env(), MESHTRAIN_CHECKPOINT_DRILL=spec)


def run_until(nproc: int, marker: str, *args: str, hold: str, timeout: float = 600, forked: bool = False) -> str:
    """Start a run and, as soon as ``marker`` appears in its output, SIGKILL every one of its
    nproc workers and then torchrun (a crash, not a clean exit); return once all of them are
    gone, with the output so far. ``hold``: the drill point where the run waits to be killed
    (``begin:@N``: before the save of step N), after ``marker`` is printed, so the kill always
    finds every worker alive and no later state on disk. ``forked``: the run on forked ranks
    (``ForkedJob``), killed the same way, for a claim about what the trainer left on disk."""
    job = (ForkedJob if forked else Job)(nproc, *args, env=drill_env(hold))
    try:
        if job.wait_for_output(marker, timeout):
            killed = job.kill()
            assert len(killed) == nproc, f"killed {killed}, expected {nproc} workers"
    finally:
        job.close()
    out = job.output
    assert marker in out, f"run ended before {marker!r}:\n{out[-3000:]}"
    return out


def all_records(folder: str | Path) -> list[dict]:
    """Every record of metrics.jsonl (training steps and evaluations) in the order written."""
    with open(Path(folder) / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def metric_records(folder: str | Path) -> list[dict]:
    """Every training-step record of metrics.jsonl in the order written (a resumed run appends
    to it); evaluation records (``validation_loss``, no ``loss``) are left out."""
    return [rec for rec in all_records(folder) if "loss" in rec]


def validation_records(folder: str | Path) -> dict[int, dict]:
    """step -> the evaluation logged after that training step."""
    return {rec["step"]: rec for rec in all_records(folder) if "validation_loss" in rec}


def read_metrics(folder: str | Path) -> dict[int, dict]:
    """step -> last record written for it (a resumed run appends to the same file)."""
    return {rec["step"]: rec for rec in metric_records(folder)}


class ForkedJob(Job):
    """``run_forked``'s job started in the background (tools/forkserver.py's ForkedTrain), its
    stdout and stderr drained together, for a test that signals the ranks themselves (as a
    scheduler signals every process of a job) or kills them (``kill``: a crash whose claim is
    what the trainer left on disk, not what torchrun does about it). ``wait`` gives the job's
    exit code."""

    def __init__(self, nproc: int, *args: str, env: dict | None = None):
        from tools.forkserver import ForkedTrain

        self.nproc = nproc
        read_fd, write_fd = os.pipe()
        try:
            self.train = ForkedTrain(
                nproc, list(args), stdout_fd=write_fd, stderr_fd=write_fd, env=env or _env(), cwd=ROOT
            )
        finally:
            os.close(write_fd)  # the ranks hold their own copies: EOF once every rank has exited
        self._start_reader(open(read_fd, encoding="utf-8", errors="replace"))

    def workers(self) -> dict[int, int]:
        return dict(enumerate(self.train.pids))

    def poll(self) -> int | None:
        """The job's exit code once it ended (ForkedTrain.poll: a failed rank has the others
        stopped), else None."""
        return self.train.poll()

    def kill(self, ranks: list[int] | None = None, timeout: float = 120) -> list[int]:
        """SIGKILL the ranks ``ranks`` (default: all), as ``Job.kill`` kills torchrun's workers.
        With some killed, the launcher tears down the others as torchrun's agent does after a
        real crash (ForkedTrain.stop: SIGTERM, SIGKILL after its grace). Returns the killed pids
        once every rank has ended and the output is read."""
        procs = self.train.procs
        ranks = list(range(len(procs))) if ranks is None else ranks
        killed = []
        for rank in ranks:
            proc = procs[rank]
            assert proc.exitcode is None, f"rank {rank} (pid {proc.pid}) already ended:\n{self.output[-3000:]}"
            os.kill(proc.pid, signal.SIGKILL)
            killed.append(proc.pid)
        try:
            self.train.wait(timeout)
        except subprocess.TimeoutExpired:
            self.close()
            raise AssertionError(
                f"the ranks did not end within {timeout}s after ranks {ranks} were killed:\n{self.output[-3000:]}"
            ) from None
        self._reader.join(timeout=30)
        return killed

    def signal(self, signum: int, ranks: list[int] | None = None) -> None:
        for rank, pid in self.workers().items():
            if ranks is None or rank in ranks:
                os.kill(pid, signum)

    def wait(self, timeout: float) -> int:
        try:
            return self.train.wait(timeout)
        finally:
            self.train.stop(grace=2.0)
            self._reader.join(timeout=30)

    def close(self) -> None:
        self.train.stop(grace=2.0)
