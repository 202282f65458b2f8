"""``make test``'s two pytest sessions, side by side instead of one after the other:

    python -m tests.both_sessions [pytest args]      # what `make test` runs after the lint

The main suite (``pytest ARGS tests``) runs in the foreground, its output on this terminal; the
second lane (``python -m tests.kernel_lane ARGS``: the numerics tests on other CPU kernels and
the mesh tests under the portable builder) starts at the same time at a lower priority
(``nice`` 10), its output kept in a file and printed once it ends. The main suite's workers
leave cores idle while a test waits (a rendezvous, a deliberate timeout, a process start): the
lane's work runs there, and in the main suite's last seconds, instead of after it (measured on
a 2-core Intel Xeon host: docs/testing.md). Both sessions always run to their end, so one run
reports the failures of both; the exit code is the main suite's if it failed, else the lane's.
Ctrl-C (or SIGTERM) stops both.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

LANE_NICE = 10


def _lower_priority() -> None:
    os.nice(LANE_NICE)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def main(argv: list[str], main_cmd: list[str] | None = None, lane_cmd: list[str] | None = None) -> int:
    """Run both sessions (``main_cmd`` / ``lane_cmd``: other commands, for its test)."""
    main_cmd = main_cmd or [sys.executable, "-m", "pytest", *argv, "tests"]
    lane_cmd = lane_cmd or [sys.executable, "-m", "tests.kernel_lane", *argv]
    with tempfile.TemporaryFile(mode="w+", prefix="meshtrain-lane-") as log:
        start = time.monotonic()
        lane = subprocess.Popen(lane_cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_lower_priority)
        main_suite = subprocess.Popen(main_cmd)
        previous = signal.signal(signal.SIGTERM, _interrupt)
        try:
            main_code = main_suite.wait()
            if lane.poll() is None:
                print("== main suite done; waiting for the second lane", flush=True)
            lane_code = lane.wait()
        except KeyboardInterrupt:
            for proc in (main_suite, lane):
                if proc.poll() is None:
                    proc.send_signal(signal.SIGINT)
            for proc in (main_suite, lane):
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
            return 130
        finally:
            signal.signal(signal.SIGTERM, previous)
        log.seek(0)
        print(f"== second lane (started beside the main suite, nice {LANE_NICE}; "
              f"ended {time.monotonic() - start:.0f} s after it started):", flush=True)  # fmt: skip
        sys.stdout.write(log.read())
        sys.stdout.flush()
    return main_code or lane_code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
