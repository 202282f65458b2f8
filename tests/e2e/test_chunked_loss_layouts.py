"""Tier 3: the chunked cross-entropy (``training.loss_chunk_tokens``) through the real trainer on
the layouts where the loss runs differently, compared with tools.compare_loss (default
tolerances, never loosened) and against the plain loss of the same seed checkpoint and data.

* llama3, block-causal, 2 blocks: ``single`` (the baseline), ``tp=2`` (loss parallel: the
  vocabulary-sharded head, log-sum-exp and target logit all-reduced over tp, the hidden-state
  gradient a partial sum reduce-scattered onto the sequence shard), ``cp=2`` (each rank's
  load-balanced chunks), ``pp=2`` (the last stage takes the micro-batch's labels as a keyword
  through the schedule; 4 micro-batches per step). Then ``single`` again with the plain loss
  (``loss_chunk_tokens = 0``) must give the baseline's curve.
* deepseek_v3 with one MTP depth: ``single`` and ``tp=2`` chunked, then the plain single run:
  the concatenated main + depth states and ``[bs, s, 1 + D]`` targets, ``mtp_loss`` too.

Chunk 24 leaves a partial last chunk on every layout (128 local tokens single/tp, 64 under
cp, 32 per pipeline micro-batch; 256 rows with MTP). 3 steps: step 2 is the first computed from
updated weights, step 3 the first shaped by optimizer state (see test_compare_loss.py), and the
grad norm is compared every step, so the gradients are checked, not only the losses.
Measured (CPU, 2 cores): every layout within 1.2e-7 relative of the baseline loss, grad norms
within 1e-7 relative; the plain runs within 1 ulp of the chunked baselines (loss, grad norm,
mtp_loss 1e-7 relative).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools.forkserver import run_train

from .helpers import read_metrics, run_compare_loss

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3
CHUNK = 24
COMMON = [
    "--model.n_layers",
    "2",
    "--training.seq_len",
    "64",
    "--training.global_batch_size",
    "8",
    "--training.local_batch_size",
    "2",
    "--metrics.enable_tensorboard",
    "false",
    "--training.loss_chunk_tokens",
    str(CHUNK),
]
RTOL, ATOL, GRAD_NORM_RTOL = 1e-5, 1e-5, 1e-4  # compare_loss's defaults


def _compare(out: Path, config: str, layouts: list[str], extra: list[str]) -> dict:
    proc = run_compare_loss(
        "--config",
        config,
        "--steps",
        str(STEPS),
        "--out",
        str(out),
        "--timeout",
        "300",
        "--launcher",
        "fork",
        "--layouts",
        *layouts,
        "--",
        *COMMON,
        *extra,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["passed"] and (summary["rtol"], summary["atol"], summary["grad_norm_rtol"]) == (
        RTOL,
        ATOL,
        GRAD_NORM_RTOL,
    )
    assert [r["layout"] for r in summary["runs"]] == layouts
    for run in summary["runs"]:
        assert run["status"] in ("ok", "baseline") and run["first_step_beyond"] is None, run
    return summary


def _plain_against_baseline(out: Path, keys: tuple[str, ...]) -> None:
    """The baseline layout's resolved config again, with the plain loss: the same curve."""
    baseline = out / "01-single"
    assert f"loss_chunk_tokens = {CHUNK}" in (baseline / "config.toml").read_text()
    plain = out / "plain"
    res = run_train(
        1,
        [
            "--config",
            str(baseline / "config.toml"),
            "--training.loss_chunk_tokens",
            "0",
            "--job.dump_folder",
            str(plain),
        ],
        cwd=ROOT,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    chunked, ref = read_metrics(baseline), read_metrics(plain)
    assert sorted(chunked) == sorted(ref) == list(range(1, STEPS + 1))
    for step in ref:
        for key in keys:
            rtol = GRAD_NORM_RTOL if key == "grad_norm" else RTOL
            assert abs(chunked[step][key] - ref[step][key]) <= ATOL + rtol * abs(ref[step][key]), (step, key)


def test_chunked_loss_llama3_layouts(tmp_path):
    out = tmp_path / "llama3"
    _compare(
        out, "train_configs/llama3.toml", ["single", "tp=2", "cp=2", "pp=2"], ["--model.attn_mask_type", "block_causal"]
    )
    _plain_against_baseline(out, ("loss", "grad_norm"))


def test_chunked_loss_mtp_layouts(tmp_path):
    out = tmp_path / "deepseek"
    _compare(out, "train_configs/deepseek_v3.toml", ["single", "tp=2"], ["--model.mtp_layers", "1"])
    _plain_against_baseline(out, ("loss", "grad_norm", "mtp_loss"))
