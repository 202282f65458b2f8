"""The start-up checks of a job, once, for every way it is launched.

A worker (``python train.py`` alone, under torchrun, under the launcher) and the launcher's
pre-start check (trainer/lifecycle/launch.py, before any worker exists) run the same functions, so a
dataset kind, a model or a layout that one accepts the other accepts too:

* :func:`plan_startup`: the tokenizer, the packed documents' separator (the chat template's for
  chat data), the job plan (degrees, batch, model vs layout) and the Hugging Face folder to
  start from; what the trainer builds everything else from;
* the data: :func:`trainer.data.loader.build_dataloader` and
  :func:`~trainer.data.loader.build_validation_dataloader`, the very loaders a worker trains
  and validates with (every kind: text, jsonl, tokens, hf, chat, mixtures, striped rows);
  :func:`check_data` builds them as batch rank 0 does, reading nothing past what their
  constructors open.

:func:`preflight` is the launcher's: both, for ``world_size`` ranks, without a process group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainer.checkpoint.manager import check_initial_load
from trainer.config import ConfigError, JobConfig
from trainer.data.loader import build_dataloader, build_validation_dataloader, document_separator
from trainer.data.tokenizer import load_tokenizer
from trainer.plan import plan_job

__all__ = ["Startup", "check_data", "plan_startup", "preflight"]


@dataclass
class Startup:
    """What :func:`plan_startup` found: the tokenizer, the token that ends each packed document,
    the job plan and the checked Hugging Face folder to start from (None: none)."""

    tokenizer: Any
    doc_separator: int | None
    plan: Any  # trainer.plan.JobPlan
    initial_hf: Any


def plan_startup(cfg: JobConfig, world_size: int, device_type: str) -> Startup:
    """Every check of a worker's start that needs no process group and no data read: raises
    the worker's own ValueError (one line, exit code 2, from the caller)."""
    tokenizer = load_tokenizer(cfg.model.tokenizer_path)
    separator = document_separator(cfg, tokenizer)  # ends each packed document
    # from here on the layout and the batch come from the plan, never from cfg.parallelism
    plan = plan_job(cfg, world_size, tokenizer.vocab_size, tokenizer_eos=separator, device_type=device_type)
    # a Hugging Face folder to start from: config.json against the flavor and overrides, every
    # tensor's shape from the headers, before anything is built
    initial_hf = check_initial_load(cfg, plan.model.args)
    return Startup(tokenizer, separator, plan, initial_hf)


def check_data(cfg: JobConfig, startup: Startup) -> None:
    """The training (and validation) loaders as batch rank 0 builds them: every file, column,
    template and stripe check their constructors make."""

    plan = startup.plan
    build_dataloader(cfg, startup.tokenizer, batch_rank=0, batch=plan.batch, log_epochs=False)
    if cfg.validation.enable:
        build_validation_dataloader(cfg, startup.tokenizer, batch_rank=0, batch_degree=plan.batch.batch_degree)


def preflight(cfg: JobConfig, world_size: int, device_type: str | None = None) -> None:
    """What a job of ``world_size`` ranks would refuse at start-up, checked in this process
    (the launcher's pre-start check): :func:`plan_startup`, then :func:`check_data`."""
    if cfg.checkpoint.create_seed_checkpoint:
        if world_size != 1:
            raise ConfigError(
                "--checkpoint.create_seed_checkpoint runs on one process: use --nproc_per_node 1 (or plain "
                "python train.py)"
            )

        load_tokenizer(cfg.model.tokenizer_path)
        return
    if device_type is None:
        from parallel_dims import default_device_type

        device_type = default_device_type()
    check_data(cfg, plan_startup(cfg, world_size, device_type))
