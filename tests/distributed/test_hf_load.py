"""Loading a Hugging Face folder straight into a parallel layout (gloo, CPU, fp32).

The test process builds small random ``transformers`` models (configs written here, matching
small overrides of our debug flavors), computes their logits on fixed tokens and saves them with
a small ``max_shard_size`` (several shards + index). Each rank then builds the model for its
layout, initializes it randomly, and loads the folder with ``load_hf_into_model`` (reading only
its shards). Rank 0 also imports the folder into the unsharded model on one process. Checked:

* every parameter's ``full_tensor()`` equals the single-process import bit for bit (so every
  shard landed in the right place, whatever the placements: FSDP, FSDP over TP
  (``_StridedShard``), EP + FSDP of experts, pipeline stages);
* the layout's logits equal the single-process import's and transformers' (rtol 1e-5);
* each rank read exactly as many elements as its local shards hold.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.hf_models import deepseek_v3_config, hf_model, llama_config
from tools.forkserver import run_distributed

SEQ = 16
VOCAB = 512
RTOL, ATOL = 1e-5, 1e-5

LLAMA = dict(n_layers=2, vocab_size=VOCAB, max_seq_len=64)
DEEPSEEK = dict(n_layers=3, vocab_size=VOCAB, max_seq_len=64)


def _hf_model(name: str):
    """transformers' model of ``name`` at the debug flavor with the LLAMA / DEEPSEEK overrides."""
    if name == "llama3":
        return hf_model(llama_config(vocab_size=VOCAB, num_hidden_layers=LLAMA["n_layers"]))
    return hf_model(deepseek_v3_config(vocab_size=VOCAB, num_hidden_layers=DEEPSEEK["n_layers"]))


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory):
    out = {}
    for name in ("llama3", "deepseek_v3"):
        folder = tmp_path_factory.mktemp(f"hf_{name}")
        model = _hf_model(name)
        with torch.no_grad():
            logits = model(input_ids=_tokens(), use_cache=False).logits.float()
        model.save_pretrained(folder, max_shard_size="1MB")
        n_shards = len([f for f in folder.iterdir() if f.name.endswith(".safetensors")])
        assert n_shards >= 3 and (folder / "model.safetensors.index.json").exists()
        out[name] = (str(folder), logits)
    return out


def _overrides(name: str) -> dict:
    return LLAMA if name == "llama3" else DEEPSEEK


def _reference(name: str, folder: str):
    from models.registry import build_model
    from trainer.checkpoint.hf_load import load_hf_into_model

    model = build_model(name, "debugmodel", device="cpu", **_overrides(name))
    model.init_weights(999)
    load_hf_into_model([model], folder, name, model.args)
    return model


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _run(rank, world_size, name, folder, degrees):
    from models.parallel.pipeline import plan_stages, split_model
    from models.parallelize import ParallelizeOptions, parallelize_model
    from models.registry import build_model
    from parallel_dims import ParallelDims
    from trainer.checkpoint.hf_load import load_hf_into_model

    torch.manual_seed(0)
    pd = ParallelDims(world_size=world_size, **degrees)
    pd.build_mesh("cpu")
    opts = ParallelizeOptions(loss_parallel=False)
    model = build_model(name, "debugmodel", device="meta", **_overrides(name))
    args = model.args
    parts = list(split_model(model, plan_stages(args.n_layers, pd.pp), pd).modules) if pd.pp > 1 else [model]
    for part in parts:
        parallelize_model(part, pd, opts)
        part.to_empty(device="cpu")
        with torch.no_grad():
            part.init_weights(1000 + rank)  # different on every rank: the load must overwrite all of it
    stats = load_hf_into_model(parts, folder, name, args)

    ref = _reference(name, folder)  # every rank checks what it holds against the 1-process import
    mismatched = []
    owned = []
    for part in parts:
        for key, t in part.state_dict().items():
            full = _full(t)  # collective over the tensor's mesh
            owned.append(key)
            if not torch.equal(full, ref.state_dict()[key]):
                mismatched.append(key)
    result = {
        "owned": owned,
        "mismatched": mismatched,
        "read": stats.elements_read,
        "local": stats.local_elements,
        "kept": stats.kept,
    }
    if pd.pp == 1:
        with torch.no_grad():
            logits = _full(model(_tokens()))
        if rank == 0:
            with torch.no_grad():
                # numpy: a tensor would travel by shared memory, which outlives no exiting rank
                result["ref_logits"] = ref(_tokens()).numpy()
            result["logits"] = logits.numpy()
    return result


