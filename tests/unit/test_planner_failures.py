"""The planner's checkpoint interval under failures (tools/planner/failures.py): Young's and
Daly's closed forms, the optimum against the modelled loss, goodput against the failure rate, and
the command line (--json carries the plan; bad values are one line and exit 2)."""

from __future__ import annotations

import io
import json
import math
from contextlib import redirect_stdout

import pytest

from tools.planner.cli import main as planner_main
from tools.planner.failures import (
    FailureModel,
    daly_interval,
    first_order_loss,
    goodput,
    job_mtbf_s,
    plan_checkpoints,
    young_interval,
)

_DEBUG = ["--model", "llama3", "--flavor", "debugmodel", "--world-size", "16", "--gpus-per-node", "8",
          "--seq-len", "256", "--global-batch", "16", "--top", "1"]  # fmt: skip


def _run(argv):
    out = io.StringIO()
    with redirect_stdout(out):
        rc = planner_main(argv)
    return rc, out.getvalue()


# (C, M, Young, Daly): Young = sqrt(2 C M); Daly = Young (1 + sqrt(x) / 3 + x / 9) - C with x = C / 2M,
# evaluated once by hand (C = 50, M = 5000: x = 0.005, Young = 707.1068, Daly = 707.1068 x 1.0241261 - 50)
@pytest.mark.parametrize(
    "save_s, mtbf_s, young, daly",
    [(30.0, 11_100.0, 816.0882, 796.2108), (50.0, 5_000.0, 707.1068, 674.1663), (1.0, 3_600.0, 84.8528, 84.1875)],
)
def test_intervals_match_the_closed_forms(save_s, mtbf_s, young, daly):
    assert young_interval(save_s, mtbf_s) == pytest.approx(young, abs=1e-4)
    assert daly_interval(save_s, mtbf_s) == pytest.approx(daly, abs=1e-4)
    assert daly_interval(save_s, mtbf_s) < young_interval(save_s, mtbf_s)  # Daly subtracts the save itself


def test_daly_caps_at_the_mtbf_when_a_save_takes_two_mtbfs():
    assert daly_interval(200.0, 100.0) == 100.0
    assert daly_interval(250.0, 100.0) == 100.0


def test_job_mtbf_is_the_node_mtbf_over_the_nodes():
    # Llama 3's 54-day snapshot: 419 unexpected interruptions on 2,048 nodes of 8 H100s
    rate = 419 / 54 / 2048
    assert job_mtbf_s(rate, 2048) == pytest.approx(54 * 86400 / 419)
    assert job_mtbf_s(rate, 1024) == pytest.approx(2 * job_mtbf_s(rate, 2048))


@pytest.mark.parametrize(
    "save_s, mtbf_s, restart_s", [(30.0, 11_100.0, 600.0), (5.0, 3_600.0, 60.0), (120.0, 86_400.0, 900.0)]
)
def test_the_optimum_minimises_the_modelled_loss(save_s, mtbf_s, restart_s):
    """Young's interval is the exact minimiser of the first-order loss and Daly's the (near)
    minimiser of the exact model: 10% shorter or longer intervals lose more. The negative control:
    an interval 10% off is not itself a minimum (one of its neighbours does better)."""
    young = young_interval(save_s, mtbf_s)
    best = first_order_loss(young, save_s, mtbf_s, restart_s)
    for tau in (0.9 * young, 1.1 * young):
        assert first_order_loss(tau, save_s, mtbf_s, restart_s) > best
    daly = daly_interval(save_s, mtbf_s)
    top = goodput(daly, save_s, mtbf_s, restart_s)
    for tau in (0.9 * daly, 1.1 * daly):
        assert goodput(tau, save_s, mtbf_s, restart_s) < top
    off = 1.1 * daly
    assert goodput(off / 1.05, save_s, mtbf_s, restart_s) > goodput(off, save_s, mtbf_s, restart_s)
    # Daly is closer to the exact model's optimum than Young (the numeric minimiser on a fine grid)
    grid = [daly * (0.8 + 0.0005 * i) for i in range(801)]
    exact = max(grid, key=lambda t: goodput(t, save_s, mtbf_s, restart_s))
    assert abs(daly - exact) <= abs(young - exact) and abs(daly - exact) / exact < 0.01


