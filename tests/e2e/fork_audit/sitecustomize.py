"""Loaded by every Python process started with this folder first on ``PYTHONPATH`` (tests/e2e/
test_restarts.py): in a worker of an elastic agent (``RANK`` set), it appends one line to the
file named by ``MESHTRAIN_FORK_AUDIT`` when the process starts (``loaded``) and one for every
process it starts: ``os.fork`` (multiprocessing's fork), ``subprocess.Popen``,
``os.posix_spawn``, ``os.system``, ``os.exec*``, ``os.spawn*`` (audit events) and
``_posixsubprocess.fork_exec`` (what multiprocessing's spawn and forkserver call directly).
A fork made in C (no Python event) is not seen: the strace measurement in docs/long_runs.md
covers those once."""

import os
import sys

_FILE, _RANK = os.environ.get("MESHTRAIN_FORK_AUDIT"), os.environ.get("RANK")
_EVENTS = {"os.fork", "os.forkpty", "subprocess.Popen", "os.posix_spawn", "os.posix_spawnp", "os.system",
           "os.exec", "os.spawn"}  # fmt: skip


def _note(what: str) -> None:
    with open(_FILE, "a") as f:
        f.write(f"rank {_RANK} pid {os.getpid()} {what}\n")


def _hook(event: str, args: tuple) -> None:
    if event in _EVENTS and os.environ.get("RANK") == _RANK:
        _note(f"{event} {str(args)[:200]}")


if _FILE and _RANK is not None:
    import _posixsubprocess

    _fork_exec = _posixsubprocess.fork_exec

    def _audited_fork_exec(*args, **kwargs):
        _note(f"_posixsubprocess.fork_exec {str(args[0])[:200]}")
        return _fork_exec(*args, **kwargs)

    _posixsubprocess.fork_exec = _audited_fork_exec
    sys.addaudithook(_hook)
    _note("loaded")
