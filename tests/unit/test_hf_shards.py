"""Loading Hugging Face weights into model parts (trainer/checkpoint/hf_load.py) with the tiny
adapter of tests/hf_folders.py: which elements a shard reads, buffers without a source, dtype
conversion, and which part of the full tensor a DTensor shard is (every placement kind, uneven
sizes, on the fake backend)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from models import registry
from tests.hf_folders import TinyAdapter, TinyArgs, TinyModel, save_tiny, tiny_state
from trainer.checkpoint.hf_load import _slices_of, load_hf_into_model, local_index
from trainer.checkpoint.hf_reader import validate_hf_checkpoint


@pytest.fixture
def adapter(monkeypatch):
    """The tiny adapter, also for every model name the loader asks the registry for."""
    ad = TinyAdapter(TinyArgs())
    monkeypatch.setattr(registry, "get_hf_adapter", lambda name, args: TinyAdapter(args))
    return ad


# ----------------------------------------------------------------------------- loading


def test_load_reads_only_the_local_block(tmp_path, adapter):
    out = save_tiny(adapter, tmp_path / "hf", max_shard_bytes=300)
    ckpt = validate_hf_checkpoint(out, adapter)
    full = tiny_state()
    # rows 4..7 of q (head 1 of 2), expert 1 only, every other embedding row
    cases = [
        ("q.weight", [torch.arange(4, 8), torch.arange(8)], 32),
        ("experts.w1", [torch.tensor([1]), torch.arange(4), torch.arange(8)], 32),
        ("embed.weight", [torch.arange(0, 16, 2), torch.arange(2, 6)], 15 * 4),  # covering range rows 0..14
    ]
    for key, index, budget in cases:
        with ckpt.reader() as r:
            slices, picks = _slices_of(index, full[key].shape)
            block = adapter.from_hf_local(key, slices, r.read)
            for dim, pick in enumerate(picks):
                if pick is not None:
                    block = block.index_select(dim, pick)
            assert torch.equal(block, full[key][torch.meshgrid(*index, indexing="ij")]), key
            assert r.elements_read <= budget, (key, r.elements_read)


def test_load_into_plain_model_keeps_uncovered_buffers(tmp_path, adapter):
    out = save_tiny(adapter, tmp_path / "hf")
    model = TinyModel(TinyArgs())
    stats = load_hf_into_model([model], out, "tiny", TinyArgs())
    for k, t in tiny_state().items():
        assert torch.equal(model.state_dict()[k], t), k
    assert stats.kept == ["table"] and torch.equal(model.table, torch.arange(5.0))
    assert stats.elements_read == stats.local_elements == sum(t.numel() for t in tiny_state().values())


def test_load_converts_dtype(tmp_path, adapter):
    out = save_tiny(adapter, tmp_path / "hf", dtype="bfloat16")
    model = TinyModel(TinyArgs()).double()
    load_hf_into_model([model], out, "tiny", TinyArgs())
    assert model.q.weight.dtype == torch.float64
    assert torch.equal(model.q.weight, tiny_state()["q.weight"].bfloat16().double())


def test_uncovered_parameter_is_an_error(tmp_path, adapter):
    out = save_tiny(adapter, tmp_path / "hf")
    model = TinyModel(TinyArgs())
    model.extra = nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match="parameter extra.weight .* no source"):
        load_hf_into_model([model], out, "tiny", TinyArgs())


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
                local, index = local_index(dt)
                assert tuple(len(i) for i in index) == tuple(local.shape)
                if local.numel():
                    assert torch.equal(full[torch.meshgrid(*index, indexing="ij")], local), (rank, placements)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
