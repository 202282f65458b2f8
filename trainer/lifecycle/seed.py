"""``--checkpoint.create_seed_checkpoint``: the job's initial weights, written once by one
process as ``<checkpoint.folder>/step-0`` (model only), so that every later layout starts from the
same weights (``--checkpoint.initial_load_path``).

The model is the job plan's (:func:`trainer.plan.plan_model`: the config's flavor, its overrides
and the tokenizer's vocabulary, what ``JobPlan.model`` holds), initialised from
``training.seed`` on the CPU. Only the model is planned: the seed is the same for every layout,
so the layout in the config is not checked against this one process.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from trainer.checkpoint.dcp import save_seed_checkpoint
from trainer.config import ConfigError, JobConfig
from trainer.data.tokenizer import load_tokenizer
from trainer.plan import plan_model
from trainer.runtime.distributed_init import init_distributed, require_writable_folder
from trainer.runtime.distributed_init import log as _log

__all__ = ["create_seed_checkpoint"]


def create_seed_checkpoint(cfg: JobConfig) -> str:
    """Initial weights from the seed, written once by one process; every layout loads them."""
    device = init_distributed(cfg)
    if dist.get_world_size() != 1:
        raise ConfigError(
            "--checkpoint.create_seed_checkpoint runs on one process: use "
            "torchrun --nproc_per_node=1 (or plain python train.py)"
        )
    require_writable_folder(cfg.job.dump_folder, "job.dump_folder")
    tokenizer = load_tokenizer(cfg.model.tokenizer_path)
    spec = plan_model(cfg, tokenizer.vocab_size, tokenizer.eos_id)
    with torch.device("cpu"):
        model = spec.model_cls(spec.args)
    with torch.no_grad():
        model.init_weights(cfg.training.seed)
    folder = cfg.resolve_path(cfg.checkpoint.folder)
    path = save_seed_checkpoint(model.to(device), folder)
    _log(f"wrote seed checkpoint {path}")
    return path
