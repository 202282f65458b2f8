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
(``trainer.metrics.training_flops_per_token``) for our rows and the bare loops, so their ratios
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
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from benchmarks.gpu_checklist import render_text as render_checklist

ROOT = Path(__file__).resolve().parents[1]
# what the GPU machine needs besides the checkout, in a folder git ignores (.git/info/exclude):
# torchtitan_ref (torchtitan's trainer scripts and configs, its data and tokenizer) and site
# (torchtitan 0.2.2 and its pure-Python dependencies, unzipped); `make bench-gpu-prepare` fills it
GPU_FOLDER = ROOT / ".gpu"
TORCHTITAN_REF = GPU_FOLDER / "torchtitan_ref"
TORCHTITAN_SITE = GPU_FOLDER / "site"


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


# ------------------------------------------------------------------ torchtitan's own trainer

# model -> (flavor, layers, run script, config) of ../shared/gpu/torchtitan_ref: the scripts
# register torchtitan flavors of these shapes ("8B_l8", "16B_l6"); seq_len and batch come from
# the command line
TORCHTITAN_REF_RUNS = {
    "llama3": ("8B", 8, "llama_run.py", "llama_8b_8layers.toml"),
    "deepseek_v3": ("16B", 6, "deepseek_run.py", "deepseek_16b_6layers.toml"),
}
TORCHTITAN_DATA = "c4_test/data.json"  # written by its make_data.py (make bench-gpu-prepare)

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# torchtitan 0.2.2's training line (torchtitan/components/metrics.py, MetricsProcessor.log):
# "step: {step:2}  loss: {loss:8.5f}  grad_norm: {norm:7.4f}  memory: {reserved_gib:5.2f}GiB({pct:.2f}%)
#  tps: {round(tps):,}  tflops: {tflops:,.2f}  mfu: {mfu:.2f}%", each field after a color code
# unless metrics.disable_color_printing, behind its logger's "[titan] <time> - root - INFO - "
_TITAN_STEP = re.compile(
    r"(?<![A-Za-z])step:\s*(?P<step>\d+)\s+loss:\s*(?P<loss>\S+)\s+grad_norm:\s*(?P<grad_norm>\S+)\s+"
    r"memory:\s*(?P<memory>[\d.]+)GiB\((?P<memory_pct>[\d.]+)%\)\s+tps:\s*(?P<tps>[\d,]+)\s+"
    r"tflops:\s*(?P<tflops>[\d,.]+)\s+mfu:\s*(?P<mfu>[\d.]+)%"
)


def parse_torchtitan_log(text: str) -> list[dict]:
    """Every training-step line of torchtitan's log in ``text`` (colored or not; validation lines,
    which have no grad_norm, are not steps): step, loss, grad_norm, tps (tokens per second per
    device over the steps since the last line; log_freq 1: that step), tflops, mfu_pct and
    reserved_gib (the step's max reserved memory), in log order."""
    records = []
    for line in text.splitlines():
        m = _TITAN_STEP.search(_ANSI.sub("", line))
        if m is None:
            continue
        records.append(
            {
                "step": int(m["step"]),
                "loss": float(m["loss"]),
                "grad_norm": float(m["grad_norm"]),
                "tps": float(m["tps"].replace(",", "")),
                "tflops": float(m["tflops"].replace(",", "")),
                "mfu_pct": float(m["mfu"]),
                "reserved_gib": float(m["memory"]),
            }
        )
    return records


def summarize_torchtitan(records: list[dict], steps: int, warmup: int) -> dict:
    """The figures of our trainer's row from torchtitan's step records: medians over the steps
    after ``warmup`` (the window ours is timed on), every one of them logged, or an error."""
    timed = [r for r in records if r["step"] > warmup]
    if sorted(r["step"] for r in timed) != list(range(warmup + 1, steps + 1)):
        got = ", ".join(str(r["step"]) for r in records) or "none"
        return {"error": f"torchtitan's log has steps {got}, not every one of steps {warmup + 1}..{steps}"}
    return {
        "tokens_per_s": statistics.median(r["tps"] for r in timed),
        "mfu_pct": statistics.median(r["mfu_pct"] for r in timed),
        "peak_reserved_gib": max(r["reserved_gib"] for r in timed),
        "steps_timed": len(timed),
        "last_loss": timed[-1]["loss"],
    }


