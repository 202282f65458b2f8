"""Checkpoint saves that do not stop training (``checkpoint.async_mode``).

``disabled``               every rank writes its shards with ``dcp.save``; training waits for the
                           last byte (the stall is the whole save).
``async``                  ``dcp.async_save``: the state dict is copied into CPU memory on the
                           main thread (torch's ``DefaultStager``; the stall; the buffers are
                           allocated by the first save and reused by every later one where
                           torch's stager can, see :func:`stager_keeps_buffers`), then written
                           by a background thread while training goes on.
``async_with_pinned_mem``  CUDA only: the copy goes into pinned, shared host buffers that are kept
                           and reused by every later save, runs on a side stream in the
                           background, and the write runs in a separate checkpoint process
                           (torch's ``AsyncCheckpointerType.PROCESS``); the next optimizer step
                           waits for the copy (:meth:`BackgroundSaver.wait_for_staging`), since it
                           changes the weights being copied.

At most one save is in flight. The background write's collectives (DCP's plan and metadata
gathers) run on a gloo process group of their own, so they never interleave with training's.
Completion is decided collectively at step boundaries (:meth:`BackgroundSaver.poll`, a two-int
all-reduce on a second gloo group while a save is in flight): a save counts as done only once
every rank's write returned, and DCP's last collective returns only after every rank's files
are written (fsynced) and rank 0 wrote ``.metadata`` (fsynced, renamed into place). Only then
does rank 0 rename ``step-N.tmp`` to ``step-N`` (:meth:`CheckpointFolder.publish`), so a folder
under a final name is always complete. A write that failed on any rank is reported by every
rank on the step it is noticed (:class:`CheckpointWriteFailed`: which rank, which file, the
cause) and the trainer stops with exit code 1; the ``.tmp`` folder is left unpublished and the
previous checkpoints untouched.
"""

from __future__ import annotations

import datetime
import functools
import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from parallel_dims.process_groups import host_group
from trainer.checkpoint.drill import drill_point

__all__ = [
    "BackgroundSaver",
    "CheckpointWriteFailed",
    "DrillWriter",
    "SaveDone",
    "describe_failure",
    "failure_line",
]

logger = logging.getLogger(__name__)

DISABLED, ASYNC, ASYNC_PINNED = "disabled", "async", "async_with_pinned_mem"  # checkpoint.async_mode


class CheckpointWriteFailed(RuntimeError):
    """A checkpoint save failed while training ran (disk full, folder made read-only, ...).
    Raised on every rank at the same step; the message is one line for the user and the
    trainer exits with code 1 (the run is not bad input: it was saving fine until now)."""


class DrillWriter(FileSystemWriter):
    """DCP's file system writer with the kill drills' ``write`` point (trainer/checkpoint/drill.py)
    after this rank's data files are written and before the metadata exists. Otherwise exactly
    ``FileSystemWriter`` (one file per rank, fsynced)."""

    def __init__(self, path: str, *, step: int, rank: int):
        super().__init__(path)
        self.drill_step, self.drill_rank = step, rank

    def write_data(self, plan, planner):
        fut = super().write_data(plan, planner)
        fut.wait()  # FileSystemWriter writes synchronously; the future is already done
        drill_point("write", self.drill_step, self.drill_rank)
        return fut


def describe_failure(exc: BaseException, rank: int) -> str | None:
    """What failed on ``rank``, in a few words naming the file and the cause, or None when
    ``exc`` only says another rank failed (DCP wraps every rank's failure on every rank)."""
    if isinstance(exc, CheckpointException):
        own = exc.failures.get(rank)
        return describe_failure(own[0], rank) if own else None
    if isinstance(exc, OSError):
        what = exc.strerror or type(exc).__name__
        return f"{what} writing {exc.filename}" if exc.filename else f"{what} ({exc})"
    return f"{type(exc).__name__}: {exc}"


