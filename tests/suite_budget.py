"""The test suite's budget (docs/testing.md): what each test costs, printed at the end of every run.

Per test (its setup, call and teardown together, so a module fixture's launch is charged to the
test that first used it):

* wall seconds;
* CPU seconds: this process and its threads, every child process it waited for (``subprocess``
  runs, torchrun with its workers) and the ranks the forkserver of ``tools/forkserver.py`` forked
  for it. On a 2-core host running three xdist workers, the suite's wall time is about its CPU
  seconds / 2: CPU is what a test takes from the others, and it barely depends on what else
  runs beside it;
* processes started (``subprocess`` launches and gloo ranks forked), where start-up goes.

The per-file wall seconds of a full run (on `make test`'s workers) are kept in tests/test_costs.json, which orders the files
(tests/conftest.py: most costly first, so the xdist workers finish together). After changing
what a file costs, refresh it from a full run:

    MESHTRAIN_TEST_TIMES=/tmp/times.json .venv/bin/python -m pytest -q -n 3 --dist loadfile --no-loadscope-reorder tests
    .venv/bin/python tests/suite_budget.py /tmp/times.json      # rewrites tests/test_costs.json

At the end of the session (on the xdist controller) it prints the total, the host (CPU model and
the flags that pick torch's CPU kernels: ``host_line``), the host's speed (``speed_gauge``, at
the start and at the end) and the 25 most costly tests, and flags
every test over the per-test budget (``PER_TEST_BUDGET_S``, wall). It does not fail the run on
time: wall time depends on the host and what else runs on it, and a red suite
for a busy neighbour would teach people to ignore it. ``MESHTRAIN_TEST_TIMES=path.json`` also
writes every test's figures to a JSON file (how docs/testing.md's table was made).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import time
from pathlib import Path

import pytest

COSTS = Path(__file__).with_name("test_costs.json")
# a file not in COSTS yet: its tier's typical cost, seconds
DEFAULT_COST = {"e2e": 30.0, "distributed": 10.0, "unit": 2.0}
PER_TEST_BUDGET_S = float(os.environ.get("MESHTRAIN_TEST_BUDGET_S", "60"))  # the variable: for its own test
SUITE_BUDGET_S = 12 * 60  # the whole `make test`, idle 2-core host
SHOWN = 25

_PROCESS_COUNT = 0


def _count_popen() -> None:
    """Count every process this worker starts through subprocess (train.py, torchrun, scripts)."""
    original = subprocess.Popen.__init__

    def counting_init(self, *args, **kwargs):
        global _PROCESS_COUNT
        _PROCESS_COUNT += 1
        original(self, *args, **kwargs)

    subprocess.Popen.__init__ = counting_init


def _forkserver_children_cpu() -> float:
    """CPU seconds of the processes the launcher's forkserver forked and reaped so far."""
    try:
        from multiprocessing import forkserver

        pid = forkserver._forkserver._forkserver_pid
        if pid is None:
            return 0.0
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        # fields[0] is field 3 (state): cutime and cstime are fields 16 and 17
        return (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ImportError, AttributeError, IndexError, ValueError):
        return 0.0


def _forked_ranks() -> int:
    try:
        import tools.forkserver

        return tools.forkserver.RANKS_STARTED
    except (ImportError, AttributeError):
        return 0


def _cpu_now() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime + _forkserver_children_cpu()


def _processes_now() -> int:
    return _PROCESS_COUNT + _forked_ranks()


class _Worker:
    """Runs where the tests run (each xdist worker, or the only process): measures each phase
    and hands the figures over in the phase's report."""

    def __init__(self) -> None:
        self.start: tuple[float, int] | None = None

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_setup(self, item):
        self.start = (_cpu_now(), _processes_now())
        yield

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item):
        self.start = (_cpu_now(), _processes_now())
        yield

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_teardown(self, item, nextitem):
        self.start = (_cpu_now(), _processes_now())
        yield

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        report = outcome.get_result()
        if self.start is not None:
            cpu, procs = self.start
            report.user_properties.append(("cpu_s", round(_cpu_now() - cpu, 3)))
            report.user_properties.append(("processes", _processes_now() - procs))


class _Collector:
    """Runs in the process that reports (the xdist controller): adds the phases up per test."""

    def __init__(self, config) -> None:
        self.config = config
        self.tests: dict[str, dict] = {}
        self.session_start = time.monotonic()
        self.gauge_start = speed_gauge()  # before the workers start: the cores are idle

    def pytest_runtest_logreport(self, report):
        row = self.tests.setdefault(report.nodeid, {"wall_s": 0.0, "cpu_s": 0.0, "processes": 0})
        row["wall_s"] += report.duration
        props = dict(report.user_properties)
        row["cpu_s"] += props.get("cpu_s", 0.0)
        row["processes"] += props.get("processes", 0)

    def pytest_terminal_summary(self, terminalreporter):
        if not self.tests:
            return
        wall = time.monotonic() - self.session_start
        rows = sorted(self.tests.items(), key=lambda kv: -kv[1]["wall_s"])
        cpu = sum(r["cpu_s"] for _, r in rows)
        procs = sum(r["processes"] for _, r in rows)
        tr = terminalreporter
        tr.section("suite budget (docs/testing.md)")
        tr.write_line(
            f"{len(rows)} tests in {wall:.0f} s wall; tests' own time {sum(r['wall_s'] for _, r in rows):.0f} s, "
            f"CPU {cpu:.0f} s, {procs} processes started (budget: make test <= {SUITE_BUDGET_S // 60} min "
            f"on an idle 2-core host, no test over {PER_TEST_BUDGET_S:.0f} s)"
        )
        gauge = (self.gauge_start, speed_gauge())
        tr.write_line(f"host: {host_line()}")
        tr.write_line(
            f"host speed: the fixed workload of tests/suite_budget.py speed_gauge took {gauge[0]:.2f} CPU s at the "
            f"start and {gauge[1]:.2f} at the end (CPU figures of two runs compare after dividing by it)"
        )
        tr.write_line(f"the {min(SHOWN, len(rows))} slowest (setup + call + teardown; a module fixture counts once):")
        tr.write_line(f"{'wall s':>7} {'CPU s':>7} {'procs':>5}  test")
        for nodeid, r in rows[:SHOWN]:
            tr.write_line(f"{r['wall_s']:7.1f} {r['cpu_s']:7.1f} {r['processes']:5d}  {nodeid}")
        over = [(n, r) for n, r in rows if r["wall_s"] > PER_TEST_BUDGET_S]
        for nodeid, r in over:
            tr.write_line(f"over budget: {nodeid} took {r['wall_s']:.0f} s (> {PER_TEST_BUDGET_S:.0f} s)", yellow=True)
        out = os.environ.get("MESHTRAIN_TEST_TIMES")
        if out:
            Path(out).write_text(
                json.dumps(
                    {"wall_s": round(wall, 1), "host": host_line(), "speed_gauge_s": gauge, "tests": dict(rows)},
                    indent=1,
                )
                + "\n"
            )


