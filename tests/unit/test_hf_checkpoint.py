"""Hugging Face folder IO (trainer/hf_checkpoint.py) with a tiny adapter written here: the
writer/reader round trip, sharding and the index, the size cap, atomic publication, each bad
input as one line naming the problem, which elements a shard reads, and which part of the full
tensor a DTensor shard is (every placement kind, uneven sizes, on the fake backend)."""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from torch import nn

import trainer.hf_checkpoint as hfc
from models.common.hf_adapter import ConfigField, HFStateDictAdapter, Plain, RopeRows, Stacked
from trainer.checkpoint import CheckpointError


@dataclass
class TinyArgs:
    dim: int = 8
    experts: int = 3


class TinyAdapter(HFStateDictAdapter):
    """embed (Plain), q (RopeRows, 2 heads), experts (Stacked [E, 4, dim])."""

    hf_architecture = "TinyForCausalLM"
    model_type = "tiny"
    model_name = "tiny"

    def _entries(self):
        a = self.args
        yield Plain("embed.weight", "model.embed_tokens.weight", (16, a.dim))
        yield RopeRows("q.weight", "model.q_proj.weight", (a.dim, a.dim), 2)
        yield Stacked(
            "experts.w1", tuple(f"model.experts.{i}.gate_proj.weight" for i in range(a.experts)), (a.experts, 4, a.dim)
        )

    def hf_config(self, dtype="bfloat16"):
        return {
            "architectures": [self.hf_architecture],
            "model_type": self.model_type,
            "hidden_size": self.args.dim,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "torch_dtype": dtype,
        }

    def _config_fields(self, config):
        return [ConfigField("hidden_size", config.get("hidden_size"), self.args.dim, "dim")]


class TinyModel(nn.Module):
    def __init__(self, args: TinyArgs):
        super().__init__()
        self.embed = nn.Embedding(16, args.dim)
        self.q = nn.Linear(args.dim, args.dim, bias=False)
        self.experts = nn.Module()
        self.experts.w1 = nn.Parameter(torch.zeros(args.experts, 4, args.dim))
        self.register_buffer("table", torch.arange(5.0), persistent=True)  # no HF source: kept


def _ours(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    a = TinyArgs()
    return {
        "embed.weight": torch.randn(16, a.dim, generator=g),
        "q.weight": torch.randn(a.dim, a.dim, generator=g),
        "experts.w1": torch.randn(a.experts, 4, a.dim, generator=g),
    }


@pytest.fixture
def adapter(monkeypatch):
    ad = TinyAdapter(TinyArgs())
    monkeypatch.setattr(hfc, "hf_adapter_for", lambda name, args: TinyAdapter(args))
    return ad


def _save(adapter, folder, max_shard_bytes=hfc.DEFAULT_MAX_SHARD_BYTES, dtype="float32"):
    return hfc.save_hf_checkpoint(
        str(folder), adapter.to_hf(_ours()), adapter.hf_config(dtype), dtype=dtype, max_shard_bytes=max_shard_bytes
    )


def _one_line(exc_info, *needles):
    msg = str(exc_info.value)
    assert "\n" not in msg, msg
    for n in needles:
        assert str(n) in msg, msg
    return msg


# ----------------------------------------------------------------------------- writer/reader


def test_round_trip_single_file_bitwise(tmp_path, adapter):
    out = _save(adapter, tmp_path / "hf")
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors"]
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == adapter.hf_config("float32")
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text())["eos_token_id"] == 2
    ckpt = hfc.validate_hf_checkpoint(out, adapter)
    expected = adapter.to_hf(_ours())
    with ckpt.reader() as r:
        got = {k: r.read(k) for k in expected}
    for k, t in expected.items():
        assert torch.equal(got[k], t), k
    back = adapter.from_hf(got)
    for k, t in _ours().items():
        assert torch.equal(back[k], t), k


def test_sharding_index_and_size_cap(tmp_path, adapter):
    hf = adapter.to_hf(_ours())
    sizes = {k: t.numel() * 4 for k, t in hf.items()}
    cap = 300  # embed (512 B) is larger than the cap: a file of its own
    out = _save(adapter, tmp_path / "hf", max_shard_bytes=cap)
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
    ckpt = hfc.validate_hf_checkpoint(out, adapter)
    assert ckpt.files == files
    with ckpt.reader() as r:
        for k, t in hf.items():
            assert ckpt.tensors[k].file == index["weight_map"][k]
            assert torch.equal(r.read(k), t)