def failure_line(exc: BaseException, step: int) -> str | None:
    """The one line for a synchronous save that raised on this rank (DCP raises the same
    failures on every rank), or None when ``exc`` is not about writing files (a bug, which keeps
    its traceback)."""
    if isinstance(exc, CheckpointException):
        for r in sorted(exc.failures):
            what = describe_failure(exc.failures[r][0], r)
            if what and isinstance(exc.failures[r][0], OSError):
                return f"checkpoint save of step {step} failed on rank {r}: {what}"
        return None
    if isinstance(exc, OSError):
        return f"checkpoint save of step {step} failed: {describe_failure(exc, 0)}"
    return None


def _new_stager(mode: str):
    """torch's staging for ``mode``: ``async`` = a synchronous deep copy of every tensor into
    CPU memory (what async_save builds for itself when given no stager); pinned = pinned, shared
    buffers filled from a side stream in the background."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    if mode == ASYNC:
        return DefaultStager(StagingOptions(False, False, False, False))
    return DefaultStager(
        StagingOptions(
            use_pinned_memory=True, use_shared_memory=True, use_async_staging=True, use_non_blocking_copy=True
        )
    )


@functools.cache
def stager_keeps_buffers() -> bool:
    """Whether this torch's ``DefaultStager`` can stage again into the buffers of its previous
    stage (torch 2.13, 2.15: it keeps a copy per source storage and copies into it). torch 2.11's
    closes its cache after every stage (and cannot stage a second time), so there each save gets
    a new stager and fresh memory. Probed by behaviour: the same source staged twice lands in the
    same buffer."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    stager = DefaultStager(StagingOptions(False, False, False, False))
    source = {"t": torch.arange(4.0), "kind": torch.Tensor}
    try:
        first = stager.stage(source)["t"]
        second = stager.stage(source)["t"]
        return first.data_ptr() == second.data_ptr()
    except Exception:  # torch 2.11: the second stage fails on the cleared dispatch table
        return False
    finally:
        stager.close()


@dataclass
class SaveDone:
    """A save whose every rank finished (successfully) at the step it was noticed."""

    step: int
    write_s: float  # from the start of the save to the end of this rank's write
    poll_stall_s: float  # main-thread seconds spent on it after it was started (polls, publish)


@dataclass
class _InFlight:
    step: int
    future: Future
    staging: Future | None
    started: float
    poll_s: float = 0.0
    ended: list[float] = field(default_factory=list)  # filled by the done callback


