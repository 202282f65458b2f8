"""`make bench-gpu` is only meaningful on a GPU; its --smoke mode runs every code path on tiny
CPU shapes so a broken benchmark is caught here, not on a lent GPU. Also: the first-GPU-run
checklist it prints (benchmarks/gpu_checklist.py, mirrored in docs/gpus.md) and the Makefile's
two ways to set up the venv (plain, and SYSTEM_TORCH=1 on the node's own torch)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from benchmarks.gpu import ROOT
from benchmarks.gpu_checklist import CHECKLIST, CheckItem, render_markdown, render_text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU smoke path and the no-GPU error")
def test_bench_gpu_refuses_without_a_gpu():
    res = subprocess.run([sys.executable, "-m", "benchmarks.gpu"], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 2
    assert "needs a CUDA GPU" in res.stderr and "--smoke" in res.stderr
    assert "SYSTEM_TORCH=1 make bench-gpu" in res.stderr  # the way to a GPU node's own torch
    assert "Traceback" not in res.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU smoke path")
def test_bench_gpu_timeout_and_masks_select_and_bound_rows(tmp_path, capsys):
    """--masks picks the rows; --timeout kills a measurement that runs too long and reports it in
    its row (a hang on a lent GPU costs one row, not the call), with exit code 1. ``main`` runs in
    this process (the command line's own exit code: test_bench_gpu_refuses_without_a_gpu); its
    measurement processes are new interpreters (the default ``--launcher subprocess``, what a GPU
    run uses), killed by the timeout."""
    from benchmarks.gpu import main

    out = tmp_path / "gpu.json"
    argv = ["--smoke", "--modes", "eager", "--masks", "block_causal"]
    argv += ["--steps", "3", "--warmup", "1", "--timeout", "0.5", "--out", str(out)]
    code = main(argv)
    res = capsys.readouterr()
    assert code == 1, res.err[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["case"]["model"], r["case"]["attn_mask_type"]) for r in rows] == [("llama3", "block_causal")]
    for kind in ("trainer", "bare"):
        assert rows[0][kind]["error"].startswith(
            ("train.py did not finish in 0.5 s", "ours loop did not finish in 0.5 s")
        ), rows[0][kind]
    assert "Traceback" not in res.err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU smoke path and the no-GPU error")
def test_bench_gpu_smoke_runs_every_measurement(tmp_path, capsys, monkeypatch):
    """Every measurement of the smoke run (trainer, bare loop, torchtitan's model, planner; bf16
    and float8 rows of both models; the block-causal row) runs and writes its row and the table.

    Kept cheap without losing a path: ``main`` runs in this process (``python -m benchmarks.gpu``
    itself, its argument parsing and its exit codes are the other tests' subject), each
    measurement process is forked from tools/launcher.py's server (``--launcher fork``: the same
    script, arguments, environment and working directory as the default new interpreter, whose
    start and timeout kill test_bench_gpu_timeout_and_masks_select_and_bound_rows runs), and 2
    steps with 1 warmup leave one timed step per measurement (the warmup step is dropped: checked),
    so the rows' figures come from the same code as with more steps (a median of one), and the
    census step is the one after them. One intra-op thread per measurement process
    (``OMP_NUM_THREADS=1``, which tools/launcher.py applies to a forked process): with torch's
    default of one per core, OpenMP's spinning threads on a loaded 2-core host cost more for the
    same run (measured: 11 vs 13 to 49 CPU s for the 11 processes and the fork server), and the
    smoke numbers mean nothing either way."""
    from benchmarks.gpu import main

    monkeypatch.setenv("OMP_NUM_THREADS", "1")

    out = tmp_path / "gpu.json"
    argv = ["--smoke", "--modes", "eager", "--steps", "2", "--warmup", "1", "--launcher", "fork", "--out", str(out)]
    code = main(argv)
    res = capsys.readouterr()
    assert code == 0, res.out[-3000:] + res.err[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["case"]["model"], r["case"]["attn_mask_type"], r["case"]["precision"]) for r in rows] == [
        ("llama3", "causal", "bf16"),
        ("llama3", "causal", "float8"),  # model.converters = ["float8"], tensorwise
        ("deepseek_v3", "causal", "bf16"),
        ("deepseek_v3", "causal", "float8"),
        ("llama3", "block_causal", "bf16"),  # the GPU's flex row, on the CPU reference kernel (sdpa)
    ]
    assert "block_causal sdpa" in rows[4]["name"] and "attn_mask_type=block_causal" in rows[4]["trainer"]["data"]
    assert "float8" in rows[1]["name"] and "float8 (linears + experts)" in rows[3]["name"]
    assert rows[0]["trainer"]["float8"] is None and "routed experts stay" in rows[1]["trainer"]["float8"]
    # DeepSeek's float8 row: its 2 MoE layers (3 layers, the first dense) with float8 experts
    assert "2 routed-expert modules' grouped GEMMs in float8" in rows[3]["trainer"]["float8"]
    for r in rows:
        assert r["trainer"]["tokens_per_s"] > 0 and r["bare"]["tokens_per_s"] > 0, r
        assert r["trainer"]["steps_timed"] == r["bare"]["steps_timed"] == 1  # the warmup step left out
        assert r["trainer_over_bare"] > 0
        planner = r["planner"]  # the planner's estimate of the same run
        assert planner["predicted_step_s"] > 0 and planner["measured_step_s"] > 0
        assert planner["predicted_over_measured"] == planner["predicted_step_s"] / planner["measured_step_s"]
        assert "smoke" in planner["hardware"]
        if r["case"]["precision"] == "bf16":
            assert r["bare"]["matmul_bf16_share"] == 1.0 and r["bare"]["matmul_float8_share"] == 0.0
            continue
        # float8 rows: the converted linears' GEMMs ran in float8, the rest in bf16
        assert 0 < r["bare"]["matmul_float8_share"] < 1
        assert r["bare"]["matmul_float8_share"] + r["bare"]["matmul_bf16_share"] == pytest.approx(1.0, abs=1e-12)
        assert r["float8_over_bf16"]["trainer"] > 0 and r["float8_over_bf16"]["bare"] > 0
        bf16_row = rows[rows.index(r) - 1]
        assert r["planner"]["predicted_time_s"]["compute"] < bf16_row["planner"]["predicted_time_s"]["compute"]
    # the float8 share of each bare loop is the planner's (both use the converters' rules; the
    # formula: tools/planner/compute.py; exact for DeepSeek too: every token visits top_k experts,
    # however it is routed)
    for r in (rows[1], rows[3]):
        assert r["bare"]["matmul_float8_share"] == pytest.approx(_planned_float8_share(r["case"]), rel=1e-9), r
    assert rows[3]["bare"]["matmul_float8_share"] > 0.5  # the experts' GEMMs are float8 too
    from benchmarks.gpu import _torchtitan_available

    if _torchtitan_available():  # make test installs it (the `peer` extra)
        assert rows[0]["torchtitan_model"]["tokens_per_s"] > 0
        assert all("skipped" in r["torchtitan_model"] for r in rows[1:])  # float8, deepseek on CPU, block_causal
    else:
        assert all("torchtitan_model" not in r for r in rows)
    assert "tr/bare" in res.out and "plan/meas s" in res.out  # the table
    # ... and the first-GPU-run checklist at the very end, after the table
    assert res.out.rstrip().endswith(render_text()), res.out[-3000:]
    assert res.out.index("tr/bare") < res.out.index("First GPU run: confirm")


def _planned_float8_share(case: dict) -> float:
    """The planner's float8 share of one step's matmul FLOPs of the bare loop (one rank, no AC
    recomputation: selective per-op AC)."""
    from models.parallel.float8 import Float8Options
    from parallel_dims.layout import validate_degrees
    from tools.planner.choice import LayoutChoice
    from tools.planner.compute import rank_matmul_flops

    b, s = case["local_batch_size"], case["seq_len"]
    experts = ("experts",) if case["model"] == "deepseek_v3" else ()  # as benchmarks/gpu.py converts
    choice = LayoutChoice(b, b, s, ac=case["ac_mode"], float8=Float8Options(moe_fqns=experts))
    overrides = dict(n_layers=case["n_layers"], vocab_size=case["vocab_size"], max_seq_len=s)
    f = rank_matmul_flops(case["model"], case["flavor"], validate_degrees(world_size=1), choice, 0, **overrides)
    return (f["forward_float8"] + f["backward_float8"] + f["recompute_float8"]) / f["total"]


# ------------------------------------------------------------------ the first-GPU-run checklist


def test_checklist_entries_say_what_and_how():
    assert len(CHECKLIST) >= 3
    for item in CHECKLIST:
        assert item.what.strip() and item.how.strip() and item.topic.strip(), item
    text = render_text()
    assert text.splitlines()[0].startswith(f"First GPU run: confirm each of these ({len(CHECKLIST)};")
    for i, item in enumerate(CHECKLIST, 1):
        assert f"{i:>3}. " + item.what.split()[0] in text


def test_gpu_docs_carry_the_checklist():
    """docs/gpus.md's copy between the markers is what `python -m benchmarks.gpu_checklist
    --markdown` prints: an entry added in code and not in the page (or the reverse) fails."""
    page = (ROOT / "docs" / "gpus.md").read_text()
    m = re.search(r"<!-- gpu-checklist:start -->\n(.*?)\n<!-- gpu-checklist:end -->", page, re.S)
    assert m, "docs/gpus.md lacks the gpu-checklist markers"
    assert m.group(1) == render_markdown(), (
        "docs/gpus.md's first-GPU-run checklist differs from benchmarks/gpu_checklist.py: paste the "
        "output of `python -m benchmarks.gpu_checklist --markdown` between the markers"
    )


def test_checklist_markdown_lines_never_open_a_new_block():
    """A wrapped line starting with '>', '-', '#' or '3.' would end the list item in markdown."""
    item = CheckItem(what="x " * 40, how="ratio (a/b) >= 0.97 - then 3. more " * 12, topic="t")
    for line in render_markdown([item, *CHECKLIST]).splitlines():
        if not re.match(r"\d+\. \*\*", line):  # an entry's own first line
            assert line.startswith("   ") and not re.match(r"\s*([>#*+-]|\d+[.)])(\s|$)", line), line


# ------------------------------------------------------------------ make setup: plain and SYSTEM_TORCH=1


def _make_dry_run(tmp_path, target: str, **env) -> str:
    """The commands `make -n target` would run, in an empty folder holding only the Makefile."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    if not (tmp_path / "pyproject.toml").exists():
        (tmp_path / "pyproject.toml").write_text("")
    # a clean top-level make: under `make test` the inherited MAKELEVEL would make it print
    # "Entering/Leaving directory" lines around the recipe
    skip = ("SYSTEM_TORCH", "MAKEFLAGS", "MFLAGS", "MAKELEVEL")
    base = {k: v for k, v in os.environ.items() if k not in skip}
    res = subprocess.run(
        ["make", "--no-print-directory", "-n", target],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**base, **env},
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_plain_setup_installs_the_cpu_torch_as_before(tmp_path):
    out = _make_dry_run(tmp_path, "setup")
    assert "-m venv .venv" in out and "--system-site-packages" not in out
    assert "pip install --quiet --upgrade pip" in out and '"torch==2.13.0"' in out
    assert "touch .venv/.installed" in out


def test_system_torch_setup_installs_nothing_from_the_network(tmp_path):
    out = _make_dry_run(tmp_path, "bench-gpu", SYSTEM_TORCH="1")
    assert "--system-site-packages" in out
    assert "--upgrade pip" not in out and "torch==2.13.0" not in out  # no pip upgrade, no torch install
    assert "pip install --quiet --no-deps --no-build-isolation --no-index -e ." in out
    assert "system-torch-constraint.txt" in out  # the optional extras keep the system's torch
    assert "touch .venv/.installed-system-torch" in out
    assert out.rstrip().splitlines()[-1].startswith(".venv/bin/python -m benchmarks.gpu")
    # the venv is remembered: once made, plain make commands use its stamp
    (tmp_path / ".venv").mkdir()
    stamp = tmp_path / ".venv" / ".installed-system-torch"
    stamp.write_text("")
    mtime = (tmp_path / "pyproject.toml").stat().st_mtime
    os.utime(stamp, (mtime + 10, mtime + 10))  # newer than pyproject.toml: set up already
    assert _make_dry_run(tmp_path, "bench-gpu").strip() == (
        ".venv/bin/python -m benchmarks.gpu --out bench_results/gpu.json"
    )