def torchtitan_trainer_cmd(case: Case, steps: int, folder: str) -> list[str]:
    """torchrun of ``.gpu/torchtitan_ref``'s script for ``case``'s model with its config, run from
    that folder (its data, tokenizer and configs are relative to it), one process."""
    _flavor, _layers, script, config = TORCHTITAN_REF_RUNS[case.model]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", script]
    cmd += ["--job.config_file", config, "--job.dump_folder", folder, "--training.steps", str(steps)]
    cmd += ["--training.seq_len", str(case.seq_len), "--training.local_batch_size", str(case.local_batch_size)]
    if case.model == "deepseek_v3":
        cmd += ["--parallelism.expert_parallel_degree", "1"]
    if case.compile:
        cmd.append("--compile.enable")  # components model and loss, as its config lists
    return cmd


def torchtitan_skip(case: Case, kind: str, unavailable: str | None) -> str | None:
    """Why torchtitan's ``kind`` (``torchtitan_model`` or ``torchtitan_trainer``) does not run on
    ``case``'s row, or None. ``unavailable``: why torchtitan cannot be imported, or None."""
    if unavailable:
        return unavailable
    if case.precision != "bf16":
        return "the torchtitan comparison runs bf16 only"
    if case.attn_mask_type != "causal":
        return "the torchtitan comparison runs causal sdpa only"
    if kind == "torchtitan_model":
        if case.device == "cpu" and case.model == "deepseek_v3":
            # its router counts tokens with torch.histc, which has no CPU kernel for integers
            return "torchtitan's MoE does not run on CPU"
        return None
    if case.device != "cuda":
        return "torchtitan's trainer runs on CUDA only (it takes device cuda:LOCAL_RANK)"
    flavor, layers, script, _config = TORCHTITAN_REF_RUNS[case.model]
    if (case.flavor, case.n_layers) != (flavor, layers):
        return f"torchtitan_ref's {script} has {flavor} shapes with {layers} layers only"
    if not (TORCHTITAN_REF / script).exists() or not (TORCHTITAN_REF / TORCHTITAN_DATA).exists():
        return (
            f"{TORCHTITAN_REF.relative_to(ROOT)} is not prepared: run make bench-gpu-prepare where "
            "../shared is, and carry .gpu to the GPU machine"
        )
    return None


