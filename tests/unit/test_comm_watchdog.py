"""The step watchdog (trainer/runtime/comm_watchdog.py): deadlines, the one line, the exit, the flight
recorder's environment, and the ordering of the watchdog against the process-group timeouts.

The decision is tested with a fake clock on the caller's thread (``poll``); the real thread and
``os._exit`` in subprocesses. What only a GPU can confirm (NCCL's own watchdog, its dump on
timeout, a rank blocked in ``.tolist()`` on a CUDA stream) is in the report's checklist."""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
import textwrap
import time

import pytest

from trainer.config import ConfigError, load_config
from trainer.runtime.comm_watchdog import (
    DUMP_WAIT_SECONDS,
    EXIT_COMM_TIMEOUT,
    GRACE_SECONDS,
    JobWatchdog,
    StepWatchdog,
    apply_flight_recorder_env,
    benchmark_arm_disarm,
    dump_prefix,
    flight_recorder_env,
    pg_timeout_seconds,
    watchdog_seconds,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _watchdog(clock, exits, dump="/run/comm_traces/rank_3", rank=3, cls=StepWatchdog, **kw):
    stream = io.StringIO()
    wd = cls(rank, clock=clock, exit=exits.append, dump=lambda note: dump, stream=stream, start=False, **kw)
    return wd, stream


# ----------------------------------------------------------------------------- the decision


def test_fires_after_the_deadline_with_one_line_naming_option_step_and_dump():
    clock, exits = FakeClock(), []
    wd, stream = _watchdog(clock, exits)
    wd.arm("step 57", 100, "comm.train_timeout_seconds")
    clock.now = 99.9
    assert not wd.poll() and exits == []
    clock.now = 100.0
    assert wd.poll()
    assert exits == [EXIT_COMM_TIMEOUT]
    out = stream.getvalue()
    assert out.count("\n") == 1, out  # ONE line
    assert out.startswith("error: rank 3: step 57 did not finish within comm.train_timeout_seconds = 100 s")
    assert "flight-recorder dump: /run/comm_traces/rank_3" in out
    assert "torchfrtrace /run/comm_traces -p rank_" in out
    assert "raise the timeout" in out


def test_does_not_fire_when_steps_finish_in_time_and_re_arms_per_step():
    clock, exits = FakeClock(), []
    wd, stream = _watchdog(clock, exits)
    for step in range(1, 50):  # 49 steps of 8 s under a 10 s limit: 392 s in all
        wd.arm(f"step {step}", 10, "comm.train_timeout_seconds")
        clock.now += 8
        assert not wd.poll()
        wd.disarm()
        clock.now += 1  # between steps: disarmed
        assert not wd.poll()
    # the deadline counts from the re-arm, not from the first arm
    wd.arm("step 50", 10, "comm.train_timeout_seconds")
    clock.now += 9.5
    assert not wd.poll()
    clock.now += 0.5
    assert wd.poll()
    assert "step 50 did not finish" in stream.getvalue() and exits == [EXIT_COMM_TIMEOUT]


def test_disarmed_or_stopped_never_fires():
    clock, exits = FakeClock(), []
    wd, _ = _watchdog(clock, exits)
    wd.arm("step 1", 1, "comm.train_timeout_seconds")
    wd.disarm()
    clock.now = 1e6
    assert not wd.poll()
    wd.arm("step 2", 1, "comm.train_timeout_seconds")
    wd.stop()
    clock.now = 2e6
    assert not wd.poll() and exits == []
    assert wd.phase == "step 2"  # kept for main()'s gloo message


def test_job_watchdog_limits_first_step_saves_and_the_gloo_backstop():
    clock, exits = FakeClock(), []
    kw = dict(train_timeout_seconds=100, init_timeout_seconds=300, dump_folder="/run")
    wd, stream = _watchdog(clock, exits, cls=JobWatchdog, backend="nccl", **kw)
    wd.step(1, first=True)  # compiles, creates communicators: the init limit
    clock.now = 299
    assert not wd.poll()
    wd.step(2, first=False)
    clock.now += 99
    assert not wd.poll()
    wd.long_phase("checkpoint save at step 2")
    clock.now += 299
    assert not wd.poll()
    clock.now += 1
    assert wd.poll()
    assert "checkpoint save at step 2 did not finish within comm.init_timeout_seconds = 300 s" in stream.getvalue()

    clock, exits = FakeClock(), []
    wd, stream = _watchdog(clock, exits, cls=JobWatchdog, backend="gloo", **kw)
    wd.step(7, first=False)
    clock.now = 2 * 100 + GRACE_SECONDS - 0.1
    assert not wd.poll()
    clock.now += 0.1
    assert wd.poll()
    assert (
        f"step 7 did not finish within 230 s ({GRACE_SECONDS} s + 2 x comm.train_timeout_seconds = 100 s)"
        in stream.getvalue()
    )


def test_a_dump_that_hangs_does_not_keep_the_process_alive():
    clock, exits = FakeClock(), []
    stream = io.StringIO()
    wd = StepWatchdog(
        0, clock=clock, exit=exits.append, dump=lambda note: time.sleep(60), stream=stream, start=False, dump_wait_s=0.2
    )
    wd.arm("step 3", 5, "comm.train_timeout_seconds")
    clock.now = 5
    t0 = time.monotonic()
    assert wd.poll()
    assert time.monotonic() - t0 < 10
    assert "flight-recorder dump: none (the dump did not finish within 0.2 s)" in stream.getvalue()
    assert exits == [EXIT_COMM_TIMEOUT]

    # the first file (without stack traces) is written: the line names it and says what is missing
    clock, exits = FakeClock(), []
    stream = io.StringIO()

    def slow_full_dump(note):
        note("/run/comm_traces/rank_0")
        time.sleep(60)

    wd = StepWatchdog(
        0, clock=clock, exit=exits.append, dump=slow_full_dump, stream=stream, start=False, dump_wait_s=0.2
    )
    wd.arm("step 4", 5, "comm.train_timeout_seconds")
    clock.now = 5
    assert wd.poll()
    assert "flight-recorder dump: /run/comm_traces/rank_0 (without stack traces: they took over 0.2 s)" in (
        stream.getvalue()
    )


# ----------------------------------------------------------------------------- ordering


@pytest.mark.parametrize("limit", [1, 5, 100, 300, 1800])
def test_the_right_mechanism_speaks_first(limit):
    # NCCL: the watchdog (and its dump) before NCCL's own timeout of any collective of the step,
    # whose timer starts when the collective is enqueued, at or after the step began
    assert watchdog_seconds("nccl", limit) + DUMP_WAIT_SECONDS < pg_timeout_seconds("nccl", limit)
    assert pg_timeout_seconds("nccl", limit) - limit == GRACE_SECONDS
    # gloo: a collective starting x s into an on-time step (x < limit + grace) raises at x + limit,
    # before the watchdog's backstop
    for x in (0, limit, limit + GRACE_SECONDS - 0.01):
        assert x + pg_timeout_seconds("gloo", limit) < watchdog_seconds("gloo", limit)
    assert pg_timeout_seconds("gloo", limit) == limit


# ----------------------------------------------------------------------------- environment


def test_flight_recorder_env_for_nccl_and_not_for_gloo(tmp_path):
    env = flight_recorder_env("nccl", str(tmp_path), 20000)
    prefix = os.path.join(str(tmp_path), "comm_traces", "rank_")
    assert env == {
        "TORCH_FR_BUFFER_SIZE": "20000",
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "20000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": prefix,
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix,
    }
    assert flight_recorder_env("gloo", str(tmp_path), 20000) == {}
    off = flight_recorder_env("nccl", str(tmp_path), 0)
    assert off == {"TORCH_FR_BUFFER_SIZE": "0", "TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}
    # a relative dump folder becomes absolute: the message names a path that works from anywhere
    rel = flight_recorder_env("nccl", "outputs/run", 5)["TORCH_FR_DUMP_TEMP_FILE"]
    assert os.path.isabs(rel) and rel.endswith(os.path.join("outputs", "run", "comm_traces", "rank_"))


def test_apply_flight_recorder_env_keeps_what_the_user_exported(tmp_path):
    environ = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "7"}
    applied = apply_flight_recorder_env("nccl", str(tmp_path), 20000, environ)
    assert environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "7" and "TORCH_FR_BUFFER_SIZE" not in environ
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in applied
    assert environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert dump_prefix(environ) == os.path.join(str(tmp_path), "comm_traces", "rank_")
    assert (tmp_path / "comm_traces").is_dir()  # NCCL's writer does not create folders

    environ = {"TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/elsewhere/trace_"}
    apply_flight_recorder_env("nccl", str(tmp_path / "b"), 20000, environ)
    assert dump_prefix(environ) == "/elsewhere/trace_" and "TORCH_FR_DUMP_TEMP_FILE" not in environ

    environ = {}
    assert apply_flight_recorder_env("gloo", str(tmp_path / "c"), 20000, environ) == {} and environ == {}


# ----------------------------------------------------------------------------- config


def test_trace_buf_size_option():
    assert load_config([]).comm.trace_buf_size == 20000
    assert load_config(["--comm.trace_buf_size", "0"]).comm.trace_buf_size == 0
    with pytest.raises(ConfigError, match=r"comm\.trace_buf_size must be >= 0 .*got -1"):
        load_config(["--comm.trace_buf_size", "-1"])
    with pytest.raises(ConfigError, match=r"comm\.trace_buf_size expects an int, got 'lots'"):
        load_config(["--comm.trace_buf_size", "lots"])
    with pytest.raises(ConfigError, match=r"comm\.init_timeout_seconds and comm\.train_timeout_seconds must be > 0"):
        load_config(["--comm.train_timeout_seconds", "0"])


# ----------------------------------------------------------------------------- the real thread


def _run(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env=env,
    )


def test_thread_ends_a_hung_step_with_one_line_and_exit_code():
    proc = _run(
        """
        import time
        from trainer.runtime.comm_watchdog import StepWatchdog
        wd = StepWatchdog(1, dump=lambda note: "/run/comm_traces/rank_1")
        for step in range(1, 4):  # three steps on time
            wd.arm(f"step {step}", 0.5, "comm.train_timeout_seconds")
            time.sleep(0.05)
            wd.disarm()
        wd.arm("step 4", 0.5, "comm.train_timeout_seconds")
        time.sleep(60)  # hung: the main thread never comes back
        print("not reached")
        """
    )
    assert proc.returncode == EXIT_COMM_TIMEOUT, proc
    assert "not reached" not in proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: rank 1: step 4 did not finish within comm.train_timeout_seconds = 0.5 s")
    assert "flight-recorder dump: /run/comm_traces/rank_1" in lines[0]


def test_thread_quiet_when_steps_finish_and_wakes_for_an_earlier_deadline():
    proc = _run(
        """
        import time
        from trainer.runtime.comm_watchdog import StepWatchdog
        wd = StepWatchdog(0, dump=lambda note: "x")
        for step in range(1, 41):  # 40 steps of 20 ms under a 0.3 s deadline: 0.8 s in all
            wd.arm(f"step {step}", 0.3, "comm.train_timeout_seconds")
            time.sleep(0.02)
            wd.disarm()
        wd.stop()
        print("clean")
        """
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "clean" and proc.stderr == "", proc
    # the thread sleeps until a long deadline (the first step's); a shorter one must wake it
    t0 = time.monotonic()
    proc = _run(
        """
        import time
        from trainer.runtime.comm_watchdog import StepWatchdog
        wd = StepWatchdog(0, dump=lambda note: "x")
        wd.arm("step 1", 600, "comm.init_timeout_seconds")
        time.sleep(0.2)
        wd.arm("step 2", 0.3, "comm.train_timeout_seconds")
        time.sleep(60)
        """
    )
    assert proc.returncode == EXIT_COMM_TIMEOUT and "step 2 did not finish" in proc.stderr, proc
    assert time.monotonic() - t0 < 50


def test_thread_writes_this_ranks_flight_recorder_dump(tmp_path):
    # a real gloo group of one, one all_reduce, then a hung step: the dump is torch's pickle
    proc = _run(
        f"""
        import datetime, os, time, torch, torch.distributed as dist
        from trainer.runtime.comm_watchdog import StepWatchdog, write_flight_recorder_dump
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0", RANK="0", WORLD_SIZE="1")
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
        dist.all_reduce(torch.ones(3))
        dump = lambda note: write_flight_recorder_dump(0, "gloo", None, {str(tmp_path)!r}, note=note)
        wd = StepWatchdog(0, dump=dump)
        wd.arm("step 9", 0.3, "comm.train_timeout_seconds")
        time.sleep(60)
        """
    )
    path = tmp_path / "comm_traces" / "rank_0"
    assert proc.returncode == EXIT_COMM_TIMEOUT, proc
    line = proc.stderr.strip().splitlines()[-1]
    if "none (" in line:  # a torch without gloo's flight recorder (before 2.8): said so, still one line
        pytest.skip(f"no flight recorder for gloo in this torch: {line}")
    assert f"flight-recorder dump: {path}" in line, proc.stderr
    dump = pickle.loads(path.read_bytes())
    assert any("all_reduce" in e["profiling_name"] for e in dump["entries"]), dump["entries"]


def test_benchmark_runs():
    # the numbers are reported, not asserted (docs/design.md section 7: no timed tests)
    result = benchmark_arm_disarm(2000)
    assert result["steps"] == 2000 and result["ns_per_step"] > 0
