"""Collective failures that explain themselves, on gloo and on NCCL.

On gloo a collective that waits longer than its process group's timeout raises in the thread
that waits, and ``trainer/trainer.py`` ``main()`` turns that into one line. On NCCL it does not:
ProcessGroupNCCL's own watchdog thread finds the timed-out work and, under torchrun
(``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``), tears the process down from C++ (SIGABRT) while the
main thread is blocked in the step's host sync (``.tolist()``), so no Python handler runs. This
module gives both backends the same ending:

* **A step watchdog** (:class:`StepWatchdog`): one daemon thread, armed with a deadline at the
  start of every training step (and of every checkpoint save and validation pass), disarmed at
  the end. When a deadline passes it writes this rank's flight-recorder dump, prints ONE line
  (rank, step, the option that sets the limit, how long it ran, where the dump went) and ends
  the process with :data:`EXIT_COMM_TIMEOUT`.
* **Ordering by backend** (:func:`watchdog_seconds`, :func:`pg_timeout_seconds`), for a limit
  T (``comm.train_timeout_seconds``, or ``comm.init_timeout_seconds`` for the first step):

  - NCCL: the watchdog fires at T after the step began; the process groups time out at
    T + :data:`GRACE_SECONDS`. Every collective of a step is enqueued after the step began, so
    NCCL's timer (which starts at enqueue) cannot run out first; the grace leaves the watchdog
    time to write the dump (at most :data:`DUMP_WAIT_SECONDS`) and exit. NCCL's own timeout
    stays as the fallback (its dump goes to the same place, ``TORCH_NCCL_DUMP_ON_TIMEOUT``).
  - gloo (and any other backend): the process groups time out at T, as before, and the
    exception speaks (``main()``'s line). The watchdog is a backstop for a hang outside any
    collective and fires at 2 T + grace: a collective that starts x s into a step times out at
    x + T, before the watchdog whenever x < T + grace, i.e. whenever the step was on time up
    to the hang.
* **The flight recorder** (:func:`flight_recorder_env`): for NCCL, the ring size
  (``comm.trace_buf_size``), dump-on-timeout and the dump file prefix
  ``<job.dump_folder>/comm_traces/rank_`` are put in the environment before
  ``init_process_group``; both dumps (the watchdog's and NCCL's) land in that file, readable
  with ``torchfrtrace <dump_folder>/comm_traces -p rank_``.

The dump is written without the Python stack of each collective first (instant), then with
them (replacing the file) within the rest of :data:`DUMP_WAIT_SECONDS`: symbolizing them the
first time imports ``torch._inductor`` (already imported when torch.compile ran; 5-10 s on a
loaded CPU box otherwise).

Costs: one daemon thread per rank, asleep on a condition variable: it wakes about once per limit
period (at the deadline it was sleeping until, then sleeps until the new one), not per step.
Per step, ``step()`` (arm: a clock read and one lock round trip, a notify only when the new
deadline is earlier than the one the thread sleeps until) and ``disarm()`` (one lock round
trip): ``python -m trainer.runtime.comm_watchdog`` measured 4-12 us per step on this project's 2-core
CPU box under full load, where a bare lock round trip took 1.8 us (a few hundred ns each on an
idle core): under 0.01 % of a 100 ms step. The flight recorder's ring is torch's, recorded per
collective whatever we do (20000 entries, as torchtitan).

What it does not cover: a hang while the main thread holds the GIL (no Python thread runs; on
NCCL the groups' own timeout ends the rank 30 s later, with NCCL's message and dump); a peer's
death that NCCL detects itself as an asynchronous error (NCCL aborts first, with its message).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, MutableMapping

from trainer.runtime.files import atomic_write

__all__ = [
    "DUMP_WAIT_SECONDS",
    "EXIT_COMM_TIMEOUT",
    "GRACE_SECONDS",
    "JobWatchdog",
    "NullWatchdog",
    "StepWatchdog",
    "apply_flight_recorder_env",
    "dump_prefix",
    "flight_recorder_env",
    "pg_timeout_seconds",
    "watchdog_seconds",
    "write_flight_recorder_dump",
]

GRACE_SECONDS = 30
"""NCCL: the process groups time out this long after the step watchdog's deadline (the watchdog
must speak first). gloo: added to the watchdog's 2 T (the exception must speak first)."""

