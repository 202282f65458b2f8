"""Local ranks forked from a server that imported torch and the trainer once.

Two uses, one forkserver:

* :func:`run_distributed`: a function on N CPU processes over gloo (the tier-2 tests and the
  benchmarks). A failing rank's traceback is re-raised in the caller, a hang is cut off by
  ``timeout``.
* :func:`run_train` / :func:`start_train`: ``train.py`` itself on N ranks of one host, what
  ``torchrun --standalone --nproc_per_node=N train.py ...`` runs, with the launch cost paid
  once (``python -m tools.compare_loss --launcher fork`` and the end-to-end tests use it). Each
  rank runs the very ``train.py`` (its ``__main__``, its exit through trainer/lifecycle/shutdown.py) with
  the environment torchrun would give it (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
  ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` of a rendezvous store the caller hosts as
  torchrun's agent does, ``OMP_NUM_THREADS=1`` for N > 1 unless set), in the caller's working
  directory, writing to the file descriptors it is given.

Why: a rank started by torchrun is a new interpreter that imports torch, the trainer and (at its
first optimizer step) torch._dynamo, about 1.5 CPU seconds before its first line of work; the
launcher itself imports torch too. On the 2 cores of a CI host that is most of a short run
(measured: llama3 tp=2 x fsdp=2, 3 steps, 13.6 CPU s under torchrun). A child of the forkserver
starts with all of it imported (preloaded in the server, which starts no thread and runs no
torch op but, under an ATen build below AVX-512, the one-thread probe of the models' CPU flash
attention guard, parallel_dims/torch_compat.py; so forking it is safe).

What a forked rank does NOT share with a torchrun worker: torchrun's supervision (its
rendezvous, restarts, its failure summary and exit code 1 for any failed worker: here the
first failing rank's own exit code is returned and the other ranks are stopped), a fresh
interpreter (anything set up at interpreter start, such as a ``sitecustomize`` on
``PYTHONPATH`` or ``PYTHONHASHSEED``, is the server's), and the process tree (the ranks are
children of the forkserver, not of the caller). Tests about those things use torchrun.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import runpy
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing import reduction
from multiprocessing.connection import wait as wait_for_any
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TRAIN_PY = ROOT / "train.py"

_CTX = None
RANKS_STARTED = 0  # processes this launcher forked, for the test suite's cost table (tests/suite_budget.py)
RUN_LOG = "MESHTRAIN_RUN_LOG"  # a JSON-lines file: every launch's script, argv and environment (log_run)


def log_run(kind: str, nproc: int, script: str, argv: list[str], env: dict[str, str] | None) -> None:
    """Append one launch to the file ``MESHTRAIN_RUN_LOG`` names, if set: the launcher kind, the
    test running it (pytest's ``PYTEST_CURRENT_TEST``), ``nproc``, the script, its argv and the
    environment entries that differ from this process's own; each forked train.py rank adds, at
    its exit, the modules it imported after the fork (``kind`` "rank_imports"). How identical
    runs across tests were looked for (docs/testing.md, "The budget"); no effect without the
    variable."""
    path = os.environ.get(RUN_LOG)
    if not path:
        return
    import json

    env = dict(os.environ if env is None else env)
    diff = {k: v for k, v in env.items() if os.environ.get(k) != v}
    diff.update({k: None for k in os.environ if k not in env})
    record = {
        "kind": kind,
        "test": os.environ.get("PYTEST_CURRENT_TEST", ""),
        "nproc": nproc,
        "script": str(script),
        "argv": [str(a) for a in argv],
        "env": diff,
    }
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def _context():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        # everything a rank imports, paid once in the server instead of once per rank, with the
        # garbage collector paused and the result frozen (tools/forkserver_preload.py)
        _CTX.set_forkserver_preload(["tools.forkserver_preload"])
    return _CTX


def start_server() -> None:
    """Start this process's forkserver now (with its preloaded imports) if it has none: a caller
    that will run a tool in-process, such as the comparison tool, keeps the server that tool
    would otherwise start and stop for itself."""
    from multiprocessing import forkserver

    _context()  # the preload list
    forkserver.ensure_running()


def server_running() -> bool:
    """Whether this process has a live forkserver (one a launch started and nothing stopped)."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    return getattr(server, "_forkserver_pid", None) is not None


def stop_server() -> None:
    """End this process's forkserver, if it started one, and wait for it. The server reaps the
    ranks it forked, so their CPU time is this process's children's (``RUSAGE_CHILDREN``) only
    once the server itself has been waited for; and no server outlives a tool that used it.
    The next launch starts a new server."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    stop = getattr(server, "_stop", None)  # CPython's own (3.8+; its test suite uses it)
    if stop is not None and getattr(server, "_forkserver_pid", None) is not None:
        stop()


def _job_store(world_size: int, timeout: float = 300.0):
    """The rendezvous store of one launch, hosted here, as torchrun's agent hosts it: a TCPStore
    bound to a port the kernel picks (port 0), so two launches at once can never pick the same
    port (probing a free port and letting rank 0 bind it later can: seen as a job whose ranks
    met another job's ranks and waited out the timeout). The ranks connect to it as clients
    (``TORCHELASTIC_USE_AGENT_STORE``, torchrun's own switch). Keep it alive until the job ends."""
    import datetime

    from torch.distributed import TCPStore

    return TCPStore(
        "127.0.0.1",
        0,
        world_size,
        is_master=True,
        timeout=datetime.timedelta(seconds=timeout),
        wait_for_workers=False,
    )


# the environment that makes init_process_group's env:// rendezvous use the store above
def _store_env(store) -> dict[str, str]:
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}


def _worker(fn, rank, world_size, port, args, queue, env):
    os.environ.update(env)  # MASTER_ADDR, MASTER_PORT and the store switch among them (_store_env)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        queue.put((rank, True, result))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 300.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the per-rank
    results in rank order. ``fn`` and ``args`` must be picklable (module-level function)."""
    log_run("distributed", world_size, f"{fn.__module__}.{fn.__qualname__}", [repr(a) for a in args], env)
    ctx = _context()
    queue = ctx.Queue()
    store = _job_store(world_size, timeout)
    env = {**(env or {}), **_store_env(store)}
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world_size, store.port, args, queue, env)) for r in range(world_size)
    ]
    global RANKS_STARTED
    for p in procs:
        p.start()
    RANKS_STARTED += len(procs)
    results: dict[int, Any] = {}
    failures: list[str] = []
    try:
        for _ in range(world_size):
            rank, ok, payload = queue.get(timeout=timeout)
            if ok:
                results[rank] = payload
            else:
                failures.append(f"--- rank {rank} ---\n{payload}")
                break  # the other ranks are likely stuck in a collective
    except Exception as exc:  # queue.Empty on timeout
        failures.append(f"timed out after {timeout}s waiting for ranks: {exc!r}")
    finally:
        for p in procs:
            if failures:
                p.kill()
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if failures:
        raise RuntimeError("distributed test failed:\n" + "\n".join(failures))
    return [results[r] for r in range(world_size)]


# ------------------------------------------------------------------ train.py on forked ranks


class _InheritedFd:
    """A file descriptor handed to a forkserver child (sent over the server's socket while the
    child is spawned, like multiprocessing's own connections); ``int`` in the child."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return (_InheritedFd._detach, (reduction.DupFd(self.fd),))

    @staticmethod
    def _detach(dup) -> int:
        return dup.detach()


def whole_lines(stream) -> None:
    """Make a rank's text stream hand each line to its file descriptor in one write. The ranks
    of a job share one pipe per stream, so a line written in two pieces can have another rank's
    line land between them. That is what an interpreter started with ``PYTHONUNBUFFERED=1`` (set
    in the environment this project's CI runs in, and inherited by the server) does: its streams write through to an
    unbuffered file, and ``print`` writes the text and the newline separately (seen: a
    ``"rank 0 on stderr"`` line torn by rank 1's under load). Buffered up to each newline
    instead, a line reaches the pipe in one ``write`` (atomic on a pipe up to ``PIPE_BUF``, 4096
    bytes; longer lines can still interleave)."""
    stream.reconfigure(line_buffering=True, write_through=False)


def _train_rank(script: str, argv: list[str], env: dict[str, str], cwd: str, stdout_fd: int, stderr_fd: int) -> None:
    """One rank: the caller's environment and directory, its output on the given descriptors,
    then ``script`` as ``python script argv`` runs it (train.py ends the process itself,
    through trainer/lifecycle/shutdown.py; a script that returns exits 0, ``SystemExit`` gives its code,
    an uncaught exception prints its traceback and exits 1)."""
    os.dup2(stdout_fd, 1)
    os.dup2(stderr_fd, 2)
    for fd in {stdout_fd, stderr_fd} - {1, 2}:
        os.close(fd)
    whole_lines(sys.stdout)
    whole_lines(sys.stderr)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    if "OMP_NUM_THREADS" in env:  # read by the OpenMP runtime when it starts: too late in a fork
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    sys.argv = [script, *argv]
    if env.get(RUN_LOG):
        _log_imports_at_exit(env[RUN_LOG], argv)
    from trainer.lifecycle.shutdown import run_and_exit

    def main() -> None:
        runpy.run_path(script, run_name="__main__")

    run_and_exit(main)


def _log_imports_at_exit(path: str, argv: list[str]) -> None:
    """At this rank's exit (train.py runs the atexit handlers before ``os._exit``), append the
    modules it imported after the fork to the run log: what tools/forkserver_preload.py could
    import once instead (how the float8 ranks' imports were found, issue 49)."""
    import atexit
    import json

    before = set(sys.modules)

    def write() -> None:
        record = {"kind": "rank_imports", "rank": os.environ.get("RANK"), "argv": argv}
        record["modules"] = sorted(set(sys.modules) - before)
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")

    atexit.register(write)


class ForkedTrain:
    """``train.py`` running on ``nproc`` forked ranks (see the module docstring). ``wait``
    gives the job's exit code: 0 when every rank exited 0, else the first failing rank's code
    (negative: the signal that ended it) after the other ranks were stopped."""

    def __init__(
        self,
        nproc: int,
        argv: list[str],
        *,
        stdout_fd: int,
        stderr_fd: int,
        env: dict[str, str] | None = None,
        cwd: str | os.PathLike | None = None,
        script: str | os.PathLike = TRAIN_PY,
    ):
        global RANKS_STARTED
        log_run("fork", nproc, str(script), list(argv), env)
        ctx = _context()
        base = dict(os.environ if env is None else env)
        if nproc > 1:
            base.setdefault("OMP_NUM_THREADS", "1")  # what torchrun does for N > 1
        self.store = _job_store(nproc)  # dropped when this object is: keep the handle until the job ends
        base.update(_store_env(self.store))
        self.procs: list = []
        self.returncode: int | None = None
        try:
            self._start(ctx, nproc, argv, base, stdout_fd, stderr_fd, cwd, script)
        except BaseException:
            self.stop(grace=2.0)
            raise
        RANKS_STARTED += nproc

    def _start(self, ctx, nproc, argv, base, stdout_fd, stderr_fd, cwd, script) -> None:
        for rank in range(nproc):
            rank_env = dict(
                base,
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                GROUP_RANK="0",
                WORLD_SIZE=str(nproc),
                LOCAL_WORLD_SIZE=str(nproc),
            )
            fds = (_InheritedFd(stdout_fd), _InheritedFd(stderr_fd))
            args = (str(script), list(argv), rank_env, str(cwd or os.getcwd()), *fds)
            proc = ctx.Process(target=_train_rank, args=args, name=f"train-rank{rank}")
            proc.start()
            self.procs.append(proc)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        codes = [p.exitcode for p in self.procs]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            self.stop()
            self.returncode = failed[0]
        elif all(c == 0 for c in codes):
            self.returncode = 0
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """The job's exit code; raises ``subprocess.TimeoutExpired`` (ranks left running) after
        ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        sentinels = {p.sentinel: p for p in self.procs}
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"train.py on {len(self.procs)} forked ranks", timeout)
            live = [s for s, p in sentinels.items() if p.exitcode is None]
            if not live:
                # every rank ended between poll() and here: poll again (waiting on no sentinel
                # would sleep out the whole timeout)
                continue
            wait_for_any(live, timeout=left)
        return self.returncode

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM every live rank, SIGKILL what is left after ``grace`` seconds (torchrun's
        teardown of the other workers after one failed)."""
        live = [p for p in self.procs if p.pid is not None and p.exitcode is None]
        for p in live:
            p.terminate()
        deadline = time.monotonic() + grace
        for p in live:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.exitcode is None:
                p.kill()
                p.join()


def _drain(fd: int, chunks: list[bytes]) -> threading.Thread:
    def read() -> None:
        with open(fd, "rb", closefd=True) as f:
            while block := f.read1(65536):
                chunks.append(block)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def run_train(
    nproc: int,
    argv: list[str],
    *,
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    timeout: float | None = None,
    script: str | os.PathLike = TRAIN_PY,
) -> subprocess.CompletedProcess:
    """``train.py argv`` on ``nproc`` forked ranks: what ``subprocess.run`` of the torchrun
    command (or of ``python train.py`` for one rank) gives, with ``capture_output=True,
    text=True``: every rank's stdout and stderr, and the job's exit code (:class:`ForkedTrain`).
    A timeout stops the ranks and raises ``subprocess.TimeoutExpired``."""
    (out_r, out_w), (err_r, err_w) = os.pipe(), os.pipe()
    out, err = [], []
    readers = [_drain(out_r, out), _drain(err_r, err)]
    try:
        job = ForkedTrain(nproc, argv, stdout_fd=out_w, stderr_fd=err_w, env=env, cwd=cwd, script=script)
    finally:
        os.close(out_w)  # the ranks hold their own copies: EOF once every rank has exited
        os.close(err_w)
    try:
        code = job.wait(timeout)
    except BaseException:
        job.stop(grace=2.0)
        raise
    finally:
        for thread in readers:
            thread.join(timeout=30)
    cmd = [str(script), *argv]
    stdout, stderr = (b"".join(c).decode(errors="replace") for c in (out, err))
    return subprocess.CompletedProcess(cmd, code, stdout, stderr)


__all__ = ["ForkedTrain", "run_distributed", "run_train", "server_running", "start_server", "stop_server"]
