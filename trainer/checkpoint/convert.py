"""Offline conversion of a Hugging Face folder into a DCP folder (``scripts/convert_hf.py
to-dcp``) that ``checkpoint.initial_load_path`` accepts. The other direction, DCP -> Hugging
Face, is :func:`trainer.checkpoint.hf_write.export_dcp_to_hf`."""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Callable

import torch

from models import registry
from models.parallel.pipeline.tied import HEAD_KEY
from trainer.checkpoint.folders import publish_folder
from trainer.checkpoint.hf_reader import validate_hf_checkpoint
from trainer.checkpoint.hf_write import layer_groups
from trainer.runtime.cli_errors import unwrap_dcp

__all__ = ["convert_hf_to_dcp"]


def convert_hf_to_dcp(
    hf_dir: str,
    out_dir: str,
    model_name: str,
    args,
    *,
    context: str = "",
    progress: Callable[[str], None] | None = None,
) -> str:
    """Single process: a Hugging Face folder -> a DCP folder (``.metadata`` + one file per
    tensor, ``model.<fqn>`` keys, the model's parameter dtypes) that
    ``checkpoint.initial_load_path`` accepts. Everything is checked before anything is written;
    tensors are converted one at a time while DCP writes them (a lazy save planner), so about
    one tensor is in memory, never the model."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from models.registry import get_model_spec, model_names

    say = progress or (lambda _m: None)
    if model_name not in model_names():
        raise ValueError(f"unknown model {model_name!r}; valid: {', '.join(model_names())}")
    adapter = registry.get_hf_adapter(model_name, args)
    ckpt = validate_hf_checkpoint(hf_dir, adapter, context)
    say(f"checked {hf_dir}: config.json fits, {len(ckpt.tensors)} tensors in {len(ckpt.files)} file(s)")
    with torch.device("meta"):
        model = get_model_spec(model_name, _first_flavor(model_name)).model_cls(args)
    state = model.state_dict()
    if getattr(args, "tie_word_embeddings", False):
        state.pop(HEAD_KEY)  # a step checkpoint holds the tied weight once (pipeline/tied.py)
    covered = adapter.our_keys()
    uncovered = [k for k in state if k not in covered]
    if uncovered:
        raise RuntimeError(
            f"{type(adapter).__name__} has no source for {uncovered[:5]}: cannot write a full checkpoint"
        )
    placeholders = {k: torch.empty(t.shape, dtype=t.dtype, device="meta") for k, t in state.items()}
    out_dir = os.path.abspath(out_dir)
    tmp = out_dir + ".tmp"
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    reader = ckpt.reader()
    groups = layer_groups(state)
    position = {k: gi for gi, (_, keys) in enumerate(groups) for k in keys}
    seen: set[int] = set()

    class _LazyPlanner(DefaultSavePlanner):
        def resolve_data(self, write_item):
            key = write_item.index.fqn[len("model.") :]
            gi = position[key]
            if gi not in seen:
                seen.add(gi)
                say(f"converting {groups[gi][0]} ({len(groups[gi][1])} tensors) [{len(seen)}/{len(groups)}]")
            ref = placeholders[key]
            full = tuple(slice(0, n) for n in ref.shape)
            return adapter.from_hf_local(key, full, reader.read).to(ref.dtype).contiguous()

    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(
                {"model": placeholders},
                storage_writer=FileSystemWriter(tmp, single_file_per_rank=False, thread_count=1),
                planner=_LazyPlanner(),
                no_dist=True,
            )
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        # dcp.save reports what failed while it planned or wrote (here: reading the Hugging Face
        # tensors in resolve_data, e.g. a CheckpointError for a corrupt safetensors file) as a
        # CheckpointException, a BaseException wrapping it: raise what actually failed
        inner = unwrap_dcp(exc)
        if inner is exc:
            raise
        raise inner from None
    finally:
        reader.close()
    return publish_folder(tmp, out_dir)


def _first_flavor(model_name: str) -> str:
    from models.registry import flavor_names

    return flavor_names(model_name)[0]
