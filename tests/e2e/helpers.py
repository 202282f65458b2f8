"""Run train.py for real (torchrun or plain python) and read what it wrote."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Small enough for CI on 2 cores, big enough to learn something.
FAST = [
    "--training.seq_len", "64",
    "--training.global_batch_size", "8",
    "--training.local_batch_size", "2",
    "--metrics.log_freq", "1",
    "--metrics.enable_tensorboard", "false",
]


def _env():
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def train_cmd(nproc: int, *args: str) -> list[str]:
    if nproc == 1:
        return [sys.executable, "train.py", *args]
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    return [torchrun, "--standalone", f"--nproc_per_node={nproc}", "train.py", *args]


def run_train(nproc: int, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        train_cmd(nproc, *args), cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=_env()
    )


def run_until(nproc: int, marker: str, *args: str, timeout: float = 600) -> str:
    """Start a run and SIGKILL its whole process group as soon as ``marker`` appears in its
    output: a crash, not a clean exit."""
    proc = subprocess.Popen(
        train_cmd(nproc, *args), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, env=_env(), start_new_session=True,
    )
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if marker in line:
                os.killpg(proc.pid, signal.SIGKILL)
                break
    finally:
        proc.wait(timeout=timeout)
    out = "".join(seen)
    assert marker in out, f"run ended before {marker!r}:\n{out[-3000:]}"
    return out


def read_metrics(folder: str | Path) -> dict[int, dict]:
    """step -> last record written for it (a resumed run appends to the same file)."""
    records = {}
    with open(Path(folder) / "metrics.jsonl") as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                records[rec["step"]] = rec
    return records
