"""Stopping a run is part of the run: SIGINT (Ctrl-C) and SIGTERM (how Slurm, Kubernetes and
torchrun end a job) stop every rank at the next step boundary with a checkpoint there.

While the training loop runs, :class:`StopSignals` holds the two signals' handlers. The first
signal is only noted. At the end of every step the ranks agree (:meth:`StopSignals.agreed`, a
max over one int on a gloo group: a rank that got a signal makes every rank stop at that same
step, whichever ranks the signal reached and whenever within the step it came). The trainer
then writes a checkpoint of that step (a synchronous save, or the background one finished),
rank 0 prints one line, ``stopped at step 12 by SIGTERM; checkpoint step-12 saved in
outputs/run/checkpoint; run the same command to resume``, and the process exits with
128 + the signal's number (130 for SIGINT, 143 for SIGTERM), the shell's convention for a
process ended by a signal, so a script that chains commands after training does not carry on
as if the run had finished.

A second signal, at least :data:`REPEAT_WINDOW_S` after the first, stops the process at once:
one line, exit code 128 + that signal, no new checkpoint (a save cut short never gets its final
name: the newest complete checkpoint stays the one to resume from). A second Ctrl-C reaches a
worker as SIGINT when it is signalled directly, and as SIGTERM through torch's elastic agent
(torchrun, trainer/lifecycle/launch.py), which answers a signal during its shutdown by shutting down
again with SIGTERM. Within the window a second signal is the first one arriving again: a
launcher forwards the signal it gets to every worker, so under a terminal's Ctrl-C or ``srun``
a worker may receive the same request twice. Schedulers send one SIGTERM and, after their
grace period, SIGKILL: they never stop a save short.

A step that hangs while stopping is bounded by the step watchdog (trainer/runtime/comm_watchdog.py),
as every step is; the save runs under its long-phase deadline.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

__all__ = ["REPEAT_WINDOW_S", "StopSignals", "exit_code", "stop_group"]

REPEAT_WINDOW_S = 3.0
_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def stop_group(comm, peers: bool) -> dist.ProcessGroup | None:
    """The gloo group the ranks agree over to stop; None without peers. On a gloo job that is
    WORLD; otherwise a host group of every rank (parallel_dims' ``host_group``, created by every
    rank), so the agreement never waits behind the accelerator's queue. ``comm``: the ``[comm]``
    section (the group's timeout is its ``init_timeout_seconds``)."""
    from parallel_dims.process_groups import host_group
    from trainer.runtime.distributed_init import wait_until_every_rank_joined

    if not peers:
        return None
    if dist.get_backend() == "gloo":
        return dist.group.WORLD
    group = host_group("stop_signals", datetime.timedelta(seconds=comm.init_timeout_seconds))
    wait_until_every_rank_joined(group)
    return group


def exit_code(signum: int) -> int:
    """The exit code of a run stopped by ``signum``: 128 + its number."""
    return 128 + int(signum)


class StopSignals:
    """SIGINT and SIGTERM noted while the training loop runs (a context manager; handlers are
    installed only in the main thread, and the previous ones are restored on exit).

    ``group``: the gloo group the ranks agree over (None: one process, nothing to agree);
    ``newest``: a callable giving the newest complete checkpoint's description for the line a
    second SIGINT prints."""

    def __init__(self, group: dist.ProcessGroup | None, newest=lambda: "none", values=None):
        self.group = group
        self.newest = newest
        # ``values``: a callable giving ints that ride on the same all-reduce (max over the ranks),
        # e.g. the data's passes that only each rank's own stripes tell (trainer/reporting/data_progress.py);
        # the agreed ones are in ``agreed_values`` after each :meth:`agreed`
        self.values = values
        self.agreed_values: list[int] = []
        self.signum: int | None = None  # the first signal received
        self._first_at = 0.0
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in _SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        now = time.monotonic()
        if self.signum is None:
            self.signum, self._first_at = signum, now
            return
        if now - self._first_at >= REPEAT_WINDOW_S:
            name = signal.Signals(signum).name
            print(
                f"stopped at once by a second signal ({name}): no checkpoint of this step; the newest "
                f"complete checkpoint is {self.newest()}",
                file=sys.stderr,
                flush=True,
            )
            os._exit(exit_code(signum))

    def agreed(self) -> int | None:
        """Collective (every rank, at the end of every step): the signal every rank stops for
        now (SIGTERM over SIGINT when ranks got different ones), or None to train on."""
        code = 0 if self.signum is None else _SIGNALS.index(self.signum) + 1
        values = list(self.values()) if self.values is not None else []
        if self.group is not None:
            flag = torch.tensor([code, *values], dtype=torch.int32 if not values else torch.int64)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
            code, *values = (int(v) for v in flag.tolist())
        self.agreed_values = values
        return None if code == 0 else int(_SIGNALS[code - 1])
