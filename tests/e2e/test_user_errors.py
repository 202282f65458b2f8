"""Every user-caused failure is one line on stderr naming the path, the problem and the fix,
with exit code 2 and no traceback: missing or unreadable inputs, absent steps, corrupt or
truncated checkpoints, bad data (no rows, no target token, a damaged parquet page only one rank
reads). A run that is already complete says so and how to go on. (Bad config
values and degrees: tests/e2e/test_train.py.) The other commands follow the same rule
(trainer/runtime/cli_errors.py; in process: tests/unit/test_cli_errors.py); one scripts/convert_hf.py
run here proves it end to end.

The train.py runs are forked from tools/forkserver.py's server (run_forked): the same train.py
``__main__`` and exit (trainer/lifecycle/shutdown.py), so the same stderr and the process's own exit code,
without a new interpreter per case; what a fresh ``python train.py`` prints and returns on bad
input is tests/e2e/test_exit.py's bad_input case and the python case of
tests/e2e/test_train.py::test_bad_config_gives_a_clear_error. 2 layers: the checkpoints only
need to exist (and be corrupted)."""

from __future__ import annotations

import json
import shutil
import struct

import pytest

from .helpers import FAST, ROOT, _env, run_forked

LLAMA = ["--config", "llama3.toml", *FAST, "--parallelism.dp_shard", "1", "--model.n_layers", "2"]


