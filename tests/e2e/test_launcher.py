"""The fork launcher (tools/forkserver.py) runs train.py as torchrun does: the same run on forked
ranks gives bitwise the torchrun run's losses and grad norms, the same output, and one failing
rank stops the job with its own exit code. The end-to-end tests whose claim is the math run on
it (tests/e2e/helpers.py); this file is why that is sound."""

from __future__ import annotations

import json
import textwrap

import pytest

from tools.forkserver import run_train as run_forked_script

from .helpers import FAST, ROOT, _env, read_metrics, run_forked, run_train

SMALL = ["--config", "llama3.toml", *FAST, "--model.n_layers", "2", "--checkpoint.enable", "false"]


def test_forked_ranks_train_bitwise_like_torchrun(tmp_path):
    """llama3 tp=2 on 2 ranks, 3 steps (gradient accumulation, sequence and loss parallel, AdamW
    state carried across steps): the same kernels on the same shapes in both launches, so equal
    bitwise; the same lines on stdout."""
    args = [*SMALL, "--training.steps", "3", "--parallelism.tp", "2"]
    real = run_train(2, *args, "--job.dump_folder", str(tmp_path / "torchrun"))
    forked = run_forked(2, *args, "--job.dump_folder", str(tmp_path / "fork"))
    assert real.returncode == 0 and forked.returncode == 0, real.stderr[-3000:] + forked.stderr[-3000:]
    a, b = read_metrics(tmp_path / "torchrun"), read_metrics(tmp_path / "fork")
    assert sorted(a) == sorted(b) == [1, 2, 3]
    assert [(a[s]["loss"], a[s]["grad_norm"]) for s in a] == [(b[s]["loss"], b[s]["grad_norm"]) for s in a]
    assert "mesh: world=2 pp=1 dp_replicate=1 dp_shard=1 cp=1 tp=2" in forked.stdout
    lines = [l.split("  tok/s/dev")[0] for l in forked.stdout.splitlines() if l.startswith("step ")]
    assert lines == [l.split("  tok/s/dev")[0] for l in real.stdout.splitlines() if l.startswith("step ")]
    assert len(lines) == 3


_RANKS = textwrap.dedent(
    """
    import json, os, sys, time
    rank = int(os.environ["RANK"])
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "OMP_NUM_THREADS", "MY_VAR")
    # one write per record (< PIPE_BUF: atomic on the shared pipe); print writes the text and its
    # newline separately, so two ranks' records could share a line
    sys.stdout.write(json.dumps({"cwd": os.getcwd(), "argv": sys.argv[1:], **{k: os.environ.get(k) for k in keys}}) + "\\n")
    sys.stdout.flush()
    print(f"rank {rank} on stderr", file=sys.stderr)
    if sys.argv[1] == "fail" and rank == 1:
        sys.exit(3)
    if sys.argv[1] == "fail":
        time.sleep(600)  # stopped by the launcher once rank 1 failed
    """
)


def test_ranks_get_torchruns_environment_and_a_failure_stops_the_job(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(_RANKS)
    env = dict(_env(), MY_VAR="x")
    env.pop("OMP_NUM_THREADS", None)
    ok = run_forked_script(3, ["pass"], env=env, cwd=tmp_path, timeout=120, script=script)
    assert ok.returncode == 0, ok.stderr
    seen = sorted((json.loads(l) for l in ok.stdout.splitlines()), key=lambda d: d["RANK"])
    assert [d["RANK"] for d in seen] == ["0", "1", "2"] and [d["LOCAL_RANK"] for d in seen] == ["0", "1", "2"]
    for d in seen:
        assert (d["WORLD_SIZE"], d["LOCAL_WORLD_SIZE"], d["MASTER_ADDR"]) == ("3", "3", "127.0.0.1")
        assert (d["cwd"], d["argv"], d["MY_VAR"], d["OMP_NUM_THREADS"]) == (str(tmp_path), ["pass"], "x", "1")
    assert sorted(ok.stderr.splitlines()) == [f"rank {r} on stderr" for r in range(3)]

    failed = run_forked_script(2, ["fail"], env=env, cwd=ROOT, timeout=120, script=script)
    assert failed.returncode == 3  # rank 1's own code; rank 0 was stopped, not waited for


def test_a_timeout_stops_every_rank(tmp_path):
    import subprocess

    script = tmp_path / "hang.py"
    script.write_text("import time\ntime.sleep(600)\n")
    with pytest.raises(subprocess.TimeoutExpired):
        run_forked_script(2, [], env=_env(), cwd=tmp_path, timeout=2, script=script)
