"""The measurements of one ``make bench-gpu`` row that are ours (``benchmarks/gpu.py``'s docstring
says what each is): the row's :class:`Case` and the cases of a GPU and a smoke run, our
trainer's command line for a case (``trainer_args``) and its run (``run_trainer``), the layout
planner's estimate of that run (``planner_check``), the bare loops (``run_bare``; ``worker`` is
their process, ``python -m benchmarks.gpu --worker ...``), and how every measurement process is
started and bounded (``LAUNCHER``, ``TIMEOUT_S``: set from ``--launcher`` and ``--timeout``).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

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


PLANNER_EFFICIENCY = 0.5  # the planner's default (python -m tools.planner --efficiency)


def planner_check(case: Case, trainer: dict, device_name: str | None) -> dict:
    """The planner's estimate of the trainer run ``trainer`` measured: step time and memory,
    predicted over measured. ``device_name`` None (a CPU smoke run): priced as an H100, so only
    the code path is checked."""
    from tools.planner.from_config import estimate_from_config
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
# (--timeout; None: no limit), so a hang costs one row, not the whole run on a lent GPU; read at
# call time here and by benchmarks/gpu_torchtitan.py (torchtitan's trainer), set by benchmarks/gpu.py
TIMEOUT_S: float | None = None


# how a measurement process starts (--launcher): "subprocess", a new interpreter (what a GPU run
# uses), or "fork", forked from a server that imported torch and the trainer once
# (tools/forkserver.py): the same script, arguments, environment and working directory without
# the ~2 CPU s of imports per process, for the CPU smoke run of the test suite
LAUNCHER = "subprocess"


def _forked(cmd: list[str], env: dict) -> subprocess.CompletedProcess:
    """``cmd`` (``python script ...`` or ``python -m module ...``) on one process forked from
    tools/forkserver.py's server: what ``subprocess.run`` gives, a timeout raising
    ``subprocess.TimeoutExpired`` too."""
    import importlib.util

    from tools.forkserver import run_train

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


# ------------------------------------------------------------------ the bare loops (benchmarks/gpu_bare.py)


def worker(argv: list[str]) -> int:
    """``python -m benchmarks.gpu --worker IMPLEMENTATION RECIPE CASE_JSON STEPS WARMUP``: one bare
    loop, its figures as one JSON line on stdout (what ``run_bare`` reads)."""
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
