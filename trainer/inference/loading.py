"""A model for inference built the trainer's way and loaded from a checkpoint.

:func:`build_from_checkpoint` is what ``InferenceSession.from_checkpoint`` runs on every rank:
the trainer's start-up checks (``trainer/startup.py``: tokenizer, job plan, the Hugging Face
folder's config and tensor shapes), the meshes of the config's ``[parallelism]``, the model
parallelized and materialized by the trainer's own ``build_model_parts``, then the weights
loaded by the trainer's checkpoint manager (``CheckpointManager.resume``) pointed at the
folder:

* a DCP step folder (``checkpoint/step-N``, or the ``checkpoint`` folder itself: its newest
  step) restores the model only (no optimizer, schedule, data position or RNG); every stored
  tensor's shape is checked against the model first, so a checkpoint of another model is one
  line. A LoRA run's step folder holds its adapters: the base comes from the config's
  ``checkpoint.initial_load_path``, as when the run resumed (the manager checks the base's
  fingerprint against the one the adapters were trained on);
* a Hugging Face folder (``config.json`` + safetensors) loads through
  ``trainer/checkpoint/hf_load.py`` (the shapes checked from the headers before the build).

Built for inference: activation checkpointing, compile and activation offload are off (they only
serve a backward); pipeline and context parallelism are refused (one line, exit code 2):
generation runs the whole model on each rank, tokens one at a time.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re

import torch
import torch.distributed as dist

from models.parallel.lora import is_adapter_key
from trainer.build import build_model_parts
from trainer.checkpoint.dcp import EXCLUDABLE
from trainer.checkpoint.errors import CheckpointError
from trainer.checkpoint.manager import CheckpointManager
from trainer.checkpoint.state import checkpoint_state_dict
from trainer.config import ConfigError, JobConfig
from trainer.runtime.distributed_init import init_distributed
from trainer.startup import plan_startup

__all__ = ["Built", "build_from_checkpoint", "eos_ids_of", "preflight", "refuse_layout"]

_STEP = re.compile(r"^step-(\d+)$")


@dataclasses.dataclass
class Built:
    """What :func:`build_from_checkpoint` returns: the config it built from (its checkpoint
    section pointed at the folder), the job plan, the model parts, tokenizer and device, and
    the folders whose generation_config.json / config.json name end-of-sequence ids."""

    cfg: JobConfig
    plan: object
    model_parts: list
    tokenizer: object
    device: torch.device
    eos_folders: list[str]


def refuse_layout(pd) -> None:
    """Pipeline and context parallelism do not generate: one line with the fix."""
    if pd.pp > 1:
        raise ConfigError(
            f"generation does not run on pipeline stages (parallelism.pp = {pd.pp}): it runs the whole model on "
            "each rank; use --parallelism.pp 1 (with tp and/or data_parallel_shard_degree for the ranks)"
        )
    if pd.cp > 1:
        raise ConfigError(
            f"generation does not run under context parallelism (parallelism.cp = {pd.cp}): a KV cache grows one "
            "token at a time; use --parallelism.cp 1 (with tp and/or data_parallel_shard_degree for the ranks)"
        )


def _kind(path: str) -> tuple[str, str, int]:
    """("hf" | "dcp", folder, step) of the checkpoint at ``path``; a CheckpointError naming
    what is wrong otherwise."""
    if not os.path.exists(path):
        raise CheckpointError(
            f"--checkpoint {path} does not exist; point it at a step-N folder or a Hugging Face folder"
        )
    if not os.path.isdir(path):
        raise CheckpointError(f"--checkpoint {path} is a file; point it at a step-N folder or a Hugging Face folder")
    if os.path.isfile(os.path.join(path, "config.json")):
        return "hf", path, -1
    name = os.path.basename(os.path.normpath(path))
    match = _STEP.match(name)
    if match and os.path.isfile(os.path.join(path, ".metadata")):
        return "dcp", os.path.dirname(os.path.abspath(path)), int(match.group(1))
    steps = sorted(
        int(m.group(1))
        for entry in os.listdir(path)
        if (m := _STEP.match(entry)) and os.path.isfile(os.path.join(path, entry, ".metadata"))
    )
    if steps:
        return "dcp", os.path.abspath(path), steps[-1]
    raise CheckpointError(
        f"--checkpoint {path} is neither a complete step-N checkpoint (with a .metadata file), a checkpoint folder "
        "holding one, nor a Hugging Face folder (config.json + safetensors)"
    )


def _point_at(cfg: JobConfig, kind: str, folder: str, step: int) -> JobConfig:
    """A copy of ``cfg`` whose checkpoint section restores the model from ``folder`` only."""
    cfg = copy.deepcopy(cfg)
    c = cfg.checkpoint
    c.async_mode = "disabled"
    c.create_seed_checkpoint = False
    lora = "lora" in cfg.model.converters
    if kind == "hf":
        if lora:
            raise ConfigError(
                f"--checkpoint {folder} is a Hugging Face folder but the config trains LoRA adapters "
                "(model.converters = ['lora']): point --checkpoint at the run's step-N folder (the adapters), or "
                "drop the converter to sample the folder's own weights"
            )
        c.enable, c.initial_load_path, c.initial_load_in_hf = False, folder, True
    else:
        c.enable, c.folder, c.load_step = True, folder, step
        c.exclude_from_loading = list(EXCLUDABLE)
        if not lora:
            c.initial_load_path = ""
    return cfg


def _check_shapes(path: str, model_parts, select) -> None:
    """``path`` stores exactly this model's tensors (``select``: those a LoRA step folder
    holds) in this model's global shapes: a CheckpointError naming the first difference
    (DCP would load a subset silently, or fail deep inside its planner)."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        meta = FileSystemReader(path).read_metadata().state_dict_metadata
    except Exception as exc:
        raise CheckpointError(f"checkpoint {path} is unreadable ({type(exc).__name__}: {exc})") from None
    fix = "it was saved from another model or flavor; pass the config (and --model.* overrides) it was trained with"
    ours = checkpoint_state_dict(model_parts, select)
    stored = {k[len("model.") :] for k in meta if k.startswith("model.")}
    if select is not None:
        stored = {k for k in stored if select(k)}
    missing, extra = sorted(ours.keys() - stored), sorted(stored - ours.keys())
    if missing or extra:
        what = f"lacks {len(missing)} of the model's tensors, e.g. {missing[0]}" if missing else ""
        what += (" and " if missing and extra else "") + (
            f"holds {len(extra)} tensors the model does not have, e.g. {extra[0]}" if extra else ""
        )
        raise CheckpointError(f"checkpoint {path} {what}: {fix}")
    for key, value in ours.items():
        have, want = tuple(meta[f"model.{key}"].size), tuple(value.shape)
        if have != want:
            raise CheckpointError(
                f"checkpoint {path} holds {key} of shape {list(have)} but the config's model has {list(want)}: {fix}"
            )


