"""The `make bench` section ``checkpoint`` (issue 27): its pure functions on metrics.jsonl records
(which saves, what each held training, which steps a background write overlaps, the ratios) on
hand-written records shaped like the trainer's, and its committed results. No training run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import checkpoint, report, run

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def _step(step, elapsed=1.0, **ckpt):
    return {"step": step, "loss": 5.0, "interval_s": elapsed, **ckpt}


# disabled: saves at 3 and 6 (6 = the last step); the stall is the write, on the save's record
DISABLED = [
    _step(1, 9.0),
    _step(2),
    _step(3, checkpoint_stall_s=4.0, checkpoint_write_s=4.0),
    _step(4),
    _step(5),
    _step(6, checkpoint_stall_s=5.0, checkpoint_write_s=5.0),
]
# async: the save of step 3 is noticed done at step 5, the final save of step 6 at the run's end
ASYNC = [
    _step(1, 9.0),
    _step(2),
    _step(3, checkpoint_stall_s=0.5),
    _step(4, 3.0),
    _step(5, 2.0, checkpoint_write_s=6.0, checkpoint_poll_stall_s=0.1),
    _step(6, checkpoint_stall_s=0.4),
    {"step": 6, "checkpoint_write_s": 7.0, "checkpoint_poll_stall_s": 6.5},
]


def test_saves_pair_each_background_start_with_the_record_of_its_end():
    s = checkpoint.saves(ASYNC)
    assert [(x["step"], x["done_step"], x["final"]) for x in s] == [(3, 5, False), (6, None, True)]
    assert s[0]["held_s"] == pytest.approx(0.6) and s[0]["write_s"] == 6.0
    assert s[1]["held_s"] == pytest.approx(6.9)  # the end-of-run wait is in the final save's figure
    d = checkpoint.saves(DISABLED)
    assert [(x["step"], x["done_step"], x["held_s"], x["write_s"]) for x in d] == [(3, 3, 4.0, 4.0), (6, 6, 5.0, 5.0)]


def test_a_save_that_starts_on_the_step_the_previous_one_ends_is_two_saves():
    """The record of a save step may also carry the previous save's end (its write and poll
    stall): that record closes the old save and opens the new one (not read as synchronous)."""
    records = [
        _step(1),
        _step(2, checkpoint_stall_s=0.3),
        _step(3),
        _step(4, checkpoint_stall_s=0.2, checkpoint_write_s=2.0, checkpoint_poll_stall_s=0.05),
        _step(5),
        _step(6, checkpoint_write_s=1.5, checkpoint_poll_stall_s=0.07),
    ]
    s = checkpoint.saves(records)
    assert [(x["step"], x["done_step"], x["write_s"]) for x in s] == [(2, 4, 2.0), (4, 6, 1.5)]
    assert checkpoint.overlapping_steps(records) == {3, 4, 5, 6}


def test_overlapping_steps_are_those_after_the_save_up_to_its_noticed_end():
    assert checkpoint.overlapping_steps(ASYNC) == {4, 5}  # the final save overlaps no later step
    assert checkpoint.overlapping_steps(DISABLED) == set()  # negative control: nothing in the background
    times = checkpoint.step_times(ASYNC, warmup=1)
    assert sorted(times["overlap"]) == [2.0, 3.0] and times["clear"] == [1.0, 1.0, 1.0]


def test_summary_ratios_are_of_the_interval_saves():
    out = checkpoint.summarize({"disabled": DISABLED, "async": ASYNC}, goal=0.2)
    # interval saves only: async held 0.6 s, disabled 4.0 s
    assert out["stall_ratio_async_over_disabled"] == pytest.approx(0.15) and out["goal_met"] is True
    assert out["async_overlap_step_over_clear_step"] == pytest.approx(2.5)  # (3 + 2) / 2 over 1
    assert out["async_overlap_step_over_disabled_step"] == pytest.approx(2.5)
    assert out["async_write_over_sync_save"] == pytest.approx(1.5)
    # the same figures against a slower async save miss the goal (the check can fail)
    slow = [dict(r, checkpoint_stall_s=2.0) if r.get("checkpoint_stall_s") == 0.5 else r for r in ASYNC]
    missed = checkpoint.summarize({"disabled": DISABLED, "async": slow}, goal=0.2)
    assert missed["stall_ratio_async_over_disabled"] == pytest.approx(0.525) and missed["goal_met"] is False


def test_train_args_name_the_mode_and_log_every_step():
    args = checkpoint.train_args("async", "/tmp/x")
    pairs = dict(zip(args[::2], args[1::2]))
    assert pairs["--checkpoint.async_mode"] == "async" and pairs["--metrics.log_freq"] == "1"
    assert pairs["--checkpoint.enable"] == "true" and pairs["--checkpoint.interval"] == str(checkpoint.INTERVAL)


def test_checkpoint_section_is_registered_and_its_results_committed():
    assert "checkpoint" in run.SECTIONS and "checkpoint" in report.SECTION_IDS
    data = json.loads((ROOT / "bench_results" / "checkpoint.json").read_text())["checkpoint"]
    assert data["config"]["model_and_adamw_bytes"] > 300e6  # several hundred MB of state
    assert set(data["modes"]) == {"disabled", "async"}
    ratio = data["stall_ratio_async_over_disabled"]
    assert ratio > 0 and data["goal_met"] == (ratio <= checkpoint.GOAL)
    assert data["summary"] == checkpoint.summary_line(data)  # the page's paragraph is of these figures
    assert "via_temp_dcp" in data["hf_export"]["seconds"] and "direct" in data["hf_export"]["seconds"]
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    assert "## Checkpoint saves and Hugging Face export" in page and "stall_ratio_async_over_disabled" in page
