"""Hugging Face folders for the tests of trainer/checkpoint/hf_*.py, without ``transformers``: a
tiny adapter (one Plain, one RopeRows, one Stacked entry) and its model, a writer of an
in-memory Hugging Face state dict built from the export's own pieces (shard planning, the
folder writer), and a safetensors header editor to break files with."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from models.common.hf_adapter import ConfigField, HFStateDictAdapter, Plain, RopeRows, Stacked
from trainer.checkpoint.hf_format import DEFAULT_MAX_SHARD_BYTES
from trainer.checkpoint.hf_write import HFFolderWriter, plan_shards, prepare_tensor, shard_names, stored_dtype
from trainer.checkpoint.state import export_dtype


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


def tiny_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """TinyModel's weights (our keys), random but reproducible."""
    g = torch.Generator().manual_seed(seed)
    a = TinyArgs()
    return {
        "embed.weight": torch.randn(16, a.dim, generator=g),
        "q.weight": torch.randn(a.dim, a.dim, generator=g),
        "experts.w1": torch.randn(a.experts, 4, a.dim, generator=g),
    }


def save_hf_checkpoint(
    out_dir: str,
    hf_state_dict: Mapping[str, Tensor],
    config: Mapping[str, Any],
    *,
    dtype: str | torch.dtype = "float32",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    keep_fp32: Callable[[str], bool] | None = None,
) -> str:
    """Single process: write an in-memory Hugging Face state dict (already in HF keys and
    layouts) as a folder; ``config`` is written as config.json as given."""
    target = export_dtype(dtype)
    keep = keep_fp32 or (lambda _k: False)
    dtypes = {k: stored_dtype(t, target, keep(k)) for k, t in hf_state_dict.items()}
    sizes = [(k, t.numel() * dtypes[k].itemsize) for k, t in hf_state_dict.items()]
    files = plan_shards(sizes, max_shard_bytes)
    writer = HFFolderWriter(out_dir)
    writer.start()
    try:
        for name, keys in zip(shard_names(len(files)), files):
            writer.write_file(name, {k: prepare_tensor(hf_state_dict[k], dtypes[k]) for k in keys})
        return writer.commit(config, files, sum(n for _, n in sizes))
    except BaseException:
        writer.abort()
        raise


def save_tiny(adapter, folder, max_shard_bytes=DEFAULT_MAX_SHARD_BYTES, dtype="float32") -> str:
    """``tiny_state()`` written as a Hugging Face folder by ``adapter``."""
    return save_hf_checkpoint(
        str(folder), adapter.to_hf(tiny_state()), adapter.hf_config(dtype), dtype=dtype, max_shard_bytes=max_shard_bytes
    )


def one_line(exc_info, *needles) -> str:
    """The raised message: one line holding every needle."""
    msg = str(exc_info.value)
    assert "\n" not in msg, msg
    for n in needles:
        assert str(n) in msg, msg
    return msg


def rewrite_header(path, edit) -> None:
    """Apply ``edit`` to the JSON header of the safetensors file ``path`` (a pathlib.Path) in place."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :])