def test_plan_shards_packs_in_order():
    assert hfc.plan_shards([("a", 4), ("b", 4), ("c", 9), ("d", 1)], 8) == [["a", "b"], ["c"], ["d"]]
    assert hfc.plan_shards([("a", 4)], 1) == [["a"]]
    assert hfc.parse_size("5GB") == 5 * 10**9 and hfc.parse_size("2MiB") == 2 * 2**20 and hfc.parse_size("77") == 77
    with pytest.raises(ValueError, match="cannot read"):
        hfc.parse_size("five")


def test_export_dtype_and_keep_fp32(tmp_path, adapter):
    hf = adapter.to_hf(_ours())
    out = hfc.save_hf_checkpoint(
        str(tmp_path / "hf"),
        hf,
        adapter.hf_config("bfloat16"),
        dtype="bfloat16",
        keep_fp32=lambda k: k.startswith("model.experts.0."),
    )
    ckpt = hfc.open_hf_checkpoint(out)
    assert ckpt.tensors["model.embed_tokens.weight"].dtype == "BF16"
    assert ckpt.tensors["model.experts.0.gate_proj.weight"].dtype == "F32"
    with ckpt.reader() as r:
        assert torch.equal(r.read("model.embed_tokens.weight"), hf["model.embed_tokens.weight"].bfloat16())


def test_interrupted_save_leaves_no_complete_looking_folder(tmp_path, adapter, monkeypatch):
    final = tmp_path / "hf"
    real_write = hfc.HFFolderWriter.write_file
    calls = {"n": 0}

    def failing(self, name, tensors):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(28, "No space left on device")
        real_write(self, name, tensors)

    monkeypatch.setattr(hfc.HFFolderWriter, "write_file", failing)
    with pytest.raises(OSError, match="No space"):
        _save(adapter, final, max_shard_bytes=300)
    assert not final.exists() and not (tmp_path / "hf.tmp").exists()

    # a crash (no cleanup) leaves only <final>.tmp, which no reader takes for a checkpoint
    writer = hfc.HFFolderWriter(str(final))
    writer.start()
    real_write(writer, "model-00001-of-00002.safetensors", {"x": torch.zeros(2)})
    assert os.listdir(tmp_path) == ["hf.tmp"]
    with pytest.raises(CheckpointError) as e:
        hfc.open_hf_checkpoint(str(final))
    _one_line(e, str(final), "does not exist")

    # the next save replaces the stale .tmp; a failing re-save keeps the previous folder whole
    monkeypatch.setattr(hfc.HFFolderWriter, "write_file", real_write)
    _save(adapter, final)
    assert not (tmp_path / "hf.tmp").exists()
    calls["n"] = 0
    monkeypatch.setattr(hfc.HFFolderWriter, "write_file", failing)
    with pytest.raises(OSError):
        _save(adapter, final, max_shard_bytes=300)
    hfc.validate_hf_checkpoint(str(final), adapter)  # the old one, intact


# ----------------------------------------------------------------------------- bad input


def _bad(tmp_path, adapter, breaker, *needles):
    out = _save(adapter, tmp_path / "hf", max_shard_bytes=300)
    breaker(tmp_path / "hf")
    with pytest.raises(CheckpointError) as e:
        hfc.validate_hf_checkpoint(out, adapter, "tiny/flavor")
    return _one_line(e, *needles)


def test_missing_folder_and_not_a_folder(tmp_path, adapter):
    with pytest.raises(CheckpointError) as e:
        hfc.open_hf_checkpoint(str(tmp_path / "nope"))
    _one_line(e, tmp_path / "nope", "does not exist", "config.json and model.safetensors")
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError) as e:
        hfc.open_hf_checkpoint(str(tmp_path / "file"))
    _one_line(e, "is not a folder")


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root reads anything")
def test_unreadable_folder(tmp_path, adapter):
    out = _save(adapter, tmp_path / "hf")
    os.chmod(out, 0)
    try:
        with pytest.raises(CheckpointError) as e:
            hfc.open_hf_checkpoint(out)
        _one_line(e, out, "permission denied")
    finally:
        os.chmod(out, 0o755)


def test_config_missing_or_invalid(tmp_path, adapter):
    _bad(tmp_path, adapter, lambda p: (p / "config.json").unlink(), "config.json is missing", "copy the model's config")
    (tmp_path / "hf" / "config.json").write_text('{"hidden_size": 8,')
    with pytest.raises(CheckpointError) as e:
        hfc.open_hf_checkpoint(str(tmp_path / "hf"))
    _one_line(e, "config.json is not valid JSON", "line 1")


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