DUMP_WAIT_SECONDS = 10
"""The longest the watchdog waits for this rank's flight-recorder dump before it ends the
process anyway (below GRACE_SECONDS, so NCCL's own timeout never overtakes it)."""

EXIT_COMM_TIMEOUT = 3
"""A rank's exit code when a collective (or a step) ran past its timeout: 0 = done, 1 = a bug or
a diverged run, 2 = bad input (trainer/runtime/cli_errors.py)."""

TRACE_FOLDER = "comm_traces"
TRACE_PREFIX = "rank_"

# torch reads the newer name first (torch/csrc/distributed/c10d/FlightRecorder.hpp: TORCH_FR_* then
# TORCH_NCCL_*); both are set so torch 2.11 .. 2.15 see the same values
_BUFFER_VARS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
_FILE_VARS = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
_DUMP_ON_TIMEOUT = "TORCH_NCCL_DUMP_ON_TIMEOUT"


def _is_nccl(backend: str) -> bool:
    return "nccl" in str(backend).lower()


def pg_timeout_seconds(backend: str, seconds: int) -> int:
    """The process-group timeout for a limit of ``seconds``: NCCL's is ``GRACE_SECONDS`` longer
    (the step watchdog fires first), every other backend's is the limit itself."""
    return seconds + GRACE_SECONDS if _is_nccl(backend) else seconds


def watchdog_seconds(backend: str, seconds: int) -> int:
    """The step watchdog's deadline for a limit of ``seconds``: the limit on NCCL; on gloo a
    backstop of 2 x limit + grace, so the collective's own exception speaks first."""
    return seconds if _is_nccl(backend) else 2 * seconds + GRACE_SECONDS


def flight_recorder_env(backend: str, dump_folder: str, trace_buf_size: int) -> dict[str, str]:
    """The environment the flight recorder needs for ``backend`` (empty but for NCCL): the ring
    size, dump on timeout and the dump file prefix ``<dump_folder>/comm_traces/rank_`` (torch
    appends the rank). ``trace_buf_size = 0`` turns the recorder off."""
    if not _is_nccl(backend):
        return {}
    env = {name: str(trace_buf_size) for name in _BUFFER_VARS}
    if trace_buf_size > 0:
        env[_DUMP_ON_TIMEOUT] = "1"
        prefix = os.path.join(os.path.abspath(dump_folder), TRACE_FOLDER, TRACE_PREFIX)
        env.update({name: prefix for name in _FILE_VARS})
    return env


def apply_flight_recorder_env(
    backend: str, dump_folder: str, trace_buf_size: int, environ: MutableMapping[str, str] | None = None
) -> dict[str, str]:
    """Put :func:`flight_recorder_env` into ``environ`` (default ``os.environ``) before the first
    process group exists; a variable the user exported wins (a group of aliases counts as set
    when any of its names is). Creates the dump folder. Returns what was set."""
    environ = os.environ if environ is None else environ
    wanted = flight_recorder_env(backend, dump_folder, trace_buf_size)
    applied = {}
    for names in (_BUFFER_VARS, _FILE_VARS, (_DUMP_ON_TIMEOUT,)):
        if any(n in environ for n in names):
            continue
        for n in names:
            if n in wanted:
                environ[n] = applied[n] = wanted[n]
    prefix = dump_prefix(environ)
    if prefix is not None and applied.get(_FILE_VARS[0]) == prefix:
        try:
            os.makedirs(os.path.dirname(prefix), exist_ok=True)
        except OSError:
            pass  # an unwritable job.dump_folder is reported by the trainer's own check
    return applied