def test_goodput_falls_as_failures_rise_and_rises_with_faster_saves():
    rates = [0.001, 0.003, 0.01, 0.03, 0.1, 0.3]
    plans = [plan_checkpoints(FailureModel(r, 30.0, 600.0), 256, 2.0) for r in rates]
    goodputs = [p["goodput"] for p in plans]
    assert all(a > b for a, b in zip(goodputs, goodputs[1:])), goodputs
    assert all(0 < g < 1 for g in goodputs)
    intervals = [p["interval_steps"] for p in plans]
    assert all(a > b for a, b in zip(intervals, intervals[1:])), intervals  # more failures: save more often
    slow, fast = (plan_checkpoints(FailureModel(0.01, c, 600.0), 256, 2.0)["goodput"] for c in (60.0, 6.0))
    assert fast > slow


def test_an_async_write_window_costs_rework_and_bounds_the_interval():
    sync = plan_checkpoints(FailureModel(0.01, 2.0, 300.0), 64, 1.0)
    async_ = plan_checkpoints(FailureModel(0.01, 2.0, 300.0, write_s=40.0), 64, 1.0)
    assert async_["interval_steps"] == sync["interval_steps"] and async_["goodput"] < sync["goodput"]
    # a write longer than Daly's interval: saves no closer than the write (the next one would wait)
    long = plan_checkpoints(FailureModel(0.01, 2.0, 300.0, write_s=5000.0), 64, 1.0)
    assert long["interval_s"] >= 5000.0 - 2.0 > long["daly_interval_s"]


def test_json_carries_the_checkpoint_plan_and_text_states_it():
    flags = ["--node-failures-per-day", "0.5", "--save-seconds", "0.2", "--restart-seconds", "30"]
    rc, out = _run([*_DEBUG, *flags, "--json"])
    assert rc == 0
    data = json.loads(out)
    ckpt = data["checkpoint"]
    mtbf = 86400 / (0.5 * 2)  # 16 GPUs, 8 per node: 2 nodes
    assert ckpt["nodes"] == 2 and ckpt["job_mtbf_hours"] == pytest.approx(mtbf / 3600, rel=1e-4)
    assert ckpt["young_interval_s"] == pytest.approx(math.sqrt(2 * 0.2 * mtbf), rel=1e-4)
    assert ckpt["daly_interval_s"] == pytest.approx(daly_interval(0.2, mtbf), rel=1e-4)
    assert ckpt["step_s"] == pytest.approx(data["top"][0]["step_time_s"]["total"], abs=1e-6)  # the winner's
    assert abs(ckpt["interval_s"] - ckpt["daly_interval_s"]) <= ckpt["step_s"]  # Daly's, in whole steps
    assert ckpt["interval_s"] == pytest.approx(ckpt["interval_steps"] * ckpt["step_s"], abs=1e-3)
    assert 0 < ckpt["goodput"] < 1 and set(ckpt["lost_hours_per_day"]) == {
        "saves",
        "rework",
        "restarts",
        "unfinished_writes",
    }
    rc, text = _run([*_DEBUG, *flags])
    assert rc == 0 and f"checkpoint.interval = {ckpt['interval_steps']} steps" in text
    assert f"expected goodput {ckpt['goodput']:.4f}" in text
    rc, out = _run([*_DEBUG, "--json"])  # no failure rate: no plan, the field is null
    assert rc == 0 and json.loads(out)["checkpoint"] is None


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--node-failures-per-day", "0", "--save-seconds", "1", "--restart-seconds", "1"], "--node-failures-per-day must be a finite number > 0, got 0"),
        (["--node-failures-per-day", "x", "--save-seconds", "1", "--restart-seconds", "1"], "--node-failures-per-day must be a number, got 'x'"),
        (["--node-mtbf-hours", "inf", "--save-seconds", "1", "--restart-seconds", "1"], "--node-mtbf-hours must be a finite number > 0"),
        (["--node-failures-per-day", "1", "--save-seconds", "-3", "--restart-seconds", "1"], "--save-seconds must be a finite number > 0"),
        (["--node-failures-per-day", "1", "--save-seconds", "1", "--restart-seconds", "-1"], "--restart-seconds must be a finite number >= 0"),
        (["--node-failures-per-day", "1"], "needs --save-seconds and --restart-seconds"),
        (["--save-seconds", "1"], "needs a failure rate: add --node-failures-per-day"),
        (["--node-failures-per-day", "1", "--node-mtbf-hours", "24", "--save-seconds", "1", "--restart-seconds", "1"], "not both"),
        (["--node-failures-per-day", "1", "--save-seconds", "9", "--restart-seconds", "1", "--save-write-seconds", "2"], "is shorter than --save-seconds"),
    ],
)  # fmt: skip
def test_bad_failure_options_are_one_line_and_exit_2(flags, expected, capsys):
    assert planner_main([*_DEBUG, *flags]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], captured.err
