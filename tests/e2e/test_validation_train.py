"""train.py with ``[validation]``: the validation loss is the same on fsdp=4, tp=2 x fsdp=2 and
pp=2 within the comparison tool's tolerance (loss and perplexity reduced over the loss mesh like
training), a different validation set gives a clearly different loss, and errors (bad validation
config, a dataset error raised on the background loading thread) stop the run with one clear line
and exit code 2.

The layout runs, whose claim is the numbers, run on ranks forked from tools/forkserver.py's server
(``run_forked``, bitwise what torchrun starts: tests/e2e/test_launcher.py), with 2 layers
(``--model.n_layers 2``): FSDP and TP shard each block alike, and pp=2 (1F1B) puts one block on
each stage, so the evaluation still runs through both stages of the pipeline's forward-only
schedule and every layout's reduction of the loss over its loss mesh. The user errors run forked
too: the same train.py ``__main__`` and exit, so the same stderr and exit code (what a fresh
``python train.py`` prints and returns on bad input: tests/e2e/test_exit.py's bad_input case)."""

from __future__ import annotations

import math

import pytest

from tools.compare_loss.compare import DEFAULT_ATOL, DEFAULT_RTOL, compare, compare_validation, load_metrics

from .helpers import FAST, read_metrics, run_forked, validation_records

STEPS = 2
COMMON = [
    "--config",
    "llama3.toml",
    *FAST,
    "--training.steps",
    str(STEPS),
    "--lr_scheduler.warmup_steps",
    "1",
    "--checkpoint.enable",
    "false",
    "--validation.enable",
    "--validation.freq",
    "1",
    "--validation.steps",
    "2",
    "--validation.seq_len",
    "64",
    "--model.n_layers",
    "2",  # module docstring
    # fixed, so every layout evaluates the same 2 x 8 samples (fsdp=4: 1 micro-batch of 2 per
    # rank, tp=2 x fsdp=2: 2 of 2, pp=2: 4 of 2 through the pipeline's forward-only schedule)
    "--validation.global_batch_size",
    "8",
    "--validation.local_batch_size",
    "2",
]
LAYOUTS = {
    "fsdp=4": (4, ["--parallelism.dp_shard", "4"]),
    "tp=2,fsdp=2": (4, ["--parallelism.tp", "2", "--parallelism.dp_shard", "2"]),
    "pp=2": (2, ["--parallelism.pp", "2", "--parallelism.dp_shard", "1"]),
}


def ok(res):
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]


def test_validation_loss_is_layout_invariant(tmp_path):
    folders = {}
    for name, (nproc, args) in LAYOUTS.items():
        folders[name] = tmp_path / name.replace(",", "_").replace("=", "")
        res = run_forked(nproc, *COMMON, *args, "--job.dump_folder", str(folders[name]))
        ok(res)
        assert "validation at step 2: loss" in res.stdout
    base = validation_records(folders["fsdp=4"])
    assert sorted(base) == [1, 2]
    for rec in base.values():
        assert rec["validation_tokens"] == 2 * 8 * 64 and rec["validation_steps"] == 2
        assert rec["validation_perplexity"] == pytest.approx(math.exp(rec["validation_loss"]), rel=1e-12)
        assert 0 < rec["validation_loss"] < 10
    assert base[2]["validation_loss"] < base[1]["validation_loss"]  # one step of training helped
    train = read_metrics(folders["fsdp=4"])
    assert sorted(train) == [1, 2] and all("data_wait_s" in r for r in train.values())
    for name in ("tp=2,fsdp=2", "pp=2"):
        other = validation_records(folders[name])
        cmp = compare_validation(base, other, rtol=DEFAULT_RTOL, atol=DEFAULT_ATOL)
        assert cmp.within and cmp.steps == [1, 2], (name, base, other)
        print(f"\nvalidation loss, fsdp=4 vs {name}: max relative gap {cmp.max_rel:.2e}")
        # measured (2 layers): 0 on tp=2 x fsdp=2, 6.1e-8 on pp=2 (float32 summation order)
        assert cmp.max_rel < 1e-6, (name, cmp)
        # the training losses agree too, so the comparison above compared the same weights
        path = str(folders[name] / "metrics.jsonl")
        assert compare(
            load_metrics(str(folders["fsdp=4"] / "metrics.jsonl")), load_metrics(path), rtol=1e-5, atol=1e-5
        ).within

    # negative control: another validation set (text), same model and training: a loss far
    # outside the tolerance
    text = tmp_path / "val.txt"
    text.write_text("the quick brown fox jumps over the lazy dog . " * 200)
    other = tmp_path / "text"
    res = run_forked(
        1,
        *COMMON,
        "--validation.dataset",
        "text",
        "--validation.dataset_path",
        str(text),
        "--job.dump_folder",
        str(other),
    )
    ok(res)
    control = compare_validation(base, validation_records(other), rtol=DEFAULT_RTOL, atol=DEFAULT_ATOL)
    print(f"another validation set: max relative gap {control.max_rel:.2e}")
    assert not control.within and control.max_rel > 100 * DEFAULT_RTOL, control  # measured: 7.1e-3


def one_error_line(res) -> str:
    assert res.returncode == 2, f"exit {res.returncode}\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    errors = [line for line in res.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, res.stderr[-3000:]
    return errors[0]


def test_validation_config_error_and_background_dataset_error_exit_2(tmp_path):
    err = one_error_line(run_forked(1, *COMMON, "--validation.steps", "-1", "--job.dump_folder", str(tmp_path / "a")))
    assert "validation.steps = -1" in err and "--validation.steps 10" in err
    # a dataset error raised on the background loading thread reaches the user unchanged
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": oops}\n')
    err = one_error_line(
        run_forked(
            1,
            *COMMON,
            "--validation.enable",
            "false",
            "--training.dataset",
            "jsonl",
            "--training.dataset_path",
            str(bad),
            "--job.dump_folder",
            str(tmp_path / "b"),
        )
    )
    assert f"{bad} (byte 17): invalid JSON line" in err
