"""A LoRA run's exports from its step checkpoints, offline (``scripts/convert_hf.py lora-peft`` /
``lora-merge``): the step holds the adapters, the LoRA options and the base's identity
(trainer/checkpoint/lora_base.py); the merge reads the base from its folder (a Hugging Face or
a DCP folder, its fingerprint checked against the one the adapters were trained on).

One process. ``lora-peft`` holds the adapters only; ``lora-merge`` holds the whole base in
memory (float32 as stored) while it merges and writes, unlike ``to-hf``'s one layer at a time.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor

from models import registry
from models.parallel.lora import LoRAOptions, is_adapter_key
from trainer.checkpoint.errors import CheckpointError
from trainer.checkpoint.hf_extras import ModelRecord, peft_base_name
from trainer.checkpoint.hf_write import HFFolderWriter, _dcp_read, dcp_model_meta, plan_hf_export, write_hf_folder
from trainer.checkpoint.lora_base import fingerprint_folder
from trainer.checkpoint.lora_export import (
    hf_weight_modules,
    merge_adapters,
    peft_config,
    peft_tensors,
    write_peft_folder,
)
from trainer.checkpoint.state import checkpoint_keys, export_dtype, from_blob, run_dcp

__all__ = ["merged_from_step", "peft_from_step", "read_lora_step", "read_step_record"]


def read_lora_step(step_dir: str) -> tuple[dict[str, Tensor], dict]:
    """(full adapter tensors, the step's extra dict with ``lora`` and ``lora_base``)."""
    meta = dcp_model_meta(step_dir)
    keys = [k for k in meta if is_adapter_key(k)]
    if not keys:
        raise CheckpointError(
            f"{step_dir} holds no LoRA adapters: it is not a step checkpoint of a model.converters = ['lora'] run"
        )
    state = {"model": {k: torch.empty(meta[k][0], dtype=meta[k][1]) for k in keys}, "train_state": b""}
    run_dcp(dcp.load, state, checkpoint_id=step_dir)
    extra = dict(from_blob(state["train_state"]).get("extra") or {})
    if "lora" not in extra or "lora_base" not in extra:
        raise CheckpointError(f"{step_dir} holds adapters but no LoRA options or base identity (saved by an older run)")
    return state["model"], extra


def read_step_record(step_dir: str) -> ModelRecord | None:
    """The :class:`ModelRecord` a run stored in its step checkpoint (the model, its args, the
    source folder's config files, the tokenizer path), or None (a checkpoint without one: written
    by an older run, or a ``convert_hf.py to-dcp`` folder)."""
    dcp_model_meta(step_dir)  # a missing or incomplete folder: one line
    if not any(k == "train_state" or k.startswith("train_state.") for k in checkpoint_keys(step_dir)):
        return None
    state = {"train_state": b""}
    run_dcp(dcp.load, state, checkpoint_id=step_dir)
    record = (from_blob(state["train_state"]).get("extra") or {}).get("model")
    return ModelRecord.from_dict(record) if isinstance(record, dict) else None


def _options(extra: dict) -> LoRAOptions:
    lo = dict(extra["lora"])
    lo["target_modules"] = tuple(lo["target_modules"])
    return LoRAOptions(**lo)


def peft_from_step(
    step_dir: str, out_dir: str, model_name: str, args, dtype: str = "float32", record: ModelRecord | None = None
) -> str:
    """The PEFT folder of a step's adapters (``record``: the tokenizer files and the base's
    portable name; trainer/checkpoint/hf_extras.py)."""
    adapters, extra = read_lora_step(step_dir)
    hf_adapter = registry.get_hf_adapter(model_name, args)
    tensors = peft_tensors(adapters, hf_adapter)
    modules = sorted({k[len("base_model.model.") : -len(".lora_A.weight")] for k in tensors if "lora_A" in k})
    base = peft_base_name(record, extra["lora_base"]["path"])
    config = peft_config(_options(extra), modules, base, hf_weight_modules(hf_adapter))
    return write_peft_folder(out_dir, tensors, config, export_dtype(dtype), record)


def base_of(step_dir: str, base: str | None) -> str:
    """The base folder to merge into: ``base`` or the one the step records, checked against the
    recorded fingerprint."""
    _, extra = read_lora_step(step_dir)
    recorded = extra["lora_base"]
    path = base or recorded["path"]
    if not path:
        raise CheckpointError(
            f"{step_dir}: its base is the run's seeded init (no checkpoint.initial_load_path), which has no folder: "
            "export the merged model from the run (checkpoint.last_save_in_hf)"
        )
    if not os.path.isdir(path):
        raise CheckpointError(f"the base folder {path} does not exist: pass --base with the folder the run trained on")
    if fingerprint_folder(path) != recorded["fingerprint"]:
        raise CheckpointError(
            f"{path} is not the base the adapters of {step_dir} were trained on (fingerprint "
            f"{fingerprint_folder(path)[:12]}, recorded {recorded['fingerprint'][:12]} for {recorded['path'] or 'the seeded init'})"
            ": pass --base with that folder"
        )
    return path


def _read_base(path: str, adapter) -> dict[str, Tensor]:
    if os.path.isfile(os.path.join(path, "config.json")):
        from safetensors.torch import load_file

        hf = {}
        for name in sorted(os.listdir(path)):
            if name.endswith(".safetensors"):
                hf.update(load_file(os.path.join(path, name)))
        return adapter.from_hf(hf)
    meta = dcp_model_meta(path)
    keys = [k for k in adapter.our_keys() if k in meta]
    return _dcp_read(path, keys, meta)


def merged_from_step(
    step_dir: str,
    out_dir: str,
    model_name: str,
    args,
    *,
    base: str | None = None,
    dtype: str = "bfloat16",
    max_shard_bytes: int,
    progress: Callable[[str], None] | None = None,
    record: ModelRecord | None = None,
) -> str:
    say = progress or (lambda _m: None)
    path = base_of(step_dir, base)
    adapters, extra = read_lora_step(step_dir)
    adapter = registry.get_hf_adapter(model_name, args)
    say(f"reading the base {path}")
    merged = merge_adapters({**_read_base(path, adapter), **adapters}, _options(extra).scale)
    meta = {k: (tuple(v.shape), v.dtype) for k, v in merged.items()}
    plan = plan_hf_export(adapter, meta, dtype, max_shard_bytes, record)

    def write_all(writer: HFFolderWriter) -> None:
        cache = {g: plan.to_hf({k: merged[k] for k in keys}) for g, keys in plan.group_keys.items()}
        for i, name in enumerate(plan.names):
            writer.write_file(name, plan.file_tensors(i, cache))
            say(f"wrote {name} [{i + 1}/{len(plan.files)}]")

    return write_hf_folder(plan, out_dir, write_all)