@pytest.fixture(scope="module")
def run_with_two_checkpoints(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ckpts") / "run"
    res = run_forked(
        1,
        *LLAMA,
        "--training.steps",
        "2",
        "--job.dump_folder",
        str(folder),
        "--checkpoint.enable",
        "true",
        "--checkpoint.interval",
        "1",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert sorted(p.name for p in (folder / "checkpoint").iterdir()) == ["step-1", "step-2"]
    return folder


def _copy(src, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(src, dst)
    return dst


def _one_clean_line(res, *needles):
    assert res.returncode == 2, f"exit {res.returncode}\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    errors = [line for line in res.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, res.stderr[-3000:]
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


def test_missing_dataset_path(tmp_path):
    res = run_forked(
        1,
        *LLAMA,
        "--training.steps",
        "2",
        "--job.dump_folder",
        str(tmp_path),
        "--training.dataset",
        "jsonl",
        "--training.dataset_path",
        str(tmp_path / "nope"),
    )
    _one_clean_line(res, "training.dataset_path", str(tmp_path / "nope"), "does not exist", ".jsonl file")


def _blank_rows(folder):
    (folder / "blank.jsonl").write_text("\n  \n\n")
    return str(folder / "blank.jsonl")


def _no_assistant_turns(folder):
    from tests.chat_data import write_jsonl

    return write_jsonl(folder / "users.jsonl", [[{"role": "user", "content": f"hello {i}"}] for i in range(40)])


def _page_only_rank_1_reads(folder):
    """64 rows in row groups of 8, the data page of row group 5 (rows 40-47) damaged: with a
    global batch of 8 read in stripes of 8 rows on 2 ranks, only rank 1 (stripes 4-7) reads it."""
    import pyarrow.parquet as pq

    from tests.chat_data import conversations, write_parquet

    path = write_parquet(folder / "chat.parquet", {"messages": conversations(64)}, row_group_size=8)
    raw = bytearray(open(path, "rb").read())
    start = pq.ParquetFile(path).metadata.row_group(5).column(0).data_page_offset
    raw[start + 2 : start + 60] = bytes(b ^ 0x5A for b in raw[start + 2 : start + 60])
    open(path, "wb").write(bytes(raw))
    return path


BAD_DATA = {  # how to write the data, ranks, what the one line says ({path}: the data's path)
    "no rows": (_blank_rows, 1, ["error: training.dataset_path '{path}' has no rows (only blank lines)"]),
    "no target": (_no_assistant_turns, 2, ["error: step 1: the whole global batch holds no target token", "{path}"]),
    "corrupt page on one rank": (
        _page_only_rank_1_reads, 2, ["error: rank 1: {path} (row group 5, rows 40-47): column 'messages' cannot be read"]
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_DATA))
def test_bad_data_is_one_line(tmp_path, case):
    """Chat data through train.py (the refusals in process: tests/unit/test_data_bad_input.py):
    a file of blank lines ends instead of starting over forever; data without any assistant
    turn stops at step 1 on every rank (the count is global) before the optimizer moves the
    weights; a damaged parquet page that only rank 1 reads ends with rank 1's own line."""
    write, nproc, needles = BAD_DATA[case]
    path = write(tmp_path)
    res = run_forked(
        nproc, "--config", "llama3.toml", *FAST, "--model.n_layers", "1", "--parallelism.dp_shard", str(nproc),
        "--training.steps", "2", "--model.attn_mask_type", "block_causal", "--training.dataset", "chat",
        "--training.dataset_path", path, "--job.dump_folder", str(tmp_path / "run"),
    )  # fmt: skip
    line = _one_clean_line(res, *(n.format(path=path) for n in needles))
    assert line.startswith(needles[0].format(path=path)), line


def test_missing_tokenizer_path(tmp_path):
    res = run_forked(
        1,
        *LLAMA,
        "--training.steps",
        "2",
        "--job.dump_folder",
        str(tmp_path),
        "--model.tokenizer_path",
        str(tmp_path / "tok"),
    )
    _one_clean_line(res, "model.tokenizer_path", str(tmp_path / "tok"), "use '' for the shipped tokenizer")


def test_unwritable_dump_folder(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    res = run_forked(1, *LLAMA, "--training.steps", "2", "--job.dump_folder", str(blocker / "run"))
    _one_clean_line(res, "job.dump_folder", str(blocker / "run"), "choose a writable folder")


def test_missing_initial_load_path(tmp_path):
    res = run_forked(
        1,
        *LLAMA,
        "--training.steps",
        "2",
        "--job.dump_folder",
        str(tmp_path / "run"),
        "--checkpoint.initial_load_path",
        str(tmp_path / "seed"),
    )
    _one_clean_line(
        res,
        "checkpoint.initial_load_path",
        str(tmp_path / "seed"),
        "does not exist",
        "point it at a complete checkpoint folder",
    )


def test_absent_load_step(tmp_path, run_with_two_checkpoints):
    run = _copy(run_with_two_checkpoints, tmp_path)
    res = run_forked(
        1,
        *LLAMA,
        "--training.steps",
        "4",
        "--job.dump_folder",
        str(run),
        "--checkpoint.enable",
        "true",
        "--checkpoint.load_step",
        "7",
    )
    _one_clean_line(res, "no complete checkpoint for step 7", "available steps: [1, 2]", "checkpoint.load_step = -1")


def test_truncated_metadata(tmp_path, run_with_two_checkpoints):
    run = _copy(run_with_two_checkpoints, tmp_path)
    meta = run / "checkpoint" / "step-2" / ".metadata"
    meta.write_bytes(meta.read_bytes()[:100])
    res = run_forked(1, *LLAMA, "--training.steps", "4", "--job.dump_folder", str(run), "--checkpoint.enable", "true")
    _one_clean_line(
        res,
        str(run / "checkpoint" / "step-2"),
        "truncated or corrupt .metadata",
        "delete it, or set checkpoint.load_step to one of 1",
    )


def test_truncated_shard_file(tmp_path, run_with_two_checkpoints):
    run = _copy(run_with_two_checkpoints, tmp_path)
    (shard,) = (run / "checkpoint" / "step-2").glob("*.distcp")
    shard.write_bytes(shard.read_bytes()[:1000])
    res = run_forked(1, *LLAMA, "--training.steps", "4", "--job.dump_folder", str(run), "--checkpoint.enable", "true")
    _one_clean_line(
        res,
        str(run / "checkpoint" / "step-2"),
        "truncated or corrupt shard file",
        "delete it, or set checkpoint.load_step to one of 1",
    )


def test_the_named_fix_works(tmp_path, run_with_two_checkpoints):
    """Following the message (load_step = 1) resumes."""
    run = _copy(run_with_two_checkpoints, tmp_path)
    meta = run / "checkpoint" / "step-2" / ".metadata"
    meta.write_bytes(meta.read_bytes()[:100])
    res = run_forked(
        1,
        *LLAMA,
        "--training.steps",
        "3",
        "--job.dump_folder",
        str(run),
        "--checkpoint.enable",
        "true",
        "--checkpoint.load_step",
        "1",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resumed from" in res.stdout and "at step 1" in res.stdout


def test_a_complete_run_says_so_and_how_to_continue(tmp_path, run_with_two_checkpoints):
    run = _copy(run_with_two_checkpoints, tmp_path)
    res = run_forked(1, *LLAMA, "--training.steps", "2", "--job.dump_folder", str(run), "--checkpoint.enable", "true")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "already complete (step 2 of training.steps = 2" in res.stdout, res.stdout[-2000:]
    assert "--training.steps" in res.stdout and f"delete {run}" in res.stdout
    assert "step 1/2" not in res.stdout  # nothing was trained


def test_convert_hf_corrupt_tensor_data_is_one_line(tmp_path):
    """A safetensors header that parses and fits its file but that safetensors refuses once the
    tensor data is read (a negative data offset): inside dcp.save, which wraps the failure."""
    from tests.hf_models import hf_model, llama_config
    from tools.forkserver import run_train as run_script

    src = tmp_path / "hf"
    hf_model(llama_config(vocab_size=512, num_hidden_layers=2)).save_pretrained(src)
    weights = src / "model.safetensors"
    raw = weights.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    first = next(k for k in header if k != "__metadata__")
    header[first]["data_offsets"][0] = -8
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    weights.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :])

    out = tmp_path / "out"
    flags = ["--model", "llama3", "--flavor", "debugmodel", "--n-layers", "2", "--vocab-size", "512"]
    # the script's __main__ in a forked process (its exit path as `python scripts/convert_hf.py`'s,
    # which tests/e2e/test_hf_train.py's bad-input test runs as a user types it; issue 49)
    argv = ["to-dcp", str(src), str(out), *flags]
    res = run_script(1, argv, env=_env(), cwd=ROOT, timeout=300, script=ROOT / "scripts" / "convert_hf.py")
    _one_clean_line(res, str(weights), "cannot be read", ": download it again")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no OUT_DIR, no OUT_DIR.tmp
