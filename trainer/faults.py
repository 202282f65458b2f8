"""Faults injected on purpose, so a user (and the tests) can rehearse a failure on their own
cluster: ``--debug.fault "nan_loss@5"``, ``"kill@7:rank=2"``, ``"hang@4:rank=1"``,
``"slow:rank=3:factor=2"`` (docs/long_runs.md).

A spec is ``KIND[@STEP][:key=value...]``; several are comma-separated (a TOML array in a config
file). ``STEP`` is the training step as the log counts it (1 = the first step); ``rank`` the
global rank (default: every rank); ``restart`` the workers' start it fires in (0: the first,
1: after the first automatic restart, ...; default: every start, so ``kill@7`` under
``--max_restarts K`` fires again in each start: the restarts are used up). The kinds:

``nan_loss@STEP``  the step's loss and this rank's gradients become NaN after the backward (the
                   whole step is then non-finite: ``training.on_nonfinite`` decides what happens).
                   Fires once: a step redone after a rollback is clean, as a transient fault is.
``kill@STEP``      the rank SIGKILLs itself as the step starts (a dead process, nothing flushed).
``hang@STEP``      the rank stops in a sleep as the step starts (a hung process; the step
                   watchdog, trainer/runtime/comm_watchdog.py, ends the job). ``hang@0``: in a
                   restarted start (``restart=N``, N >= 1), before the rank joins its group
                   (the others end within ``comm.init_timeout_seconds`` naming it).
``slow``           every step (from ``@STEP``, default 1) the rank sleeps ``factor - 1`` times its
                   own step time (``factor`` > 1, required) after its step: a rank ``factor`` times
                   slower, which trainer/reporting/stragglers.py names.

Parsing (trainer/config/long_run_specs.py) is strict: an unknown kind, key or a bad value is a :class:`ConfigError` (one line, exit
2). This is not trainer/checkpoint/drill.py's ``MESHTRAIN_CHECKPOINT_DRILL``: those are holding
points inside a save for tests that kill a process at an exact state, set by an environment
variable and never by a user; these are a documented config option that changes what a run does.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time

import torch

from trainer.config.long_run_specs import Fault, parse_faults

__all__ = ["Faults", "before_joining"]


def _start() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)  # the elastic agent's


def _this_start(specs: list[str], world_size: int) -> list[Fault]:
    """The faults due in this start of the workers. A rank outside the job is refused for these
    only: after a lost node (--nnodes MIN:MAX) a fault meant for the first start may name a rank
    the smaller world lacks."""
    parse_faults(specs)  # every spec well-formed
    start = _start()
    now = [s for s in specs if s.strip() and parse_faults([s])[0].restart in (None, start)]
    return parse_faults(now, world_size)


def before_joining(specs: list[str], rank: int, world_size: int) -> None:
    """A restarted worker, before it joins its group: a due ``hang@0`` hangs it there."""
    for f in _this_start(specs, world_size):
        if f.kind == "hang" and f.step == 0 and f.rank in (None, rank):
            print(f"debug.fault: hang before joining the group on rank {rank}: hanging", file=sys.stderr, flush=True)
            while True:
                time.sleep(60)


class Faults:
    """The faults of this rank, fired by the training loop's hooks."""

    def __init__(self, specs: list[str], rank: int, world_size: int):
        self.rank = rank
        self.faults = [f for f in _this_start(specs, world_size) if f.rank is None or f.rank == rank]
        self._fired: set[Fault] = set()

    def _announce(self, fault: Fault, step: int, what: str) -> None:
        print(f"debug.fault: {fault.kind} at step {step} on rank {self.rank}: {what}", file=sys.stderr, flush=True)

    def step_start(self, step: int) -> None:
        """As step ``step`` starts: the kill and hang faults due now."""
        for f in self.faults:
            if f.step != step or f in self._fired:
                continue
            if f.kind == "kill":
                self._announce(f, step, "SIGKILL")
                os.kill(os.getpid(), signal.SIGKILL)
            elif f.kind == "hang":
                self._fired.add(f)
                self._announce(f, step, "hanging (the step watchdog ends the job)")
                while True:
                    time.sleep(60)

    def poison(self, step: int, loss_sum: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
        """After the backward of ``step``: a due ``nan_loss`` makes this rank's gradients and loss
        NaN (once); returns the loss to use."""
        for f in self.faults:
            if f.kind == "nan_loss" and f.step == step and f not in self._fired:
                self._fired.add(f)
                self._announce(f, step, "loss and gradients set to NaN")
                for p in params:
                    if p.grad is not None:
                        p.grad.fill_(math.nan)
                return loss_sum * math.nan
        return loss_sum

    def slow(self, step: int, step_s: float) -> float:
        """After ``step`` took this rank ``step_s`` seconds: a due ``slow`` fault sleeps
        ``factor - 1`` times that; returns the seconds slept."""
        extra = sum((f.factor - 1) * step_s for f in self.faults if f.kind == "slow" and step >= (f.step or 1))
        if extra > 0:
            time.sleep(extra)
        return extra
