"""How a process that joined a process group ends: ``run_and_exit(main)``.

Why not simply return from ``main`` and let Python exit? Because torch's communication
threads can outlive ``destroy_process_group()`` and touch Python objects while the interpreter
is being torn down, which kills a finished run at exit:

* ``destroy_process_group()`` shuts a gloo backend down only by dropping references; the
  backend's worker threads (``pt_gloo_runloop``) are joined by its C++ destructor, which runs
  only when the last reference goes. torch itself keeps references that Python cannot see or
  drop: measured on torch 2.13, the first call of a functional collective's
  ``AsyncCollectiveTensor`` wrapper adds 10 references to the WORLD group, and FSDP2 and the
  autograd all-to-all keep one more group each. After ``main()`` of a DeepSeek
  ``dp_replicate=2, dp_shard=2, ep=2`` run returns, 3 process groups, 6 worker threads and 3
  transport threads are still alive on every rank (tests/unit/test_shutdown.py counts them).
* A worker thread drops a finished collective's tensors just after waking the main thread. A
  tensor whose Python object is owned by the tensor (the Python side let go first) must take
  the GIL to release it. If the main thread has meanwhile started interpreter finalization,
  taking the GIL calls ``pthread_exit``; its forced unwind meets the work's ``noexcept``
  destructor and C++ calls ``std::terminate``: "terminate called without an active
  exception", SIGABRT, and torchrun reports the finished job as failed. The backtrace of the
  aborting thread: ``ProcessGroupGloo::runLoop`` -> ``TensorImpl::decref_pyobject`` ->
  ``PyEval_RestoreThread`` -> ``pthread_exit`` -> ``_Unwind_ForcedUnwind`` ->
  ``__gxx_personality_v0`` -> ``std::terminate``. It needs the worker thread to be descheduled
  across the whole of the main thread's exit, so it shows under CPU load (about 1 run in 20
  of that layout with a busy process per core; in most runs when the comm threads are starved,
  ``python -m tools.exit_stress --starve-comm``). The same window exists for NCCL's
  watchdog and for any library thread that calls back into Python.

So the process never finalizes the interpreter while those threads may run. ``run_and_exit``
does what Python's own exit does up to the dangerous part, the same sequence as the exit of a
``multiprocessing`` child: join the non-daemon Python threads (``threading._shutdown``, which
also stops ``concurrent.futures`` executors), run the ``atexit`` handlers (logging's flush
among them), flush stdout and stderr, then ``os._exit(code)``. Module teardown, the final
garbage collection and C++ static destructors are skipped, and with them every path by which a
leftover thread could call into a dying interpreter. What the caller must do itself (and the
trainer does): close what it writes (metrics, checkpoints and traces are closed by their
context managers before ``main`` returns); an object's ``__del__`` does not run at exit.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import traceback
from collections.abc import Callable

__all__ = ["exit_now", "run_and_exit"]


def _exit_code(code: object) -> int:
    """``sys.exit``'s rules: None is 0, an int is itself, anything else is printed and is 1."""
    if code is None:
        return 0
    if isinstance(code, bool):
        return int(code)
    if isinstance(code, int):
        return code
    try:
        print(code, file=sys.stderr)
    except Exception:
        pass
    return 1


def exit_now(code: object = 0) -> None:
    """End the process with ``code`` after Python's orderly part of exiting (threads joined,
    atexit handlers run, std streams flushed), without finalizing the interpreter."""
    status = _exit_code(code)
    try:
        shutdown = getattr(threading, "_shutdown", None)
        if shutdown is not None and threading.current_thread() is threading.main_thread():
            shutdown()  # joins non-daemon threads; stops concurrent.futures executors
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
        status = status or 1
    finally:
        for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
            try:
                if stream is not None:
                    stream.flush()
            except Exception:
                pass
        os._exit(status)


def run_and_exit(main: Callable[[], object]) -> None:
    """``sys.exit(main())`` for a process that may hold process groups: the same exit codes
    (an uncaught exception prints its traceback and exits 1), ended by :func:`exit_now`."""
    try:
        code = main()
    except SystemExit as exc:
        code = exc.code
    except KeyboardInterrupt:  # a Ctrl-C that main() did not end itself: one line, from rank 0
        if os.environ.get("RANK", "0") == "0":
            print("interrupted (SIGINT)", file=sys.stderr, flush=True)
        code = 130
    except BaseException:
        traceback.print_exc()
        code = 1
    exit_now(code)
