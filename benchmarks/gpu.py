"""`make bench-gpu`: our trainer against a bare mixed-precision loop of the same model code (the
framework's overhead), a pure-bf16 loop, torchtitan's model in that loop, and torchtitan's own
trainer, on one GPU, in one call.

For each model (Llama 3 with 8B shapes and 8 layers, 1 x 8192 tokens; DeepSeek-V3 with 16B
shapes and 6 layers, 2 x 4096 tokens, ep 1; selective per-op activation checkpointing, as in the
GPU issue's measurements) and each mode (eager, compiled):

* ``trainer``: ``train.py`` as a user launches it (bf16 mixed precision: fp32 master weights,
  bf16 compute; synthetic data, checkpointing off); tokens/s, MFU and peak memory from its own
  metrics.jsonl;
* ``bare_mixed`` (``--references mixed``): the same model code in a loop a user would write by
  hand for the trainer's recipe (``benchmarks/gpu_bare.py``): fp32 masters, one foreach cast to
  bf16 compute copies per step, bf16 forward and backward under the same activation
  checkpointing and per-block compile, gradients cast to fp32, clipping with one
  ``torch._foreach_norm``, fp32 fused AdamW, one ``loss.item()`` per step; no FSDP, no
  ParallelDims, no data loader. ``trainer_over_bare_mixed`` is the framework's overhead (goal
  >= 0.97);
* ``bare_bf16`` (``--references bf16``): the same loop on bf16 parameters with bf16 AdamW state,
  a different and cheaper recipe, kept as a second reference (``trainer_over_bare_bf16``);
* ``torchtitan_model`` (``--references torchtitan_model``): torchtitan's model of the same shapes
  (``attn_type="sdpa"``, causal) in the pure-bf16 loop (``bare_bf16_over_torchtitan_model``:
  model code against model code);
* ``torchtitan_trainer`` (``--references torchtitan_trainer``): torchtitan 0.2.2's own trainer
  (``torchrun``, one process) on the same shapes, from ``.gpu/torchtitan_ref``
  (``make bench-gpu-prepare`` copies it there with torchtitan's wheels in ``.gpu/site``): the
  median of the tps its log prints for the same timed steps as ours (``parse_torchtitan_log``);
  ``ours_over_torchtitan_trainer`` = trainer / it (goal >= 1.05). On one GPU torchtitan trains
  fp32 parameters under ``torch.autocast(bfloat16)``; its memory column is its max reserved GiB.

torchtitan's rows say ``torchtitan not importable`` when it is not (``.gpu/site`` is put on the
path when it exists and torchtitan is not importable without it), and are skipped for float8,
block-causal and (its trainer) CPU rows.

* ``block_causal`` rows (``model.attn_mask_type = "block_causal"``, ``attn_type = "flex"``,
  compiled only): the trainer and the bare loops on the same packed windows of the trainer's
  data (its synthetic documents, EOS between them; the trainer's ``data:`` startup line gives
  their mean length), to read against the causal compiled row of the same model. FlexAttention
  has no CPU backward, so the smoke row runs this code on ``sdpa``.

* ``planner``: the layout planner's estimate of the trainer's run (``tools.planner``: the same
  config through ``estimate_from_config``, the GPU's table entry, the planner's default
  efficiency 0.5): predicted step time and memory against the trainer's measured ones
  (``predicted_over_measured``, ``memory_predicted_over_measured``), and the efficiency that
  would make the predicted step time exact (``efficiency_implied``). The planner does not model
  ``torch.compile``; the compiled rows show what that costs its estimate.

Every measurement runs in a fresh process (a new interpreter; ``--launcher fork`` forks it from
a server that imported torch and the trainer once instead, as the CPU smoke test does; torchtitan's
trainer always starts a new one). MFU uses the trainer's FLOPs per token
(``trainer.reporting.metrics.training_flops_per_token``) for our rows and the bare loops, so their ratios
of MFU equal the ratios of tokens/s; torchtitan's trainer's MFU is its own count.

* float8 rows (``--precisions``, default ``bf16 float8``; causal rows only): the trainer with
  ``--model.converters float8`` (tensorwise; one GPU, so no FSDP float8 all-gather), for
  DeepSeek also ``float8_experts`` (the routed experts' grouped GEMMs, rowwise: torchao's
  ``torch._scaled_grouped_mm`` path on sm90+), and the bare loops with the same model converted
  (``convert_to_float8`` before the bf16 cast, AC and compile); ``float8_over_bf16``: their
  tokens/s over the bf16 row of the same model and mode (the issue's anchor: >= 1.2 on Llama 3
  8B shapes compiled); the mixed loop's matmul census reports the float8 share of the GEMM FLOPs
  (``matmul_float8_share``); torchtitan is skipped; MFU stays priced at the bf16 peak, the
  planner row prices the converted GEMMs at the float8 peak.

JSON to ``bench_results/gpu.json`` (with ``goals``: :data:`GOALS` evaluated on its rows), a
table to stdout.

``--smoke`` runs the same code paths on tiny debug shapes (on the CPU when there is no GPU), so
CI proves the benchmark itself works; its numbers mean nothing.

Every run ends with the first-GPU-run checklist (``benchmarks/gpu_checklist.py``): what a GPU
must confirm beyond this table.

Where GPUs are (often no network, a driver pinned to the node's CUDA build of torch):
``SYSTEM_TORCH=1 make bench-gpu`` makes ``.venv`` on the node python's own torch and installs
nothing that needs the network (see the Makefile's setup), or, with no venv at all, run
``python -m benchmarks.gpu`` with that python from the repository root: the benchmark needs torch,
numpy and tokenizers and this checkout (train.py is run from the root); torchtitan's rows need
``.gpu/`` (``make bench-gpu-prepare`` where ``../shared`` is, then carry ``.gpu``).

The code: this module is the command line and the loop over rows (``measure``);
``benchmarks/gpu_measure.py`` holds the cases and our measurements (the trainer, the planner's
estimate, the bare loops' processes), ``benchmarks/gpu_torchtitan.py`` torchtitan's trainer and
``make bench-gpu-prepare``, ``benchmarks/gpu_rows.py`` the ratios, goals and table, and
``benchmarks/gpu_bare.py`` the bare loops themselves.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from benchmarks import gpu_measure
from benchmarks.gpu_checklist import render_text as render_checklist
from benchmarks.gpu_measure import GPU_CASES, SMOKE_CASES, Case, planner_check, run_bare, run_trainer
from benchmarks.gpu_rows import MEASURED, REFERENCES, add_float8_ratios, add_ratios, evaluate_goals, print_table
from benchmarks.gpu_torchtitan import (
    prepare_torchtitan,
    run_torchtitan_trainer,
    torchtitan_skip,
    torchtitan_unavailable,
)


def measure(
    cases: list[Case],
    steps: int,
    warmup: int,
    references: list[str] | tuple[str, ...] = tuple(REFERENCES),
    titan_unavailable: str | None = None,
    device_name: str | None = None,
) -> list[dict]:
    """One row per case: the trainer, the planner's estimate of it, and each of ``references``
    (torchtitan's with the reason they did not run where they did not)."""
    rows = []
    for case in cases:
        print(f"== {case.name}", file=sys.stderr, flush=True)
        row = {"case": asdict(case), "name": case.name}
        row["trainer"] = run_trainer(case, steps, warmup)
        row["planner"] = planner_check(case, row["trainer"], device_name)
        for recipe in ("mixed", "bf16"):
            if recipe in references:
                row[REFERENCES[recipe]] = run_bare(case, "ours", recipe, steps, warmup)
        for kind in ("torchtitan_model", "torchtitan_trainer"):
            if kind not in references:
                continue
            skip = torchtitan_skip(case, kind, titan_unavailable)
            if skip is not None:
                row[kind] = {"skipped": skip}
            elif kind == "torchtitan_model":
                row[kind] = run_bare(case, "torchtitan", "bf16", steps, warmup)
            else:
                row[kind] = run_torchtitan_trainer(case, steps, warmup)
        add_ratios(row)
        rows.append(row)
    add_float8_ratios(rows)
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return gpu_measure.worker(argv[1:])
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench_results/gpu.json")
    p.add_argument("--models", nargs="*", choices=["llama3", "deepseek_v3"], default=["llama3", "deepseek_v3"])
    p.add_argument("--modes", nargs="*", choices=["eager", "compiled"], default=["eager", "compiled"])
    p.add_argument("--steps", type=int, default=15, help="steps per measurement (default 15)")
    p.add_argument("--warmup", type=int, default=5, help="untimed first steps (default 5)")
    p.add_argument(
        "--masks",
        nargs="*",
        choices=["causal", "block_causal"],
        default=["causal", "block_causal"],
        help="attention masks to run (block_causal rows are compiled flex attention)",
    )
    p.add_argument(
        "--precisions",
        nargs="*",
        choices=["bf16", "float8"],
        default=["bf16", "float8"],
        help="bf16 rows and/or float8 rows (model.converters = ['float8'], tensorwise, and "
        "'float8_experts' for DeepSeek; causal rows only)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds one measurement process may run before it is killed and its row reports an error",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="tiny debug shapes, on the CPU when there is no GPU: checks the benchmark runs",
    )
    p.add_argument(
        "--launcher",
        choices=["subprocess", "fork"],
        default="subprocess",
        help="how each measurement process starts: a new interpreter (default), or forked from a "
        "server that imported torch and the trainer once (tools/forkserver.py; the test suite's CPU "
        "smoke run: the same scripts and arguments without the imports per process)",
    )
    p.add_argument(
        "--references",
        nargs="*",
        choices=list(REFERENCES),
        default=list(REFERENCES),
        help="what the trainer is measured against (default all): the mixed-precision bare loop, the "
        "pure-bf16 bare loop, torchtitan's model in the bf16 loop, torchtitan's own trainer",
    )
    p.add_argument(
        "--prepare-torchtitan",
        metavar="SHARED",
        help="copy SHARED/gpu/torchtitan_ref and unzip SHARED/wheels into .gpu/ (make bench-gpu-prepare), "
        "then exit; nothing else runs",
    )
    args = p.parse_args(argv)
    if args.prepare_torchtitan:
        return prepare_torchtitan(Path(args.prepare_torchtitan))

    import torch

    has_gpu = torch.cuda.is_available()
    if not has_gpu and not args.smoke:
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        print(
            "error: make bench-gpu needs a CUDA GPU and torch.cuda.is_available() is False here "
            f"(torch {torch.__version__}, {build}, from {Path(torch.__file__).parent}); run it on a GPU "
            "machine (where the python already has a CUDA torch: SYSTEM_TORCH=1 make bench-gpu, or "
            "python -m benchmarks.gpu with that python), or pass --smoke to check the benchmark on "
            "tiny CPU shapes",
            file=sys.stderr,
        )
        return 2
    gpu_measure.TIMEOUT_S, gpu_measure.LAUNCHER = args.timeout, args.launcher
    if args.warmup >= args.steps:
        print(f"error: --warmup {args.warmup} leaves no timed step of --steps {args.steps}", file=sys.stderr)
        return 2
    base = SMOKE_CASES if args.smoke else GPU_CASES
    device = "cuda" if has_gpu else "cpu"
    cases = [
        replace(c, compile=mode == "compiled", device=device)
        for c in base
        if c.model in args.models and c.attn_mask_type in args.masks
        for mode in args.modes
        if not (c.attn_type == "flex" and mode == "eager")  # flex rows: compiled only
    ]
    cases = [
        replace(c, precision=p)
        for c in cases
        for p in args.precisions
        if p == "bf16" or c.attn_mask_type == "causal"  # float8: next to the causal rows
    ]
    titan = torchtitan_unavailable() if any(k.startswith("torchtitan") for k in args.references) else None
    if titan:
        print(f"{titan}: torchtitan's rows are skipped", file=sys.stderr)
    device_name = torch.cuda.get_device_name() if has_gpu else None
    rows = measure(cases, args.steps, args.warmup, args.references, titan, device_name)
    result = {
        "host": {
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if has_gpu else "cpu",
            "smoke": args.smoke,
        },
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "references": args.references,
        "steps": {"total": args.steps, "warmup": args.warmup},
        "rows": rows,
        "goals": evaluate_goals(rows),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print_table(rows)
    print(f"\nwrote {out}", file=sys.stderr, flush=True)
    # what a first GPU run must confirm beyond these numbers (one list: benchmarks/gpu_checklist.py)
    print("\n" + render_checklist())
    failed = [r["name"] for r in rows if any("error" in r.get(k, {}) for k in MEASURED)]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