def dump_prefix(environ: MutableMapping[str, str] | None = None) -> str | None:
    """The flight-recorder dump prefix in effect (the rank is appended), or None."""
    environ = os.environ if environ is None else environ
    for name in _FILE_VARS:
        if environ.get(name):
            return environ[name]
    return None


def write_flight_recorder_dump(
    rank: int,
    backend: str,
    prefix: str | None,
    dump_folder: str,
    *,
    stack_traces: bool = True,
    note: Callable[[str], None] | None = None,
) -> str:
    """Write this rank's flight-recorder ring (what torch's dump on timeout writes: a pickle,
    the format ``torchfrtrace`` reads) to ``<prefix><rank>`` (default prefix
    ``<dump_folder>/comm_traces/rank_``); returns the path, or why there is none.

    Without the Python stack of each collective first (instant), then, with ``stack_traces``,
    with them, replacing the file: the first symbolization of a process can take seconds
    (measured: 5 s on a loaded CPU box), and the caller may not wait that long. ``note(path)``
    is called once the first file is complete."""
    try:
        import torch._C._distributed_c10d as c10d
    except ImportError:
        return "none (torch.distributed is unavailable)"
    dump = getattr(c10d, "_dump_nccl_trace", None) if _is_nccl(backend) else None
    dump = dump or getattr(c10d, "_dump_fr_trace", None)
    if dump is None:
        return "none (this torch has no flight recorder)"
    if prefix is None:
        prefix = os.path.join(os.path.abspath(dump_folder), TRACE_FOLDER, TRACE_PREFIX)
    path = f"{prefix}{rank}"
    written = False
    try:
        data = _call_dump(dump, stack_traces=False)
        if not data:
            return "none (the flight recorder is off: comm.trace_buf_size = 0)"
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        atomic_write(path, data)
        written = True
        if note is not None:
            note(path)
        if stack_traces:
            atomic_write(path, _call_dump(dump, stack_traces=True))
    except Exception as exc:  # a failed dump must not hide the timeout itself
        if written:
            return path
        return f"none ({type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''})"
    return path


def _call_dump(dump, stack_traces: bool) -> bytes:
    # (includeCollectives, includeStackTraces, onlyActive): the arguments of both dump functions
    # (torch/csrc/distributed/c10d/init.cpp); a torch without them dumps everything
    try:
        return dump(True, stack_traces, False)
    except TypeError:
        return dump()


def _exit_process(code: int) -> None:
    os._exit(code)


