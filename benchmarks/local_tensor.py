"""What ``comm.mode = "local_tensor"`` costs (issue 29): step time and peak memory of one
process simulating every rank of a layout against the real processes of the same layout.

The same ``train.py`` job twice in one bench run: the llama3 debug model, tp=2 x dp_shard=2 (4
ranks), ``SEQ`` tokens, global batch ``GLOBAL_BATCH`` (local ``LOCAL_BATCH``), ``STEPS`` steps,
every step logged, checkpoints off; once as ``NPROC`` gloo processes through torchrun, once as
one process with ``--comm.mode local_tensor --comm.fake_world_size 4``. One intra-op thread per
process in both (``OMP_NUM_THREADS=1``): the real run's 4 processes share the machine's cores,
the simulation is one thread.

* step time: the median ``interval_s`` (metrics.jsonl, rank 0) of the steps after the first
  ``WARMUP``;
* peak memory: each process's peak resident set (``VmHWM`` of ``/proc/self/status``, written
  at exit by :func:`train_recording_usage`, the wrapper both runs start ``train.py`` through):
  for the real run the sum over its processes (what the layout holds on one host) and the
  largest one, for the simulation its one process; with it each process's CPU time (user +
  system, the whole run: start-up included), summed;
* the loss of the last step in both: for this layout every reduction has two terms, so the
  simulation is bitwise the real run (``tests/e2e/test_local_tensor.py``) and ``same_loss``
  must be true.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NPROC = 4
LAYOUT = ["--parallelism.tp", "2", "--parallelism.dp_shard", "2"]
SEQ, GLOBAL_BATCH, LOCAL_BATCH = 64, 8, 2
STEPS = 6
WARMUP = 2  # first steps left out of the step time (start-up, first allocations)
USAGE_FILE = "usage_rank{rank}.json"
# run in each process: record the peak RSS at exit, then be train.py (argv: folder, script, args)
WRAPPER = "from benchmarks.local_tensor import train_recording_usage; train_recording_usage()"


def peak_rss_bytes() -> int:
    """This process's peak resident set: ``VmHWM`` of its own memory map. Not ``ru_maxrss``:
    Linux carries that over ``execve`` from the process that forked it, so a worker started
    by torchrun (or by this bench, which imports torch) would report at least its parent's peak
    (measured: a bare interpreter started from a process holding 200 MiB reports 216 MB of
    ``ru_maxrss`` and 11 MB of ``VmHWM``). ``ru_maxrss`` only where there is no /proc."""
    import resource

    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def train_recording_usage() -> None:
    """``python -c WRAPPER FOLDER SCRIPT ARGS...``: run ``SCRIPT`` as ``__main__`` with ``ARGS``,
    and at exit write this process's peak RSS (bytes) and CPU time (s) to
    ``FOLDER/usage_rank{RANK}.json``.
    train.py ends through ``trainer.lifecycle.shutdown.run_and_exit``, which runs the ``atexit`` handlers
    before ``os._exit``; this module imports nothing but the standard library before the
    script runs, so it adds nothing measurable to the figure."""
    import atexit
    import resource
    import runpy

    folder, script, *args = sys.argv[1:]
    rank = os.environ.get("RANK", "0")

    def record() -> None:
        u = resource.getrusage(resource.RUSAGE_SELF)
        usage = {"peak_rss_bytes": peak_rss_bytes(), "cpu_s": u.ru_utime + u.ru_stime}
        Path(folder, USAGE_FILE.format(rank=rank)).write_text(json.dumps(usage))

    atexit.register(record)
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


def train_args(folder: str, steps: int = STEPS) -> list[str]:
    return [
        "--config", "llama3.toml", "--training.seq_len", str(SEQ), "--training.global_batch_size", str(GLOBAL_BATCH),
        "--training.local_batch_size", str(LOCAL_BATCH), "--training.steps", str(steps), "--metrics.log_freq", "1",
        "--metrics.enable_tensorboard", "false", "--checkpoint.enable", "false", *LAYOUT, "--job.dump_folder", folder,
    ]  # fmt: skip


def command(mode: str, rss_folder: str, args: list[str]) -> list[str]:
    """The command line of one run: ``real`` through torchrun (``--no-python``: each worker is
    ``python -c WRAPPER``), ``local_tensor`` one plain process."""
    wrapped = [sys.executable, "-c", WRAPPER, rss_folder, "train.py", *args]
    if mode == "real":
        torchrun = str(Path(sys.executable).with_name("torchrun"))
        return [torchrun, "--standalone", f"--nproc_per_node={NPROC}", "--no-python", *wrapped]
    return [*wrapped, "--comm.mode", "local_tensor", "--comm.fake_world_size", str(NPROC)]


def train(mode: str, steps: int = STEPS) -> dict:
    """One run: its metrics.jsonl records, each process's peak RSS (bytes) and CPU seconds (rank
    order), wall time."""
    with tempfile.TemporaryDirectory(prefix=f"bench_lt_{mode}_") as d:
        usage = Path(d, "usage")
        usage.mkdir()
        cmd = command(mode, str(usage), train_args(str(Path(d, "run")), steps))
        t0 = time.perf_counter()
        res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        wall = time.perf_counter() - t0
        if res.returncode != 0:
            raise RuntimeError(f"{mode} run failed ({res.returncode}): {res.stderr[-3000:]}")
        (path,) = Path(d, "run").rglob("metrics.jsonl")
        records = [json.loads(line) for line in path.open() if line.strip()]
        files = sorted(usage.iterdir(), key=lambda p: int(p.stem.rsplit("rank", 1)[1]))
        per_process = [json.loads(p.read_text()) for p in files]
    expected = NPROC if mode == "real" else 1
    if len(per_process) != expected:
        raise RuntimeError(f"{mode} run: {len(per_process)} usage files, expected {expected}")
    return {
        "records": records,
        "peak_rss_bytes": [u["peak_rss_bytes"] for u in per_process],
        "cpu_s": [u["cpu_s"] for u in per_process],
        "wall_s": wall,
    }


# ------------------------------------------------------------------ pure functions on the runs
def mode_figures(run: dict, warmup: int = WARMUP) -> dict:
    """One run's row: median step time after ``warmup``, peak RSS (sum and largest process, MiB),
    the last step's loss."""
    steps = sorted((r for r in run["records"] if "loss" in r), key=lambda r: r["step"])
    timed = [r["interval_s"] for r in steps if r["step"] > warmup]
    if not timed:
        raise ValueError(f"no step after the {warmup} warm-up steps in the records")
    peaks = run["peak_rss_bytes"]
    return {
        "processes": len(peaks),
        "median_step_s": statistics.median(timed),
        "timed_steps": len(timed),
        "peak_rss_sum_mib": sum(peaks) / 2**20,
        "peak_rss_max_process_mib": max(peaks) / 2**20,
        "last_step": steps[-1]["step"],
        "last_loss": steps[-1]["loss"],
        "run_cpu_s_sum": sum(run["cpu_s"]) if run.get("cpu_s") else None,
        "run_wall_s": run.get("wall_s"),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarize(real: dict, local: dict, warmup: int = WARMUP) -> dict:
    """The section's figures from the two runs (``train``'s dicts)."""
    r, lt = mode_figures(real, warmup), mode_figures(local, warmup)
    return {
        "rows": [{"mode": "real (torchrun, gloo)", **r}, {"mode": "local_tensor", **lt}],
        "step_time_local_over_real": lt["median_step_s"] / r["median_step_s"],
        "peak_rss_local_over_real_sum": lt["peak_rss_sum_mib"] / r["peak_rss_sum_mib"],
        "peak_rss_local_over_real_max_process": lt["peak_rss_sum_mib"] / r["peak_rss_max_process_mib"],
        "run_cpu_local_over_real": _ratio(lt["run_cpu_s_sum"], r["run_cpu_s_sum"]),
        "same_loss": r["last_loss"] == lt["last_loss"] and r["last_step"] == lt["last_step"],
    }


def summary_line(result: dict) -> str:
    """The section's figures in one paragraph (the page's summary)."""
    real, local = result["rows"]
    return (
        f"llama3 debug model, tp=2 x dp_shard=2 ({NPROC} ranks), seq {SEQ}, global batch {GLOBAL_BATCH}, "
        f"median of steps {WARMUP + 1}-{result['config']['steps']}: one local_tensor process took "
        f"{result['step_time_local_over_real']:.2f}x the step time of the {real['processes']} real gloo "
        f"processes ({local['median_step_s']:.3f} s vs {real['median_step_s']:.3f} s) and peaked at "
        f"{local['peak_rss_sum_mib']:.0f} MiB RSS, {result['peak_rss_local_over_real_sum']:.2f}x the sum of "
        f"the real processes' peaks ({real['peak_rss_sum_mib']:.0f} MiB; largest process "
        f"{real['peak_rss_max_process_mib']:.0f} MiB: the one process holds every rank's shards but loads "
        f"the interpreter and torch once, where each real process loads its own); CPU time of the whole run, start-up included, "
        f"{result['run_cpu_local_over_real']:.2f}x the real processes' sum. Last-step loss "
        f"{'bitwise the same' if result['same_loss'] else 'DIFFERS'} in both. One intra-op thread per process: the real run's processes share the host's "
        f"{result['machine']['cpus']} cores while the simulation runs every rank's ops in turn on one; "
        f"the host is shared with other jobs, so absolute times are noisy and the ratios (both runs "
        f"measured back to back in the same bench run) are the figures to read."
    )


def _round(v, nd: int = 4):
    """Floats to ``nd`` digits, except the losses (kept exact: the page shows them equal)."""
    if isinstance(v, float):
        return round(v, nd)
    if isinstance(v, dict):
        return {k: x if k == "last_loss" else _round(x, nd) for k, x in v.items()}
    if isinstance(v, list):
        return [_round(x, nd) for x in v]
    return v


def run(steps: int = STEPS) -> dict:
    import platform

    import torch

    started = time.perf_counter()
    runs = {}
    for mode in ("real", "local_tensor"):
        print(f"local_tensor: training {mode} ({NPROC} ranks, {steps} steps)", file=sys.stderr)
        runs[mode] = train(mode, steps)
    result = _round(
        {
            **summarize(runs["real"], runs["local_tensor"]),
            "config": {
                "model": "llama3 debugmodel",
                "layout": "tp 2 x dp_shard 2",
                "ranks": NPROC,
                "seq": SEQ,
                "global_batch": GLOBAL_BATCH,
                "local_batch": LOCAL_BATCH,
                "steps": steps,
                "warmup_steps_left_out": WARMUP,
                "threads_per_process": 1,
                "dtype": "float32",
            },
            "machine": {
                "cpus": os.cpu_count(),
                "platform": platform.platform(),
                "torch": torch.__version__,
                "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
            },
            "section_wall_s": time.perf_counter() - started,
        }
    )
    result = {"summary": summary_line(result), **result}
    print(f"local_tensor: {result['summary']}", file=sys.stderr)
    return result


if __name__ == "__main__":
    print(json.dumps(run(), indent=1))
