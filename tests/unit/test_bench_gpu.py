"""`make bench-gpu` is only meaningful on a GPU; its --smoke mode runs every code path on tiny
CPU shapes so a broken benchmark is caught here, not on a lent GPU."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from benchmarks.gpu import ROOT


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU smoke path and the no-GPU error")
def test_bench_gpu_refuses_without_a_gpu():
    res = subprocess.run([sys.executable, "-m", "benchmarks.gpu"], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 2
    assert "needs a CUDA GPU" in res.stderr and "--smoke" in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU smoke path and the no-GPU error")
def test_bench_gpu_smoke_runs_every_measurement(tmp_path):
    out = tmp_path / "gpu.json"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.gpu",
            "--smoke",
            "--modes",
            "eager",
            "--steps",
            "3",
            "--warmup",
            "1",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["case"]["model"] for r in rows] == ["llama3", "deepseek_v3"]
    for r in rows:
        assert r["trainer"]["tokens_per_s"] > 0 and r["bare"]["tokens_per_s"] > 0, r
        assert r["trainer_over_bare"] > 0
        assert r["bare"]["matmul_bf16_share"] == 1.0  # the bare loop's GEMMs are bf16
        planner = r["planner"]  # the planner's estimate of the same run
        assert planner["predicted_step_s"] > 0 and planner["measured_step_s"] > 0
        assert planner["predicted_over_measured"] == planner["predicted_step_s"] / planner["measured_step_s"]
        assert "smoke" in planner["hardware"]
    from benchmarks.gpu import _torchtitan_available

    if _torchtitan_available():  # make test installs it (the `peer` extra)
        assert rows[0]["torchtitan_model"]["tokens_per_s"] > 0
        assert "skipped" in rows[1]["torchtitan_model"]
    else:
        assert all("torchtitan_model" not in r for r in rows)
    assert "tr/bare" in res.stdout and "plan/meas s" in res.stdout  # the table
