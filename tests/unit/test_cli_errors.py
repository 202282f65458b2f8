"""Every user-facing command ends bad input the same way (trainer/runtime/cli_errors.py): exit code 2,
exactly one ``error:`` line on stderr naming the problem and the fix, no traceback, nothing
written at the output path. In-process ``main(argv)`` of scripts/convert_hf.py (to-dcp, to-hf),
scripts/tokenize_dataset.py, scripts/train_tokenizer.py, tools/compare_loss and tools/planner.
(The same through a subprocess: tests/e2e/test_user_errors.py.)"""

from __future__ import annotations

import shutil
import struct
import sys
from pathlib import Path

import pytest

from tests.hf_folders import rewrite_header
from tests.hf_models import deepseek_v3_config, hf_model, llama_config
from trainer.checkpoint.errors import CheckpointError
from trainer.config import ConfigError
from trainer.runtime.cli_errors import error_line, run_command, unwrap_dcp, user_error

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import convert_hf  # noqa: E402
import tokenize_dataset  # noqa: E402
import train_tokenizer  # noqa: E402

from tools.compare_loss import cli as compare_loss_cli  # noqa: E402
from tools.compare_loss import runner as compare_loss_runner  # noqa: E402
from tools.planner import cli as planner_cli  # noqa: E402
from tools.tokenize import shipped_tokenizer  # noqa: E402

VOCAB = 512
# the debug flavors at these sizes; transformers' models of the same shapes write the folders
SIZES = {"llama3": dict(n_layers=2), "deepseek_v3": dict(n_layers=3)}


def _flags(model: str) -> list[str]:
    return ["--model", model, "--flavor", "debugmodel", "--n-layers", str(SIZES[model]["n_layers"]), "--vocab-size",
            str(VOCAB)]  # fmt: skip


def _one_error_line(rc: int, err: str, *needles) -> str:
    assert rc == 2, f"exit {rc}\n{err[-3000:]}"
    assert "Traceback" not in err, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err[-3000:]
    for needle in needles:
        assert str(needle) in errors[0], errors[0]
    return errors[0]


def _nothing_at(out: Path) -> None:
    assert not out.exists(), sorted(p.name for p in out.iterdir()) if out.is_dir() else out
    leftovers = [p.name for p in out.parent.iterdir() if p.name.startswith(out.name + ".")]
    assert not leftovers, leftovers


# ------------------------------------------------------------------------------ the helper


def test_user_error_unwraps_dcp_and_keeps_bugs():
    from torch.distributed.checkpoint.api import CheckpointException

    ours = CheckpointError("x.safetensors cannot be read (bad header): download it again")
    wrapped = CheckpointException("write_data", {0: (ours, None)})
    assert user_error(ours) is ours and user_error(wrapped) is ours and unwrap_dcp(wrapped) is ours
    nested = CheckpointException("save", {1: (wrapped, None), 0: (ConfigError("bad value: fix it"), None)})
    assert isinstance(user_error(nested), ConfigError)  # rank order
    bug = CheckpointException("save", {0: (ours, None), 1: (RuntimeError("bug"), None)})
    assert user_error(bug) is None  # a wrapper that holds a bug keeps its traceback
    assert user_error(KeyboardInterrupt()) is None and user_error(RuntimeError("x")) is None
    assert user_error(FileNotFoundError("f")) is None and user_error(FileNotFoundError("f"), (OSError,)) is not None
    assert error_line(ValueError("two\n  lines")) == "error: two lines"


def test_run_command(capsys):
    from torch.distributed.checkpoint.api import CheckpointException

    def wrapped():
        raise CheckpointException("write_data", {0: (CheckpointError("f cannot be read: download it again"), None)})

    assert run_command(lambda: None) == 0 and run_command(lambda: 1) == 1
    assert run_command(wrapped) == 2
    assert capsys.readouterr().err == "error: f cannot be read: download it again\n"
    with pytest.raises(RuntimeError):
        run_command(lambda: (_ for _ in ()).throw(RuntimeError("bug")))


