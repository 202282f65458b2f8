"""`make bench-gpu`: our trainer against a bare bf16 loop of the same model, and our model code
against torchtitan's, on one GPU, in one run.

For each model (Llama 3 with 8B shapes and 8 layers, 1 x 8192 tokens; DeepSeek-V3 with 16B
shapes and 6 layers, 2 x 4096 tokens, ep 1; selective per-op activation checkpointing, as in the
GPU issue's measurements) and each mode (eager, compiled):

* ``trainer``: ``train.py`` as a user launches it (bf16 mixed precision, synthetic data,
  checkpointing off); tokens/s, MFU and peak memory from its own metrics.jsonl;
* ``bare``: the same model code in a loop a user would write by hand: bf16 parameters, the same
  activation checkpointing and per-block compile, cross entropy, clipping, fused AdamW, one
  ``loss.item()`` per step; no FSDP, no ParallelDims, no data loader;
* ``torchtitan``: torchtitan's model of the same shapes (``attn_type="sdpa"``, causal) in the
  very same bare loop, when torchtitan is importable.

* ``block_causal`` rows (``model.attn_mask_type = "block_causal"``, ``attn_type = "flex"``,
  compiled only; unmeasured until a GPU runs them): the trainer and the bare loop on the same
  packed windows of the trainer's data (its synthetic documents, EOS between them; the trainer's
  ``data:`` startup line gives their mean length), to read against the causal compiled row of the
  same model. FlexAttention has no CPU backward, so the smoke row runs this code on ``sdpa``.

* ``planner``: the layout planner's estimate of the trainer's run (``tools.planner``: the same
  config through ``estimate_from_config``, the GPU's table entry, the planner's default
  efficiency 0.5): predicted step time and memory against the trainer's measured ones
  (``predicted_over_measured``, ``memory_predicted_over_measured``), and the efficiency that
  would make the predicted step time exact (``efficiency_implied``). The planner does not model
  ``torch.compile``; the compiled rows show what that costs its estimate.

Every measurement runs in a fresh process (a new interpreter; ``--launcher fork`` forks it from
a server that imported torch and the trainer once instead, as the CPU smoke test does). Ratios:
trainer / bare (framework overhead; goal >= 0.97) and bare / torchtitan (model code; goal >= 1.0).
MFU uses the trainer's FLOPs per token (``trainer.metrics.training_flops_per_token``) for all
three, so the ratios of MFU equal the ratios of tokens/s.

* float8 rows (``--precisions``, default ``bf16 float8``; causal rows only): the trainer with
  ``--model.converters float8`` (tensorwise; one GPU, so no FSDP float8 all-gather), for
  DeepSeek also ``float8_experts`` (the routed experts' grouped GEMMs, rowwise: torchao's
  ``torch._scaled_grouped_mm`` path on sm90+), and the bare loop with the same model converted
  (``convert_to_float8`` before the bf16 cast, AC and compile); ``float8_over_bf16``: their tokens/s over the bf16 row of the same model and
  mode (the issue's anchor: >= 1.2 on Llama 3 8B shapes compiled); the bare loop's matmul census
  reports the float8 share of the GEMM FLOPs (``matmul_float8_share``); torchtitan's model is
  skipped; MFU stays priced at the bf16 peak, the planner row prices the converted GEMMs at the
  float8 peak.

JSON to ``bench_results/gpu.json``, a table to stdout.

``--smoke`` runs the same code paths on tiny debug shapes (on the CPU when there is no GPU), so
CI proves the benchmark itself works; its numbers mean nothing.

Every run ends with the first-GPU-run checklist (``benchmarks/gpu_checklist.py``): what a GPU
must confirm beyond this table.

Where GPUs are (often no network, a driver pinned to the node's CUDA build of torch):
``SYSTEM_TORCH=1 make bench-gpu`` makes ``.venv`` on the node python's own torch and installs
nothing that needs the network (see the Makefile's setup), or, with no venv at all, run
``python -m benchmarks.gpu`` with that python from the repository root: the benchmark needs torch,
numpy, tokenizers and this checkout (train.py is run from the root; torchtitan's model rows are
skipped when torchtitan is not importable).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from benchmarks.gpu_checklist import render_text as render_checklist

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Case:
    model: str
    flavor: str
    n_layers: int
    seq_len: int
    local_batch_size: int
    ac_mode: str = "selective"
    compile: bool = False
    device: str = "cuda"
    vocab_size: int | None = None  # None: the flavor's
    attn_mask_type: str = "causal"
    attn_type: str = "sdpa"
    precision: str = "bf16"  # "float8": float8 linears, tensorwise, and MoE experts (causal rows only)

    @property
    def name(self) -> str:
        mask = "" if self.attn_mask_type == "causal" else f", {self.attn_mask_type} {self.attn_type}"
        f8 = ""
        if self.precision == "float8":  # the linears and, for DeepSeek, the routed experts
            f8 = ", float8" + (" (linears + experts)" if self.model == "deepseek_v3" else "")
        return (
            f"{self.model} {self.flavor} x{self.n_layers} layers{mask}{f8}, {'compiled' if self.compile else 'eager'}"
        )


GPU_CASES = [
    Case("llama3", "8B", n_layers=8, seq_len=8192, local_batch_size=1),
    Case("deepseek_v3", "16B", n_layers=6, seq_len=4096, local_batch_size=2),
    Case("llama3", "8B", n_layers=8, seq_len=8192, local_batch_size=1, attn_mask_type="block_causal",
         attn_type="flex"),
    Case("deepseek_v3", "16B", n_layers=6, seq_len=4096, local_batch_size=2, attn_mask_type="block_causal",
         attn_type="flex"),
]  # fmt: skip
SMOKE_CASES = [
    Case("llama3", "debugmodel", n_layers=2, seq_len=64, local_batch_size=2, vocab_size=2048),
    Case("deepseek_v3", "debugmodel", n_layers=3, seq_len=64, local_batch_size=2, vocab_size=2048),
    Case("llama3", "debugmodel", n_layers=2, seq_len=64, local_batch_size=2, vocab_size=2048,
         attn_mask_type="block_causal", attn_type="sdpa"),
]  # fmt: skip


# ------------------------------------------------------------------ the trainer (train.py)


def trainer_args(case: Case, steps: int, folder: str) -> list[str]:
    args = [
        "--config", f"{case.model}.toml", "--model.flavor", case.flavor,
        "--model.n_layers", str(case.n_layers),
        "--training.seq_len", str(case.seq_len),
        "--training.local_batch_size", str(case.local_batch_size),
        "--training.global_batch_size", "-1", "--training.steps", str(steps),
        "--training.dataset", "synthetic",
        "--parallelism.dp_shard", "-1",
        "--parallelism.mixed_precision_param", "bfloat16",
        "--parallelism.mixed_precision_reduce", "float32",
        "--activation_checkpoint.mode", case.ac_mode, "--activation_checkpoint.selective_ac_option", "op",
        "--compile.enable", str(case.compile).lower(),
        "--checkpoint.enable", "false", "--metrics.log_freq", "1",
        "--metrics.enable_tensorboard", "false", "--job.dump_folder", folder,
        "--lr_scheduler.warmup_steps", "2",
        "--model.attn_mask_type", case.attn_mask_type, "--model.attn_type", case.attn_type,
    ]  # fmt: skip
    if case.vocab_size is not None:
        args += ["--model.vocab_size", str(case.vocab_size)]
    if case.precision == "float8":  # one GPU: no FSDP sharding, so no float8 all-gather
        converters = "float8,float8_experts" if case.model == "deepseek_v3" else "float8"
        args += ["--model.converters", converters, "--float8.recipe_name", "tensorwise"]
    return args


PLANNER_EFFICIENCY = 0.5  # the planner's default (python -m parallel_dims plan --efficiency)


def planner_check(case: Case, trainer: dict, device_name: str | None) -> dict:
    """The planner's estimate of the trainer run ``trainer`` measured: step time and memory,
    predicted over measured. ``device_name`` None (a CPU smoke run): priced as an H100, so only
    the code path is checked."""
    from tools.planner.estimate import estimate_from_config
    from tools.planner.hardware import hardware_for_device, load_hardware
    from trainer.config import load_config

    if "error" in trainer:
        return {"error": "the trainer run failed"}
    hw = hardware_for_device(device_name) if device_name else load_hardware("h100")
    if hw is None:
        return {"error": f"the planner has no entry for {device_name!r}"}
    with tempfile.TemporaryDirectory() as folder:
        cfg = load_config(trainer_args(case, 2, folder))
    est = estimate_from_config(cfg, 1, hw, gpus_per_node=1, efficiency=PLANNER_EFFICIENCY)
    t = est.time
    measured = case.seq_len * case.local_batch_size / trainer["tokens_per_s"]
    flop_time = (t["compute"] + t["recompute"]) * PLANNER_EFFICIENCY  # the FLOPs' time at peak
    rest = t["total"] - t["compute"] - t["recompute"]  # optimizer (no collectives on one GPU)
    out = {
        "hardware": hw.name if device_name else "h100 (smoke run on CPU: the ratios mean nothing)",
        "efficiency_assumed": PLANNER_EFFICIENCY,
        "predicted_step_s": t["total"],
        "measured_step_s": measured,
        "predicted_over_measured": t["total"] / measured,
        "efficiency_implied": flop_time / (measured - rest) if measured > rest else None,
        "predicted_memory_gib": est.memory["total"] / 2**30,
        "predicted_time_s": {k: v for k, v in t.items() if k in ("compute", "recompute", "optimizer")},
    }
    if trainer.get("peak_memory_gib"):
        out["memory_predicted_over_measured"] = out["predicted_memory_gib"] / trainer["peak_memory_gib"]
    return out


# seconds one measurement (one process) may take before it is killed and reported as an error
# (--timeout; None: no limit), so a hang costs one row, not the whole run on a lent GPU
TIMEOUT_S: float | None = None


# how a measurement process starts (--launcher): "subprocess", a new interpreter (what a GPU run
# uses), or "fork", forked from a server that imported torch and the trainer once
# (tools/launcher.py): the same script, arguments, environment and working directory without
# the ~2 CPU s of imports per process, for the CPU smoke run of the test suite
LAUNCHER = "subprocess"


def _forked(cmd: list[str], env: dict) -> subprocess.CompletedProcess:
    """``cmd`` (``python script ...`` or ``python -m module ...``) on one process forked from
    tools/launcher.py's server: what ``subprocess.run`` gives, a timeout raising
    ``subprocess.TimeoutExpired`` too."""
    import importlib.util

    from tools.launcher import run_train

    if cmd[1] == "-m":
        script, argv = importlib.util.find_spec(cmd[2]).origin, cmd[3:]
    else:
        script, argv = str(ROOT / cmd[1]), cmd[2:]
    return run_train(1, argv, env=env, cwd=ROOT, timeout=TIMEOUT_S, script=script)


def _run_process(cmd: list[str], env: dict) -> subprocess.CompletedProcess | str:
    """Run ``cmd`` from the repository root (in a new interpreter, or forked: ``LAUNCHER``); the
    completed process, or what went wrong when it ran past ``TIMEOUT_S``."""
    try:
        if LAUNCHER == "fork":
            return _forked(cmd, env)
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        return f"did not finish in {TIMEOUT_S:g} s (--timeout), killed: {err[-2000:]}"


def run_trainer(case: Case, steps: int, warmup: int) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        cmd = [sys.executable, "train.py", *trainer_args(case, steps, folder)]
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0"))
        if case.device == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""
        res = _run_process(cmd, env)
        if isinstance(res, str):
            return {"error": f"train.py {res}"}
        if res.returncode != 0:
            return {"error": f"train.py exited {res.returncode}: {res.stderr[-2000:]}"}
        records = [json.loads(line) for line in open(os.path.join(folder, "metrics.jsonl"))]
    timed = [r for r in records if r["step"] > warmup]
    mem_key = next((k for k in records[0] if k.endswith("_gib")), None)
    data_line = next((line for line in res.stdout.splitlines() if line.startswith("data: ")), None)
    float8_line = next((line for line in res.stdout.splitlines() if line.startswith("float8: ")), None)
    return {
        "data": data_line,  # the trainer's startup line: mean document length, documents per window
        "float8": float8_line,  # what converted, and which backend runs the experts' float8 GEMMs
        "tokens_per_s": statistics.median(r["tps"] for r in timed),
        "mfu_pct": statistics.median(r["mfu_pct"] for r in timed) if "mfu_pct" in timed[0] else None,
        "peak_memory_gib": max(r[mem_key] for r in records) if mem_key == "cuda_max_alloc_gib" else None,
        "steps_timed": len(timed),
    }


# ------------------------------------------------------------------ driver


def _worker(argv: list[str]) -> int:
    from benchmarks.gpu_bare import bare_loop

    kind, case_json, steps, warmup = argv
    case = Case(**json.loads(case_json))
    print(json.dumps(bare_loop(case, kind, int(steps), int(warmup), trainer_args)))
    return 0


def run_bare(case: Case, kind: str, steps: int, warmup: int) -> dict:
    env = dict(os.environ)
    if case.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    res = _run_process(
        [sys.executable, "-m", "benchmarks.gpu", "--worker", kind, json.dumps(asdict(case)), str(steps), str(warmup)],
        env,
    )
    if isinstance(res, str):
        return {"error": f"{kind} loop {res}"}
    if res.returncode != 0:
        return {"error": f"{kind} loop exited {res.returncode}: {res.stderr[-2000:]}"}
    return json.loads(res.stdout.strip().splitlines()[-1])


def _torchtitan_available() -> bool:
    try:
        import torchtitan.models.deepseek_v3
        import torchtitan.models.llama3  # noqa: F401
    except Exception:
        return False
    return True


def _ratio(a: dict, b: dict) -> float | None:
    if "error" in a or "error" in b or not b.get("tokens_per_s"):
        return None
    return a["tokens_per_s"] / b["tokens_per_s"]


def measure(
    cases: list[Case], steps: int, warmup: int, with_torchtitan: bool, device_name: str | None = None
) -> list[dict]:
    rows = []
    for case in cases:
        print(f"== {case.name}", file=sys.stderr, flush=True)
        row = {"case": asdict(case), "name": case.name}
        row["trainer"] = run_trainer(case, steps, warmup)
        row["planner"] = planner_check(case, row["trainer"], device_name)
        row["bare"] = run_bare(case, "ours", steps, warmup)
        row["trainer_over_bare"] = _ratio(row["trainer"], row["bare"])
        if with_torchtitan and case.precision != "bf16":
            row["torchtitan_model"] = {"skipped": "the torchtitan comparison runs bf16 only"}
        elif with_torchtitan and case.attn_mask_type != "causal":
            row["torchtitan_model"] = {"skipped": "the torchtitan comparison runs causal sdpa only"}
        elif with_torchtitan and case.device == "cpu" and case.model == "deepseek_v3":
            # its router counts tokens with torch.histc, which has no CPU kernel for integers
            row["torchtitan_model"] = {"skipped": "torchtitan's MoE does not run on CPU"}
        elif with_torchtitan:
            row["torchtitan_model"] = run_bare(case, "torchtitan", steps, warmup)
            row["bare_over_torchtitan_model"] = _ratio(row["bare"], row["torchtitan_model"])
        rows.append(row)
    _float8_ratios(rows)
    return rows


def _float8_ratios(rows: list[dict]) -> None:
    """Each float8 row's tokens/s over the bf16 row of the same model, mask and mode (trainer and
    bare loop; None when that row was not run or failed)."""
    same = ("model", "flavor", "n_layers", "seq_len", "attn_mask_type", "compile")
    for row in rows:
        if row["case"]["precision"] != "float8":
            continue
        key = tuple(row["case"][k] for k in same)
        bf16 = next(
            (r for r in rows if r["case"]["precision"] == "bf16" and tuple(r["case"][k] for k in same) == key), None
        )
        row["float8_over_bf16"] = {
            kind: _ratio(row[kind], bf16[kind]) if bf16 is not None else None for kind in ("trainer", "bare")
        }


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(rows: list[dict]) -> None:
    header = (
        f"{'case':<60}{'trainer tok/s':>14}{'MFU%':>7}{'GiB':>7}{'bare tok/s':>12}{'MFU%':>7}"
        f"{'GiB':>7}{'tr/bare':>9}{'titan tok/s':>13}{'bare/titan':>11}{'bf16 GEMM':>10}"
        f"{'f8 GEMM':>8}{'f8/bf16 tr':>11}{'f8/bf16 bare':>13}{'plan/meas s':>12}{'plan/meas GiB':>14}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        t, b, tt, pl = r["trainer"], r["bare"], r.get("torchtitan_model", {}), r.get("planner", {})
        f8 = r.get("float8_over_bf16", {})
        print(
            f"{r['name']:<60}{_fmt(t.get('tokens_per_s'), ',.0f'):>14}{_fmt(t.get('mfu_pct'), '.1f'):>7}"
            f"{_fmt(t.get('peak_memory_gib'), '.1f'):>7}{_fmt(b.get('tokens_per_s'), ',.0f'):>12}"
            f"{_fmt(b.get('mfu_pct'), '.1f'):>7}{_fmt(b.get('peak_memory_gib'), '.1f'):>7}"
            f"{_fmt(r['trainer_over_bare'], '.3f'):>9}{_fmt(tt.get('tokens_per_s'), ',.0f'):>13}"
            f"{_fmt(r.get('bare_over_torchtitan_model'), '.3f'):>11}{_fmt(b.get('matmul_bf16_share'), '.3f'):>10}"
            f"{_fmt(b.get('matmul_float8_share'), '.3f'):>8}{_fmt(f8.get('trainer'), '.3f'):>11}"
            f"{_fmt(f8.get('bare'), '.3f'):>13}{_fmt(pl.get('predicted_over_measured'), '.3f'):>12}"
            f"{_fmt(pl.get('memory_predicted_over_measured'), '.3f'):>14}"
        )
    for r in rows:
        for kind in ("trainer", "bare", "torchtitan_model"):
            if "error" in r.get(kind, {}):
                print(f"\n{r['name']} / {kind} failed:\n{r[kind]['error']}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return _worker(argv[1:])
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
        "server that imported torch and the trainer once (tools/launcher.py; the test suite's CPU "
        "smoke run: the same scripts and arguments without the imports per process)",
    )
    args = p.parse_args(argv)

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
    global TIMEOUT_S, LAUNCHER
    TIMEOUT_S, LAUNCHER = args.timeout, args.launcher
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
    with_titan = _torchtitan_available()
    if not with_titan:
        print("torchtitan is not importable: the model comparison is skipped", file=sys.stderr)
    rows = measure(cases, args.steps, args.warmup, with_titan, torch.cuda.get_device_name() if has_gpu else None)
    result = {
        "host": {
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if has_gpu else "cpu",
            "smoke": args.smoke,
        },
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print_table(rows)
    print(f"\nwrote {out}", file=sys.stderr, flush=True)
    # what a first GPU run must confirm beyond these numbers (one list: benchmarks/gpu_checklist.py)
    print("\n" + render_checklist())
    failed = [r["name"] for r in rows if any("error" in r.get(k, {}) for k in ("trainer", "bare", "torchtitan_model"))]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