@pytest.mark.parametrize(
    "name, degrees",
    [
        ("llama3", dict(dp_shard=2, tp=2)),  # FSDP over TP: _StridedShard
        ("deepseek_v3", dict(dp_shard=4, ep=2)),  # experts: efsdp=2 x ep=2; dense: fsdp=4
        ("llama3", dict(dp_shard=2, pp=2)),  # stages hold only their layers
    ],
    ids=["llama3-fsdp2-tp2", "deepseek_v3-fsdp-ep2", "llama3-pp2-fsdp2"],
)
def test_hf_import_into_layout(hf_folders, name, degrees):
    folder, hf_logits = hf_folders[name]
    results = run_distributed(_run, 4, name, folder, degrees, timeout=300)
    r0 = results[0]
    for rank, r in enumerate(results):
        assert r["mismatched"] == [], (rank, r["mismatched"][:5])
    if degrees.get("pp", 1) > 1:
        # the stages of pp ranks 0 and 1 (ranks 0 and 2) cover every tensor exactly once
        from models.registry import build_model

        all_keys = set(build_model(name, "debugmodel", **_overrides(name)).state_dict())
        stage0, stage1 = set(results[0]["owned"]), set(results[2]["owned"])
        assert stage0 | stage1 == all_keys and not stage0 & stage1
        assert stage0 and stage1
    else:
        logits = torch.from_numpy(r0["logits"])
        torch.testing.assert_close(logits, torch.from_numpy(r0["ref_logits"]), rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(logits, hf_logits, rtol=RTOL, atol=ATOL)
        assert hf_logits.abs().max() > 0.1
    for rank, r in enumerate(results):
        assert r["read"] == r["local"] > 0, (rank, r["read"], r["local"])
        assert r["kept"] == []


def _export(rank, world_size, name, dcp_dir, out_dir):
    from trainer.checkpoint.hf_write import export_dcp_to_hf

    args = _reference_args(name)
    export_dcp_to_hf(dcp_dir, out_dir, name, args, dtype="float32", max_shard_bytes=500_000)
    return sorted(os.listdir(out_dir))


def _reference_args(name: str):
    from models.registry import build_model

    return build_model(name, "debugmodel", **_overrides(name)).args


@pytest.mark.parametrize("name", ["llama3", "deepseek_v3"])
def test_hf_to_dcp_to_hf_bitwise_with_ranks_writing_shards(hf_folders, tmp_path, name):
    """HF -> our DCP (convert_hf_to_dcp) -> HF written by 4 ranks (shard i by rank i % 4):
    the same keys, each tensor bit for bit (fp32; DeepSeek's expert bias included)."""
    from trainer.checkpoint.convert import convert_hf_to_dcp
    from trainer.checkpoint.hf_reader import open_hf_checkpoint

    folder, _ = hf_folders[name]
    dcp_dir, out = str(tmp_path / "dcp"), str(tmp_path / "hf")
    convert_hf_to_dcp(folder, dcp_dir, name, _reference_args(name))
    files = run_distributed(_export, 4, name, dcp_dir, out, timeout=300)[0]
    assert len([f for f in files if f.endswith(".safetensors")]) > 4 and "model.safetensors.index.json" in files
    src, dst = open_hf_checkpoint(folder), open_hf_checkpoint(out)
    assert set(src.tensors) == set(dst.tensors)
    with src.reader() as a, dst.reader() as b:
        for key in src.tensors:
            assert torch.equal(a.read(key), b.read(key)), key