class BackgroundSaver:
    """The machinery of ``async`` / ``async_with_pinned_mem`` saves for one run. Every rank
    builds one (collective: it creates two gloo process groups) and calls every method at the
    same points."""

    def __init__(self, mode: str, *, timeout_s: float):
        if mode not in (ASYNC, ASYNC_PINNED):
            raise ValueError(f"BackgroundSaver is for {ASYNC!r} / {ASYNC_PINNED!r}, not {mode!r}")
        self.mode = mode
        timeout = datetime.timedelta(seconds=timeout_s)
        # DCP's collectives in the writer thread / process; a second group for the main thread's
        # completion checks, which must not interleave with a collective the writer has in flight
        self.write_pg = host_group("checkpoint_write", timeout)
        self.status_pg = host_group("checkpoint_status", timeout)
        # both wait for the slowest rank's write (DCP's gathers; a blocking completion check), which
        # may take longer than comm.train_timeout_seconds: they keep this timeout for the run
        from trainer.runtime.distributed_init import keep_creation_timeout, wait_until_every_rank_joined

        keep_creation_timeout(self.write_pg)
        keep_creation_timeout(self.status_pg)
        # no rank goes on (and perhaps stops on bad input: a load_step that is not there) while a
        # peer is still connecting these groups' sockets
        wait_until_every_rank_joined(self.status_pg)
        self.rank = dist.get_rank()
        self._stager = None
        self._inflight: _InFlight | None = None

    @property
    def in_flight(self) -> int | None:
        """The step of the save being written, or None."""
        return self._inflight.step if self._inflight is not None else None

    def start(self, step: int, state: dict[str, Any], path: str) -> None:
        """Stage ``state`` (copied: training may change it from now on) and start writing it to
        ``path`` (an existing, empty folder on every rank). Nothing may be in flight."""
        if self._inflight is not None:
            raise RuntimeError(f"save of step {self._inflight.step} still in flight")
        drill_point("staging", step, self.rank)
        started = time.monotonic()
        writer = DrillWriter(path, step=step, rank=self.rank)
        if self._stager is None or not stager_keeps_buffers():
            self._close_stager()
            self._stager = _new_stager(self.mode)
        if self.mode == ASYNC:
            # our writer is also an AsyncStager, which async_save would stage through if not
            # given a stager
            fut = dcp.async_save(
                state, checkpoint_id=path, storage_writer=writer, process_group=self.write_pg, async_stager=self._stager
            )
            staging = None
        else:
            from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

            response = dcp.async_save(
                state,
                checkpoint_id=path,
                storage_writer=writer,
                process_group=self.write_pg,
                async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                async_stager=self._stager,
            )
            fut, staging = response.upload_completion, response.staging_completion
        inflight = _InFlight(step=step, future=fut, staging=staging, started=started)
        fut.add_done_callback(lambda _f: inflight.ended.append(time.monotonic()))
        self._inflight = inflight

    def wait_for_staging(self) -> None:
        """Block until the in-flight save's copy of the state is complete (pinned mode copies in
        the background; the optimizer must not change the weights before)."""
        if self._inflight is not None and self._inflight.staging is not None:
            self._inflight.staging.result()
            self._inflight.staging = None

    def poll(self, *, block: bool = False) -> SaveDone | None:
        """Collective, at a step boundary: whether the in-flight save is finished on every rank
        (``block``: wait until it is). Raises :class:`CheckpointWriteFailed` on every rank when
        it failed anywhere; returns None while it is still being written."""
        inflight = self._inflight
        if inflight is None:
            return None
        t0 = time.monotonic()
        while True:
            if block:
                self._wait_local(inflight)
            done = inflight.future.done()
            failed = done and inflight.future.exception() is not None
            flags = torch.tensor([int(failed), int(not done)], dtype=torch.int64)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.status_pg)
            any_failed, any_running = (bool(v) for v in flags.tolist())
            if any_failed:
                self._wait_local(inflight)  # DCP hands every rank's failure to every rank
                self._inflight = None
                raise CheckpointWriteFailed(self._failure_line(inflight))
            if not any_running:
                break
            if not block:
                inflight.poll_s += time.monotonic() - t0
                return None
        self._inflight = None
        inflight.poll_s += time.monotonic() - t0
        end = inflight.ended[0] if inflight.ended else time.monotonic()
        return SaveDone(inflight.step, end - inflight.started, inflight.poll_s)

    def _wait_local(self, inflight: _InFlight) -> None:
        try:
            inflight.future.result()
        except BaseException:  # reported collectively by poll()
            pass

    def _failure_line(self, inflight: _InFlight) -> str:
        exc = inflight.future.exception()
        mine = describe_failure(exc, self.rank) if exc is not None else None
        everyone: list[Any] = [None] * dist.get_world_size(self.status_pg)
        dist.all_gather_object(everyone, mine, group=self.status_pg)
        for r, what in enumerate(everyone):
            if what:
                return f"checkpoint save of step {inflight.step} failed on rank {r}: {what}"
        return f"checkpoint save of step {inflight.step} failed: {exc!r}"

    def close(self) -> None:
        """Release the kept staging buffers (the run's last save must be finished)."""
        self._close_stager()

    def _close_stager(self) -> None:
        if self._stager is not None:
            self._stager.close()
            self._stager = None
