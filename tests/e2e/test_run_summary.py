"""After the run: the end-of-run summary block, the metrics' time fields, scripts/plot_run.py, and a
failing resume leaving the folder it resumed byte-identical.

One module fixture trains one forked process (the claims are what the run prints and writes, not
the processes; the summary at a SIGTERM stop is checked in tests/e2e/test_train.py's stop test):
llama3 with 1 layer (the summary and the files do not depend on the depth), 3 steps of 64-token
windows from a .jsonl file, validation after steps 2 and 3, a checkpoint at step 3. Then:

* the summary is the run's last block and its figures are metrics.jsonl's (final and best loss,
  the last validation loss, the tokens, the checkpoint written);
* ``elapsed_s`` grows from row to row (time since the launch started) and ``interval_s`` is what
  ``tps`` divides by; the step line says ``tok/s/dev``;
* the data file is then overwritten with bad rows and the same command resumes with
  ``--training.steps 5``: it fails at the first step it reads (one line, exit 2) and every file of
  the run folder is byte-identical to before (the resolved config.toml, which would say
  ``steps = 5``, and the metrics files are written only once a launch's first step is done);
* ``scripts/plot_run.py`` draws that run and another overlaid into a PNG; a folder without
  metrics.jsonl is one line, exit 2.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest

from .helpers import FAST, ROOT, all_records, read_metrics, run_forked

pytestmark = pytest.mark.e2e


def _job(data, run, steps: int) -> list[str]:
    return [
        "--config", "llama3.toml", *FAST, "--model.n_layers", "1", "--training.steps", str(steps),
        "--training.dataset", "jsonl", "--training.dataset_path", str(data),
        "--lr_scheduler.warmup_steps", "1", "--checkpoint.enable", "--checkpoint.interval", "100",
        "--validation.enable", "--validation.freq", "2", "--validation.steps", "1",
        "--validation.seq_len", "64", "--validation.local_batch_size", "2",
        "--job.dump_folder", str(run),
    ]  # fmt: skip


def _folder_bytes(folder) -> dict[str, str]:
    out = {}
    for root, _dirs, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, folder)] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    base = tmp_path_factory.mktemp("run_summary")
    data = base / "data.jsonl"
    with open(data, "w") as f:
        for i in range(400):
            f.write(json.dumps({"text": f"document {i}: " + " ".join(f"w{(i * j) % 97}" for j in range(40))}) + "\n")
    run = base / "run"
    res = run_forked(1, *_job(data, run, 3))
    assert res.returncode == 0, res.stderr[-3000:]
    return data, run, res.stdout


def test_the_summary_ends_the_run_with_the_metrics_figures(finished):
    _data, run, out = finished
    lines = out.splitlines()
    start = lines.index(f"run summary ({run}):")
    block = dict(line.split(None, 1) for line in lines[start + 1 :])
    keys = {"time", "steps", "tokens", "loss", "data", "validation", "checkpoints", "metrics"}
    assert set(block) == keys, lines[start:]
    assert block["data"] == "epoch 0 (complete passes over the data)"  # 400 documents: less than one pass
    assert all(r["epoch"] == 0 for r in read_metrics(run).values())
    m = read_metrics(run)
    best = min(m, key=lambda s: m[s]["loss"])
    assert block["steps"] == "1-3 of 3 (3 this launch)"
    assert block["tokens"] == f"{3 * 8 * 64:,} this launch (global window positions)"
    assert block["loss"] == f"final {m[3]['loss']:.4f} at step 3; best {m[best]['loss']:.4f} at step {best}"
    validation = [r for r in all_records(run) if "validation_loss" in r]
    assert [r["step"] for r in validation] == [2, 3]
    assert block["validation"] == f"{validation[-1]['validation_loss']:.4f} at step 3"
    assert block["checkpoints"] == f"{run / 'checkpoint'}: written this launch step-3"
    assert block["metrics"] == f"{run / 'metrics.jsonl'} (plot: python scripts/plot_run.py {run})"
    # the time fields: elapsed_s since the launch started (growing), interval_s what tps divides by
    rows = [m[s] for s in (1, 2, 3)]
    assert 0 < rows[0]["elapsed_s"] < rows[1]["elapsed_s"] < rows[2]["elapsed_s"]
    assert all(r["interval_s"] > 0 and r["tps"] == pytest.approx(8 * 64 / r["interval_s"]) for r in rows)
    assert all("tok/s/dev" in line for line in lines if line.startswith("step "))


def test_a_resume_that_fails_at_start_up_leaves_the_folder_byte_identical(finished, tmp_path):
    data, run, _ = finished
    before = _folder_bytes(run)
    assert {"config.toml", "metrics.jsonl"} <= set(before)
    size = os.path.getsize(data)
    with open(data, "w") as f:  # the same file, now bad rows wherever the resumed position reads
        f.write("{not json\n" * (size // 10 + 100))
    res = run_forked(1, *_job(data, run, 5))
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-3000:]
    assert "resumed from" in res.stdout and "invalid JSON" in res.stderr, res.stderr[-3000:]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    assert _folder_bytes(run) == before


def test_plot_run_overlays_runs_into_a_png(finished, tmp_path, capsys):
    from tools.plot_run import main

    _data, run, _ = finished
    other = tmp_path / "other"
    other.mkdir()
    with open(other / "metrics.jsonl", "w") as f:  # another run: the same curve, shifted
        for r in all_records(run):
            r = dict(r, loss=r["loss"] + 0.5) if "loss" in r else r
            f.write(json.dumps(r) + "\n")
    out = tmp_path / "curves.png"
    assert main([str(run), str(other), "--out", str(out)]) == 0
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert capsys.readouterr().out.strip() == f"wrote {out}"
    # bad input: one line, exit 2, through the script as users run it
    res = subprocess.run(
        [sys.executable, "scripts/plot_run.py", str(tmp_path / "nothing")], cwd=ROOT, capture_output=True, text=True
    )
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and res.stderr.startswith("error: "), res.stderr
    assert main([str(tmp_path)]) == 2  # a folder without metrics.jsonl
    assert "has no metrics.jsonl" in capsys.readouterr().err
