"""Qwen3 through ``train.py`` (``train_configs/qwen3.toml``, ``qwen3_moe.toml``): both debug
flavors train in one process, and Qwen3-MoE gives the one-process loss curve over fsdp=2, tp=2
and fsdp=2 x ep=2 (``tools.compare_loss``, its DEFAULT tolerance, block-causal attention).

Shapes as tests/e2e/test_compare_loss.py's matrices (its docstring says why they suffice): 2
blocks (with Qwen3-MoE every block is routed, so both carry the router and the experts that
tp and ep shard), seq_len 64, global batch 8 with local batch 2, 3 steps (step 3 is the first
that depends on optimizer state carried over), forked ranks. Measured (CPU, 2 cores): max rel
loss diff 6.0e-8 (fsdp=2, fsdp=2 x ep=2) and 7.8e-7 (tp=2) against the tolerance's 1e-5; about
14 s wall for the comparison, a few seconds per one-process run.
"""

from __future__ import annotations

import math

import pytest

from .helpers import FAST, read_metrics, run_forked
from .test_compare_loss import MATRIX, STEPS, _assert_all_agree, compare_loss

QWEN3_MOE_LAYOUTS = ["single", "fsdp=2", "tp=2", "fsdp=2,ep=2"]


@pytest.mark.parametrize("config", ["qwen3.toml", "qwen3_moe.toml"])
def test_debug_flavor_trains_in_one_process(tmp_path, config):
    """The shipped config trains (2 blocks, 6 steps, warm-up 2): every step's loss and grad
    norm are finite and the loss falls from about ln(2048) = 7.6."""
    out = tmp_path / "run"
    res = run_forked(
        1,
        "--config",
        config,
        *FAST,
        "--model.n_layers",
        "2",
        "--training.steps",
        "6",
        "--lr_scheduler.warmup_steps",
        "2",
        "--checkpoint.enable",
        "false",
        "--job.dump_folder",
        str(out),
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    m = read_metrics(out)
    assert sorted(m) == list(range(1, 7))
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in m.values())
    assert m[6]["loss"] < m[1]["loss"] - 0.1, (m[1]["loss"], m[6]["loss"])


def test_qwen3_moe_layouts_match_one_process(tmp_path):
    """fsdp=2, tp=2 and fsdp=2 x ep=2 give the one-process loss and grad norm within
    compare_loss's default tolerance on every step."""
    out = tmp_path / "cmp"
    proc = compare_loss(
        "--config",
        "train_configs/qwen3_moe.toml",
        "--steps",
        str(STEPS),
        "--out",
        str(out),
        "--timeout",
        "300",
        "--launcher",
        "fork",
        "--layouts",
        *QWEN3_MOE_LAYOUTS,
        "--",
        *MATRIX,
    )
    _assert_all_agree(proc, out, QWEN3_MOE_LAYOUTS)