# ---------------------------------------------------------------------- Hugging Face folders


def _first(header: dict) -> str:
    return next(k for k in header if k != "__metadata__")


def _negative_offsets(h: dict) -> None:
    k = _first(h)
    h[k]["data_offsets"] = [-8, h[k]["data_offsets"][1]]


def _offsets_not_dtype_x_shape(h: dict) -> None:
    k = _first(h)
    begin, end = h[k]["data_offsets"]
    h[k]["data_offsets"] = [begin, end - 4]


def _entry_the_model_lacks(h: dict) -> None:
    h["model.layers.99.extra.weight"] = {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}


HEADER_CORRUPTIONS = {
    "negative_offsets": _negative_offsets,
    "offsets_not_dtype_x_shape": _offsets_not_dtype_x_shape,
    "entry_the_model_lacks": _entry_the_model_lacks,
}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """A clean single-file Hugging Face folder per model (the debug flavor at SIZES, vocab 512)."""
    out = {}
    for model, config in [
        ("llama3", llama_config(vocab_size=VOCAB, num_hidden_layers=SIZES["llama3"]["n_layers"])),
        ("deepseek_v3", deepseek_v3_config(vocab_size=VOCAB, num_hidden_layers=SIZES["deepseek_v3"]["n_layers"])),
    ]:
        folder = tmp_path_factory.mktemp(f"hf_{model}") / "hf"
        hf_model(config).save_pretrained(folder)
        assert (folder / "model.safetensors").exists()
        out[model] = folder
    return out


@pytest.fixture(scope="module")
def dcp_dir(hf_dirs, tmp_path_factory):
    """The llama3 folder converted to DCP (the to-hf input)."""
    out = tmp_path_factory.mktemp("dcp") / "dcp"
    assert convert_hf.main(["to-dcp", str(hf_dirs["llama3"]), str(out), *_flags("llama3")]) == 0
    return out


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "in"
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("model", ["llama3", "deepseek_v3"])
def test_to_dcp_clean_folder_converts(hf_dirs, tmp_path, model, capsys):
    """The control: the folders the corruptions start from convert with these flags."""
    out = tmp_path / "out"
    assert convert_hf.main(["to-dcp", str(hf_dirs[model]), str(out), *_flags(model)]) == 0
    assert (out / ".metadata").exists() and "done:" in capsys.readouterr().err


@pytest.mark.parametrize("corruption", sorted(HEADER_CORRUPTIONS))
@pytest.mark.parametrize("model", ["llama3", "deepseek_v3"])
def test_to_dcp_corrupt_safetensors_data_phase(hf_dirs, tmp_path, model, corruption, capsys):
    """Headers that parse and fit the file, but that safetensors refuses when the tensor data is
    read (inside dcp.save, which wraps the failure in a CheckpointException)."""
    src = _copy(hf_dirs[model], tmp_path)
    rewrite_header(src / "model.safetensors", HEADER_CORRUPTIONS[corruption])
    out = tmp_path / "out"
    rc = convert_hf.main(["to-dcp", str(src), str(out), *_flags(model)])
    _one_error_line(rc, capsys.readouterr().err, src / "model.safetensors", "cannot be read", ": download it again")
    _nothing_at(out)


def test_convert_hf_to_dcp_raises_the_checkpoint_error_itself(hf_dirs, tmp_path):
    """The fix at the cause: what failed inside dcp.save is raised, not DCP's wrapper."""
    from models.registry import build_model
    from trainer.checkpoint.convert import convert_hf_to_dcp

    src = _copy(hf_dirs["llama3"], tmp_path)
    rewrite_header(src / "model.safetensors", _negative_offsets)
    args = build_model("llama3", "debugmodel", device="meta", vocab_size=VOCAB, **SIZES["llama3"]).args
    with pytest.raises(CheckpointError, match="download it again"):
        convert_hf_to_dcp(str(src), str(tmp_path / "out"), "llama3", args)
    _nothing_at(tmp_path / "out")