def preflight(cfg: JobConfig, path: str, world_size: int, device_type: str) -> None:
    """What :func:`build_from_checkpoint` would refuse for a job of ``world_size`` ranks,
    checked in this process without a process group (a launcher's check before its workers
    start): the folder, the config against it (a Hugging Face folder's config.json and
    headers, a step folder's stored shapes against the model's on the meta device) and the
    layout."""
    kind, folder, step = _kind(path)
    cfg = _point_at(cfg, kind, folder, step)
    plan = plan_startup(cfg, world_size, device_type).plan
    refuse_layout(plan.parallel_dims)
    if kind == "dcp":
        with torch.device("meta"):
            model = plan.model.model_cls(plan.model.args)
        _check_shapes(os.path.join(folder, f"step-{step}"), [model], None)


def build_from_checkpoint(cfg: JobConfig, path: str, log=lambda _line: None) -> Built:
    """This rank's model (eval mode, no optimizer) parallelized as ``cfg`` says, with the
    weights of the checkpoint at ``path`` (see the module docstring). Joins the job's process
    group (or makes a group of one) if none exists."""
    kind, folder, step = _kind(path)
    cfg = _point_at(cfg, kind, folder, step)
    device = init_distributed(cfg)
    world = dist.get_world_size()
    startup = plan_startup(cfg, world, device.type)
    plan = startup.plan
    refuse_layout(plan.parallel_dims)
    opts = dataclasses.replace(plan.parallelize, ac_mode="none", compile=False, ac_offload=False)
    plan = dataclasses.replace(plan, parallelize=opts)
    plan.parallel_dims.build_mesh(device.type)
    with torch.device("meta"):
        model = plan.model.model_cls(plan.model.args)
    parts = build_model_parts(plan, model, device, cfg.training.seed)
    if kind == "dcp":
        select = is_adapter_key if opts.lora is not None else None
        _check_shapes(os.path.join(folder, f"step-{step}"), parts, select)
    manager = CheckpointManager(
        cfg,
        model_parts=parts,
        optimizer=None,
        lr_scheduler=None,
        dataloader=None,
        model_args=plan.model.args,
        initial_hf=startup.initial_hf,
        log=log,
        lora=opts.lora,
    )
    manager.resume()
    for part in parts:
        part.eval()
    eos_folders = [folder] if kind == "hf" else []
    c = cfg.checkpoint
    if c.initial_load_in_hf and c.initial_load_path:
        eos_folders.append(c.initial_load_path)
    tok_path = getattr(startup.tokenizer, "path", None)
    if tok_path:
        eos_folders.append(os.path.dirname(tok_path))
    return Built(cfg, plan, parts, startup.tokenizer, device, eos_folders)


def eos_ids_of(tokenizer, folders: list[str]) -> tuple[int, ...]:
    """The ids that end a completion: the tokenizer's eos, and every ``eos_token_id`` that a
    generation_config.json or config.json in ``folders`` names (an instruct model ends its turn
    with ``<|eot_id|>`` or ``<|im_end|>``), in that order, without repeats."""
    ids = [int(tokenizer.eos_id)]
    for folder in folders:
        for name in ("generation_config.json", "config.json"):
            try:
                with open(os.path.join(folder, name)) as f:
                    value = json.load(f).get("eos_token_id")
            except (OSError, ValueError, AttributeError):
                continue
            for i in value if isinstance(value, list) else [value]:
                if isinstance(i, int) and i not in ids:
                    ids.append(i)
    return tuple(ids)