class StepWatchdog:
    """Ends this process with one line when an armed phase runs past its deadline.

    ``arm(phase, seconds, option, limit_seconds, how)``: ``phase`` names what runs ("step 57"),
    ``seconds`` is the deadline from now, ``option`` and ``limit_seconds`` the config key and
    its value the message names (default: ``seconds``), ``how`` how ``seconds`` follows from
    that value when they differ (gloo's backstop), for the message. ``disarm()`` at the end of
    the phase; ``stop()`` ends the thread.

    ``dump(note)`` writes the flight-recorder dump and returns its path or why there is none
    (``note(path)`` once a first, partial file exists); it gets ``dump_wait_s``. ``clock``,
    ``dump`` and ``exit`` are injectable for tests; ``poll()`` takes the thread's decision on
    the caller's thread.
    """

    def __init__(
        self,
        rank: int,
        *,
        dump: Callable[[Callable[[str], None]], str] | None = None,
        clock: Callable[[], float] = time.monotonic,
        exit: Callable[[int], None] = _exit_process,
        stream=None,
        dump_wait_s: float = DUMP_WAIT_SECONDS,
        fr_reader_hint: bool = True,
        start: bool = True,
    ) -> None:
        self.rank = rank
        self._fr_reader_hint = fr_reader_hint
        self._dump = dump
        self._clock = clock
        self._exit = exit
        self._stream = stream
        self._dump_wait_s = dump_wait_s
        self._cond = threading.Condition(threading.Lock())
        self._deadline: float | None = None
        self._started_at = 0.0
        self._phase = ""
        self._option = ""
        self._limit = 0.0
        self._how = ""
        self._seconds = 0.0
        self._waiting_until: float | None = None  # the deadline the thread sleeps until (None: no timeout)
        self._stopped = False
        self.fired: str | None = None
        self._thread: threading.Thread | None = None
        if start:
            self._thread = threading.Thread(target=self._run, name="meshtrain-step-watchdog", daemon=True)
            self._thread.start()

    @property
    def phase(self) -> str:
        """The phase armed last ("step 57"; kept after disarm and stop), "" before the first."""
        return self._phase

    def arm(self, phase: str, seconds: float, option: str, limit_seconds: float | None = None, how: str = "") -> None:
        now = self._clock()
        with self._cond:
            self._phase, self._option, self._seconds = phase, option, seconds
            self._limit = seconds if limit_seconds is None else limit_seconds
            self._how = how
            self._started_at = now
            self._deadline = now + seconds
            # the usual re-arm sets a later deadline than the one the thread sleeps until: it
            # wakes then, sees the new one and sleeps on, so no wake-up per step
            if self._waiting_until is None or self._deadline < self._waiting_until:
                self._cond.notify()

    def disarm(self) -> None:
        with self._cond:
            self._deadline = None

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._deadline = None
            self._cond.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def __enter__(self) -> StepWatchdog:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def message(self, now: float, dump: str, finished: bool = True) -> str:
        elapsed = now - self._started_at
        limit = f"{self._option} = {self._limit:g} s"
        if self._seconds != self._limit:
            limit = f"{self._seconds:g} s ({self._how or 'from'} {limit})"
        where = dump
        if not dump.startswith("none"):
            prefix = os.path.basename(dump)[: -len(str(self.rank))]
            if not finished:
                where += f" (without stack traces: they took over {self._dump_wait_s:g} s)"
            if self._fr_reader_hint:
                where += f" (read all ranks' with: torchfrtrace {os.path.dirname(dump)} -p {prefix})"
        return (
            f"error: rank {self.rank}: {self._phase} did not finish within {limit} (it ran {elapsed:.0f} s): "
            f"a collective is waiting for a hung or dead rank (see the other ranks' logs), or this rank "
            f"is hung; flight-recorder dump: {where}; if this legitimately takes that long, raise the timeout"
        )

    def check(self, now: float) -> bool:
        """Whether the armed phase is past its deadline at ``now``."""
        return self._deadline is not None and not self._stopped and now >= self._deadline

    def poll(self) -> bool:
        """The thread's decision, taken now on the caller's thread (tests with a fake clock)."""
        if self.check(self._clock()):
            self._fire()
            return True
        return False

    def _run(self) -> None:
        with self._cond:
            while not self._stopped:
                if self._deadline is None:
                    self._waiting_until = None
                    self._cond.wait()
                    continue
                remaining = self._deadline - self._clock()
                if remaining > 0:
                    self._waiting_until = self._deadline
                    self._cond.wait(remaining)
                    continue
                break
            if self._stopped:
                return
        self._fire()

    def _fire(self) -> None:
        now = self._clock()
        dump, finished = self._run_dump()
        line = self.message(now, dump, finished)
        self.fired = line
        try:
            # os.write, not print: the main thread may hold sys.stderr's lock (blocked mid-write)
            fd = (self._stream or sys.__stderr__ or sys.stderr).fileno()
            os.write(fd, (line + "\n").encode("utf-8", "replace"))
        except Exception:  # a stream without a descriptor (a StringIO)
            stream = self._stream or sys.stderr
            stream.write(line + "\n")
            stream.flush()
        self._exit(EXIT_COMM_TIMEOUT)

    def _run_dump(self) -> tuple[str, bool]:
        """(the dump's path or why there is none, whether it finished), within dump_wait_s."""
        if self._dump is None:
            return "none", True
        result = [f"none (the dump did not finish within {self._dump_wait_s:g} s)"]

        def note(partial: str) -> None:
            result[0] = partial

        def work() -> None:
            try:
                result[0] = self._dump(note)
            except Exception as exc:
                result[0] = f"none ({type(exc).__name__})"

        t = threading.Thread(target=work, name="meshtrain-fr-dump", daemon=True)
        t.start()
        t.join(self._dump_wait_s)
        return result[0], not t.is_alive()