def _rewrite_header(path, edit):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :])


def test_wrong_shape_from_header(tmp_path, adapter):
    def reshape(p):
        index = json.loads((p / "model.safetensors.index.json").read_text())
        f = p / index["weight_map"]["model.q_proj.weight"]
        _rewrite_header(f, lambda h: h["model.q_proj.weight"].update(shape=[4, 16]))

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
        _rewrite_header(f, lambda h: h["model.q_proj.weight"].update(dtype="F8_E4M3"))

    _bad(tmp_path, adapter, fp8, "stored as F8_E4M3", "dequantize")


# ----------------------------------------------------------------------------- loading


def test_load_reads_only_the_local_block(tmp_path, adapter):
    out = _save(adapter, tmp_path / "hf", max_shard_bytes=300)
    ckpt = hfc.validate_hf_checkpoint(out, adapter)
    full = _ours()
    # rows 4..7 of q (head 1 of 2), expert 1 only, every other embedding row
    cases = [
        ("q.weight", [torch.arange(4, 8), torch.arange(8)], 32),
        ("experts.w1", [torch.tensor([1]), torch.arange(4), torch.arange(8)], 32),
        ("embed.weight", [torch.arange(0, 16, 2), torch.arange(2, 6)], 15 * 4),  # covering range rows 0..14
    ]
    for key, index, budget in cases:
        with ckpt.reader() as r:
            slices, picks = hfc._slices_of(index, full[key].shape)
            block = adapter.from_hf_local(key, slices, r.read)
            for dim, pick in enumerate(picks):
                if pick is not None:
                    block = block.index_select(dim, pick)
            assert torch.equal(block, full[key][torch.meshgrid(*index, indexing="ij")]), key
            assert r.elements_read <= budget, (key, r.elements_read)


def test_load_into_plain_model_keeps_uncovered_buffers(tmp_path, adapter):
    out = _save(adapter, tmp_path / "hf")
    model = TinyModel(TinyArgs())
    stats = hfc.load_hf_into_model([model], out, "tiny", TinyArgs())
    for k, t in _ours().items():
        assert torch.equal(model.state_dict()[k], t), k
    assert stats.kept == ["table"] and torch.equal(model.table, torch.arange(5.0))
    assert stats.elements_read == stats.local_elements == sum(t.numel() for t in _ours().values())


def test_load_converts_dtype(tmp_path, adapter):
    out = _save(adapter, tmp_path / "hf", dtype="bfloat16")
    model = TinyModel(TinyArgs()).double()
    hfc.load_hf_into_model([model], out, "tiny", TinyArgs())
    assert model.q.weight.dtype == torch.float64
    assert torch.equal(model.q.weight, _ours()["q.weight"].bfloat16().double())


def test_uncovered_parameter_is_an_error(tmp_path, adapter):
    out = _save(adapter, tmp_path / "hf")
    model = TinyModel(TinyArgs())
    model.extra = nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match="parameter extra.weight .* no source"):
        hfc.load_hf_into_model([model], out, "tiny", TinyArgs())


# ----------------------------------------------------------------------------- DTensor shards


def test_local_index_matches_dtensor_shards():
    """For every rank of a 2x2 mesh (fake backend), the positions local_index names are
    exactly the local shard torch holds, for Shard, Replicate, uneven sizes and FSDP-over-TP's
    _StridedShard."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    cases = [
        ((8, 6), (_StridedShard(0, split_factor=2), Shard(0))),
        ((10, 4), (_StridedShard(0, split_factor=2), Shard(0))),
        ((7, 5), (Shard(0), Shard(1))),
        ((5, 3), (Shard(0), Shard(0))),
        ((9, 4), (Replicate(), Shard(0))),
        ((3, 4, 6), (Shard(0), Shard(2))),
    ]
    try:
        for rank in range(4):
            if dist.is_initialized():
                dist.destroy_process_group()
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=4)
            mesh = init_device_mesh("cpu", (2, 2))
            for shape, placements in cases:
                full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
                dt = distribute_tensor(full, mesh, placements, src_data_rank=None)
                local, index = hfc.local_index(dt)
                assert tuple(len(i) for i in index) == tuple(local.shape)
                if local.numel():
                    assert torch.equal(full[torch.meshgrid(*index, indexing="ij")], local), (rank, placements)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
