"""Weights & Biases logging (``metrics.enable_wandb``, trainer/reporting/wandb_log.py), offline, in this
process: the run holds the metrics.jsonl rows (merged per step) and the resolved config, read
back from its .wandb file (tests/wandb_records.py); a resumed logger continues the same run id,
a fresh start makes a new one; the run ends and W&B's service process is gone when the logger
closes, also on an exception and when W&B's process died mid-run (a warning, training goes on);
``wandb`` missing but asked for, or W&B refusing to start: one line, exit 2. No network: W&B
runs with WANDB_MODE=offline and every folder it writes is under tmp_path.
train.py end to end (2 ranks, a stop signal and a resume): tests/e2e/test_wandb_train.py."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.wandb_records import offline_runs, rows_by_step
from trainer.config import ConfigError, load_config
from trainer.reporting.metrics import MetricsLogger
from trainer.reporting.wandb_log import RUN_ID_FILE


def needs_wandb():
    pytest.importorskip("wandb")


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """W&B offline, silent, every folder of its own under tmp_path; no WANDB_* of the caller's."""
    for key in [k for k in os.environ if k.startswith("WANDB_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc, no ~/.config/wandb
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var, sub in (("WANDB_CONFIG_DIR", "cfg"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data")):
        monkeypatch.setenv(var, str(tmp_path / "wandb_home" / sub))
    return tmp_path


def job(dump, *args):
    return load_config(
        [
            "--config",
            "llama3.toml",
            "--job.dump_folder",
            str(dump),
            "--metrics.enable_wandb",
            "--metrics.enable_tensorboard",
            "false",
            "--checkpoint.enable",
            *args,
        ]
    )


def wandb_children() -> list[int]:
    """Live (not zombie) wandb-core / wandb-symon processes started by this process (by their
    executable's name: pytest's own children carry "wandb" in their arguments, this file's name)."""
    out = subprocess.run(["ps", "-o", "pid=,stat=,comm=", "--ppid", str(os.getpid())], capture_output=True, text=True)
    pids = []
    for line in out.stdout.splitlines():
        pid, stat, comm = line.split(None, 2)
        if comm.startswith("wandb") and not stat.startswith("Z"):
            pids.append(int(pid))
    return pids


def next_second() -> None:
    """W&B names an offline run's folder by the second it started and its id: a resumed run in
    the same second would land in the first one's folder (a real resume is never that quick)."""
    time.sleep(1.02 - time.time() % 1)


def log_steps(m: MetricsLogger, steps, extra=None) -> None:
    for step in steps:
        m.log(step, loss=4.0 / step, grad_norm=0.5 * step, lr=1e-3, num_tokens=2048, extra=extra)


def jsonl(dump) -> list[dict]:
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


def test_run_holds_rows_and_config_and_ends_with_the_logger(offline):
    needs_wandb()
    dump = offline / "run"
    cfg = job(dump)
    with MetricsLogger(str(dump), 0, cfg, total_steps=4) as m:
        assert len(wandb_children()) == 1  # W&B's service runs while the logger is open (the check below bites)
        # every field a row carries goes through, whatever its name (per-source token shares...)
        log_steps(m, [1, 2], extra={"tokens_share_web": 0.75, "tokens_share_code": 0.25, "note": "text"})
        m.log_validation(2, loss=3.5, steps=2, tokens=256, seconds=0.1)
        log_steps(m, [3])
        m.log_checkpoint(3, {"checkpoint_write_s": 0.25})
        m.log(4, loss=float("nan"), grad_norm=math.inf, lr=0.0, num_tokens=1)
    assert wandb_children() == []  # the run finished and the service is shut down before close() returned
    [run] = offline_runs(str(dump))  # no WANDB_DIR: under job.dump_folder
    assert run.run_id == (dump / "checkpoint" / RUN_ID_FILE).read_text().strip()
    assert (run.project, run.name, run.resume, run.exit_code) == ("meshtrain", "run", False, 0)
    expected = rows_by_step(jsonl(dump))
    # non-finite values: metrics.jsonl writes null, W&B keeps NaN / Infinity
    assert expected[4]["loss"] is None and math.isnan(run.history[4].pop("loss"))
    assert expected[4]["grad_norm"] is None and run.history[4].pop("grad_norm") == math.inf
    del expected[4]["loss"], expected[4]["grad_norm"]
    assert run.history == expected
    assert run.history[2]["validation_loss"] == 3.5 and run.history[2]["loss"] == 2.0
    assert run.history[1]["tokens_share_web"] == 0.75 and run.history[1]["note"] == "text"
    # negative control: the comparison sees one changed value
    changed = jsonl(dump)
    changed[0]["grad_norm"] += 1e-9
    assert rows_by_step(changed) != rows_by_step(jsonl(dump))
    run.config.pop("_wandb")
    assert run.config == cfg.to_dict()  # the resolved config, every section


def test_resume_continues_the_run_a_fresh_start_makes_a_new_one(offline, monkeypatch):
    needs_wandb()
    dump = offline / "run"
    monkeypatch.setenv("WANDB_DIR", str(offline / "wb"))  # honoured instead of the dump folder
    monkeypatch.setenv("WANDB_PROJECT", "from_env")
    with MetricsLogger(str(dump), 0, job(dump)) as m:
        log_steps(m, [1, 2])
    next_second()
    with MetricsLogger(str(dump), 0, job(dump), resumed=True) as m:  # the trainer resumed from step 2
        log_steps(m, [3, 4])
    first, second = offline_runs(str(offline / "wb"))
    assert first.run_id == second.run_id and (first.resume, second.resume) == (False, True)
    assert first.project == second.project == "from_env"
    assert sorted(first.history) == [1, 2] and sorted(second.history) == [3, 4]
    assert {**first.history, **second.history} == rows_by_step(jsonl(dump))
    # negative control: starting at step 0 again (no checkpoint restored) is a new W&B run,
    # whose id replaces the stored one; config values win over WANDB_* variables
    next_second()
    fresh = job(dump, "--metrics.wandb_project", "mine", "--metrics.wandb_run_name", "again")
    with MetricsLogger(str(dump), 0, fresh) as m:
        log_steps(m, [1])
    third = offline_runs(str(offline / "wb"))[-1]
    assert third.run_id != first.run_id and not third.resume
    assert (third.project, third.name) == ("mine", "again")
    assert (dump / "checkpoint" / RUN_ID_FILE).read_text().strip() == third.run_id
    # WANDB_RUN_ID names the run whatever the folder holds
    next_second()
    monkeypatch.setenv("WANDB_RUN_ID", "chosen01")
    with MetricsLogger(str(dump), 0, job(dump), resumed=True) as m:
        log_steps(m, [2])
    assert offline_runs(str(offline / "wb"))[-1].run_id == "chosen01"
    assert wandb_children() == []


def test_exception_marks_the_run_failed_and_shuts_wandb_down(offline):
    needs_wandb()
    dump = offline / "run"
    with pytest.raises(RuntimeError, match="boom"), MetricsLogger(str(dump), 0, job(dump)) as m:
        log_steps(m, [1])
        raise RuntimeError("boom")
    assert wandb_children() == []
    [run] = offline_runs(str(dump))
    assert run.exit_code == 1 and sorted(run.history) == [1]


def test_wandb_dying_mid_run_leaves_training_and_jsonl_going(offline, capsys):
    """W&B's service killed (a scheduler's SIGTERM to every process of the job): one warning,
    no exception into the training loop, metrics.jsonl complete, nothing left running."""
    needs_wandb()
    dump = offline / "run"
    with MetricsLogger(str(dump), 0, job(dump)) as m:
        log_steps(m, [1])
        [core] = wandb_children()
        os.kill(core, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while wandb_children() and time.monotonic() < deadline:
            time.sleep(0.05)
        log_steps(m, [2, 3])
    assert [r["step"] for r in jsonl(dump)] == [1, 2, 3]
    err = capsys.readouterr().err
    assert err.count("warning: W&B failed while") == 1 and "W&B logging stopped" in err, err
    assert wandb_children() == []


def test_wandb_refusing_to_start_is_one_line(offline, monkeypatch):
    """Online mode without an API key (nothing is sent: wandb refuses before any network)."""
    needs_wandb()
    monkeypatch.setenv("WANDB_MODE", "online")
    dump = offline / "run"
    with pytest.raises(ConfigError, match=r"W&B could not start the run \(No API key configured") as info:
        MetricsLogger(str(dump), 0, job(dump))
    assert "WANDB_MODE=offline" in str(info.value) and "metrics.enable_wandb = false" in str(info.value)
    assert wandb_children() == []
    assert not (dump / "metrics.jsonl").exists()  # nothing else was opened
    assert not (dump / "checkpoint" / RUN_ID_FILE).exists()  # no id of a run that never started


def test_the_run_id_is_stored_once_the_run_goes_on(offline):
    """A new run's id reaches the checkpoint folder at the first record (the trainer commits after
    its first step), not when W&B starts: a launch that fails before leaves no id, nor metrics
    files (tests/e2e/test_run_summary.py checks a failed resume leaves its folder byte-identical)."""
    needs_wandb()
    dump = offline / "run"
    with MetricsLogger(str(dump), 0, job(dump, "--metrics.enable_tensorboard", "true")) as m:
        assert not (dump / "checkpoint").exists() and os.listdir(dump) in ([], ["wandb"])
        log_steps(m, [1])
        stored = (dump / "checkpoint" / RUN_ID_FILE).read_text().strip()
        assert stored == m._wandb.run_id and (dump / "metrics.jsonl").exists() and (dump / "tb").is_dir()


def test_missing_wandb_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    from trainer.lifecycle.rank import run_rank as main

    args = ["--config", "llama3.toml", "--job.dump_folder", str(tmp_path), "--metrics.enable_wandb"]
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` fails, find_spec finds nothing
    with pytest.raises(ConfigError, match=r"metrics.enable_wandb needs the wandb package.*meshtrain\[wandb\]"):
        load_config(args)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: metrics.enable_wandb needs the wandb package") and err.count("\n") == 1
    load_config(args[:-1])  # without W&B asked for, the package is not needed
    monkeypatch.delitem(sys.modules, "wandb")
    if _installed():
        load_config(args)  # negative control: with the package there, the same config loads


def _installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("wandb") is not None


def test_wandb_is_not_imported_by_a_run_without_it():
    code = "import sys, trainer.lifecycle.rank, trainer.reporting.metrics; print('wandb' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=os.getcwd(), timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr
