"""The model a job config describes: ``model.name`` / ``model.flavor``, or, with ``model.flavor
= 'hf'``, every size from a Hugging Face ``config.json`` (any size of a supported architecture).

The config.json is ``model.hf_config`` (a folder or the file) or, when that is empty, the one of
``checkpoint.initial_load_path`` with ``checkpoint.initial_load_in_hf = true``: the run starts
from the very folder that sizes it. Every caller that needs the model's args for a config (the
job plan, the seed checkpoint, the planner) goes through :func:`config_model_spec`, so the layout
rules, the planner and the trainer all see the derived args.
"""

from __future__ import annotations

from models.registry import HF_FLAVOR, ModelSpec, get_model_spec
from trainer.config import ConfigError, JobConfig

__all__ = ["config_model_spec", "hf_config_source"]


def hf_config_source(cfg: JobConfig) -> str:
    """Where ``model.flavor = 'hf'`` reads config.json from ('' when nowhere is configured)."""
    c = cfg.checkpoint
    if cfg.model.hf_config:
        return cfg.model.hf_config
    return c.initial_load_path if c.initial_load_in_hf else ""


def config_model_spec(cfg: JobConfig) -> ModelSpec:
    """The spec of ``cfg``'s model before the run's overrides (a private copy of the args).
    ConfigError (one line) for a config.json that cannot size the model."""
    if cfg.model.flavor != HF_FLAVOR:
        return get_model_spec(cfg.model.name, cfg.model.flavor)
    source = hf_config_source(cfg)
    if not source:
        raise ConfigError(
            f"model.flavor = '{HF_FLAVOR}' takes every size from a Hugging Face config.json: set model.hf_config "
            "to the folder (or its config.json), or start from the folder with checkpoint.initial_load_path and "
            "checkpoint.initial_load_in_hf = true"
        )
    from trainer.checkpoint.hf_format import read_hf_config

    config = read_hf_config(source)  # CheckpointError: one line naming the path
    try:
        return get_model_spec(cfg.model.name, HF_FLAVOR, config)
    except ValueError as exc:
        raise ConfigError(f"model.flavor = '{HF_FLAVOR}' sized by {source}: {exc}") from None