def run_torchtitan_trainer(case: Case, steps: int, warmup: int) -> dict:
    """torchtitan's trainer on ``case`` (``torchtitan_trainer_cmd``), its figures from its log
    (``summarize_torchtitan``), or an error with the log's tail. Past ``TIMEOUT_S`` torchrun gets
    SIGTERM, on which it stops its worker (which runs in a session of its own) before it exits,
    so no worker is left holding the GPU for the next measurement; SIGKILL to torchrun's session
    after 30 s more. The log goes to a file, which a worker cannot hold open the way it could a
    pipe."""
    import signal

    with tempfile.TemporaryDirectory() as folder:
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0"))
        if TORCHTITAN_SITE.is_dir():
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TORCHTITAN_SITE), env.get("PYTHONPATH")]))
        log_path = Path(folder) / "torchtitan.log"
        with open(log_path, "w") as log_file:
            proc = subprocess.Popen(
                torchtitan_trainer_cmd(case, steps, os.path.join(folder, "dump")),
                cwd=TORCHTITAN_REF,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
            timed_out = False
            try:
                proc.wait(timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                timed_out = True
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        log = log_path.read_text(errors="replace")
    if timed_out:
        return {"error": f"torchtitan's trainer did not finish in {TIMEOUT_S:g} s (--timeout), killed: {log[-2000:]}"}
    if proc.returncode != 0:
        return {"error": f"torchtitan's trainer exited {proc.returncode}: {log[-2000:]}"}
    out = summarize_torchtitan(parse_torchtitan_log(log), steps, warmup)
    if "error" in out:
        out["error"] += f": {log[-2000:]}"
    return out


# ------------------------------------------------------------------ driver


def _worker(argv: list[str]) -> int:
    from benchmarks.gpu_bare import bare_loop

    implementation, recipe, case_json, steps, warmup = argv
    case = Case(**json.loads(case_json))
    print(json.dumps(bare_loop(case, implementation, int(steps), int(warmup), trainer_args, recipe)))
    return 0


def run_bare(case: Case, implementation: str, recipe: str, steps: int, warmup: int) -> dict:
    """A bare loop (``benchmarks/gpu_bare.py``) of ``implementation``'s model (``ours`` or
    ``torchtitan``) in ``recipe`` (``mixed`` or ``bf16``), in its own process."""
    env = dict(os.environ)
    if case.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [sys.executable, "-m", "benchmarks.gpu", "--worker", implementation, recipe, json.dumps(asdict(case))]
    res = _run_process(cmd + [str(steps), str(warmup)], env)
    what = f"{recipe} loop" + (" of torchtitan's model" if implementation == "torchtitan" else "")
    if isinstance(res, str):
        return {"error": f"{what} {res}"}
    if res.returncode != 0:
        return {"error": f"{what} exited {res.returncode}: {res.stderr[-2000:]}"}
    return json.loads(res.stdout.strip().splitlines()[-1])


def _import_torchtitan() -> str | None:
    """None when torchtitan's models import, else the error."""
    try:
        import torchtitan.models.deepseek_v3
        import torchtitan.models.llama3  # noqa: F401
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def torchtitan_unavailable() -> str | None:
    """None when torchtitan is importable, else the reason its rows give. Not importable as is but
    ``.gpu/site`` exists (``make bench-gpu-prepare``): that folder goes on this process's path and
    on ``PYTHONPATH`` for the measurement processes, and counts if torchtitan imports from it."""
    err = _import_torchtitan()
    if err is not None and TORCHTITAN_SITE.is_dir() and str(TORCHTITAN_SITE) not in sys.path:
        sys.path.insert(0, str(TORCHTITAN_SITE))
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TORCHTITAN_SITE), os.environ.get("PYTHONPATH")]))
        err = _import_torchtitan()
    return None if err is None else f"torchtitan not importable ({err})"


def _ratio(a: dict | None, b: dict | None) -> float | None:
    if not a or not b or "error" in a or "error" in b or not a.get("tokens_per_s") or not b.get("tokens_per_s"):
        return None
    return a["tokens_per_s"] / b["tokens_per_s"]


# what each reference is (--references), the row key it writes
REFERENCES = {
    "mixed": "bare_mixed",
    "bf16": "bare_bf16",
    "torchtitan_model": "torchtitan_model",
    "torchtitan_trainer": "torchtitan_trainer",
}
MEASURED = ("trainer", *REFERENCES.values())  # the row keys of measurements (a failure: "error")


def add_ratios(row: dict) -> None:
    """The row's ratios of tokens/s (None where a side is missing, failed or skipped)."""
    row["trainer_over_bare_mixed"] = _ratio(row["trainer"], row.get("bare_mixed"))
    row["trainer_over_bare_bf16"] = _ratio(row["trainer"], row.get("bare_bf16"))
    row["bare_bf16_over_torchtitan_model"] = _ratio(row.get("bare_bf16"), row.get("torchtitan_model"))
    row["ours_over_torchtitan_trainer"] = _ratio(row["trainer"], row.get("torchtitan_trainer"))


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
    _float8_ratios(rows)
    return rows


def _float8_ratios(rows: list[dict]) -> None:
    """Each float8 row's tokens/s over the bf16 row of the same model, mask and mode (trainer and
    bare loops; None when that row was not run or failed)."""
    same = ("model", "flavor", "n_layers", "seq_len", "attn_mask_type", "compile")
    for row in rows:
        if row["case"]["precision"] != "float8":
            continue
        key = tuple(row["case"][k] for k in same)
        bf16 = next(
            (r for r in rows if r["case"]["precision"] == "bf16" and tuple(r["case"][k] for k in same) == key), None
        )
        row["float8_over_bf16"] = {
            kind: _ratio(row.get(kind), bf16.get(kind)) if bf16 is not None else None
            for kind in ("trainer", "bare_mixed", "bare_bf16")
            if kind in row
        }


