"""Automatic restarts (trainer/lifecycle/restarts.py, docs/long_runs.md) through the launcher,
as users type it: ``python train.py --nproc_per_node N --max_restarts K``. Real launches (the
claim is the elastic agent's: processes killed, restarted, their exit codes), so few of them.

* the drill: 4 processes (fsdp=4), ``--max_restarts 2``, checkpoints every 2 steps, rank 2
  SIGKILLed as step 4 starts in the first start only (``kill@4:rank=2:restart=0``): the agent
  restarts all four once, they resume from step-2, redo step 3 and finish; exit 0, exactly one
  restart line naming rank 2, SIGKILL, step 4 and step-2; a ``restart`` row counting the one
  redone step; the loss curve (the last row of each step) bitwise the uninterrupted run's on
  the same layout (its ranks forked: tests/e2e/test_launcher.py proves a forked run bitwise the
  torchrun run);
* restarts spent: 2 processes, ``--max_restarts 1``, ``kill@2:rank=1`` in every start: one
  restart line, then one ``gave up after 1 restart`` line, exit 137 (SIGKILL's code).

Bad input under ``--max_restarts 2`` is not restarted: tests/e2e/test_train_launcher.py (its
launches of the workers' user error carry the flag)."""

from __future__ import annotations

import pytest

from .helpers import FAST, all_records, metric_records, read_metrics, run_forked
from .test_train_launcher import launch

pytestmark = pytest.mark.e2e

DRILL = ["--config", "llama3.toml", "--model.n_layers", "2", *FAST, "--training.steps", "6",
         "--checkpoint.enable", "true", "--checkpoint.interval", "2"]  # fmt: skip
KILLED_RANK, KILLED_AT = 2, 4  # checkpoints at 2, 4, 6: step 3 is done twice


def _restart_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("restart ")]


def test_a_killed_rank_is_restarted_and_the_loss_curve_is_the_uninterrupted_runs(tmp_path):
    fault = f"kill@{KILLED_AT}:rank={KILLED_RANK}:restart=0"
    run = launch(4, "--max_restarts", "2", *DRILL, "--job.dump_folder", str(tmp_path / "drill"),
                 "--debug.fault", fault)  # fmt: skip
    out = run.stdout + run.stderr
    assert run.returncode == 0, (fault, out[-4000:])
    want_line = f"restart 1/2: rank {KILLED_RANK} died (SIGKILL) at step {KILLED_AT}; resuming from step-2"
    assert _restart_lines(out) == [want_line], (fault, out[-4000:])
    assert "error:" not in out and "gave up" not in out, out[-4000:]

    rows = all_records(tmp_path / "drill")
    events = [r for r in rows if "restart" in r]
    assert events == [{**events[0], "step": 2, "restart": 1, "resumed_from": 2, "redone_steps": 1}], events
    assert [r["step"] for r in metric_records(tmp_path / "drill")] == [1, 2, 3, 3, 4, 5, 6]

    reference = run_forked(4, *DRILL, "--job.dump_folder", str(tmp_path / "reference"))
    assert reference.returncode == 0, reference.stderr[-3000:]
    got = {step: row["loss"] for step, row in read_metrics(tmp_path / "drill").items()}  # the last row of a step
    want = {step: row["loss"] for step, row in read_metrics(tmp_path / "reference").items()}
    assert got == want and len(got) == 6, (fault, got, want)


def test_restarts_spent_end_in_one_line(tmp_path):
    """``kill@2:rank=1`` fires in every start (each resumes before step 2): the one restart
    is spent, and the job ends with one line, non-zero."""
    run = launch(2, "--max_restarts", "1", *DRILL, "--job.dump_folder", str(tmp_path), "--debug.fault", "kill@2:rank=1")
    out = run.stdout + run.stderr
    assert run.returncode == 137, out[-4000:]
    assert _restart_lines(out) == ["restart 1/1: rank 1 died (SIGKILL) at step 2; no checkpoint: starting from step 0"]
    ends = [line for line in out.splitlines() if line.startswith("gave up")]
    assert ends == ["gave up after 1 restart: rank 1 died (SIGKILL) at step 2; no checkpoint (its output is above)"], (
        out
    )
    assert "Traceback" not in out, out[-4000:]
