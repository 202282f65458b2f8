"""A Hugging Face folder straight from the live, sharded model (``checkpoint.last_save_in_hf``
without a temporary DCP checkpoint): :func:`export_model_to_hf`.

It writes the folder :func:`~trainer.checkpoint.hf_write.export_dcp_to_hf` writes from a DCP
checkpoint of the same weights, file for file: both build the same
:class:`~trainer.checkpoint.hf_write.HFExportPlan` (shapes -> Hugging Face keys -> shard files,
file ``i`` written by rank ``i % world``), convert each layer group with the same ``to_hf`` and
write through the same :class:`~trainer.checkpoint.hf_write.HFFolderWriter` (``<out>.tmp``,
then published). Only the source of a group's full tensors differs: here
:class:`~trainer.checkpoint.live.LiveModel` gathers them from the shards (``full_tensor()`` on
the ranks that hold them) and sends them to the file's writer, which may sit on another
pipeline stage.

Why not torch's ``HuggingFaceStorageWriter`` (``dcp.save(..., storage_writer=...)``, as
torchtitan's ``dcp_save(to_hf=True)`` does): it saves what DCP's planner gives it, each rank's
local shards, into per-rank safetensors files and then consolidates them
(``enable_consolidation``) -- the second pass through the disk this module removes. It also
writes the state dict after ``to_hf`` on the *sharded* tensors, while our adapters permute q/k
rows (llama3) and split stacked expert weights per expert (deepseek) on full tensors; its shard
plan is ``fqn_to_index_mapping``'s, and our ``keep_in_fp32`` dtypes and config /
generation_config files would still be ours to write. Sharing the offline converter's plan and
writer makes the two folders equal by construction.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn as nn
from torch import Tensor

from models import registry
from trainer.checkpoint.hf_extras import ModelRecord
from trainer.checkpoint.hf_format import DEFAULT_MAX_SHARD_BYTES
from trainer.checkpoint.hf_write import HFFolderWriter, plan_hf_export, write_hf_folder
from trainer.checkpoint.live import LiveModel

__all__ = ["export_model_to_hf"]


def export_model_to_hf(
    model_parts: Sequence[nn.Module],
    out_dir: str,
    model_name: str,
    model_args,
    *,
    dtype: str | torch.dtype = "bfloat16",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    progress: Callable[[str], None] | None = None,
    process_group=None,
    extra_keys: Callable[[Sequence[str], Sequence[str]], list[str]] | None = None,
    transform: Callable[[dict[str, Tensor]], dict[str, Tensor]] | None = None,
    record: ModelRecord | None = None,
) -> str:
    """Write the weights of ``model_parts`` (this rank's stages of the model built from
    ``model_args``) as a Hugging Face folder ``out_dir``; returns its absolute path.

    Collective when torch.distributed is initialized: every rank of ``process_group`` calls
    it. Shard file ``i`` is written by rank ``i % world``; for each file, in order, every rank
    takes part in gathering the layer groups its writer does not hold yet (the writer keeps
    those its previous file also needs, like the DCP converter). A rank holds at most one
    file's layer groups (ours and Hugging Face's) plus that file's tensors, and one full tensor
    while gathering for another rank.

    ``extra_keys(group_keys, all_keys)``: more of the model's keys to fetch with a layer group
    (e.g. its LoRA adapters), and ``transform`` turns the fetched group into the adapter's keys
    before ``to_hf`` (e.g. merges them: trainer/checkpoint/lora_export.py). ``record``: the
    run's source folder and tokenizer, for config.json's carried fields, generation_config.json
    and the tokenizer files (trainer/checkpoint/hf_extras.py)."""
    say = progress or (lambda _m: None)
    adapter = registry.get_hf_adapter(model_name, model_args)
    live = LiveModel(model_parts, process_group)
    ours = adapter.our_keys()
    missing = [k for k in ours if k not in live.meta]
    wrong = [k for k in ours if k in live.meta and tuple(live.meta[k][0]) != tuple(ours[k])]
    if missing or wrong:
        raise ValueError(
            f"the model parts do not match {model_name} with these args: missing {missing[:3]}, "
            f"wrong shapes {wrong[:3]}"
        )
    plan = plan_hf_export(adapter, {k: live.meta[k] for k in ours}, dtype, max_shard_bytes, record)
    names = plan.names

    def write_shards(writer: HFFolderWriter) -> None:
        cached: list[set[str]] = [set() for _ in range(live.world)]  # each writer's groups, known to all
        cache: dict[str, dict[str, Tensor]] = {}  # this rank's: group -> its Hugging Face tensors
        for i in range(len(plan.files)):
            w = i % live.world
            needed = plan.file_groups(i)
            cached[w] &= set(needed)
            if w == live.rank:
                for g in list(cache):
                    if g not in needed:
                        del cache[g]
            for g in needed:
                if g in cached[w]:
                    continue
                keys = plan.group_keys[g]
                state = live.fetch(keys + (extra_keys(keys, live.order) if extra_keys else []), w)
                if w == live.rank:
                    cache[g] = plan.to_hf(transform(state) if transform else state)
                del state
                cached[w].add(g)
            if w == live.rank:
                writer.write_file(names[i], plan.file_tensors(i, cache))
                say(f"wrote {names[i]} ({len(plan.files[i])} tensors) [{i + 1}/{len(plan.files)}]")
        cache.clear()

    return write_hf_folder(plan, out_dir, write_shards, process_group)