# ------------------------------------------------------------------ goals (issue 39)

# (id, what, threshold): each measured on the four bf16 causal rows of the GPU shapes (both
# models, eager and compiled) of one or more runs that had these references
GOALS = [
    ("ours_over_torchtitan_trainer", "ours / torchtitan's trainer (tokens/s, same shapes, same call), each row", 1.05),
    ("trainer_over_bare_mixed", "trainer / mixed-precision bare loop (tokens/s), each row", 0.97),
    ("deepseek_compiled_over_eager", "DeepSeek-V3 trainer compiled / eager (tokens/s)", 1.10),
]
GOAL_ROWS = [(m, c) for m in ("llama3", "deepseek_v3") for c in (False, True)]
# how to measure the goals: here, then on the GPU machine (one call per model: each is 2 rows of
# the trainer and 4 references), then the report here
GOALS_COMMAND = (
    "here: `make bench-gpu-prepare`; on the GPU machine (carry `.gpu`), from the repository root: "
    "`python -m benchmarks.gpu --models llama3 --masks causal --precisions bf16 "
    "--out bench_results/gpu_issue39_llama3.json`, then the same with `--models deepseek_v3` and "
    "`--out bench_results/gpu_issue39_deepseek_v3.json` (on a lent device machine: `--out $OUT/...`, "
    "then copy both files into bench_results/ here); then `python -m benchmarks.report` here"
)


def _row_label(model: str, compiled: bool) -> str:
    return f"{model} {'compiled' if compiled else 'eager'}"


def evaluate_goals(rows: list[dict]) -> list[dict]:
    """:data:`GOALS` on ``rows`` (later rows of the same case replace earlier ones): per goal its
    threshold, the measured values by row and its status: ``met``, ``missed``, or ``UNMEASURED``
    when a value is missing (not run, failed, skipped)."""
    four: dict[tuple[str, bool], dict] = {}
    for r in rows:
        c = r["case"]
        shapes = TORCHTITAN_REF_RUNS.get(c["model"], (None, None))[:2]
        if (c["precision"], c["attn_mask_type"], c["device"]) == ("bf16", "causal", "cuda") and (
            c["flavor"],
            c["n_layers"],
        ) == shapes:
            four[(c["model"], c["compile"])] = r
    out = []
    for gid, what, threshold in GOALS:
        if gid == "deepseek_compiled_over_eager":
            eager, compiled = four.get(("deepseek_v3", False)), four.get(("deepseek_v3", True))
            value = _ratio(compiled["trainer"], eager["trainer"]) if eager and compiled else None
            measured = {"deepseek_v3": value}
        else:
            measured = {_row_label(*k): (four[k].get(gid) if k in four else None) for k in GOAL_ROWS}
        values = list(measured.values())
        if any(v is None for v in values):
            status = "UNMEASURED"
        else:
            status = "met" if all(v >= threshold for v in values) else "missed"
        out.append({"goal": gid, "what": what, "threshold": threshold, "status": status, "measured": measured})
    return out


# ------------------------------------------------------------------ the table


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


