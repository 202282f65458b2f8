"""Job configuration: one dataclass per TOML section, TOML loading and CLI overrides.

Precedence is dataclass defaults < TOML file < command line. Every key of every section
can be overridden as ``--section.key value`` or ``--section.key=value``; the parser is
hand-written (rather than argparse/tyro) so that misspelled keys fail loudly with a
suggestion instead of being silently ignored, which is the most common way a long
multi-node job ends up running with the wrong settings.

CLI aliases for the parallelism degrees (accepted in TOML too, written back in full)::

    --parallelism.dp_replicate  -> parallelism.data_parallel_replicate_degree
    --parallelism.dp_shard      -> parallelism.data_parallel_shard_degree
    --parallelism.cp            -> parallelism.context_parallel_degree
    --parallelism.tp            -> parallelism.tensor_parallel_degree
    --parallelism.pp            -> parallelism.pipeline_parallel_degree
    --parallelism.ep            -> parallelism.expert_parallel_degree
    --parallelism.etp           -> parallelism.expert_tensor_parallel_degree

Value syntax on the CLI: bools accept true/false/1/0/yes/no/on/off and a bare flag
(``--checkpoint.enable``) means true; lists are comma separated (``--compile.components
model,loss``); optional ints accept ``none``.

The bottom of the trainer: it imports no other part of it (``models`` and ``parallel_dims``
for the flavors and the degrees); every other part reads its sections.
"""

from trainer.config.batch import gradient_accumulation_steps, resolve_global_batch_size
from trainer.config.errors import ConfigError
from trainer.config.loader import (
    apply_mapping,
    config_from_dict,
    format_help,
    load_config,
    load_toml,
    resolve_config_path,
)
from trainer.config.schema import (
    ALIASES,
    CONFIG_DIR,
    PARALLELISM_ALIASES,
    REPO_ROOT,
    SECTIONS,
    ActivationCheckpoint,
    Checkpoint,
    Comm,
    Compile,
    Job,
    JobConfig,
    LRScheduler,
    Metrics,
    Model,
    Optimizer,
    Parallelism,
    Profiling,
    Training,
    Validation,
)
from trainer.config.toml_writer import dump_toml
from trainer.config.validate import validate_config

__all__ = [
    "ALIASES",
    "CONFIG_DIR",
    "PARALLELISM_ALIASES",
    "REPO_ROOT",
    "SECTIONS",
    "ActivationCheckpoint",
    "Checkpoint",
    "Comm",
    "Compile",
    "ConfigError",
    "Job",
    "JobConfig",
    "LRScheduler",
    "Metrics",
    "Model",
    "Optimizer",
    "Parallelism",
    "Profiling",
    "Training",
    "Validation",
    "apply_mapping",
    "config_from_dict",
    "dump_toml",
    "format_help",
    "gradient_accumulation_steps",
    "load_config",
    "load_toml",
    "resolve_config_path",
    "resolve_global_batch_size",
    "validate_config",
]
