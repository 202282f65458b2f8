"""train.py and scripts/convert_hf.py with Hugging Face folders, end to end (fp32, CPU).

A random ``LlamaForCausalLM`` with the llama3 debug flavor's shapes (config written here) is
saved with ``save_pretrained`` in several shards. Then:

* a 2-process run (fsdp=2) starting from it (``initial_load_in_hf``) has the step-1 loss that
  transformers computes on the same global batch (rtol 1e-5);
* its ``last_save_in_hf`` folder loads with ``AutoModelForCausalLM.from_pretrained``, whose
  logits equal ours on the run's final weights (rtol 1e-5), and holds exactly those weights;
* a pp=2 run without ``checkpoint.enable`` (exported from the live stages, layers sent to the
  file writers across stages) at lr 0 exports exactly the tensors it loaded;
* ``save_in_hf_every`` during a run with asynchronous checkpoints: every ``step-N-hf`` holds
  exactly what ``convert_hf.py to-hf`` makes of the ``step-N`` checkpoint saved at that step;
* ``convert_hf.py to-dcp`` (flavor inferred) and training from the DCP folder gives the same
  step-1 loss, bit for bit, as loading the Hugging Face folder directly; ``to-hf`` of that DCP
  folder gives back every tensor bit for bit;
* bad input to train.py and to the script: one ``error:`` line, exit 2, no traceback, nothing
  written.

The trainings and the successful conversions, whose claims are the numbers, run on processes
forked from tools/forkserver.py's server (``run_forked``; ``_convert_forked`` for
scripts/convert_hf.py), bitwise what torchrun and ``python`` start (tests/e2e/test_launcher.py);
so do train.py's bad-input cases (the same ``__main__`` and exit, so the same stderr and exit
code; a fresh ``python train.py`` on bad input: tests/e2e/test_exit.py's bad_input case). The
script's bad input runs ``python scripts/convert_hf.py`` as users do.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from tests.hf_models import hf_model, llama_config

from .helpers import FAST, ROOT, _env, read_metrics, run_forked

RTOL = 1e-5
LLAMA = ["--config", "llama3.toml", *FAST]
HF_LOAD = ["--checkpoint.initial_load_in_hf", "true", "--checkpoint.initial_load_path"]


def _hf_llama():
    return hf_model(llama_config())  # = llama3/debugmodel


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf") / "llama3-debug-hf"
    _hf_llama().save_pretrained(folder, max_shard_size="4MB")
    assert (folder / "model.safetensors.index.json").exists()
    return folder


@pytest.fixture(scope="module")
def hf_run(hf_dir, tmp_path_factory):
    """Two steps on fsdp=2 from the Hugging Face folder, a resumable checkpoint at the end and
    the Hugging Face export next to it."""
    run = tmp_path_factory.mktemp("runs") / "from_hf"
    res = run_forked(
        2,
        *LLAMA,
        "--parallelism.dp_shard",
        "2",
        "--training.steps",
        "2",
        "--job.dump_folder",
        str(run),
        *HF_LOAD,
        str(hf_dir),
        "--checkpoint.last_save_in_hf",
        "true",
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert "loaded initial weights from Hugging Face folder" in res.stdout
    return run


def _global_batch(extra: list[str]):
    """The trainer's global batch of step 1, from its own data loader."""
    from trainer.config import load_config
    from trainer.data.loader import build_dataloader
    from trainer.data.tokenizer import load_tokenizer

    cfg = load_config([*LLAMA, *extra])
    loader = build_dataloader(cfg, load_tokenizer(cfg.model.tokenizer_path), batch_rank=0, batch_degree=1)
    micro = loader.next_step()
    return torch.cat([x for x, _ in micro]), torch.cat([y for _, y in micro])


def _loss(logits, labels) -> float:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()).item()


def test_step1_loss_equals_transformers(hf_dir, hf_run):
    inputs, labels = _global_batch(["--training.steps", "2"])
    assert inputs.shape == (8, 64)
    with torch.no_grad():
        expected = _loss(_hf_llama()(input_ids=inputs, use_cache=False).logits, labels)
    got = read_metrics(hf_run)[1]["loss"]
    assert abs(got - expected) <= RTOL * abs(expected), (got, expected)


def test_last_save_in_hf_loads_in_transformers(hf_run):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from models.registry import build_model, get_hf_adapter
    from trainer.checkpoint.dcp import load_checkpoint

    ckpt = hf_run / "checkpoint"
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-2", "step-2-hf"]
    out = ckpt / "step-2-hf"
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["torch_dtype"] == "float32"

    ours = build_model("llama3", "debugmodel", device="cpu")
    load_checkpoint(str(ckpt / "step-2"), [ours])
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        a, b = ours(tokens), theirs(input_ids=tokens, use_cache=False).logits
    assert b.abs().max() > 0.1
    torch.testing.assert_close(b, a, rtol=RTOL, atol=1e-5)
    stored = {}
    for f in out.glob("*.safetensors"):
        stored.update(load_file(f))
    expected = get_hf_adapter("llama3", ours.args).to_hf(ours.state_dict())
    assert stored.keys() == expected.keys()
    for k, t in expected.items():
        assert torch.equal(stored[k], t), k


