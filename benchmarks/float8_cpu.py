"""Float8 on a CPU host: what a float8 run costs against the same run without float8, and what
one float8 GEMM costs by each route (``make bench`` section ``float8_cpu``; also ``python -m
benchmarks.run --only float8_cpu --out bench_results/float8_cpu.json``).

* ``runs``: ``train.py`` as one process (one thread), llama3 debugmodel (6 layers), the shipped
  config's batch (4 micro-batches of 4 x 128 tokens), 3 steps, no checkpoint: wall time of the
  whole command (start-up included, as a user waits for it), median of ``REPEATS``; without
  float8 (the reference), with ``model.converters = ["float8"]`` tensorwise and rowwise on the
  default ``float8.cpu_gemm = "emulated"``, and with ``"scaled_mm"`` (torch's own CPU kernel)
  only where that kernel is not oneDNN's (no AMX-INT8): on an AMX host it would take over
  half an hour, so that row is priced from the GEMM figures instead (the run's
  ``scaled_mm`` GEMM count times the measured cost of one). Goal: float8 / reference <= 3.
* ``gemms``: one 256 x 256 x 256 GEMM, one thread, median: float32 and bfloat16 ``mm``, and
  ``torch._scaled_mm`` (e4m3 operands, bf16 output) tensorwise and rowwise through torch's
  kernel and through the emulation.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REPEATS = 3
COMMON = ["--config", "llama3.toml", "--training.steps", "3", "--checkpoint.enable", "false"]
COMMON += ["--metrics.enable_tensorboard", "false"]
VARIANTS = {
    "no float8": [],
    "float8 tensorwise, emulated": ["--model.converters", "float8"],
    "float8 rowwise, emulated": ["--model.converters", "float8", "--float8.recipe_name", "rowwise"],
    "float8 tensorwise, scaled_mm": ["--model.converters", "float8", "--float8.cpu_gemm", "scaled_mm"],
}
TOKENS = 3 * 16 * 128  # 3 steps of the shipped config's global batch (16 x 128 tokens)


def _wall(extra: list[str]) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        out = subprocess.run(
            [sys.executable, "train.py", *COMMON, *extra, "--job.dump_folder", tmp],
            cwd=ROOT,
            capture_output=True,
            text=True,
            env=env,
        )
        wall = time.perf_counter() - start
    if out.returncode != 0:
        raise RuntimeError((out.stderr.strip().splitlines() or ["?"])[-1])
    return wall


def _median_ms(fn, budget_s: float = 2.0, most: int = 20) -> float:
    fn()  # warm-up
    times = []
    while len(times) < most and sum(times) < budget_s:
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def gemms() -> dict:
    import torch

    from models.parallel.float8 import set_cpu_gemm

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(256, 256, generator=g), torch.randn(256, 256, generator=g)
    a8 = a.to(torch.float8_e4m3fn)
    b8 = b.to(torch.float8_e4m3fn).t().contiguous().t()
    sa, sb = torch.tensor(0.5), torch.tensor(0.25)
    ra, rb = torch.full((256, 1), 0.5), torch.full((1, 256), 0.25)
    bf16 = torch.bfloat16
    out = {
        "float32 mm": _median_ms(lambda: a @ b),
        "bfloat16 mm": _median_ms(lambda: a.to(bf16) @ b.to(bf16)),
    }
    for route, cpu_gemm in (("torch's kernel", "scaled_mm"), ("emulated", "emulated")):
        was = set_cpu_gemm(cpu_gemm)
        try:
            out[f"_scaled_mm tensorwise, {route}"] = _median_ms(
                lambda: torch._scaled_mm(a8, b8, scale_a=sa, scale_b=sb, out_dtype=bf16)
            )
            out[f"_scaled_mm rowwise, {route}"] = _median_ms(
                lambda: torch._scaled_mm(a8, b8, scale_a=ra, scale_b=rb, out_dtype=bf16)
            )
        finally:
            set_cpu_gemm(was)
    return {name: round(ms, 3) for name, ms in out.items()}


def _float8_macs() -> int:
    """Multiply-adds of the run's float8 GEMMs: every converted linear's three (output, input
    gradient, weight gradient) over every token of the 3 steps."""
    from torch import nn

    from models.parallel.float8 import Float8Options, float8_decisions
    from models.registry import build_model

    model = build_model("llama3", "debugmodel")  # meta: shapes only
    mods = dict(model.named_modules())
    per_token = sum(
        mods[f].in_features * mods[f].out_features
        for f, why in float8_decisions(model, Float8Options()).items()
        if why is None and isinstance(mods[f], nn.Linear)
    )
    return 3 * per_token * TOKENS


def run() -> dict:
    from models.common.cpu_info import describe_cpu, has_amx_int8

    per_gemm = gemms()
    for name, ms in per_gemm.items():
        print(f"float8_cpu gemm {name:36s} {ms:10.3f} ms", file=sys.stderr)
    rows = []
    for name, extra in VARIANTS.items():
        row: dict = {"variant": name}
        if name.endswith("scaled_mm") and has_amx_int8():
            # oneDNN's float8 kernel on this host: price the run instead of waiting for it, from
            # the extra cost per multiply-add of one GEMM and the run's float8 multiply-adds
            extra_ms = per_gemm["_scaled_mm tensorwise, torch's kernel"] - per_gemm["_scaled_mm tensorwise, emulated"]
            emulated = next(r for r in rows if r["variant"] == "float8 tensorwise, emulated")
            extra_s = _float8_macs() * extra_ms / 1e3 / 256**3
            row["wall_s_estimated"] = round(emulated["wall_s"] + extra_s)
            row["note"] = (
                "not run (oneDNN on this AMX host): the emulated run plus its float8 multiply-adds at "
                "the 256^3 GEMM's extra cost per multiply-add"
            )
        else:
            walls = [_wall(extra) for _ in range(REPEATS)]
            row["wall_s"] = round(statistics.median(walls), 2)
        rows.append(row)
    ref = rows[0]["wall_s"]
    for row in rows[1:]:
        wall = row.get("wall_s", row.get("wall_s_estimated"))
        row["over_no_float8"] = round(wall / ref, 2)
    for row in rows:
        print(f"float8_cpu run {row}", file=sys.stderr)
    gemm_rows = [
        {"gemm": name, "ms": ms, "over_float32_mm": round(ms / per_gemm["float32 mm"], 1)}
        for name, ms in per_gemm.items()
    ]
    return {"cpu": describe_cpu(), "gemms": gemm_rows, "runs": rows}
