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
from pathlib import Path

import pytest
import torch

from benchmarks.gpu_checklist import CHECKLIST, CheckItem, render_markdown, render_text
from benchmarks.gpu_measure import ROOT
from benchmarks.gpu_torchtitan import torchtitan_skip


@pytest.fixture(autouse=True)
def _restore_measurement_settings(monkeypatch):
    """``benchmarks.gpu.main`` sets the module-wide ``--timeout`` and ``--launcher`` of
    benchmarks/gpu_measure.py; each test gets them back as they were, so a test's 0.5 s timeout
    never reaches a later test (which then killed its torchrun under load when run without the
    test between them that happened to reset it)."""
    import benchmarks.gpu_measure as gpu_measure

    monkeypatch.setattr(gpu_measure, "TIMEOUT_S", gpu_measure.TIMEOUT_S)
    monkeypatch.setattr(gpu_measure, "LAUNCHER", gpu_measure.LAUNCHER)


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
    for kind in ("trainer", "bare_mixed", "bare_bf16"):
        assert rows[0][kind]["error"].startswith(
            (
                "train.py did not finish in 0.5 s",
                "mixed loop did not finish in 0.5 s",
                "bf16 loop did not finish in 0.5 s",
            )
        ), rows[0][kind]
    assert "Traceback" not in res.err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU smoke path and the no-GPU error")