def host_line() -> str:
    """The host the run's figures come from: the CPU model and the instruction-set flags that
    decide torch's CPU kernels (models/common/cpu_info.py), the core count, torch's CPU
    capability and the kernel variables the second lane sets (tests/kernel_lane.py), so a slow
    run on a new kind of host is explainable from its log."""
    import torch

    from models.common.cpu_info import describe_cpu

    lane = [f"{k}={os.environ[k]}" for k in ("ATEN_CPU_CAPABILITY", "MKL_CBWR") if os.environ.get(k)]
    return (
        f"{describe_cpu()}, {os.cpu_count()} cores; torch {torch.__version__}, CPU capability "
        f"{torch.backends.cpu.get_cpu_capability()}" + (f" ({', '.join(lane)})" if lane else "")
    )


def speed_gauge() -> float:
    """CPU seconds of a fixed workload shaped like the suite's (interpreter work and small torch
    ops through the dispatcher; one thread): 0.13-0.15 s on the 2-core Intel Xeon AMX host on
    2026-12-08 (``import torch`` 1.5 CPU s then). That host's speed drifted by up to 2x within a
    session (docs/testing.md), and every CPU figure of a run moves with it: a run's CPU seconds
    divided by its gauge compare with another run's, where the raw figures do not. Median of
    three tries."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tries = []
    try:
        for _ in range(3):
            t0 = time.process_time()
            table: dict[int, str] = {}
            for i in range(200_000):
                table[i * 7919 % 65_521] = str(i)
            sorted(table.items(), key=lambda kv: kv[1])
            x = torch.ones(8, 8)
            for _ in range(20_000):
                x = torch.add(x, 1.0).mul_(0.5)
            tries.append(time.process_time() - t0)
    finally:
        torch.set_num_threads(threads)
    return round(sorted(tries)[1], 3)


_costs: dict[str, float] | None = None


def file_cost(path: str) -> float:
    """Seconds a worker spent on the test file ``path`` (relative to the repository,
    "tests/unit/x.py") in the last recorded full run, or its tier's default. Wall, not CPU: a
    worker waiting on a hung rank's timeout is busy for the schedule all the same."""
    global _costs
    if _costs is None:
        try:
            _costs = json.loads(COSTS.read_text())["wall_s"]
        except (OSError, ValueError, KeyError):
            _costs = {}
    if path in _costs:
        return _costs[path]
    parts = Path(path).parts
    return DEFAULT_COST.get(parts[1] if len(parts) > 2 else "", 1.0)


def write_costs(times_json: str) -> dict[str, float]:
    """tests/test_costs.json from a full run's MESHTRAIN_TEST_TIMES file: wall and CPU seconds per
    file."""
    tests = json.loads(Path(times_json).read_text())["tests"]
    wall: dict[str, float] = {}
    cpu: dict[str, float] = {}
    for nodeid, row in tests.items():
        name = nodeid.split("::", 1)[0]
        wall[name] = wall.get(name, 0.0) + row["wall_s"]
        cpu[name] = cpu.get(name, 0.0) + row["cpu_s"]
    ordered = {k: round(v, 1) for k, v in sorted(wall.items(), key=lambda kv: -kv[1])}
    doc = {
        "about": "seconds per test file in a full make-test run (tests/suite_budget.py): wall_s orders the files, "
        "most costly first; cpu_s is for people",
        "wall_s": ordered,
        "cpu_s": {k: round(cpu[k], 1) for k in ordered},
    }
    COSTS.write_text(json.dumps(doc, indent=1) + "\n")
    return ordered


def pytest_configure(config):
    _count_popen()
    config.pluginmanager.register(_Worker(), "suite_budget_worker")
    if not hasattr(config, "workerinput"):  # the controller, or a run without xdist
        config.pluginmanager.register(_Collector(config), "suite_budget_collector")


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python tests/suite_budget.py", description="rewrite tests/test_costs.json from a full run's times"
    )
    parser.add_argument("times_json", help="the file a full run wrote with MESHTRAIN_TEST_TIMES=<file>")
    args = parser.parse_args(argv)
    costs = write_costs(args.times_json)
    print(f"{COSTS}: {len(costs)} files, {sum(costs.values()):.0f} s of tests in all")


if __name__ == "__main__":
    main()