def _break_config_json(p: Path) -> None:
    (p / "config.json").write_text('{"hidden_size": 256,')


def _truncate_weights(p: Path) -> None:
    f = p / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-10])


def _huge_header_length(p: Path) -> None:
    f = p / "model.safetensors"
    f.write_bytes(struct.pack("<Q", 1 << 40) + f.read_bytes()[8:])


def _unsupported_dtype(p: Path) -> None:
    rewrite_header(p / "model.safetensors", lambda h: h[_first(h)].update(dtype="F8_E4M3"))


@pytest.mark.parametrize(
    "breaker, needles",
    [
        (None, ["does not exist", "point it at a Hugging Face model folder"]),
        (_break_config_json, ["config.json is not valid JSON", "restore the config.json"]),
        (_truncate_weights, ["model.safetensors is truncated", "download model.safetensors again"]),
        (_huge_header_length, ["not a safetensors file", "download model.safetensors again"]),
        (_unsupported_dtype, ["F8_E4M3"]),
    ],
    ids=["missing_folder", "config_json", "truncated", "header_length", "dtype"],
)
def test_to_dcp_bad_folder(hf_dirs, tmp_path, breaker, needles, capsys):
    src = tmp_path / "missing"
    if breaker is not None:
        src = _copy(hf_dirs["llama3"], tmp_path)
        breaker(src)
    out = tmp_path / "out"
    rc = convert_hf.main(["to-dcp", str(src), str(out), *_flags("llama3")])
    _one_error_line(rc, capsys.readouterr().err, *needles)
    _nothing_at(out)


def test_to_dcp_bad_flags(hf_dirs, tmp_path, capsys):
    out = tmp_path / "out"
    for argv, needles in [
        (["--model", "gpt2"], ["unknown --model 'gpt2'", "choose one of"]),
        (["--model", "llama3", "--flavor", "9B"], ["unknown --flavor '9B'", "choose one of"]),
        (_flags("llama3")[:-2] + ["--vocab-size", "1000"], ["does not fit", "vocab_size"]),
    ]:
        rc = convert_hf.main(["to-dcp", str(hf_dirs["llama3"]), str(out), *argv])
        _one_error_line(rc, capsys.readouterr().err, *needles)
        _nothing_at(out)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "mine.txt").write_text("keep")
    rc = convert_hf.main(["to-dcp", str(hf_dirs["llama3"]), str(busy), *_flags("llama3")])
    _one_error_line(rc, capsys.readouterr().err, "already exists and is not empty", "choose a new folder")
    assert [p.name for p in busy.iterdir()] == ["mine.txt"]


def _truncate_metadata(p: Path) -> None:
    f = p / ".metadata"
    f.write_bytes(f.read_bytes()[:50])


def _truncate_shard(p: Path) -> None:
    f = sorted(p.glob("*.distcp"))[0]
    f.write_bytes(f.read_bytes()[:100])


def _remove_metadata(p: Path) -> None:
    (p / ".metadata").unlink()


@pytest.mark.parametrize(
    "breaker, argv, needles",
    [
        (None, [], ["does not exist", "point it at a step-N folder"]),
        (_remove_metadata, [], ["no .metadata", "point it at a step-N folder"]),
        (_truncate_metadata, [], ["truncated or corrupt .metadata"]),
        (_truncate_shard, [], ["truncated or corrupt shard file", "point it at another step-N folder"]),
        (lambda p: None, ["--model", "deepseek_v3"], ["cannot infer the deepseek_v3 flavor", "pass --flavor"]),
        (lambda p: None, ["--max-shard-size", "lots"], ["--max-shard-size", "write e.g. 5GB"]),
    ],
    ids=["missing", "no_metadata", "metadata", "shard", "other_model", "shard_size"],
)
def test_to_hf_bad_input(dcp_dir, tmp_path, breaker, argv, needles, capsys):
    src = tmp_path / "missing"
    if breaker is not None:
        src = _copy(dcp_dir, tmp_path)
        breaker(src)
    out = tmp_path / "out"
    flags = argv if "--model" in argv else ["--model", "llama3", *argv]
    rc = convert_hf.main(["to-hf", str(src), str(out), *flags])
    _one_error_line(rc, capsys.readouterr().err, *needles)
    _nothing_at(out)


