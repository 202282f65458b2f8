"""The checkpoint-process kill drill's CPU side (tools/ckpt_kill_drill, docs/long_runs.md "The
checkpoint-process kill drill"): the drill itself needs CUDA (``async_with_pinned_mem``); what it
reads (processes, lines, checkpoints, curves) and how it judges are checked here on made-up and
real inputs, each failure it must catch with a record that has it, and its runs' commands
against the trainer's own config loader and planner. On CPU it refuses in one line."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from tools.ckpt_kill_drill.checks import (
    BOUND_GRACE_S,
    checkpoint_processes,
    compare_curves,
    complete_steps,
    judge,
    last_rows,
    outcome_lines,
    proc_table,
    restart_rows,
    tagged_processes,
)

pytestmark = pytest.mark.unit

SPAWN = ["/usr/bin/python", "-c", "from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=5, pipe_handle=7)",
         "--multiprocessing-fork"]  # fmt: skip


def _proc(ppid, cmdline, **env):
    return {"ppid": ppid, "cmdline": cmdline, "environ": [f"{k}={v}" for k, v in env.items()]}


def test_the_checkpoint_processes_are_the_spawned_children_of_the_launcher_s_workers():
    table = {
        100: _proc(1, ["python", "train.py", "--nproc_per_node", "2"]),  # the launcher
        101: _proc(100, ["python", "train.py"], RANK="0"),
        102: _proc(100, ["python", "train.py"], RANK="1"),
        103: _proc(100, ["python", "-c", "x"]),  # the launcher's child that is no worker (no RANK)
        201: _proc(101, SPAWN, RANK="0"),  # rank 0's checkpoint process
        202: _proc(101, ["python", "-c", "from multiprocessing.resource_tracker import main;main(5)"], RANK="0"),
        203: _proc(102, SPAWN, RANK="1"),
        204: _proc(103, SPAWN),  # spawned by a non-worker
        300: _proc(1, SPAWN, RANK="0"),  # an orphan of another job
    }
    assert checkpoint_processes(table, 100) == {0: [201], 1: [203]}
    assert checkpoint_processes(table, 999) == {}


def test_the_orphans_are_the_tagged_processes_left_and_proc_is_read_for_real(tmp_path):
    table = {5: _proc(1, ["a"], DRILL="x"), 6: _proc(1, ["b"], DRILL="y"), 7: _proc(1, ["c"], DRILL="x")}
    assert [p["pid"] for p in tagged_processes(table, "DRILL", "x", exclude={7})] == [5]
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], env={**os.environ, "DRILL": "z"})
    try:
        found = tagged_processes(proc_table(), "DRILL", "z")
        assert [(p["pid"], p["ppid"]) for p in found] == [(child.pid, os.getpid())], found
    finally:
        child.kill()
        child.wait()


def test_complete_checkpoints_are_final_names_with_dcp_metadata(tmp_path):
    assert complete_steps(tmp_path / "none") == []
    for name, metadata in (("step-2", True), ("step-10", True), ("step-4.tmp", True), ("step-6", False)):
        (tmp_path / name).mkdir()
        if metadata:
            (tmp_path / name / ".metadata").write_bytes(b"x")
    (tmp_path / "step-8").write_text("a file, not a folder")
    assert complete_steps(tmp_path) == [2, 10]


def test_the_curve_is_the_last_row_of_each_step_and_one_ulp_is_caught():
    records = [{"step": 1, "loss": 8.0, "grad_norm": 1.0}, {"step": 2, "loss": 7.5, "grad_norm": 1.2},
               {"step": 3, "loss": 9.9, "grad_norm": 9.9},  # trained on weights the resume discarded
               {"step": 2, "restart": 1, "resumed_from": 2, "redone_steps": 1},
               {"step": 3, "loss": 7.0, "grad_norm": 1.1}]  # fmt: skip
    rows = last_rows(records)
    assert [rows[s]["loss"] for s in (1, 2, 3)] == [8.0, 7.5, 7.0]
    assert restart_rows(records) == [records[3]]
    reference = {1: {"loss": 8.0, "grad_norm": 1.0}, 2: {"loss": 7.5, "grad_norm": 1.2}, 3: {"loss": 7.0, "grad_norm": 1.1}}  # fmt: skip
    assert compare_curves(reference, rows, range(1, 4)) == []
    # negative control: one ulp off in one step, a step missing
    off = {**reference, 3: {"loss": math.nextafter(7.0, 8.0), "grad_norm": 1.1}}
    assert compare_curves(off, rows, range(1, 5)) == [
        f"step 3: loss 7.0 != reference {math.nextafter(7.0, 8.0)!r}",
        "step 4: no reference row",
    ]


def test_the_launcher_s_outcome_lines_are_read():
    out = "\n".join([
        "step 6/12  loss 7.1",
        "error: checkpoint save of step 6 failed on rank 1: Checkpoint background process is dead",
        "restart 1/1: rank 1 exited with code 1 at step 7; resuming from step-4",
        "gave up after 1 restart: rank 0 exited with code 3 at step 9; the newest checkpoint is step-8 (...)",
        "  restart 2/3 is not at the start of a line",
    ])  # fmt: skip
    lines = outcome_lines(out)
    assert lines["restarts"] == ["restart 1/1: rank 1 exited with code 1 at step 7; resuming from step-4"]
    assert [line[:9] for line in lines["gave_up"]] == ["gave up a"] and len(lines["errors"]) == 1
    assert not lines["traceback"] and outcome_lines("Traceback (most recent call last):\n  x")["traceback"]


def _passing() -> dict:
    return {
        "bound_s": 60 + BOUND_GRACE_S,
        "kill": {"rank": 1, "pid": 4321, "step": 6, "mid_save": True, "complete_before": [2, 4]},
        "end": {"exitcode": 0, "outcome_after_s": 3.5},
        "lines": {
            "restarts": ["restart 1/1: rank 1 exited with code 1 at step 7; resuming from step-4"],
            "gave_up": [],
            "errors": ["error: checkpoint save of step 6 failed on rank 1: ..."],
            "traceback": False,
        },
        "orphans": [],
        "resumed_from": 4,
        "complete_steps": [2, 4, 8, 10, 12],
        "before_kill": [],
        "after_resume": [],
    }


def _with(**changes) -> dict:
    record = _passing()
    for key, value in changes.items():
        if "." in key:
            outer, inner = key.split(".")
            record[outer] = {**record[outer], inner: value}
        else:
            record[key] = value
    return record


ONE_LINE_END = {"restarts": [], "gave_up": [], "errors": ["error: checkpoint save of step 6 failed ..."], "traceback": False}  # fmt: skip


@pytest.mark.parametrize(
    "record, failure",
    [
        (_with(kill=None, why_no_kill="rank 1's checkpoint process is not one process: {1: []}"),
         "no checkpoint process was killed: rank 1's"),
        (_with(**{"end.exitcode": None}), "the job did not end within its deadline after the kill (a hang)"),
        (_with(**{"end.outcome_after_s": 121.0}), "no restart line nor end within 120 s of the kill"),
        (_with(**{"end.outcome_after_s": None}), "no restart line nor end within 120 s of the kill"),
        (_with(**{"lines.restarts": ["restart 1/2: a", "restart 2/2: b"]}), "2 restart lines after one kill"),
        (_with(**{"end.exitcode": 1}), "the restarted job ended with exit code 1"),
        (_with(lines={**ONE_LINE_END, "errors": ["error: a", "error: b"]}, **{"end.exitcode": 1}),
         "without a restart the job must end in one line"),
        (_with(**{"lines.traceback": True}), "a traceback was printed after the kill"),
        (_with(orphans=[{"pid": 77, "ppid": 1, "cmdline": "python -c spawn_main --multiprocessing-fork"}]),
         "1 process(es) of the job outlived it"),
        (_with(resumed_from=None), "nothing resumed after the kill"),
        (_with(resumed_from=2), "resumed from step 2, older than the newest complete checkpoint step-4"),
        (_with(resumed_from=6), "resumed from step 6, which is not a complete checkpoint"),
        (_with(before_kill=["step 1: loss 8.0 != reference 8.000001"]), "the drill and the reference differ before"),
        (_with(after_resume=["step 7: loss 7.0 != reference 7.1"]), "the resumed curve is not bitwise the reference's"),
    ],
)  # fmt: skip
def test_each_failure_of_the_drill_is_caught(record, failure):
    assert judge(_passing()) == []  # the control: a drill that did everything right passes
    fails = judge(record)
    assert len(fails) == 1 and fails[0].startswith(failure), fails


def test_an_end_in_one_line_without_a_restart_passes():
    assert judge(_with(lines=ONE_LINE_END, **{"end.exitcode": 1})) == []


def test_on_cpu_it_refuses_in_one_line(capsys, monkeypatch):
    import torch

    from tools.ckpt_kill_drill.__main__ import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["--out", "unused.json"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("error: the checkpoint-process kill drill needs CUDA")
    assert main(["--steps", "6"]) == 2  # two saves, one to kill and a step after it need 8
    assert capsys.readouterr().err.startswith("error: --steps must be at least 8")


@pytest.mark.parametrize("ranks", [1, 2])
def test_its_runs_are_valid_jobs_on_cuda(ranks, tmp_path):
    """The three runs' config arguments load and plan for CUDA (async_with_pinned_mem is refused
    only off CUDA), with the same global batch on 1 and 2 ranks."""
    from tools.ckpt_kill_drill.__main__ import commands
    from trainer.config import load_config
    from trainer.plan import plan_job

    cmds = commands("python", ranks, 12, 131072, 60, tmp_path)
    plans = {name: plan_job(load_config(cmd[cmd.index("--config") :]), ranks, device_type="cuda") for name, cmd in cmds.items()}  # fmt: skip
    assert {p.batch.global_batch_size for p in plans.values()} == {4}
    assert plans["drill"].config.checkpoint.async_mode == "async_with_pinned_mem"
    assert cmds["drill"][:6] == ["python", "train.py", "--nproc_per_node", str(ranks), "--max_restarts", "1"]
    assert cmds["resume"] == [*cmds["drill"][:4], *cmds["drill"][6:]]  # the same job without the restarts