# (header, width, value of a row, format)
_COLUMNS = [
    ("trainer tok/s", 14, lambda r: r["trainer"].get("tokens_per_s"), ",.0f"),
    ("MFU%", 7, lambda r: r["trainer"].get("mfu_pct"), ".1f"),
    ("GiB", 7, lambda r: r["trainer"].get("peak_memory_gib"), ".1f"),
    ("mixed tok/s", 12, lambda r: r.get("bare_mixed", {}).get("tokens_per_s"), ",.0f"),
    ("tr/mixed", 9, lambda r: r.get("trainer_over_bare_mixed"), ".3f"),
    ("bf16 tok/s", 12, lambda r: r.get("bare_bf16", {}).get("tokens_per_s"), ",.0f"),
    ("tr/bf16", 9, lambda r: r.get("trainer_over_bare_bf16"), ".3f"),
    ("titan-tr tok/s", 15, lambda r: r.get("torchtitan_trainer", {}).get("tokens_per_s"), ",.0f"),
    ("ours/titan-tr", 14, lambda r: r.get("ours_over_torchtitan_trainer"), ".3f"),
    ("titan-model", 12, lambda r: r.get("torchtitan_model", {}).get("tokens_per_s"), ",.0f"),
    ("bf16/t-model", 13, lambda r: r.get("bare_bf16_over_torchtitan_model"), ".3f"),
    ("bf16 GEMM", 10, lambda r: r.get("bare_mixed", {}).get("matmul_bf16_share"), ".3f"),
    ("f8 GEMM", 8, lambda r: r.get("bare_mixed", {}).get("matmul_float8_share"), ".3f"),
    ("f8/bf16 tr", 11, lambda r: r.get("float8_over_bf16", {}).get("trainer"), ".3f"),
    ("plan/meas s", 12, lambda r: r.get("planner", {}).get("predicted_over_measured"), ".3f"),
    ("plan/meas GiB", 14, lambda r: r.get("planner", {}).get("memory_predicted_over_measured"), ".3f"),
]


def print_table(rows: list[dict]) -> None:
    header = f"{'case':<60}" + "".join(f"{h:>{w}}" for h, w, _v, _f in _COLUMNS)
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['name']:<60}" + "".join(f"{_fmt(v(r), f):>{w}}" for _h, w, v, f in _COLUMNS))
    for r in rows:
        for kind in MEASURED:
            if "error" in r.get(kind, {}):
                print(f"\n{r['name']} / {kind} failed:\n{r[kind]['error']}")
    skipped = {r[kind]["skipped"] for r in rows for kind in MEASURED if "skipped" in r.get(kind, {})}
    for reason in sorted(skipped):
        print(f"skipped: {reason}")


# ------------------------------------------------------------------ prepare (make bench-gpu-prepare)


def prepare_torchtitan(shared: Path) -> int:
    """Fill ``.gpu/`` for the GPU machine from ``shared`` (../shared): ``gpu/torchtitan_ref`` copied
    to ``.gpu/torchtitan_ref`` (writable copies) and its data written there (its make_data.py),
    every wheel of ``wheels/`` unzipped into ``.gpu/site``, and ``/.gpu/`` added to
    ``.git/info/exclude`` so git ignores the folder."""
    import zipfile

    ref, wheels = shared / "gpu" / "torchtitan_ref", shared / "wheels"
    missing = [str(p) for p in (ref, wheels) if not p.is_dir()]
    if missing:
        print(
            f"error: {', '.join(missing)} not found: pass the folder that holds gpu/torchtitan_ref and "
            "wheels/ (make bench-gpu-prepare SHARED=path)",
            file=sys.stderr,
        )
        return 2
    for src in sorted(ref.rglob("*")):
        dst = TORCHTITAN_REF / src.relative_to(ref)
        if src.is_dir():
            dst.mkdir(parents=True, exist_ok=True)
        else:
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)  # contents only: the source is read-only
    TORCHTITAN_SITE.mkdir(parents=True, exist_ok=True)
    names = sorted(w.name for w in wheels.glob("*.whl"))
    for name in names:
        with zipfile.ZipFile(wheels / name) as z:
            z.extractall(TORCHTITAN_SITE)
    subprocess.run([sys.executable, "make_data.py"], cwd=TORCHTITAN_REF, check=True)
    git_dir = subprocess.run(
        ["git", "rev-parse", "--git-path", "info/exclude"], cwd=ROOT, capture_output=True, text=True
    )
    if git_dir.returncode == 0:
        exclude = ROOT / git_dir.stdout.strip()
        lines = exclude.read_text().splitlines() if exclude.exists() else []
        if "/.gpu/" not in lines:
            exclude.parent.mkdir(parents=True, exist_ok=True)
            exclude.write_text("\n".join([*lines, "/.gpu/"]) + "\n")
    print(
        f"prepared {GPU_FOLDER.relative_to(ROOT)}/: torchtitan_ref from {ref} (data: {TORCHTITAN_DATA}), "
        f"site from {len(names)} wheels ({', '.join(names)}); carry .gpu to the GPU machine"
    )
    return 0


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
