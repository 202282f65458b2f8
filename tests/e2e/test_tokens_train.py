"""train.py on pre-tokenized shards (training.dataset = "tokens"): the loss curve equals the
streaming path's bitwise, resuming on another batch degree continues on exactly the same samples,
and bad shards stop the run with one line and exit code 2.

The trainings run on ranks forked from tools/forkserver.py's server (``run_forked``, bitwise what
torchrun starts: tests/e2e/test_launcher.py), with 2 layers (``--model.n_layers 2``): the claims
are about which tokens each rank reads, which the depth does not change, and two blocks still
make every sample's loss depend on the weights of each layout's shards. The bad-shard errors run
forked too: the same train.py ``__main__`` and exit, so the same stderr and exit code (a fresh
``python train.py`` on bad input: tests/e2e/test_exit.py's bad_input case)."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from tools.tokenize.writer import tokenize_to_shards

from .helpers import FAST, metric_records, read_metrics, run_forked

STEPS = 4
COMMON = [
    "--config",
    "llama3.toml",  # training.seed = 42: the synthetic stream of seed 42
    *FAST,
    "--model.n_layers",
    "2",
    "--training.steps",
    str(STEPS),
    "--lr_scheduler.warmup_steps",
    "2",
    "--checkpoint.enable",
    "false",
]
LAYOUTS = {"fsdp2": [], "tp2": ["--parallelism.tp", "2"]}


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """The first 300 documents of the debug corpus (synthetic, seed 42) in shards of 1000
    tokens: 4 steps x 8 samples x 65 tokens cross two shard boundaries."""
    out = tmp_path_factory.mktemp("tokens") / "debug"
    index = tokenize_to_shards(["synthetic:42:300"], str(out), shard_tokens=1000, workers=1, log=None)
    assert index["total_tokens"] > STEPS * 8 * 65 > 2 * 1000
    return out


def tokens_args(path) -> list[str]:
    return ["--training.dataset", "tokens", "--training.dataset_path", str(path)]


def curve(folder) -> list[tuple[float, float]]:
    m = read_metrics(folder)
    assert sorted(m) == list(range(1, STEPS + 1))
    return [(m[s]["loss"], m[s]["grad_norm"]) for s in range(1, STEPS + 1)]


def ok(res):
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]


LR0 = ["--optimizer.lr", "0"]


@pytest.fixture(scope="module")
def tp2_tokens_lr0(shards, tmp_path_factory):
    """tp=2 (batch degree 1) on the shards with lr = 0 for all steps: the reference of two tests."""
    folder = tmp_path_factory.mktemp("tp2_tokens_lr0")
    ok(run_forked(2, *COMMON, *LAYOUTS["tp2"], *LR0, *tokens_args(shards), "--job.dump_folder", str(folder)))
    return curve(folder)


def test_tokens_loss_curve_equals_streaming_bitwise_fsdp2(tmp_path, shards):
    stream, tokens = tmp_path / "stream", tmp_path / "tokens"
    ok(run_forked(2, *COMMON, "--job.dump_folder", str(stream)))
    ok(run_forked(2, *COMMON, *tokens_args(shards), "--job.dump_folder", str(tokens)))
    a, b = curve(stream), curve(tokens)
    assert a == b  # bitwise: the same tokens on every rank, in the same order
    assert a[-1][0] < a[0][0] and len(set(a)) == STEPS


def test_tokens_loss_curve_equals_streaming_bitwise_tp2(tmp_path, tp2_tokens_lr0):
    stream = tmp_path / "stream"
    ok(run_forked(2, *COMMON, *LAYOUTS["tp2"], *LR0, "--job.dump_folder", str(stream)))
    assert curve(stream) == tp2_tokens_lr0
    assert len(set(tp2_tokens_lr0)) == STEPS  # lr = 0: the losses differ only by their samples


def test_resume_on_another_batch_degree_is_bitwise(tmp_path, shards, tp2_tokens_lr0):
    """Steps 1-2 on fsdp=2 (batch degree 2), checkpoint, steps 3-4 on tp=2 (batch degree 1),
    against tp=2 all the way. With lr = 0 the weights stay the initial ones bitwise under
    both layouts, so the losses after the resume depend only on the samples: equal bitwise
    iff the resumed run reads exactly the uninterrupted run's samples. (With a real lr the
    weights after step 2 differ in the last bits between layouts, as their reductions differ.)"""
    args = [*COMMON, *LR0, *tokens_args(shards), "--checkpoint.enable", "true", "--checkpoint.interval", "2"]
    resumed = tmp_path / "resumed"
    ok(run_forked(2, *args, "--training.steps", "2", "--job.dump_folder", str(resumed)))
    assert sorted(os.listdir(resumed / "checkpoint")) == ["step-2"]
    res = run_forked(2, *args, *LAYOUTS["tp2"], "--job.dump_folder", str(resumed))
    ok(res)
    assert f"resumed from {resumed / 'checkpoint'} at step 2" in res.stdout, res.stdout[-2000:]
    after = [(r["loss"], r["grad_norm"]) for r in metric_records(resumed) if r["step"] > 2]
    assert after == tp2_tokens_lr0[2:]


def one_error_line(res) -> str:
    assert res.returncode == 2, f"exit {res.returncode}\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    errors = [line for line in res.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, res.stderr[-3000:]
    return errors[0]


def test_mismatched_tokenizer_and_truncated_shard_exit_2(tmp_path, shards):
    other = tmp_path / "bytes"
    tokenize_to_shards(["synthetic:42:20"], str(other), tokenizer_path="bytes", shard_tokens=1000, workers=1, log=None)
    res = run_forked(1, *COMMON, *tokens_args(other), "--job.dump_folder", str(tmp_path / "a"))
    err = one_error_line(res)
    assert "bytes (vocab 259" in err and "tokenizer/tokenizer.json (vocab 2048" in err and "tokenizer_path" in err
    # a truncated shard (in a copy of the good folder)
    broken = tmp_path / "broken"
    shutil.copytree(shards, broken)
    shard = json.loads((broken / "index.json").read_text())["shards"][1]["file"]
    (broken / shard).write_bytes((broken / shard).read_bytes()[:123])
    err = one_error_line(run_forked(1, *COMMON, *tokens_args(broken), "--job.dump_folder", str(tmp_path / "b")))
    assert f"{shard} is truncated (123 bytes, the index says 2000)" in err and "re-run `python scripts/" in err
