"""Bad steps, fault drills and stragglers through train.py (docs/long_runs.md), on forked ranks
(tests/e2e/helpers.py ``run_forked``: the claims are the loop's, not the launcher's).

* rollback: 2 ranks (fsdp=2), checkpoints every 3 steps, ``nan_loss@5``: the run reloads
  step-3, names global samples 32:40 (step 5 of G = 8) in its line and in a metrics row, trains
  step 4 again and goes on; its loss curve (the last row of each step) is bitwise the one of an
  uninterrupted run started with ``--training.skip_samples 32:40`` (the same kernels).
* skip: one rank, ``nan_loss@2,nan_loss@3`` with ``max_consecutive_skips = 1``: step 2 is skipped
  (its line, ``skipped_steps`` in the rows), step 3 ends the run with one line, exit 1.
* straggler: ``slow:rank=1:factor=3`` is named (rank 1, its host) within its first interval of
  ``metrics.straggler_interval = 2`` steps after the first; the two rollback runs, without the
  fault, print no such line (and their rows carry the gathered step times).

The run config: llama3 debugmodel, 2 layers, FAST shapes (8 x 64 tokens a step)."""

from __future__ import annotations

import socket

import pytest

from tests.e2e.helpers import FAST, all_records, run_forked

pytestmark = pytest.mark.e2e

BASE = ["--config", "llama3.toml", "--model.n_layers", "2", *FAST, "--metrics.straggler_interval", "2"]
TWO = [*BASE, "--parallelism.fsdp", "2", "--training.steps", "6", "--checkpoint.enable", "true",
       "--checkpoint.interval", "3"]  # fmt: skip


def _curve(folder) -> dict[int, float]:
    """The loss of each step as the run ends with it: its last row (a rollback repeats steps)."""
    return {r["step"]: r["loss"] for r in all_records(folder) if "loss" in r}


@pytest.fixture(scope="module")
def rollback(tmp_path_factory):
    folder = tmp_path_factory.mktemp("rollback")
    runs = {
        "rollback": run_forked(2, *TWO, "--job.dump_folder", str(folder / "rollback"),
                               "--training.on_nonfinite", "rollback", "--debug.fault", "nan_loss@5"),
        "reference": run_forked(2, *TWO, "--job.dump_folder", str(folder / "reference"),
                                "--training.skip_samples", "32:40"),
    }  # fmt: skip
    return folder, runs


def test_rollback_reloads_names_the_samples_and_equals_a_run_that_skips_them(rollback):
    folder, runs = rollback
    for name, run in runs.items():
        assert run.returncode == 0, (name, run.stderr[-3000:])
    out = runs["rollback"].stdout + runs["rollback"].stderr
    lines = [line for line in out.splitlines() if line.startswith("rollback:")]
    assert len(lines) == 1, out[-3000:]
    assert "non-finite loss at step 5" in lines[0] and "reloaded checkpoint step-3" in lines[0], lines
    assert "global samples 32:40 of step 5 are skipped" in lines[0], lines
    events = [r for r in all_records(folder / "rollback") if "rollback_to" in r]
    assert events == [{**events[0], "step": 5, "rollback_to": 3, "skipped_samples": "32:40", "skipped_steps": 1}]
    steps = [r["step"] for r in all_records(folder / "rollback") if "loss" in r]
    assert steps == [1, 2, 3, 4, 4, 5, 6], steps  # step 4 trained again after the reload
    got, want = _curve(folder / "rollback"), _curve(folder / "reference")
    assert got == want, (got, want)


def test_no_straggler_line_without_the_fault_and_the_rows_carry_step_times(rollback):
    folder, runs = rollback
    for name, run in runs.items():
        assert "straggler:" not in run.stdout + run.stderr, (name, run.stdout[-3000:])
    rows = {r["step"]: r for r in all_records(folder / "reference") if "loss" in r}
    for step in (2, 4, 6):
        row = rows[step]
        assert row["step_s_min"] <= row["step_s_median"] <= row["step_s_max"], row
        assert row["step_s_slowest_rank"] in (0, 1), row
    assert "step_s_max" not in rows[3], rows[3]  # every interval, not every step


def test_skip_counts_the_step_and_stops_after_too_many_in_a_row(tmp_path):
    run = run_forked(1, *BASE, "--job.dump_folder", str(tmp_path), "--training.steps", "4",
                     "--training.on_nonfinite", "skip", "--training.max_consecutive_skips", "1",
                     "--debug.fault", "nan_loss@2,nan_loss@3")  # fmt: skip
    assert run.returncode == 1, run.stderr[-3000:]
    out = run.stdout + run.stderr
    assert "skipped step 2: non-finite loss at step 2" in out, out[-3000:]
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "2 bad steps in a row" in errors[0] and "step 3" in errors[0], run.stderr[-3000:]
    assert "Traceback" not in run.stderr
    rows = {r["step"]: r for r in all_records(tmp_path) if "loss" in r}
    assert rows[1]["skipped_steps"] == 0 and rows[2]["skipped_steps"] == 1 and rows[2]["loss"] is None, rows


def test_a_slow_rank_is_named_with_its_host_within_an_interval(tmp_path):
    run = run_forked(2, *BASE, "--job.dump_folder", str(tmp_path), "--training.steps", "4",
                     "--parallelism.fsdp", "2", "--debug.fault", "slow:rank=1:factor=3")  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line for line in (run.stdout + run.stderr).splitlines() if line.startswith("straggler:")]
    assert lines, run.stdout[-3000:]
    assert lines[0].startswith(f"straggler: rank 1 ({socket.gethostname()}) took"), lines
    assert "over steps 2-2" in lines[0] or "over steps 2-4" in lines[0], lines
    assert all(line.startswith("straggler: rank 1 ") for line in lines), lines
    rows = {r["step"]: r for r in all_records(tmp_path) if "loss" in r}
    assert rows[2]["step_s_slowest_rank"] == 1 and rows[4]["step_s_slowest_rank"] == 1, rows
