"""Automatic restarts under ``--max_restarts K`` (docs/long_runs.md, "Automatic restarts").

torch's elastic agent restarts every worker when one fails, up to K times; the workers resume
from the newest complete checkpoint as any run started again with the same command does. This
module adds what the agent leaves out:

* the launcher's side (trainer/lifecycle/launch.py): :func:`restarting_agent` gives the agent
  one line per restart (``restart 1/2: rank 1 died (SIGKILL) at step 5; resuming from step-4``,
  the failure from the agent's result, the step from metrics.jsonl, the checkpoint from the
  run's checkpoint folder), and ends it at once, with no restart, when a worker's failure is
  not one a restart can mend: bad input (exit code 2, the rank printed its ``error:`` line) or
  a stop by SIGINT / SIGTERM (a scheduler ending the job);
* the workers' side is trainer/reporting/restart_row.py: the ``restart`` row a restarted run
  writes to metrics.jsonl before its first step, counting the steps it will do again.

Under plain torchrun the workers resume and write the same row, but torchrun's agent prints no
restart line and restarts on any failure, bad input included.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import typing

from trainer.reporting.restart_row import attempt_progress, metrics_size

__all__ = ["cause", "describe", "restartable", "restarting", "restarting_agent", "where"]

# bad input; a stop (the worker's own exit after SIGINT / SIGTERM, or the signal itself)
NOT_RESTARTED = {2, 128 + signal.SIGINT, 128 + signal.SIGTERM, -signal.SIGINT, -signal.SIGTERM}


def cause(failures: dict):
    """The failure that ended the worker group: ``(rank, failure)`` from ``{rank: failure}``.
    After one rank fails the others end as a consequence (their collectives fail on the gone
    peer: exit code 4; the agent's SIGTERM: 143 or -15), possibly within the same second; so bad input
    (2) first, then any other failure (a bug, a kill), then a stop signal, then a rank whose
    peer was gone; the earliest within each."""
    from trainer.runtime.distributed_init import EXIT_PEER_GONE

    def priority(code: int) -> int:
        if code == 2:
            return 0
        if code == EXIT_PEER_GONE:
            return 3
        # a stop: the worker's own exit after one (128 + the signal) or the signal itself (the
        # agent's SIGTERM to the group's other workers once one failed)
        return 2 if code in NOT_RESTARTED else 1

    return min(failures.items(), key=lambda kv: (priority(kv[1].exitcode), kv[1].timestamp, kv[0]))


def restartable(failures: dict) -> bool:
    """Whether a restart can mend the failure of a worker group, ``{rank: failure}``: decided on
    its :func:`cause` alone. Once one worker fails, torch's agent SIGTERMs the others before it
    reports (its ``PContext`` closes them as it polls), and those that were still running end
    with 143 (their stop handler, trainer/runtime/stop.py) or -15: a consequence, not a stop;
    the group was stopped only when its cause is a stop."""
    return cause(failures)[1].exitcode not in NOT_RESTARTED


def describe(rank: int, failure) -> str:
    """``rank 1 died (SIGKILL)`` or ``rank 1 exited with code 3``."""
    code = failure.exitcode
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else f"signal {-code}"
        return f"rank {rank} died ({name})"
    return f"rank {rank} exited with code {code}"


def _newest_checkpoint(cfg) -> int | None:
    if not cfg.checkpoint.enable:
        return None
    from trainer.checkpoint.dcp import CheckpointFolder

    try:
        return CheckpointFolder(cfg.resolve_path(cfg.checkpoint.folder)).latest_step()
    except Exception:  # an unreadable folder: the workers say why as they resume
        return None


def where(cfg, attempt: int = 0, offset: int = 0, gave_up: bool = False) -> str:
    """``at step 7; resuming from step-6``: where the workers' start ``attempt`` (0: the first)
    was when it failed, from the rows it wrote to metrics.jsonl past byte ``offset`` (the file's
    size as the launch began): the step after its last row (with ``metrics.log_freq`` > 1,
    after its last row), ``before its first step`` when it wrote none (it failed while
    starting: resuming, forming its group); then the newest complete checkpoint, as the
    workers will find it (``gave_up``: as the run leaves it)."""
    started, last = attempt_progress(cfg.job.dump_folder, attempt, offset)
    if not started or last is None:
        at = "before its first step"
    else:
        at = f"at step {last + 1}" if cfg.metrics.log_freq == 1 else f"after step {last}"
    step = _newest_checkpoint(cfg)
    if gave_up:
        return f"{at}; the newest checkpoint is step-{step}" if step is not None else f"{at}; no checkpoint"
    return f"{at}; resuming from step-{step}" if step is not None else f"{at}; no checkpoint: starting from step 0"


def restarting_agent(cfg, base):
    """A subclass of torch's ``LocalElasticAgent`` (``base``) that prints a line per restart
    and restarts no failure in :data:`NOT_RESTARTED`; ``restarts`` counts those it made."""
    from torch.distributed.elastic.agent.server.api import WorkerState

    class RestartingAgent(base):
        restarts = 0  # made so far: the workers' start now running is attempt ``restarts``
        failures: typing.ClassVar[dict] = {}  # the failed attempt's, for its restart line
        offset = metrics_size(cfg.job.dump_folder)  # this launch's rows of metrics.jsonl begin here

        def _monitor_workers(self, worker_group):
            result = super()._monitor_workers(worker_group)
            if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
                type(self).failures = dict(result.failures)  # this attempt's (none: unhealthy)
                if result.failures and not restartable(result.failures):
                    self._remaining_restarts = 0  # the agent stops the others and returns the failure
            return result

        def _restart_workers(self, worker_group):
            # torch's: stop, rendezvous, start; the line once the old workers are gone (a save
            # they finished meanwhile is then the one resumed from). A healthy group is restarted
            # to admit a node waiting to join a node range (--nnodes MIN:MAX): no restart spent
            joining = worker_group.state == WorkerState.HEALTHY
            before = _world(worker_group)
            self._stop_workers(worker_group)
            worker_group.state = WorkerState.STOPPED
            if joining:
                line = (
                    f"a node is joining: restarting the workers to take it in {where(cfg, self.restarts, self.offset)}"
                )
            else:
                line = f"restart {self.restarts + 1}/{worker_group.spec.max_restarts}"
                if self.failures:
                    line += f": {describe(*cause(self.failures))} {where(cfg, self.restarts, self.offset)}"
                else:
                    line += f": the worker group was unhealthy {where(cfg, self.restarts, self.offset)}"
                type(self).restarts += 1
            print(line, file=sys.stderr, flush=True)
            self._initialize_workers(worker_group)
            _say_world(before, _world(worker_group))

    return RestartingAgent


def _world(worker_group) -> tuple[int, int] | None:
    """``(nodes, ranks)`` of the agent's last rendezvous (None before the first)."""
    workers = getattr(worker_group, "workers", None)
    if not workers or worker_group.group_world_size is None:
        return None
    return worker_group.group_world_size, workers[0].world_size


def _say_world(before: tuple[int, int] | None, after: tuple[int, int] | None) -> None:
    """One line when a restart's rendezvous gathered another number of nodes (a node lost or
    taken in, trainer/lifecycle/elastic.py): the workers plan their layout for it."""
    if before and after and after != before:
        print(
            f"elastic: the job goes on with {after[0]} node{'s' if after[0] != 1 else ''} ({after[1]} ranks), "
            f"was {before[0]} ({before[1]} ranks); the layout is planned for it (docs/long_runs.md)",
            file=sys.stderr,
            flush=True,
        )


@contextlib.contextmanager
def restarting(cfg):
    """torch's ``elastic_launch`` builds a ``LocalElasticAgent`` by the name its module holds:
    for the launch within, that name is :func:`restarting_agent`'s subclass. Yields the class
    (its ``restarts`` read after the launch)."""
    import torch.distributed.launcher.api as launcher_api

    base = launcher_api.LocalElasticAgent
    agent = restarting_agent(cfg, base)
    launcher_api.LocalElasticAgent = agent
    try:
        yield agent
    finally:
        launcher_api.LocalElasticAgent = base
