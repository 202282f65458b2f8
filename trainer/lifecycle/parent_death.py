"""A worker ends with its launcher: a launcher SIGKILLed (the OOM killer, a scheduler's hard
kill, ``kill -9``) leaves no orphaned workers.

torch's elastic agent (our launcher, trainer/lifecycle/launch.py, and torchrun) starts each
worker in a session of its own, so a signal to the launcher's process group does not reach
them, and a launcher that is killed outright cannot send them anything: they used to live on,
waiting in their collectives. :func:`die_with_launcher`, run by train.py before its imports,
asks Linux to SIGKILL the worker when its parent, the agent, ends (``PR_SET_PDEATHSIG``). The
worker's newest complete checkpoint is what a new launch resumes from (saves are kill-safe).

Only a worker of an elastic agent (``TORCHELASTIC_RUN_ID`` set) does so: a plain ``python
train.py`` may outlive the shell that started it (``nohup``). Standard library only.

A process a worker starts with multiprocessing's ``spawn`` (torch's checkpoint
process under ``checkpoint.async_mode = async_with_pinned_mem``) runs train.py's top again, as
``__mp_main__``, with the worker's environment: there :func:`die_with_launcher` makes it end with
its *worker* instead (:func:`follow_parent`: its parent is the worker, not the launcher, which
the launcher check would take for a launcher that is gone). Not ``PR_SET_PDEATHSIG``: Linux
sends that when the *thread* that started the child ends, and torch starts its checkpoint
process from the thread of a pool made for one save (torch/distributed/checkpoint/
_async_process_executor.py), while the process serves every later save.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

__all__ = ["LAUNCHER_PID", "die_with_launcher", "follow_parent"]

LAUNCHER_PID = "MESHTRAIN_LAUNCHER_PID"  # the launcher's pid, which its workers' parent must be
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
FOLLOW_PERIOD_S = 0.5  # how often a worker's multiprocessing child looks for its parent


def follow_parent(period_s: float = FOLLOW_PERIOD_S) -> None:
    """In a child a worker started: a daemon thread that ends this process, with one line, within
    ``period_s`` of its parent's end (its parent pid changes when the parent is gone)."""
    import threading
    import time

    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(period_s)
        print(
            f"error: rank {os.environ.get('RANK', '?')} (pid {parent}) ended; its child process {os.getpid()} "
            "ends with it",
            file=sys.stderr,
            flush=True,
        )
        os._exit(128 + signal.SIGKILL)

    threading.Thread(target=watch, name="follow-parent", daemon=True).start()


def die_with_launcher() -> bool:
    """In a worker of an elastic agent on Linux: be SIGKILLed when the agent ends. A worker whose
    launcher already ended before this ran (its parent is no longer the launcher) ends now,
    with one line. Returns whether the guard is set. In a multiprocessing child of a worker
    (spawn: ``--multiprocessing-fork`` on its command line), the child ends with
    the worker instead (:func:`follow_parent`)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return False
    if "--multiprocessing-fork" in getattr(sys, "orig_argv", ()):
        follow_parent()
        return True
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):  # no prctl: the worker runs unguarded, as before
        return False
    expected = os.environ.get(LAUNCHER_PID)
    parent = os.getppid()
    if parent == 1 or (expected is not None and expected != str(parent)):
        print(
            f"error: the launcher (pid {expected or 'unknown'}) ended before rank {os.environ.get('RANK', '?')} "
            "started: nothing to do",
            file=sys.stderr,
            flush=True,
        )
        os._exit(128 + signal.SIGKILL)
    return True