class JobWatchdog(StepWatchdog):
    """The step watchdog with a training job's limits (``comm.*_timeout_seconds``) and backend.

    * ``step(n, first)``: training step n; the first step this process runs (compilation,
      lazy communicator creation, under ``comm.init_timeout_seconds``) gets the init limit,
      every later one ``comm.train_timeout_seconds``.
    * ``long_phase(name)``: a checkpoint save or a validation pass (disk I/O, a first
      compilation of the eval graphs): ``comm.init_timeout_seconds``.
    """

    def __init__(
        self,
        rank: int,
        backend: str,
        *,
        train_timeout_seconds: int,
        init_timeout_seconds: int,
        dump_folder: str,
        **kwargs,
    ) -> None:
        self.backend = backend
        self.train_timeout_seconds = train_timeout_seconds
        self.init_timeout_seconds = init_timeout_seconds
        # torch 2.13's gloo dumps have an empty pg_config, which torchfrtrace cannot read
        kwargs.setdefault("fr_reader_hint", _is_nccl(backend))
        kwargs.setdefault(
            "dump", lambda note: write_flight_recorder_dump(rank, backend, dump_prefix(), dump_folder, note=note)
        )
        super().__init__(rank, **kwargs)

    def _arm_limit(self, phase: str, option: str, seconds: int) -> None:
        deadline = watchdog_seconds(self.backend, seconds)
        self.arm(phase, deadline, option, seconds, how="" if deadline == seconds else f"{GRACE_SECONDS} s + 2 x")

    def step(self, step: int, first: bool) -> None:
        if first:
            self._arm_limit(f"step {step}", "comm.init_timeout_seconds", self.init_timeout_seconds)
        else:
            self._arm_limit(f"step {step}", "comm.train_timeout_seconds", self.train_timeout_seconds)

    def long_phase(self, phase: str) -> None:
        self._arm_limit(phase, "comm.init_timeout_seconds", self.init_timeout_seconds)


class NullWatchdog:
    """The watchdog's interface doing nothing: a run without peers (one process, or the fake
    backend's one simulated rank) has no collective to wait on."""

    phase = ""

    def step(self, step: int, first: bool) -> None:
        pass

    def long_phase(self, phase: str) -> None:
        pass

    def disarm(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def __enter__(self) -> NullWatchdog:
        return self

    def __exit__(self, *exc) -> None:
        pass


def benchmark_arm_disarm(steps: int = 100_000) -> dict[str, float]:
    """Nanoseconds per step of the watchdog's hooks (one ``step()`` arm + one ``disarm()``), with
    its thread running, against an empty loop: ``python -m trainer.runtime.comm_watchdog``."""
    wd = JobWatchdog(0, "nccl", train_timeout_seconds=3600, init_timeout_seconds=3600, dump_folder=".")
    try:
        t0 = time.perf_counter_ns()
        for _i in range(steps):
            pass
        empty = time.perf_counter_ns() - t0
        t0 = time.perf_counter_ns()
        for i in range(steps):
            wd.step(i + 1, first=False)
            wd.disarm()
        armed = time.perf_counter_ns() - t0
    finally:
        wd.stop()
    return {"ns_per_step": (armed - empty) / steps, "steps": steps}


if __name__ == "__main__":
    print(benchmark_arm_disarm())
