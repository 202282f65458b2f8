"""Hugging Face folders (trainer/checkpoint/hf_format.py, hf_reader.py, hf_write.py) with the
tiny adapter of tests/hf_folders.py: the writer/reader round trip, sharding and the index, the
size cap, atomic publication, and each bad input as one line naming the problem."""

from __future__ import annotations

import json
import os

import pytest
import torch

from models import registry
from tests.hf_folders import TinyAdapter, TinyArgs, one_line, rewrite_header, save_hf_checkpoint, save_tiny, tiny_state
from trainer.checkpoint.errors import CheckpointError
from trainer.checkpoint.hf_format import parse_size
from trainer.checkpoint.hf_reader import open_hf_checkpoint, validate_hf_checkpoint
from trainer.checkpoint.hf_write import HFFolderWriter, plan_shards


@pytest.fixture
def adapter(monkeypatch):
    """The tiny adapter, also for every model name the loader asks the registry for."""
    ad = TinyAdapter(TinyArgs())
    monkeypatch.setattr(registry, "get_hf_adapter", lambda name, args: TinyAdapter(args))
    return ad


# ----------------------------------------------------------------------------- writer/reader


def test_round_trip_single_file_bitwise(tmp_path, adapter):
    out = save_tiny(adapter, tmp_path / "hf")
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors"]
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == adapter.hf_config("float32")
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text())["eos_token_id"] == 2
    ckpt = validate_hf_checkpoint(out, adapter)
    expected = adapter.to_hf(tiny_state())
    with ckpt.reader() as r:
        got = {k: r.read(k) for k in expected}
    for k, t in expected.items():
        assert torch.equal(got[k], t), k
    back = adapter.from_hf(got)
    for k, t in tiny_state().items():
        assert torch.equal(back[k], t), k


def test_sharding_index_and_size_cap(tmp_path, adapter):
    hf = adapter.to_hf(tiny_state())
    sizes = {k: t.numel() * 4 for k, t in hf.items()}
    cap = 300  # embed (512 B) is larger than the cap: a file of its own
    out = save_tiny(adapter, tmp_path / "hf", max_shard_bytes=cap)
    files = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    n = len(files)
    assert n > 2 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(sizes.values())
    assert set(index["weight_map"]) == set(hf)
    per_file: dict[str, int] = {}
    for k, f in index["weight_map"].items():
        per_file[f] = per_file.get(f, 0) + sizes[k]
    for f, total in per_file.items():
        keys = [k for k, g in index["weight_map"].items() if g == f]
        assert total <= cap or len(keys) == 1, (f, total, keys)
    ckpt = validate_hf_checkpoint(out, adapter)
    assert ckpt.files == files
    with ckpt.reader() as r:
        for k, t in hf.items():
            assert ckpt.tensors[k].file == index["weight_map"][k]
            assert torch.equal(r.read(k), t)


def test_plan_shards_packs_in_order():
    assert plan_shards([("a", 4), ("b", 4), ("c", 9), ("d", 1)], 8) == [["a", "b"], ["c"], ["d"]]
    assert plan_shards([("a", 4)], 1) == [["a"]]
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2MiB") == 2 * 2**20 and parse_size("77") == 77
    with pytest.raises(ValueError, match="cannot read"):
        parse_size("five")


def test_export_dtype_and_keep_fp32(tmp_path, adapter):
    hf = adapter.to_hf(tiny_state())
    out = save_hf_checkpoint(
        str(tmp_path / "hf"),
        hf,
        adapter.hf_config("bfloat16"),
        dtype="bfloat16",
        keep_fp32=lambda k: k.startswith("model.experts.0."),
    )
    ckpt = open_hf_checkpoint(out)
    assert ckpt.tensors["model.embed_tokens.weight"].dtype == "BF16"
    assert ckpt.tensors["model.experts.0.gate_proj.weight"].dtype == "F32"
    with ckpt.reader() as r:
        assert torch.equal(r.read("model.embed_tokens.weight"), hf["model.embed_tokens.weight"].bfloat16())


def test_interrupted_save_leaves_no_complete_looking_folder(tmp_path, adapter, monkeypatch):
    final = tmp_path / "hf"
    real_write = HFFolderWriter.write_file
    calls = {"n": 0}

    def failing(self, name, tensors):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(28, "No space left on device")
        real_write(self, name, tensors)

    monkeypatch.setattr(HFFolderWriter, "write_file", failing)
    with pytest.raises(OSError, match="No space"):
        save_tiny(adapter, final, max_shard_bytes=300)
    assert not final.exists() and not (tmp_path / "hf.tmp").exists()

    # a crash (no cleanup) leaves only <final>.tmp, which no reader takes for a checkpoint
    writer = HFFolderWriter(str(final))
    writer.start()
    real_write(writer, "model-00001-of-00002.safetensors", {"x": torch.zeros(2)})
    assert os.listdir(tmp_path) == ["hf.tmp"]
    with pytest.raises(CheckpointError) as e:
        open_hf_checkpoint(str(final))
    one_line(e, str(final), "does not exist")

    # the next save replaces the stale .tmp; a failing re-save keeps the previous folder whole
    monkeypatch.setattr(HFFolderWriter, "write_file", real_write)
    save_tiny(adapter, final)
    assert not (tmp_path / "hf.tmp").exists()
    calls["n"] = 0
    monkeypatch.setattr(HFFolderWriter, "write_file", failing)
    with pytest.raises(OSError):
        save_tiny(adapter, final, max_shard_bytes=300)
    validate_hf_checkpoint(str(final), adapter)  # the old one, intact