# ------------------------------------------------------------------------------ the others


@pytest.mark.parametrize(
    "argv, needles",
    [
        (["{tmp}/missing.jsonl"], ["does not exist"]),
        (["{tmp}/x.csv"], ["unknown file type"]),
        (["synthetic:0:10", "--shard-tokens", "0"], ["--shard-tokens must be > 0"]),
        (["synthetic:0:10", "--tokenizer", "{tmp}/no_tokenizer"], ["no_tokenizer"]),
    ],
    ids=["missing_input", "file_type", "shard_tokens", "tokenizer"],
)
def test_tokenize_dataset_bad_input(tmp_path, argv, needles, capsys):
    (tmp_path / "x.csv").write_text("a,b\n")
    out = tmp_path / "out"
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    rc = tokenize_dataset.main([*argv, "--out", str(out), "--workers", "1"])
    _one_error_line(rc, capsys.readouterr().err, *needles)
    _nothing_at(out)


def test_tokenize_dataset_verify_of_a_missing_folder(tmp_path, capsys):
    rc = tokenize_dataset.main(["--verify", "--out", str(tmp_path / "nope")])
    _one_error_line(rc, capsys.readouterr().err, tmp_path / "nope")
    _nothing_at(tmp_path / "nope")


@pytest.mark.parametrize(
    "argv, needles",
    [
        (["--check", "--out", "{tmp}/missing.json"], ["--check compares with an existing tokenizer.json"]),
        (["--out", "{tmp}"], ["is a folder", "tokenizer.json"]),
        (["--out", "{tmp}/a_file/tokenizer.json"], ["is not a writable folder"]),
    ],
    ids=["check_missing", "folder", "under_a_file"],
)
def test_train_tokenizer_bad_out(tmp_path, argv, needles, monkeypatch, capsys):
    monkeypatch.setattr(shipped_tokenizer, "train", lambda: pytest.fail("the --out check comes before training"))
    (tmp_path / "a_file").write_text("x")
    before = sorted(p.name for p in tmp_path.iterdir())
    rc = train_tokenizer.main([a.replace("{tmp}", str(tmp_path)) for a in argv])
    _one_error_line(rc, capsys.readouterr().err, *needles)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize(
    "argv, needles",
    [
        (["--config", "llama3", "--layouts", "fsdp=4", "tpp=2"], ["did you mean 'tp'?"]),
        (["--config", "llama3", "--layouts", "fsdp=4", "--steps", "0"], ["--steps must be >= 1"]),
        (["--config", "nope.toml", "--layouts", "fsdp=4"], ["config file 'nope.toml' not found", "pass a path"]),
        (["--config", "llama3", "--layouts", "fsdp=4", "--", "--training.seq_lne", "5"], ["did you mean"]),
        (["--config", "llama3", "--layouts", "fsdp=4", "--seed-checkpoint", "{tmp}/no_seed"], ["is not a folder"]),
    ],
    ids=["layout", "steps", "config", "override", "seed"],
)
def test_compare_loss_bad_input(tmp_path, argv, needles, monkeypatch, capsys):
    def must_not_run(*a, **k):
        raise AssertionError("nothing may run for bad input")

    monkeypatch.setattr(compare_loss_runner, "run_layouts", must_not_run)
    monkeypatch.setattr(compare_loss_runner, "create_seed_checkpoint", must_not_run)
    out = tmp_path / "out"
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    cut = argv.index("--") if "--" in argv else len(argv)
    rc = compare_loss_cli.main([*argv[:cut], "--out", str(out), *argv[cut:]])
    _one_error_line(rc, capsys.readouterr().err, *needles)
    _nothing_at(out)