def test_pipeline_run_exports_exactly_what_it_loaded(hf_dir, tmp_path):
    """pp=2 (each stage loads only its layers) without checkpoint.enable (the export is written
    from the live stages) and lr 0: the exported folder holds the input's tensors, bit for bit."""
    from trainer.checkpoint.hf_reader import open_hf_checkpoint

    run = tmp_path / "pp"
    res = run_forked(
        2,
        *LLAMA,
        "--parallelism.dp_shard",
        "1",
        "--parallelism.pp",
        "2",
        "--training.steps",
        "1",
        "--optimizer.lr",
        "0",
        "--job.dump_folder",
        str(run),
        "--checkpoint.enable",
        "false",
        *HF_LOAD,
        str(hf_dir),
        "--checkpoint.last_save_in_hf",
        "true",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert sorted(p.name for p in (run / "checkpoint").iterdir()) == ["step-1-hf"]  # no temporary save
    src, dst = open_hf_checkpoint(str(hf_dir)), open_hf_checkpoint(str(run / "checkpoint" / "step-1-hf"))
    assert set(src.tensors) == set(dst.tensors)
    with src.reader() as a, dst.reader() as b:
        for key in src.tensors:
            assert torch.equal(a.read(key), b.read(key)), key


def test_hf_every_n_steps_equals_the_offline_conversion_of_that_steps_checkpoint(tmp_path):
    """fsdp=2, async checkpoints and a Hugging Face folder every 2 steps: the live export at step N
    (written while the background save of step N may still be in flight) and the offline
    conversion of the published step-N checkpoint hold the same tensors, bit for bit (the same
    weights through the same conversion: a file round trip). The weights change every step, so
    a folder exported at another step would differ. 2 layers (no Hugging Face input here): the
    export converts every block alike, and ``to-hf`` infers the depth from the checkpoint."""
    from trainer.checkpoint.hf_reader import open_hf_checkpoint

    run = tmp_path / "every"
    res = run_forked(
        2,
        *LLAMA,
        "--model.n_layers",
        "2",
        "--parallelism.dp_shard",
        "2",
        "--training.steps",
        "4",
        "--job.dump_folder",
        str(run),
        "--checkpoint.enable",
        "true",
        "--checkpoint.interval",
        "2",
        "--checkpoint.keep_latest_k",
        "0",
        "--checkpoint.async_mode",
        "async",
        "--checkpoint.save_in_hf_every",
        "2",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    ck = run / "checkpoint"
    assert sorted(p.name for p in ck.iterdir()) == ["step-2", "step-2-hf", "step-4", "step-4-hf"]
    assert res.stdout.count("(written in the background in") == 2
    tensors = {}
    for step in (2, 4):
        out = tmp_path / f"offline-{step}"
        conv = _convert_forked("to-hf", str(ck / f"step-{step}"), str(out), "--model", "llama3", "--dtype", "float32")
        assert conv.returncode == 0, conv.stderr[-3000:]
        live, offline = open_hf_checkpoint(str(ck / f"step-{step}-hf")), open_hf_checkpoint(str(out))
        assert set(live.tensors) == set(offline.tensors)
        with live.reader() as a, offline.reader() as b:
            tensors[step] = {key: a.read(key) for key in live.tensors}
            for key in live.tensors:
                assert torch.equal(tensors[step][key], b.read(key)), (step, key)
    # negative control: the two exports differ (training moved the weights between them)
    assert not torch.equal(
        tensors[2]["model.layers.0.self_attn.q_proj.weight"], tensors[4]["model.layers.0.self_attn.q_proj.weight"]
    )


def _convert_forked(*args: str) -> subprocess.CompletedProcess:
    """scripts/convert_hf.py in one process forked from the launcher's server (torch imported
    once): for the conversions whose claim is the tensors they write."""
    from tools.forkserver import run_train as run_script

    return run_script(1, list(args), env=_env(), cwd=ROOT, timeout=300, script=ROOT / "scripts" / "convert_hf.py")


def _convert(*args: str) -> subprocess.CompletedProcess:
    """``python scripts/convert_hf.py``, as a user runs it (the bad-input cases)."""
    return subprocess.run(
        [sys.executable, "scripts/convert_hf.py", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
    )


def test_convert_to_dcp_trains_like_hf_and_converts_back(hf_dir, hf_run, tmp_path):
    """The run from the DCP folder trains one step: its step-1 loss is the claim (the loss of
    the converted weights on the same layout and batch)."""
    dcp_dir = tmp_path / "dcp"
    res = _convert_forked("to-dcp", str(hf_dir), str(dcp_dir), "--model", "llama3")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "converting layers.5" in res.stderr and (dcp_dir / ".metadata").exists()

    run = tmp_path / "from_dcp"
    res = run_forked(
        2,
        *LLAMA,
        "--parallelism.dp_shard",
        "2",
        "--training.steps",
        "1",
        "--job.dump_folder",
        str(run),
        "--checkpoint.enable",
        "false",
        "--checkpoint.initial_load_path",
        str(dcp_dir),
    )
    assert res.returncode == 0, res.stderr[-3000:]
    # the same weights on the same layout and batch: the same loss, bit for bit
    assert read_metrics(run)[1]["loss"] == read_metrics(hf_run)[1]["loss"]

    back = tmp_path / "back"
    res = _convert_forked(
        "to-hf", str(dcp_dir), str(back), "--model", "llama3", "--dtype", "float32", "--max-shard-size", "3MB"
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "wrote model-00001-of-" in res.stderr
    from trainer.checkpoint.hf_reader import open_hf_checkpoint

    src, dst = open_hf_checkpoint(str(hf_dir)), open_hf_checkpoint(str(back))
    assert set(src.tensors) == set(dst.tensors) and len(dst.files) > 1
    with src.reader() as a, dst.reader() as b:
        for key in src.tensors:
            assert torch.equal(a.read(key), b.read(key)), key


# ------------------------------------------------------------------------------- bad input


def _one_clean_line(res, *needles) -> str:
    assert res.returncode == 2, f"exit {res.returncode}\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    errors = [line for line in res.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, res.stderr[-3000:]
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


def _broken_copy(hf_dir, tmp_path, how: str):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "hf"
    shutil.copytree(hf_dir, folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    if how == "missing_shard":
        (folder / index["model.layers.2.mlp.up_proj.weight"]).unlink()
    elif how == "wrong_shape":
        f = folder / index["model.layers.1.self_attn.k_proj.weight"]
        tensors = load_file(f)
        tensors["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(64, 256)
        save_file(tensors, f, metadata={"format": "pt"})
    elif how == "other_architecture":
        config.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3")
        config_path.write_text(json.dumps(config))
    elif how == "other_heads":
        config["num_attention_heads"] = 8
        config_path.write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(
    "how, needles",
    [
        ("missing_folder", ["checkpoint.initial_load_path", "does not exist", "config.json and model.safetensors"]),
        ("missing_shard", ["lists shard model-0000", "missing from", "copy the complete model folder"]),
        ("wrong_shape", ["model.layers.1.self_attn.k_proj.weight", "[64, 256]", "expected [128, 256]"]),
        ("other_architecture", ["DeepseekV3ForCausalLM", "loads LlamaForCausalLM", "llama3/debugmodel"]),
        ("other_heads", ["num_attention_heads=8 in config.json vs 16"]),
    ],
)
def test_bad_hf_folder_through_train_py(hf_dir, tmp_path, how, needles):
    folder = tmp_path / "nope" if how == "missing_folder" else _broken_copy(hf_dir, tmp_path, how)
    run = tmp_path / "run"
    res = run_forked(
        1,
        *LLAMA,
        "--parallelism.dp_shard",
        "1",
        "--training.steps",
        "1",
        "--job.dump_folder",
        str(run),
        *HF_LOAD,
        str(folder),
        "--checkpoint.last_save_in_hf",
        "true",
    )
    _one_clean_line(res, *needles)
    assert not run.exists() or list(run.iterdir()) == []  # nothing written


def test_bad_input_through_convert_script(hf_dir, tmp_path):
    """Bad input to scripts/convert_hf.py: one line, exit 2, nothing written. The first case runs
    ``python scripts/convert_hf.py`` as a user types it (the entry point's own exit); the others
    the same script's ``__main__`` in a forked process (``_convert_forked``: the same exit path,
    SystemExit's code, without an interpreter and a torch import each; issue 49)."""
    out = tmp_path / "out"
    res = _convert("to-dcp", str(tmp_path / "nope"), str(out), "--model", "llama3")
    _one_clean_line(res, str(tmp_path / "nope"), "does not exist")
    res = _convert_forked("to-hf", str(hf_dir), str(out), "--model", "llama3")  # not a DCP folder
    _one_clean_line(res, "is not a complete checkpoint (no .metadata)")
    res = _convert_forked("to-dcp", str(hf_dir), str(out), "--model", "deepseek_v3")
    _one_clean_line(res, "LlamaForCausalLM", "DeepseekV3ForCausalLM")
    res = _convert_forked("to-dcp", str(hf_dir), str(out), "--model", "llama3", "--flavor", "8B")
    _one_clean_line(res, "hidden_size=256 in config.json vs 4096")
    assert not out.exists() and not (tmp_path / "out.tmp").exists()
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    res = _convert_forked("to-dcp", str(hf_dir), str(out), "--model", "llama3")
    _one_clean_line(res, "already exists and is not empty")
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