# ----------------------------------------------------------------------------- bad input


def _bad(tmp_path, adapter, breaker, *needles):
    out = save_tiny(adapter, tmp_path / "hf", max_shard_bytes=300)
    breaker(tmp_path / "hf")
    with pytest.raises(CheckpointError) as e:
        validate_hf_checkpoint(out, adapter, "tiny/flavor")
    return one_line(e, *needles)


def test_missing_folder_and_not_a_folder(tmp_path, adapter):
    with pytest.raises(CheckpointError) as e:
        open_hf_checkpoint(str(tmp_path / "nope"))
    one_line(e, tmp_path / "nope", "does not exist", "config.json and model.safetensors")
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError) as e:
        open_hf_checkpoint(str(tmp_path / "file"))
    one_line(e, "is not a folder")


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root reads anything")
def test_unreadable_folder(tmp_path, adapter):
    out = save_tiny(adapter, tmp_path / "hf")
    os.chmod(out, 0)
    try:
        with pytest.raises(CheckpointError) as e:
            open_hf_checkpoint(out)
        one_line(e, out, "permission denied")
    finally:
        os.chmod(out, 0o755)


def test_config_missing_or_invalid(tmp_path, adapter):
    _bad(tmp_path, adapter, lambda p: (p / "config.json").unlink(), "config.json is missing", "copy the model's config")
    (tmp_path / "hf" / "config.json").write_text('{"hidden_size": 8,')
    with pytest.raises(CheckpointError) as e:
        open_hf_checkpoint(str(tmp_path / "hf"))
    one_line(e, "config.json is not valid JSON", "line 1")


def test_config_mismatch_names_field_and_both_values(tmp_path, adapter):
    def edit(p):
        cfg = json.loads((p / "config.json").read_text())
        cfg["hidden_size"] = 12
        (p / "config.json").write_text(json.dumps(cfg))

    _bad(tmp_path, adapter, edit, "config.json does not fit tiny/flavor", "hidden_size=12", "vs 8")


def test_config_of_another_architecture(tmp_path, adapter):
    def edit(p):
        cfg = json.loads((p / "config.json").read_text())
        cfg.update(architectures=["LlamaForCausalLM"], model_type="llama")
        (p / "config.json").write_text(json.dumps(cfg))

    _bad(tmp_path, adapter, edit, "LlamaForCausalLM", "TinyForCausalLM")


def test_no_weights(tmp_path, adapter):
    def strip(p):
        for f in os.listdir(p):
            if "safetensors" in f:
                os.remove(p / f)
        (p / "pytorch_model.bin").write_bytes(b"")

    _bad(tmp_path, adapter, strip, "has no model.safetensors", "pytorch_model.bin", "only safetensors")


def test_index_lists_missing_shard(tmp_path, adapter):
    _bad(
        tmp_path,
        adapter,
        lambda p: (p / "model-00002-of-00004.safetensors").unlink(),
        "lists shard model-00002-of-00004.safetensors",
        "missing from",
        "all 4 shards",
    )


def test_truncated_shard(tmp_path, adapter):
    def cut(p):
        f = p / "model-00003-of-00004.safetensors"
        f.write_bytes(f.read_bytes()[:-10])

    _bad(tmp_path, adapter, cut, "model-00003-of-00004.safetensors is truncated", "download")


def test_wrong_shape_from_header(tmp_path, adapter):
    def reshape(p):
        index = json.loads((p / "model.safetensors.index.json").read_text())
        f = p / index["weight_map"]["model.q_proj.weight"]
        rewrite_header(f, lambda h: h["model.q_proj.weight"].update(shape=[4, 16]))

    msg = _bad(tmp_path, adapter, reshape, "model.q_proj.weight", "[4, 16]", "expected [8, 8]")
    assert msg.startswith("Hugging Face checkpoint")


def test_missing_key(tmp_path, adapter):
    def drop(p):
        index_path = p / "model.safetensors.index.json"
        index = json.loads(index_path.read_text())
        del index["weight_map"]["model.experts.1.gate_proj.weight"]
        index_path.write_text(json.dumps(index))

    _bad(tmp_path, adapter, drop, "lacks 1 of the 5 tensors", "model.experts.1.gate_proj.weight")


def test_unsupported_dtype(tmp_path, adapter):
    def fp8(p):
        index = json.loads((p / "model.safetensors.index.json").read_text())
        f = p / index["weight_map"]["model.q_proj.weight"]
        rewrite_header(f, lambda h: h["model.q_proj.weight"].update(dtype="F8_E4M3"))

    _bad(tmp_path, adapter, fp8, "stored as F8_E4M3", "dequantize")
