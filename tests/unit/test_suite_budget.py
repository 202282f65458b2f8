"""The suite's cost table (tests/suite_budget.py) counts what a test really costs: CPU of the
processes it waits for (a subprocess, torchrun and its workers) and of the ranks the launcher's
forkserver forks; it flags a test over the per-test budget; and the run order puts the costly
files first."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.suite_budget import DEFAULT_COST, file_cost

ROOT = Path(__file__).resolve().parents[2]

BUSY = "import time\\nt = time.process_time()\\nwhile time.process_time() - t < 0.6: pass\\n"

SAMPLE = textwrap.dedent(
    f"""
    import subprocess, sys, time

    def test_waits_for_a_busy_child():
        subprocess.run([sys.executable, "-c", "{BUSY}"], check=True)

    def test_sleeps():
        time.sleep(0.3)

    def test_forks_two_busy_ranks(tmp_path):
        from tools.forkserver import run_train
        script = tmp_path / "busy.py"
        script.write_text("{BUSY}")
        assert run_train(2, [], script=script, cwd=tmp_path, timeout=120).returncode == 0
    """
)


def test_the_table_counts_children_and_forked_ranks_and_flags_slow_tests(tmp_path):
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    times = tmp_path / "times.json"
    env = dict(os.environ, MESHTRAIN_TEST_TIMES=str(times), MESHTRAIN_TEST_BUDGET_S="0.25", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "tests.suite_budget", "-p", "no:cacheprovider", "test_sample.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "suite budget" in proc.stdout and "3 tests in" in proc.stdout
    rows = json.loads(times.read_text())["tests"]
    child = rows["test_sample.py::test_waits_for_a_busy_child"]
    forked = rows["test_sample.py::test_forks_two_busy_ranks"]
    sleeper = rows["test_sample.py::test_sleeps"]
    assert child["cpu_s"] >= 0.6 and child["processes"] == 1
    assert forked["cpu_s"] >= 1.2 and forked["processes"] == 2  # both ranks' CPU, though not our children
    assert sleeper["wall_s"] >= 0.3 and sleeper["cpu_s"] < 0.2 and sleeper["processes"] == 0
    # the host is named, in the table and the file: CPU model, kernel flags, cores, torch's capability
    from models.common.cpu_info import cpu_model

    host = json.loads(times.read_text())["host"]
    assert f"host: {host}" in proc.stdout and host.startswith(cpu_model()) and "CPU capability" in host
    # and its speed: the fixed workload, timed before and after the tests (a positive CPU time)
    gauge = json.loads(times.read_text())["speed_gauge_s"]
    assert len(gauge) == 2 and all(g > 0 for g in gauge)
    assert f"took {gauge[0]:.2f} CPU s at the start and {gauge[1]:.2f} at the end" in proc.stdout
    assert "over budget: test_sample.py::test_sleeps" in proc.stdout  # 0.3 s > the 0.25 s budget here


def test_costly_files_run_first():
    costs = json.loads((ROOT / "tests" / "test_costs.json").read_text())["wall_s"]
    assert costs and all(os.path.isfile(ROOT / name) for name in costs), "tests/test_costs.json names a missing file"
    assert list(costs.values()) == sorted(costs.values(), reverse=True)
    first = next(iter(costs))
    assert file_cost(first) == max(costs.values())
    assert file_cost("tests/e2e/test_not_measured_yet.py") == DEFAULT_COST["e2e"]
    # the hook's order on a few files, measured and not
    from tests.conftest import run_order

    names = ["tests/unit/test_not_measured_yet.py", *list(costs)[-2:], "tests/e2e/test_not_measured_yet.py", first]
    ordered = run_order(names)
    assert ordered[0] == first and ordered.index("tests/e2e/test_not_measured_yet.py") < ordered.index(
        "tests/unit/test_not_measured_yet.py"
    )
    assert [file_cost(f) for f in ordered] == sorted((file_cost(f) for f in names), reverse=True)


def test_run_log_records_each_launch_and_what_a_rank_imported(tmp_path, monkeypatch):
    """``MESHTRAIN_RUN_LOG`` (tools/forkserver.py, docs/testing.md "The budget"): a launch's
    record holds its argv and the environment entries that differ from the caller's; a rank's
    record, written at its exit, the modules it imported after it started logging."""
    from tools.forkserver import RUN_LOG, log_run

    log = tmp_path / "runs.jsonl"
    log_run("fork", 2, "train.py", ["--x", "1"], {**os.environ, "EXTRA": "y"})  # unset: nothing written
    assert not log.exists()
    monkeypatch.setenv(RUN_LOG, str(log))
    monkeypatch.setenv("GONE", "z")
    env = {k: v for k, v in os.environ.items() if k != "GONE"}
    log_run("fork", 2, "train.py", ["--x", "1"], {**env, "EXTRA": "y"})
    (record,) = [json.loads(line) for line in log.read_text().splitlines()]
    assert record["kind"] == "fork" and record["nproc"] == 2 and record["argv"] == ["--x", "1"]
    assert record["env"] == {"EXTRA": "y", "GONE": None}

    code = f"from tools.forkserver import _log_imports_at_exit as f; f({str(log)!r}, ['a']); import colorsys"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)
    rank = json.loads(log.read_text().splitlines()[1])
    assert rank["kind"] == "rank_imports" and rank["argv"] == ["a"] and "colorsys" in rank["modules"]