def test_bench_gpu_smoke_runs_every_measurement(tmp_path, capsys, monkeypatch):
    """Every measurement of the smoke run (trainer, the mixed-precision and pure-bf16 bare loops,
    torchtitan's model, planner; bf16 and float8 rows of both models; the block-causal row) runs
    and writes its row, its ratios and the table; torchtitan's trainer (CUDA only) says why it
    did not run.

    Kept cheap without losing a path: ``main`` runs in this process (``python -m benchmarks.gpu``
    itself, its argument parsing and its exit codes are the other tests' subject), each
    measurement process is forked from tools/forkserver.py's server (``--launcher fork``: the same
    script, arguments, environment and working directory as the default new interpreter, whose
    start and timeout kill test_bench_gpu_timeout_and_masks_select_and_bound_rows runs), and 2
    steps with 1 warmup leave one timed step per measurement (the warmup step is dropped: checked),
    so the rows' figures come from the same code as with more steps (a median of one), and the
    census step is the one after them. One intra-op thread per measurement process
    (``OMP_NUM_THREADS=1``, which tools/forkserver.py applies to a forked process): with torch's
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
        assert r["trainer"]["tokens_per_s"] > 0, r
        for kind, recipe, master in (("bare_mixed", "mixed", "float32"), ("bare_bf16", "bf16", "bfloat16")):
            assert r[kind]["tokens_per_s"] > 0 and r[kind]["recipe"] == recipe, r
            assert r[kind]["master_dtype"] == master  # the mixed loop keeps fp32 masters
            assert r[kind]["steps_timed"] == 1  # the warmup step left out
        assert r["trainer"]["steps_timed"] == 1
        for ratio, ref in (("trainer_over_bare_mixed", "bare_mixed"), ("trainer_over_bare_bf16", "bare_bf16")):
            assert r[ratio] == r["trainer"]["tokens_per_s"] / r[ref]["tokens_per_s"]
        assert r["torchtitan_trainer"] == {"skipped": torchtitan_skip(replace_case(r), "torchtitan_trainer", None)}
        assert r["ours_over_torchtitan_trainer"] is None
        planner = r["planner"]  # the planner's estimate of the same run
        assert planner["predicted_step_s"] > 0 and planner["measured_step_s"] > 0
        assert planner["predicted_over_measured"] == planner["predicted_step_s"] / planner["measured_step_s"]
        assert "smoke" in planner["hardware"]
        if r["case"]["precision"] == "bf16":
            for kind in ("bare_mixed", "bare_bf16"):
                assert r[kind]["matmul_bf16_share"] == 1.0 and r[kind]["matmul_float8_share"] == 0.0
            continue
        # float8 rows: the converted linears' GEMMs ran in float8, the rest in bf16
        for kind in ("bare_mixed", "bare_bf16"):
            assert 0 < r[kind]["matmul_float8_share"] < 1
            assert r[kind]["matmul_float8_share"] + r[kind]["matmul_bf16_share"] == pytest.approx(1.0, abs=1e-12)
            assert r["float8_over_bf16"][kind] > 0
        assert r["float8_over_bf16"]["trainer"] > 0
        bf16_row = rows[rows.index(r) - 1]
        assert r["planner"]["predicted_time_s"]["compute"] < bf16_row["planner"]["predicted_time_s"]["compute"]
    # the float8 share of each bare loop is the planner's (both use the converters' rules; the
    # formula: tools/planner/compute.py; exact for DeepSeek too: every token visits top_k experts,
    # however it is routed)
    for r in (rows[1], rows[3]):
        assert r["bare_mixed"]["matmul_float8_share"] == pytest.approx(_planned_float8_share(r["case"]), rel=1e-9), r
    assert rows[3]["bare_mixed"]["matmul_float8_share"] > 0.5  # the experts' GEMMs are float8 too
    from benchmarks.gpu_torchtitan import torchtitan_unavailable

    if torchtitan_unavailable() is None:  # make test installs it (the `peer` extra)
        assert rows[0]["torchtitan_model"]["tokens_per_s"] > 0
        assert rows[0]["bare_bf16_over_torchtitan_model"] > 0
        assert all("skipped" in r["torchtitan_model"] for r in rows[1:])  # float8, deepseek on CPU, block_causal
    else:
        assert all(r["torchtitan_model"]["skipped"].startswith("torchtitan not importable") for r in rows)
    assert "tr/mixed" in res.out and "ours/titan-tr" in res.out and "plan/meas s" in res.out  # the table
    assert "skipped: torchtitan's trainer runs on CUDA only" in res.out
    # the run's goals: none measured by a smoke run on CPU
    assert [g["status"] for g in json.loads(out.read_text())["goals"]] == ["UNMEASURED"] * 3
    # ... and the first-GPU-run checklist at the very end, after the table
    assert res.out.rstrip().endswith(render_text()), res.out[-3000:]
    assert res.out.index("tr/mixed") < res.out.index("First GPU run: confirm")


def replace_case(row: dict):
    from benchmarks.gpu_measure import Case

    return Case(**row["case"])


def _planned_float8_share(case: dict) -> float:
    """The planner's float8 share of one step's matmul FLOPs of the bare loop (one rank, no AC
    recomputation: selective per-op AC)."""
    from models.parallel.float8 import Float8Options
    from parallel_dims.layout import validate_degrees
    from tools.planner.choice import LayoutChoice
    from tools.planner.compute import rank_matmul_flops

    b, s = case["local_batch_size"], case["seq_len"]
    experts = ("experts",) if case["model"] == "deepseek_v3" else ()  # as benchmarks/gpu_measure.py converts
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


# ------------------------------------------------------------------ torchtitan's own trainer

# one training line as torchtitan 0.2.2 logs it (torchtitan/components/metrics.py,
# MetricsProcessor.log, behind tools/logging.py's "[titan] %(asctime)s - %(name)s - %(levelname)s - "),
# colored (metrics.disable_color_printing false, its default; utils.Color's codes) and plain
_RECORDED = (
    "[titan] 2026-11-26 04:41:07,512 - root - INFO - \x1b[31mstep:  7  \x1b[32mloss:  9.87654  "
    "\x1b[38;2;180;60;0mgrad_norm:  2.3456  \x1b[38;2;54;234;195mmemory: 61.23GiB(43.80%)  "
    "\x1b[34mtps: 25,512  \x1b[36mtflops: 425.67  \x1b[35mmfu: 43.04%\x1b[39m"
)
_RECORDED_PLAIN = (
    "[titan] 2026-11-26 04:41:08,101 - root - INFO - step: 12  loss:  8.50000  grad_norm:  1.0000  "
    "memory: 61.23GiB(43.80%)  tps: 1,029,511  tflops: 1,234.50  mfu: 124.82%"
)
_VALIDATION = "[titan] 2026-11-26 04:41:09,000 - root - INFO - validate step:  5  loss:  7.1234  memory: 61.23GiB(43.80%)  tps: 99,999"


def test_parse_torchtitan_log_reads_recorded_lines():
    """Colored and plain training lines parse to their fields (thousands separators dropped);
    a validation line (no grad_norm) and other log lines are not steps."""
    from benchmarks.gpu_torchtitan import parse_torchtitan_log

    text = "\n".join(["[titan] ... - root - INFO - Training starts at step 1", _RECORDED, _VALIDATION, _RECORDED_PLAIN])
    assert parse_torchtitan_log(text) == [
        {"step": 7, "loss": 9.87654, "grad_norm": 2.3456, "tps": 25512.0, "tflops": 425.67, "mfu_pct": 43.04,
         "reserved_gib": 61.23},
        {"step": 12, "loss": 8.5, "grad_norm": 1.0, "tps": 1029511.0, "tflops": 1234.5, "mfu_pct": 124.82,
         "reserved_gib": 61.23},
    ]  # fmt: skip


def test_parse_torchtitan_log_reads_what_torchtitans_own_code_prints():
    """torchtitan 0.2.2's MetricsProcessor.log itself (members set by hand: no GPU, no job) prints
    through its own log format, colored and plain; the parser gets back the step, loss, norm,
    memory, and the tps, TFLOP/s and MFU torchtitan computed (the values it hands its metric
    logger), to the precision it prints them. A line with the step's fields reordered would not
    parse: the negative control."""
    import io
    import logging
    import time
    from types import SimpleNamespace

    pytest.importorskip("torchtitan")
    from torchtitan.components.metrics import DeviceMemStats, MetricsProcessor
    from torchtitan.tools import logging as titan_logging
    from torchtitan.tools.utils import Color, NoColor

    from benchmarks.gpu_torchtitan import parse_torchtitan_log

    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    try:  # torchtitan's own handler and format, then the root logger as it was
        titan_logging.init_logger()
        formatter = root.handlers[0].formatter
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    handler.setFormatter(formatter)
    logged = []
    stats = DeviceMemStats(30.5, 21.4, 61.2345, 43.79, 0, 0)
    proc = object.__new__(MetricsProcessor)
    proc.num_flops_per_token = 6 * 1.6e9
    proc.parallel_dims = SimpleNamespace(non_data_parallel_size=1)
    proc.gpu_peak_flops = 989e12
    proc.job_config = SimpleNamespace(metrics=SimpleNamespace(log_freq=1))
    proc.device_memory_monitor = SimpleNamespace(get_peak_stats=lambda: stats, reset_peak_stats=lambda: None)
    proc.logger = SimpleNamespace(log=lambda metrics, step: logged.append(metrics))
    root.addHandler(handler)
    level = root.level
    root.setLevel(logging.INFO)
    try:
        for step, color in ((3, Color()), (4, NoColor())):
            proc.color = color
            proc.ntokens_since_last_log, proc.data_loading_times = 8192, [0.001]
            proc.time_last_log = time.perf_counter() - 0.27
            proc.log(step, 7.25 + step, 7.5, 0.75)
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
    text = buf.getvalue()
    assert "\x1b[34mtps: " in text.splitlines()[0] and "\x1b" not in text.splitlines()[1]
    records = parse_torchtitan_log(text)
    assert [r["step"] for r in records] == [3, 4]
    for r, m, step in zip(records, logged, (3, 4)):
        assert r["loss"] == 7.25 + step and r["grad_norm"] == 0.75 and r["reserved_gib"] == 61.23
        assert r["tps"] == round(m["throughput(tps)"]) and r["mfu_pct"] == round(m["mfu(%)"], 2)
        assert r["tflops"] == round(m["tflops"], 2)
    swapped = text.splitlines()[1].replace("tps:", "TPS:").replace("mfu:", "tps:").replace("TPS:", "mfu:")
    assert parse_torchtitan_log(swapped) == []


def _titan_records(steps, tps=lambda s: 1000.0 * s):
    return [{"step": s, "loss": 1.0, "grad_norm": 1.0, "tps": tps(s), "tflops": 1.0, "mfu_pct": s / 10,
             "reserved_gib": 50.0 + s} for s in steps]  # fmt: skip


def test_summarize_torchtitan_times_the_steps_ours_are_timed_on():
    """Ours: the median over steps warmup+1..steps (metrics.jsonl's ``step > warmup``); torchtitan's
    figures come from exactly those steps of its log, and a log missing one is an error, not a
    median of fewer steps."""
    from benchmarks.gpu_torchtitan import summarize_torchtitan

    got = summarize_torchtitan(_titan_records(range(1, 16)), steps=15, warmup=5)
    assert got == {"tokens_per_s": 10500.0, "mfu_pct": 1.05, "peak_reserved_gib": 65.0, "steps_timed": 10,
                   "last_loss": 1.0}  # fmt: skip
    assert "not every one of steps 6..15" in summarize_torchtitan(_titan_records(range(1, 15)), 15, 5)["error"]
    assert "has steps none" in summarize_torchtitan([], 15, 5)["error"]


def _case(**kw):
    from benchmarks.gpu_measure import Case

    base = {"llama3": dict(flavor="8B", n_layers=8, seq_len=8192, local_batch_size=1),
            "deepseek_v3": dict(flavor="16B", n_layers=6, seq_len=4096, local_batch_size=2)}  # fmt: skip
    model = kw.pop("model", "llama3")
    return Case(model, **{**base[model], **kw})


_SHARED_REF = ROOT.parent / "shared" / "gpu" / "torchtitan_ref"


@pytest.mark.skipif(not _SHARED_REF.is_dir(), reason="needs ../shared/gpu/torchtitan_ref (the configs the GPU runs)")
def test_torchtitan_trainer_command_is_what_torchtitan_parses(monkeypatch):
    """The command bench-gpu gives torchrun, parsed by torchtitan 0.2.2's own ConfigManager in the
    reference folder: the model, the flavor its script registers, our steps, sequence length and
    batch, one expert-parallel degree for DeepSeek, compile on exactly in the compiled rows,
    per-op selective AC and bf16 as ours, a step line every step."""
    pytest.importorskip("torchtitan")
    from torchtitan.config import ConfigManager

    from benchmarks.gpu_torchtitan import torchtitan_trainer_cmd

    monkeypatch.chdir(_SHARED_REF)
    for case, flavor in ((_case(), "8B_l8"), (_case(model="deepseek_v3", compile=True), "16B_l6")):
        cmd = torchtitan_trainer_cmd(case, 15, "/tmp/dump")
        assert cmd[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
        assert (_SHARED_REF / cmd[5]).exists()
        cfg = ConfigManager().parse_args(cmd[6:])
        assert (cfg.model.name, cfg.model.flavor) == (case.model, flavor)
        assert (cfg.training.steps, cfg.training.seq_len, cfg.training.local_batch_size) == (
            15,
            case.seq_len,
            case.local_batch_size,
        )
        assert cfg.compile.enable is case.compile and cfg.job.dump_folder == "/tmp/dump"
        assert (cfg.activation_checkpoint.mode, cfg.activation_checkpoint.selective_ac_option) == ("selective", "op")
        assert cfg.training.mixed_precision_param == "bfloat16" and cfg.metrics.log_freq == 1
        assert cfg.parallelism.expert_parallel_degree == 1 and cfg.parallelism.data_parallel_shard_degree == -1


def test_torchtitan_rows_say_why_they_did_not_run(tmp_path, monkeypatch):
    """Not importable: both torchtitan rows say so first; float8, block-causal and CPU rows are
    skipped with their reason; the trainer runs only on the shapes of torchtitan_ref's scripts and
    only once .gpu/torchtitan_ref holds its scripts and data."""
    import benchmarks.gpu_torchtitan as titan

    reason = "torchtitan not importable (ModuleNotFoundError: No module named 'torchtitan')"
    for kind in ("torchtitan_model", "torchtitan_trainer"):
        assert titan.torchtitan_skip(_case(), kind, reason) == reason
        assert "bf16 only" in titan.torchtitan_skip(_case(precision="float8"), kind, None)
        assert "causal sdpa only" in titan.torchtitan_skip(_case(attn_mask_type="block_causal"), kind, None)
    assert titan.torchtitan_skip(_case(device="cpu"), "torchtitan_model", None) is None
    assert "CUDA only" in titan.torchtitan_skip(_case(device="cpu"), "torchtitan_trainer", None)
    assert "8 layers only" in titan.torchtitan_skip(_case(n_layers=2), "torchtitan_trainer", None)
    monkeypatch.setattr(titan, "TORCHTITAN_REF", tmp_path / ".gpu" / "torchtitan_ref")
    monkeypatch.setattr(titan, "ROOT", tmp_path)
    assert "not prepared: run make bench-gpu-prepare" in titan.torchtitan_skip(_case(), "torchtitan_trainer", None)
    (tmp_path / ".gpu" / "torchtitan_ref" / "c4_test").mkdir(parents=True)
    (tmp_path / ".gpu" / "torchtitan_ref" / "llama_run.py").write_text("")
    (tmp_path / ".gpu" / "torchtitan_ref" / "c4_test" / "data.json").write_text("")
    assert titan.torchtitan_skip(_case(), "torchtitan_trainer", None) is None
    assert "not prepared" in titan.torchtitan_skip(_case(model="deepseek_v3"), "torchtitan_trainer", None)


def test_prepare_copies_the_reference_and_unzips_the_wheels(tmp_path, monkeypatch, capsys):
    """`make bench-gpu-prepare` (``--prepare-torchtitan SHARED``): the reference folder copied
    (writable, though the source is read-only), its data written by its own make_data.py, every
    wheel unzipped into .gpu/site; a missing SHARED is one line and exit 2. Runs on a stand-in
    SHARED with one tiny wheel (the real one: the GPU check's command)."""
    import stat
    import zipfile

    import benchmarks.gpu as gpu
    import benchmarks.gpu_torchtitan as titan

    shared = tmp_path / "shared"
    ref = shared / "gpu" / "torchtitan_ref"
    (ref / "assets" / "tokenizer").mkdir(parents=True)
    (ref / "assets" / "tokenizer" / "tokenizer.json").write_text("{}")
    (ref / "make_data.py").write_text("import os\nos.makedirs('c4_test')\nopen('c4_test/data.json', 'w').write('{}')\n")
    (shared / "wheels").mkdir()
    with zipfile.ZipFile(shared / "wheels" / "tiny-1.0-py3-none-any.whl", "w") as z:
        z.writestr("tiny/__init__.py", "X = 1\n")
    for p in [ref, *ref.rglob("*")]:
        p.chmod(p.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    repo = tmp_path / "repo"
    repo.mkdir()
    monkeypatch.setattr(titan, "ROOT", repo)
    monkeypatch.setattr(titan, "GPU_FOLDER", repo / ".gpu")
    monkeypatch.setattr(titan, "TORCHTITAN_REF", repo / ".gpu" / "torchtitan_ref")
    monkeypatch.setattr(titan, "TORCHTITAN_SITE", repo / ".gpu" / "site")
    try:
        assert gpu.main(["--prepare-torchtitan", str(shared)]) == 0
    finally:
        for p in [ref, *ref.rglob("*")]:
            p.chmod(p.stat().st_mode | stat.S_IWUSR)
    assert (repo / ".gpu" / "torchtitan_ref" / "assets" / "tokenizer" / "tokenizer.json").read_text() == "{}"
    assert (repo / ".gpu" / "torchtitan_ref" / "c4_test" / "data.json").exists()
    assert (repo / ".gpu" / "site" / "tiny" / "__init__.py").read_text() == "X = 1\n"
    assert "carry .gpu" in capsys.readouterr().out
    assert gpu.main(["--prepare-torchtitan", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "SHARED=path" in err


# ------------------------------------------------------------------ ratios and goals of a recorded run


def recorded_run() -> dict:
    """A bench-gpu result as benchmarks/gpu.py writes it for the four goal rows (tokens/s chosen
    so each goal has a known outcome), plus a float8 row that the goals ignore."""
    from dataclasses import asdict

    from benchmarks.gpu_rows import add_ratios

    # (model, compiled): trainer, mixed bare, bf16 bare, torchtitan's trainer, torchtitan's model
    tps = {
        ("llama3", False): (27000.0, 27500.0, 29600.0, 25500.0, 32600.0),
        ("llama3", True): (31000.0, 31500.0, 33200.0, 29000.0, 33900.0),
        ("deepseek_v3", False): (40000.0, 41000.0, 48700.0, 31400.0, 52700.0),
        ("deepseek_v3", True): (45000.0, 45500.0, 55000.0, 35600.0, 66500.0),
    }
    rows = []
    for (model, compiled), (tr, mixed, bf16, titan_tr, titan_model) in tps.items():
        case = _case(model=model, compile=compiled)
        row = {
            "case": asdict(case),
            "name": case.name,
            "trainer": {"tokens_per_s": tr, "mfu_pct": tr / 600},
            "planner": {"predicted_over_measured": 0.9, "memory_predicted_over_measured": 1.05},
            "bare_mixed": {"recipe": "mixed", "tokens_per_s": mixed},
            "bare_bf16": {"recipe": "bf16", "tokens_per_s": bf16},
            "torchtitan_model": {"recipe": "bf16", "tokens_per_s": titan_model},
            "torchtitan_trainer": {"tokens_per_s": titan_tr, "mfu_pct": 43.0, "steps_timed": 10},
        }
        add_ratios(row)
        rows.append(row)
    f8 = _case(precision="float8", compile=True)
    row = {"case": asdict(f8), "name": f8.name, "trainer": {"tokens_per_s": 40000.0},
           "torchtitan_trainer": {"skipped": "the torchtitan comparison runs bf16 only"}}  # fmt: skip
    add_ratios(row)
    rows.append(row)
    return {
        "host": {"torch": "2.11.0+cu130", "device": "NVIDIA H200", "smoke": False},
        "started": "2026-12-01T10:00:00",
        "references": ["mixed", "bf16", "torchtitan_model", "torchtitan_trainer"],
        "rows": rows,
    }


def test_ratios_and_goals_of_a_recorded_run():
    """add_ratios: each row's ratios of tokens/s (None where a side was skipped); evaluate_goals
    on the four rows: ours / torchtitan's trainer met (1.059 at least), trainer / mixed bare met
    (0.976 to 0.989), DeepSeek compiled / eager met (1.125); the float8 row is not a goal row.
    Negative controls: one row below its threshold makes the goal missed; one row's reference
    failed makes it UNMEASURED; without the DeepSeek rows every goal is UNMEASURED."""
    import copy

    from benchmarks.gpu_rows import evaluate_goals

    run = recorded_run()
    r0 = run["rows"][0]
    assert r0["trainer_over_bare_mixed"] == 27000 / 27500 and r0["trainer_over_bare_bf16"] == 27000 / 29600
    assert r0["ours_over_torchtitan_trainer"] == 27000 / 25500
    assert r0["bare_bf16_over_torchtitan_model"] == 29600 / 32600
    f8 = run["rows"][-1]
    assert f8["ours_over_torchtitan_trainer"] is None and f8["trainer_over_bare_mixed"] is None
    goals = {g["goal"]: g for g in evaluate_goals(run["rows"])}
    assert goals["ours_over_torchtitan_trainer"]["status"] == "met"
    assert min(goals["ours_over_torchtitan_trainer"]["measured"].values()) == pytest.approx(27000 / 25500)
    assert goals["trainer_over_bare_mixed"]["status"] == "met"  # 0.976 ... 0.989, all >= 0.97
    assert goals["deepseek_compiled_over_eager"]["measured"] == {"deepseek_v3": 45000 / 40000}
    assert goals["deepseek_compiled_over_eager"]["status"] == "met"

    slow = copy.deepcopy(run["rows"])
    slow[1]["trainer_over_bare_mixed"] = 0.96
    assert {g["goal"]: g["status"] for g in evaluate_goals(slow)}["trainer_over_bare_mixed"] == "missed"
    failed = copy.deepcopy(run["rows"])
    failed[3]["torchtitan_trainer"] = {"error": "exited 1"}
    from benchmarks.gpu_rows import add_ratios

    add_ratios(failed[3])
    status = {g["goal"]: g["status"] for g in evaluate_goals(failed)}
    assert status["ours_over_torchtitan_trainer"] == "UNMEASURED" and status["trainer_over_bare_mixed"] == "met"
    assert {g["status"] for g in evaluate_goals(run["rows"][:2])} == {"UNMEASURED"}  # no DeepSeek rows


def test_make_bench_gpu_prepare_copies_from_shared_without_a_venv(tmp_path):
    """`make bench-gpu-prepare` is the one command that fills .gpu/ (the copy itself:
    test_prepare_copies_the_reference_and_unzips_the_wheels): the system python, no venv set-up,
    ../shared unless SHARED says otherwise."""
    assert _make_dry_run(tmp_path, "bench-gpu-prepare", PYTHON="python3").strip() == (
        "python3 -m benchmarks.gpu --prepare-torchtitan ../shared"
    )
    assert (
        _make_dry_run(tmp_path, "bench-gpu-prepare", SHARED="/data/shared")
        .strip()
        .endswith("--prepare-torchtitan /data/shared")
    )


def test_run_torchtitan_trainer_reads_the_log_of_its_torchrun(tmp_path, monkeypatch):
    """run_torchtitan_trainer end to end but for torchtitan itself: torchrun (one process) starts
    the reference folder's script from that folder with .gpu/site on PYTHONPATH, and its log (a
    stand-in script printing torchtitan's recorded line format for every step it was asked to
    run) becomes the row: the median tps of the steps after warmup. A script that fails is an
    error with its log's tail, not an exception; one that runs past --timeout is killed with its
    torchrun (its worker too: checked)."""
    import benchmarks.gpu_measure as gpu_measure
    import benchmarks.gpu_torchtitan as titan

    ref, site = tmp_path / "torchtitan_ref", tmp_path / "site"
    ref.mkdir()
    site.mkdir()
    (ref / "llama_run.py").write_text(
        "import os, sys\n"
        "steps = int(sys.argv[sys.argv.index('--training.steps') + 1])\n"
        "assert os.path.exists('llama_8b_8layers.toml') and '--compile.enable' in sys.argv\n"
        f"assert os.environ['PYTHONPATH'].split(os.pathsep)[0] == {str(site)!r}\n"
        "for s in range(1, steps + 1):\n"
        "    print(f'[titan] 2026-12-01 10:00:00,000 - root - INFO - \\x1b[31mstep: {s:2}  \\x1b[32mloss:  8.00000  '\n"
        "          f'grad_norm:  1.0000  memory: 60.00GiB(42.00%)  \\x1b[34mtps: {1000 * s:,}  tflops: 400.00  '\n"
        "          f'mfu: 40.00%\\x1b[39m', flush=True)\n"
    )
    (ref / "llama_8b_8layers.toml").write_text("")
    monkeypatch.setattr(titan, "TORCHTITAN_REF", ref)
    monkeypatch.setattr(titan, "TORCHTITAN_SITE", site)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    got = titan.run_torchtitan_trainer(_case(compile=True), steps=6, warmup=2)
    assert got == {"tokens_per_s": 4500.0, "mfu_pct": 40.0, "peak_reserved_gib": 60.0, "steps_timed": 4,
                   "last_loss": 8.0}  # fmt: skip
    got = titan.run_torchtitan_trainer(_case(compile=False), steps=6, warmup=2)  # its assert fails
    assert got["error"].startswith("torchtitan's trainer exited 1") and "AssertionError" in got["error"]

    # past --timeout the whole session goes: torchrun and its worker (which would hold the GPU)
    pid_file = tmp_path / "worker.pid"
    (ref / "deepseek_run.py").write_text(
        f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\nprint('started', flush=True)\n"
        "time.sleep(600)\n"
    )
    monkeypatch.setattr(gpu_measure, "TIMEOUT_S", 6.0)
    got = titan.run_torchtitan_trainer(_case(model="deepseek_v3"), steps=6, warmup=2)
    assert got["error"].startswith("torchtitan's trainer did not finish in 6 s (--timeout), killed"), got
    assert "got signal: 15" in got["error"]  # torchrun's SIGTERM, on which it stops its worker
    status = Path(f"/proc/{pid_file.read_text()}/status")
    assert not status.exists() or "State:\tZ" in status.read_text()  # gone (or a zombie awaiting its reaper)


def test_torchtitan_comes_from_gpu_site_when_not_importable_otherwise(tmp_path, monkeypatch):
    """No torchtitan on the path: .gpu/site (make bench-gpu-prepare) goes on this process's path
    and on PYTHONPATH for the measurement processes, and counts if torchtitan imports from it;
    without that folder the rows' reason is "torchtitan not importable (<the import error>)"."""
    import benchmarks.gpu_torchtitan as titan

    site = tmp_path / "site"
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    missing = "ModuleNotFoundError: No module named 'torchtitan'"
    monkeypatch.setattr(titan, "_import_torchtitan", lambda: None if str(site) in sys.path else missing)
    monkeypatch.setattr(titan, "TORCHTITAN_SITE", site)
    assert titan.torchtitan_unavailable() == f"torchtitan not importable ({missing})"
    assert str(site) not in sys.path and os.environ["PYTHONPATH"] == "/elsewhere"
    site.mkdir()
    assert titan.torchtitan_unavailable() is None
    assert sys.path[0] == str(site) and os.environ["PYTHONPATH"] == os.pathsep.join([str(site), "/elsewhere"])
