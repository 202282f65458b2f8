"""The `make bench` section ``local_tensor`` (issue 29: what simulating every rank in one process
costs): its figures from hand-written metrics records, the wrapper that records each process's
peak RSS and CPU time (on small scripts, no training run), its command lines and its committed
results."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import local_tensor, report, run

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
MIB = 2**20


def _records(times: list[float], last_loss: float) -> list[dict]:
    out = [{"step": i + 1, "loss": 7.0 - i * 0.1, "interval_s": t} for i, t in enumerate(times)]
    out[-1]["loss"] = last_loss
    return out + [{"step": len(times), "checkpoint_write_s": 1.0}]  # a record without a loss is no step


REAL = {"records": _records([9.0, 5.0, 1.0, 3.0, 2.0, 2.5], 6.5), "peak_rss_bytes": [600 * MIB, 500 * MIB] * 2,
        "cpu_s": [10.0] * 4, "wall_s": 40.0}  # fmt: skip
LOCAL = {"records": _records([30.0, 20.0, 6.0, 5.0, 7.0, 8.0], 6.5), "peak_rss_bytes": [880 * MIB], "cpu_s": [60.0]}


def test_summary_is_the_median_after_warmup_and_memory_against_the_sum():
    out = local_tensor.summarize(REAL, LOCAL, warmup=2)
    real, local = out["rows"]
    # steps 3-6 only: the warm-up steps 9.0 / 5.0 and 30.0 / 20.0 would move both medians
    assert (real["median_step_s"], real["timed_steps"]) == (2.25, 4) and local["median_step_s"] == 6.5
    assert out["step_time_local_over_real"] == pytest.approx(6.5 / 2.25)
    assert (real["peak_rss_sum_mib"], real["peak_rss_max_process_mib"], real["processes"]) == (2200, 600, 4)
    assert out["peak_rss_local_over_real_sum"] == pytest.approx(0.4)
    assert out["peak_rss_local_over_real_max_process"] == pytest.approx(880 / 600)
    assert out["run_cpu_local_over_real"] == pytest.approx(1.5) and out["same_loss"] is True
    # negative controls: a last loss one ulp away, or a run that stopped a step early, is not the same
    other = dict(LOCAL, records=_records([30.0, 20.0, 6.0, 5.0, 7.0, 8.0], float.fromhex("0x1.a000000000001p+2")))
    assert local_tensor.summarize(REAL, other, warmup=2)["same_loss"] is False
    short = dict(LOCAL, records=_records([30.0, 20.0, 6.0, 5.0, 7.0], 6.5))
    assert local_tensor.summarize(REAL, short, warmup=2)["same_loss"] is False
    with pytest.raises(ValueError, match="warm-up"):
        local_tensor.summarize(REAL, LOCAL, warmup=6)


SCRIPT = """
import sys
from trainer.lifecycle.shutdown import run_and_exit

def main():
    assert __name__ == "__main__" and sys.argv[1:] == ["--size", "{size}"], (__name__, sys.argv)
    block = b"\\x01" * ({size} * 2**20)  # written, so resident
    return 0

run_and_exit(main)
"""


# a parent that holds its own block of memory while the wrapped script runs
PARENT = "import subprocess, sys; b = b'\\x01' * (300 * 2**20); sys.exit(subprocess.run(sys.argv[1:]).returncode)"


def _usage(tmp_path: Path, size_mib: int, parent: bool = False) -> dict:
    folder = tmp_path / f"usage{size_mib}"
    folder.mkdir()
    script = tmp_path / f"alloc{size_mib}.py"
    script.write_text(SCRIPT.format(size=size_mib))
    cmd = [sys.executable, "-c", local_tensor.WRAPPER, str(folder), str(script), "--size", str(size_mib)]
    if parent:
        cmd = [sys.executable, "-c", PARENT, *cmd]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr[-2000:]
    (path,) = folder.iterdir()
    assert path.name == "usage_rank0.json"  # no RANK outside torchrun
    return json.loads(path.read_text())


def test_wrapper_records_the_peak_rss_of_the_script_it_runs(tmp_path):
    """The script ends like train.py (``run_and_exit``: atexit handlers, then ``os._exit``) and
    the wrapper still writes its figures. A 300 MiB block in the script shows in its peak; a
    1 MiB block in a script started by a parent holding 300 MiB (as torchrun's workers are
    started by a process that imported torch) does not: the figure is the script's own (Linux's
    ``ru_maxrss`` would report the parent's 300 MiB there; measured here ~15 MB vs ~315 MB)."""
    small, big = _usage(tmp_path, 1, parent=True), _usage(tmp_path, 300)
    assert small["peak_rss_bytes"] < 100 * MIB and small["cpu_s"] > 0, small
    assert big["peak_rss_bytes"] - small["peak_rss_bytes"] > 280 * MIB, (small, big)


def test_commands_run_the_same_job_as_processes_and_simulated():
    args = local_tensor.train_args("/tmp/x")
    pairs = dict(zip(args[::2], args[1::2]))
    assert (pairs["--parallelism.tp"], pairs["--parallelism.dp_shard"]) == ("2", "2")
    assert pairs["--checkpoint.enable"] == "false" and pairs["--metrics.log_freq"] == "1"
    real, local = local_tensor.command("real", "/u", args), local_tensor.command("local_tensor", "/u", args)
    assert real[1:4] == ["--standalone", "--nproc_per_node=4", "--no-python"]
    assert real[4:] == local[: len(real) - 4]  # the same wrapped train.py command
    assert local[len(real) - 4 :] == ["--comm.mode", "local_tensor", "--comm.fake_world_size", "4"]
    assert "--comm.mode" not in real


def test_local_tensor_section_is_registered_and_its_results_committed():
    assert "local_tensor" in run.SECTIONS and "local_tensor" in report.SECTION_IDS
    data = json.loads((ROOT / "bench_results" / "local_tensor.json").read_text())["local_tensor"]
    real, local = data["rows"]
    assert (real["processes"], local["processes"]) == (4, 1) and data["same_loss"] is True
    assert real["last_loss"] == local["last_loss"]
    assert data["step_time_local_over_real"] == pytest.approx(local["median_step_s"] / real["median_step_s"], rel=1e-3)
    assert data["summary"] == local_tensor.summary_line(data)  # the page's paragraph is of these figures
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    assert "## Simulated ranks in one process against real processes" in page
    assert "step_time_local_over_real" in page