def test_compare_loss_out_is_a_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(compare_loss_runner, "run_layouts", lambda *a, **k: pytest.fail("must not run"))
    out = tmp_path / "out"
    out.write_text("mine")
    rc = compare_loss_cli.main(["--config", "llama3", "--layouts", "fsdp=4", "--out", str(out)])
    _one_error_line(rc, capsys.readouterr().err, "is a file, not a folder", "pick a new folder")
    assert out.read_text() == "mine"


PLAN = ["--model", "llama3", "--flavor", "debugmodel", "--world-size", "8", "--seq-len", "256", "--global-batch", "16"]


@pytest.mark.parametrize(
    "extra, needles",
    [
        (["--model", "gpt2"], ["valid models: deepseek_v3, llama3, qwen3"]),
        (["--gpu", "v100"], ["valid gpus:"]),
        (["--world-size", "0"], ["--world-size must be >= 1"]),
        (["--profile", "{tmp}/missing.json"], ["missing.json is not a file", "JSON file of hardware keys"]),
        (["--profile", "{tmp}/broken.json"], ["broken.json is not valid JSON", "fix the file"]),
        (["--toml", "{tmp}/no_folder/plan.toml"], ["does not exist", "choose another path"]),
        (["--toml", "{tmp}"], ["is a folder", "pass a file path"]),
    ],
    ids=["model", "gpu", "world_size", "profile_missing", "profile_json", "toml_folder_missing", "toml_is_folder"],
)
def test_planner_bad_input(tmp_path, extra, needles, capsys):
    (tmp_path / "broken.json").write_text("{")
    argv = list(PLAN)
    for flag, value in zip(extra[::2], extra[1::2]):
        value = value.replace("{tmp}", str(tmp_path))
        if flag in argv:
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag, value]
    before = sorted(p.name for p in tmp_path.iterdir())
    rc = planner_cli.main(argv)
    captured = capsys.readouterr()
    _one_error_line(rc, captured.err, *needles)
    assert captured.out == ""  # the search did not run
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_planner_toml_is_written_whole(tmp_path, capsys):
    path = tmp_path / "plan.toml"
    assert planner_cli.main([*PLAN, "--top", "1", "--toml", str(path)]) == 0
    assert path.read_text().startswith("# layout planner: llama3/debugmodel")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.toml"]  # no temporary file left


def test_help_names_the_defaults_and_choices(capsys):
    """--help says what a user must otherwise guess: the converter's export dtype (bfloat16 by
    default, float32 for a bit-for-bit round trip), the checkpoint tool's, and the planner's
    flavors of every registered model."""
    from models.registry import flavor_names, model_names
    from trainer.checkpoint import __main__ as checkpoint_tool

    def help_text(main, argv) -> str:
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 0
        return " ".join(capsys.readouterr().out.split())  # argparse wraps lines

    to_hf = help_text(convert_hf.main, ["to-hf", "--help"])
    assert "default bfloat16" in to_hf and "float32 keeps the training run's float32 weights bit for bit" in to_hf
    assert "(default float32)" in help_text(checkpoint_tool.main, ["--help"])
    plan = help_text(planner_cli.main, ["--help"])
    for model in model_names():
        assert f"{model}: {', '.join(flavor_names(model))}" in plan


def test_checkpoint_tool_says_a_missing_folder_does_not_exist(tmp_path, capsys):
    """``python -m trainer.checkpoint`` on a path that is not there says so (not "not a complete
    checkpoint", which is for a folder without .metadata), and writes nothing."""
    from trainer.checkpoint import __main__ as checkpoint_tool

    missing, out = tmp_path / "step-7", tmp_path / "x.pt"
    _one_error_line(checkpoint_tool.main([str(missing), str(out)]), capsys.readouterr().err, "does not exist")
    missing.mkdir()
    _one_error_line(
        checkpoint_tool.main([str(missing), str(out)]), capsys.readouterr().err, "not a complete checkpoint"
    )
    assert not out.exists()
