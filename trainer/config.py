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
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import sys
import types
import typing
from dataclasses import dataclass, field, make_dataclass
from typing import Any

from models.registry import flavor_names, has_experts, model_names
from parallel_dims.axes import AXES

try:  # Python >= 3.11
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - exercised only on Python < 3.11
    import tomli as tomllib

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_DIR = os.path.join(REPO_ROOT, "train_configs")

PARALLELISM_ALIASES: dict[str, str] = {a.name: a.config_key for a in AXES}
ALIASES: dict[str, dict[str, str]] = {"parallelism": PARALLELISM_ALIASES}


class ConfigError(ValueError):
    """A configuration value or key the trainer cannot run with."""


def _opt(default: Any, help: str, *, choices: tuple | None = None) -> Any:
    """Field with help text and, for enums, the legal values.

    Mutable defaults are copied per instance so two configs never share a list.
    """
    metadata = {"help": help, "choices": choices}
    if isinstance(default, list):
        return field(default_factory=lambda d=default: list(d), metadata=metadata)
    return field(default=default, metadata=metadata)


# --------------------------------------------------------------------------- sections


@dataclass
class Job:
    name: str = _opt("default", "Run name, shown in logs.")
    dump_folder: str = _opt("./outputs", "Run folder; relative checkpoint/TensorBoard/metrics paths live under it.")
    description: str = _opt("", "Free-form description, recorded with the resolved config.")


@dataclass
class Model:
    name: str = _opt("llama3", "Model family (models/registry.py).", choices=tuple(model_names()))
    flavor: str = _opt("debugmodel", "Size preset of the model family.")
    tokenizer_path: str = _opt(
        "",
        "'' = the tokenizer shipped in assets/tokenizer, 'bytes' = byte-level tokenizer, "
        "otherwise a tokenizer.json file or a folder containing one.",
    )
    vocab_size: int | None = _opt(None, "Override the flavor's vocabulary size; must be >= the tokenizer's vocab size.")
    n_layers: int | None = _opt(
        None,
        "Override the flavor's number of transformer layers (e.g. a real-size model with a "
        "few layers for benchmarks); none = the flavor's.",
    )


@dataclass
class Training:
    global_batch_size: int = _opt(
        -1,
        "Samples per optimizer step across all data-parallel ranks; -1 = local_batch_size "
        "x batch degree (no gradient accumulation).",
    )
    local_batch_size: int = _opt(8, "Micro-batch size per rank (samples per forward/backward).")
    seq_len: int = _opt(2048, "Tokens per sample.")
    steps: int = _opt(10000, "Optimizer steps to train for.")
    max_norm: float = _opt(1.0, "Gradient-norm clipping threshold; 0 disables clipping.")
    seed: int = _opt(0, "Seed for parameter init and the synthetic corpus.")
    deterministic: bool = _opt(False, "Use deterministic kernels (slower).")
    dataset: str = _opt(
        "synthetic",
        "'synthetic' (built-in generated corpus), 'text' (.txt file or folder), "
        "'jsonl' (.jsonl file or folder, field 'text').",
        choices=("synthetic", "text", "jsonl"),
    )
    dataset_path: str = _opt("", "File or folder for the 'text' and 'jsonl' datasets.")

    def resolve_global_batch_size(self, batch_degree: int) -> int:
        return resolve_global_batch_size(self.global_batch_size, self.local_batch_size, batch_degree)

    def gradient_accumulation_steps(self, batch_degree: int) -> int:
        """Derived, not a key: it depends on the batch degree, known only at launch."""
        return gradient_accumulation_steps(self.global_batch_size, self.local_batch_size, batch_degree)


@dataclass
class Optimizer:
    name: str = _opt("AdamW", "Optimizer class.", choices=("AdamW",))
    lr: float = _opt(8e-4, "Peak learning rate.")
    betas: list[float] = _opt([0.9, 0.95], "Adam (beta1, beta2).")
    eps: float = _opt(1e-8, "Adam epsilon.")
    weight_decay: float = _opt(0.1, "Decoupled weight decay for matrices (>= 2-D parameters).")
    implementation: str = _opt(
        "auto",
        "AdamW kernels: 'fused' (one kernel per parameter group; CUDA and CPU), 'foreach' "
        "(multi-tensor), 'for-loop' (one parameter at a time), 'auto' = fused on GPU, "
        "foreach on CPU.",
        choices=("auto", "fused", "foreach", "for-loop"),
    )


@dataclass
class LRScheduler:
    warmup_steps: int = _opt(200, "Steps of linear warmup to the peak lr.")
    decay_style: str = _opt("cosine", "Shape of the decay after warmup.", choices=("cosine", "linear", "constant"))
    min_lr_ratio: float = _opt(0.1, "Final lr as a fraction of the peak (ignored by 'constant').")


# One field per parallel axis, derived from parallel_dims/axes.py (key, default, help, alias).
_ParallelismDegrees = make_dataclass(
    "_ParallelismDegrees",
    [(a.config_key, int, _opt(a.default, f"{a.help} (alias {a.name}).")) for a in AXES],
)


@dataclass
class Parallelism(_ParallelismDegrees):
    fsdp_reshard_after_forward: str = _opt(
        "default",
        "Free gathered params after forward: 'default' = yes except the last (PP: no).",
        choices=("default", "always", "never"),
    )
    mixed_precision_param: str = _opt(
        "float32", "Compute dtype of FSDP-gathered params.", choices=("float32", "bfloat16")
    )
    mixed_precision_reduce: str = _opt("float32", "Dtype of gradient reduce-scatter.", choices=("float32", "bfloat16"))
    enable_sequence_parallel: bool = _opt(True, "Shard norm/dropout activations over TP ranks.")
    enable_loss_parallel: bool = _opt(True, "Compute the loss on vocab-sharded logits under TP.")
    pipeline_parallel_schedule: str = _opt(
        "1F1B",
        "torch.distributed.pipelining schedule name.",
        choices=("1F1B", "GPipe", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble"),
    )
    pipeline_parallel_microbatches: int | None = _opt(
        None,
        "Pipeline microbatches per local batch; must divide training.local_batch_size. "
        "none = pipeline_parallel_degree.",
    )
    pipeline_parallel_layers_per_stage: int | None = _opt(
        None, "Transformer layers per (virtual) stage; none = split evenly."
    )
    pipeline_parallel_split_points: list[str] = _opt(
        [], "Explicit stage boundaries as module FQNs, e.g. layers.4,layers.8."
    )

    def pipeline_microbatches(self) -> int:
        return self.pipeline_parallel_microbatches or self.pipeline_parallel_degree


@dataclass
class ActivationCheckpoint:
    mode: str = _opt("none", "Recompute activations in backward.", choices=("none", "full", "selective"))
    selective_ac_option: str = _opt(
        "op",
        "'op' = per-op selective AC; an integer N = checkpoint every N-th transformer block.",
    )


@dataclass
class Compile:
    enable: bool = _opt(False, "torch.compile the components below.")
    components: list[str] = _opt(["model", "loss"], "What to compile: model, loss.")


@dataclass
class Checkpoint:
    enable: bool = _opt(False, "Save resumable checkpoints and resume from the latest one.")
    folder: str = _opt("checkpoint", "Checkpoint folder, relative to job.dump_folder.")
    interval: int = _opt(500, "Save every N steps (the last step is always saved).")
    keep_latest_k: int = _opt(10, "Keep the newest K checkpoints; 0 keeps all.")
    load_step: int = _opt(-1, "Step to resume from; -1 = latest found in the folder.")
    create_seed_checkpoint: bool = _opt(
        False, "Only initialise the model, save it as step-0 and exit (run with 1 process)."
    )
    initial_load_path: str = _opt("", "Checkpoint folder to initialise from when the run folder has no checkpoint yet.")
    initial_load_model_only: bool = _opt(
        True, "Take only model weights from initial_load_path (not optimizer/data state)."
    )
    export_dtype: str = _opt("float32", "Dtype of exported weights.", choices=("float32", "bfloat16", "float16"))
    last_save_model_only: bool = _opt(
        False,
        "At the final step write consolidated weights (export_dtype) instead of a resumable checkpoint.",
    )
    exclude_from_loading: list[str] = _opt(
        [], "Parts not restored on resume: optimizer, lr_scheduler, dataloader, rng."
    )


@dataclass
class Metrics:
    log_freq: int = _opt(10, "Log every N steps (step 1 is always logged).")
    enable_tensorboard: bool = _opt(False, "Write TensorBoard scalars (rank 0).")
    save_tb_folder: str = _opt("tb", "TensorBoard folder, relative to job.dump_folder.")
    enable_jsonl: bool = _opt(True, "Append one JSON object per logged step to metrics.jsonl.")


@dataclass
class Profiling:
    enable_profiling: bool = _opt(False, "Record torch profiler traces (Chrome/Perfetto JSON, one file per rank).")
    save_traces_folder: str = _opt(
        "profile_traces", "Trace folder, relative to job.dump_folder: iteration_N/rankR_trace.json."
    )
    profile_freq: int = _opt(10, "Profile (and snapshot memory) every N steps: steps N, 2N, ... are recorded.")
    profiler_warmup: int = _opt(3, "Steps the profiler runs unrecorded before each recorded window.")
    profiler_active: int = _opt(1, "Steps recorded in each window (ending at a multiple of profile_freq).")
    enable_memory_snapshot: bool = _opt(
        False,
        "Record CUDA allocator history and dump a snapshot (open it at pytorch.org/memory_viz) "
        "every profile_freq steps and on out-of-memory; GPU only.",
    )
    save_memory_snapshot_folder: str = _opt(
        "memory_snapshot",
        "Snapshot folder, relative to job.dump_folder: iteration_N/rankR_memory_snapshot.pickle.",
    )


@dataclass
class Comm:
    init_timeout_seconds: int = _opt(300, "Process-group timeout until the first step.")
    train_timeout_seconds: int = _opt(100, "Collective timeout once training runs.")


SECTIONS: dict[str, type] = {
    "job": Job,
    "model": Model,
    "training": Training,
    "optimizer": Optimizer,
    "lr_scheduler": LRScheduler,
    "parallelism": Parallelism,
    "activation_checkpoint": ActivationCheckpoint,
    "compile": Compile,
    "checkpoint": Checkpoint,
    "metrics": Metrics,
    "profiling": Profiling,
    "comm": Comm,
}


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    parallelism: Parallelism = field(default_factory=Parallelism)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    metrics: Metrics = field(default_factory=Metrics)
    profiling: Profiling = field(default_factory=Profiling)
    comm: Comm = field(default_factory=Comm)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {
            name: {f.name: _copy_value(getattr(getattr(self, name), f.name)) for f in dataclasses.fields(cls)}
            for name, cls in SECTIONS.items()
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JobConfig:
        """Build and validate from a nested ``{section: {key: value}}`` mapping (e.g. TOML)."""
        cfg = cls()
        _apply_mapping(cfg, data, source="config")
        cfg.validate()
        return cfg

    def to_toml(self) -> str:
        return dump_toml(self.to_dict(), header="Resolved job config; load it with --config <file>.")

    def resolve_path(self, path: str) -> str:
        """Relative output paths are anchored at job.dump_folder so one run = one folder."""
        return path if os.path.isabs(path) else os.path.join(self.job.dump_folder, path)

    def validate(self) -> None:
        """Raise ConfigError for the first value the trainer could not run with."""
        for name, cls in SECTIONS.items():
            section = getattr(self, name)
            for f in dataclasses.fields(cls):
                choices = f.metadata.get("choices")
                value = getattr(section, f.name)
                if choices is not None and value not in choices:
                    raise ConfigError(_choice_message(f"{name}.{f.name}", value, choices))
        _validate_values(self)


# ---------------------------------------------------------------- batch-size arithmetic


def resolve_global_batch_size(global_batch_size: int, local_batch_size: int, batch_degree: int) -> int:
    if batch_degree < 1:
        raise ConfigError(f"batch degree must be >= 1, got {batch_degree}")
    if global_batch_size == -1:
        return local_batch_size * batch_degree
    return global_batch_size


def gradient_accumulation_steps(global_batch_size: int, local_batch_size: int, batch_degree: int) -> int:
    """Micro-batches each rank runs per optimizer step.

    The global batch G is split into D contiguous per-rank slices of G/D samples, each
    consumed as micro-batches of local_batch_size, so G must be a multiple of
    D * local_batch_size.
    """
    g = resolve_global_batch_size(global_batch_size, local_batch_size, batch_degree)
    unit = batch_degree * local_batch_size
    if g <= 0 or g % unit != 0:
        legal = ", ".join(str(unit * k) for k in range(1, 5))
        msg = (
            f"training.global_batch_size ({g}) must be a positive multiple of batch degree "
            f"({batch_degree}) x training.local_batch_size ({local_batch_size}) = {unit}; "
            f"legal values: {legal}, ..."
        )
        if g > 0 and g % batch_degree == 0:
            per_rank = g // batch_degree
            divisors = [d for d in range(1, per_rank + 1) if per_rank % d == 0]
            msg += f"; or keep it and set training.local_batch_size to one of {divisors}"
        raise ConfigError(msg)
    return g // unit


# ------------------------------------------------------------------------- validation


def _validate_values(cfg: JobConfig) -> None:
    def need(cond: bool, message: str) -> None:
        if not cond:
            raise ConfigError(message)

    t, o, s, p = cfg.training, cfg.optimizer, cfg.lr_scheduler, cfg.parallelism

    flavors = tuple(flavor_names(cfg.model.name))
    if cfg.model.flavor not in flavors:
        raise ConfigError(_choice_message("model.flavor", cfg.model.flavor, flavors, f" for model '{cfg.model.name}'"))
    need(
        cfg.model.vocab_size is None or cfg.model.vocab_size > 0,
        f"model.vocab_size must be > 0 (or none for the flavor default), got {cfg.model.vocab_size}",
    )
    need(
        cfg.model.n_layers is None or cfg.model.n_layers > 0,
        f"model.n_layers must be > 0 (or none for the flavor's), got {cfg.model.n_layers}",
    )

    need(t.local_batch_size > 0, f"training.local_batch_size must be > 0, got {t.local_batch_size}")
    need(
        t.global_batch_size > 0 or t.global_batch_size == -1,
        f"training.global_batch_size must be > 0 or -1 (= local_batch_size x batch degree), got {t.global_batch_size}",
    )
    if t.global_batch_size > 0:
        need(
            t.global_batch_size % t.local_batch_size == 0,
            f"training.global_batch_size ({t.global_batch_size}) must be a multiple of "
            f"training.local_batch_size ({t.local_batch_size})",
        )
    need(t.seq_len > 0, f"training.seq_len must be > 0, got {t.seq_len}")
    need(t.steps > 0, f"training.steps must be > 0, got {t.steps}")
    need(t.max_norm >= 0, f"training.max_norm must be >= 0 (0 disables clipping), got {t.max_norm}")
    need(
        t.dataset == "synthetic" or t.dataset_path != "",
        f"training.dataset = '{t.dataset}' needs training.dataset_path (a file or folder)",
    )

    need(o.lr >= 0 and math.isfinite(o.lr), f"optimizer.lr must be a finite number >= 0, got {o.lr}")
    need(
        len(o.betas) == 2 and all(0.0 <= b < 1.0 for b in o.betas),
        f"optimizer.betas must be two numbers in [0, 1), got {o.betas}",
    )
    need(o.eps > 0, f"optimizer.eps must be > 0, got {o.eps}")
    need(o.weight_decay >= 0, f"optimizer.weight_decay must be >= 0, got {o.weight_decay}")

    need(s.warmup_steps >= 0, f"lr_scheduler.warmup_steps must be >= 0, got {s.warmup_steps}")
    need(0.0 <= s.min_lr_ratio <= 1.0, f"lr_scheduler.min_lr_ratio must be in [0, 1], got {s.min_lr_ratio}")

    # the degrees themselves are validated (with the fix) by the job plan, which knows the
    # world size: trainer/plan.py -> parallel_dims.validate_degrees
    if not has_experts(cfg.model.name, cfg.model.flavor):
        need(
            p.expert_parallel_degree == 1 and p.expert_tensor_parallel_degree == 1,
            f"expert parallelism (parallelism.ep/etp) needs an MoE model; model.name = "
            f"'{cfg.model.name}' has no experts: set parallelism.ep = 1 and parallelism.etp = 1",
        )
    if p.pipeline_parallel_microbatches is not None:
        need(
            p.pipeline_parallel_microbatches > 0,
            f"parallelism.pipeline_parallel_microbatches must be > 0, got {p.pipeline_parallel_microbatches}",
        )
    if p.pipeline_parallel_degree > 1:
        m = p.pipeline_microbatches()
        need(
            t.local_batch_size % m == 0,
            f"training.local_batch_size ({t.local_batch_size}) must be divisible by the pipeline "
            f"microbatch count {m} (parallelism.pipeline_parallel_microbatches, default = "
            f"pipeline_parallel_degree)",
        )
    if p.pipeline_parallel_layers_per_stage is not None:
        need(
            p.pipeline_parallel_layers_per_stage > 0,
            f"parallelism.pipeline_parallel_layers_per_stage must be > 0, got {p.pipeline_parallel_layers_per_stage}",
        )
        need(
            not p.pipeline_parallel_split_points,
            "set either parallelism.pipeline_parallel_layers_per_stage or "
            "parallelism.pipeline_parallel_split_points, not both",
        )

    ac = cfg.activation_checkpoint
    if ac.selective_ac_option != "op":
        need(
            ac.selective_ac_option.isdigit() and int(ac.selective_ac_option) > 0,
            f"activation_checkpoint.selective_ac_option must be 'op' or a positive integer N "
            f"(checkpoint every N-th block), got '{ac.selective_ac_option}'",
        )

    for comp in cfg.compile.components:
        if comp not in ("model", "loss"):
            raise ConfigError(_choice_message("compile.components entry", comp, ("model", "loss")))

    c = cfg.checkpoint
    need(c.interval > 0, f"checkpoint.interval must be > 0, got {c.interval}")
    need(c.keep_latest_k >= 0, f"checkpoint.keep_latest_k must be >= 0 (0 keeps all), got {c.keep_latest_k}")
    need(c.load_step >= -1, f"checkpoint.load_step must be >= 0 or -1 (latest), got {c.load_step}")
    excludable = ("optimizer", "lr_scheduler", "dataloader", "rng")
    for part in c.exclude_from_loading:
        if part not in excludable:
            raise ConfigError(_choice_message("checkpoint.exclude_from_loading entry", part, excludable))

    need(cfg.metrics.log_freq > 0, f"metrics.log_freq must be > 0, got {cfg.metrics.log_freq}")
    prof = cfg.profiling
    need(
        prof.profiler_warmup >= 0 and prof.profiler_active >= 1,
        f"profiling.profiler_warmup must be >= 0 and profiling.profiler_active >= 1, got "
        f"{prof.profiler_warmup} and {prof.profiler_active}",
    )
    need(
        prof.profile_freq >= prof.profiler_warmup + prof.profiler_active,
        f"profiling.profile_freq ({prof.profile_freq}) must be >= profiler_warmup + "
        f"profiler_active ({prof.profiler_warmup} + {prof.profiler_active}): each recorded "
        f"window fits inside one period; raise profile_freq or lower the other two",
    )
    need(
        cfg.comm.init_timeout_seconds > 0 and cfg.comm.train_timeout_seconds > 0,
        "comm.init_timeout_seconds and comm.train_timeout_seconds must be > 0",
    )


def _choice_message(key: str, value: Any, choices: tuple, context: str = "") -> str:
    msg = f"{key} must be one of {', '.join(repr(c) for c in choices)}{context}, got {value!r}"
    close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1, cutoff=0.5)
    if not close:  # case-only typos such as 'adamw' are below difflib's cutoff
        close = [c for c in map(str, choices) if c.lower() == str(value).lower()]
    if close:
        msg += f"; did you mean {close[0]!r}?"
    return msg


# ------------------------------------------------------------------ typed coercion

# `Optional[X]` and `X | None` have different origins (typing.Union vs types.UnionType)
_UNION_ORIGINS = (typing.Union, types.UnionType)
_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}
_TYPE_NAMES = {int: "an int", float: "a float", bool: "a bool (true/false)", str: "a string"}
_LIST_NAMES = {int: "ints", float: "floats", bool: "bools", str: "strings"}


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is list:
        (inner,) = typing.get_args(tp)
        return f"a comma-separated list of {_LIST_NAMES[inner]}"
    if origin in _UNION_ORIGINS:
        inner = [a for a in typing.get_args(tp) if a is not type(None)][0]
        return f"{_TYPE_NAMES[inner]} or none"
    return _TYPE_NAMES[tp]


def _coerce(key: str, tp: Any, value: Any, from_cli: bool) -> Any:
    """Convert a TOML value or a CLI string to the field type, or raise a ConfigError."""

    def bad() -> ConfigError:
        return ConfigError(f"{key} expects {_describe(tp)}, got {value!r}")

    origin = typing.get_origin(tp)
    if origin in _UNION_ORIGINS:  # Optional[X], X | None
        inner = [a for a in typing.get_args(tp) if a is not type(None)][0]
        if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null", "")):
            return None
        try:
            return _coerce(key, inner, value, from_cli)
        except ConfigError:
            raise bad() from None
    if origin is list:
        (inner,) = typing.get_args(tp)
        if isinstance(value, str):
            items = [v.strip() for v in value.split(",")] if value.strip() else []
            return [_coerce(key, inner, v, True) for v in items]
        if not isinstance(value, (list, tuple)):
            raise bad()
        try:
            return [_coerce(key, inner, v, from_cli) for v in value]
        except ConfigError:
            raise bad() from None
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and from_cli and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        raise bad()
    if tp is int:
        if isinstance(value, bool):
            raise bad()
        if isinstance(value, int):
            return value
        if isinstance(value, str) and from_cli:
            try:
                return int(value.strip())
            except ValueError:
                raise bad() from None
        raise bad()
    if tp is float:
        if isinstance(value, bool):
            raise bad()
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str) and from_cli:
            try:
                return float(value.strip())
            except ValueError:
                raise bad() from None
        raise bad()
    if tp is str:
        if isinstance(value, str):
            return value
        # selective_ac_option = 2 in TOML is natural to write; keep the field a string.
        if isinstance(value, int) and not isinstance(value, bool) and key.endswith("selective_ac_option"):
            return str(value)
        raise bad()
    raise TypeError(f"unsupported config field type {tp!r} for {key}")  # programming error


# --------------------------------------------------------------------- key lookup


def _all_keys() -> list[str]:
    return [f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)] + [
        f"{s}.{a}" for s, al in ALIASES.items() for a in al
    ]


def _leaf_hint(name: str, prefix: str = "") -> str:
    """Suggest section.key for a key given without its section."""
    keys = _all_keys()
    close = difflib.get_close_matches(name, [k.split(".", 1)[1] for k in keys], n=1, cutoff=0.6)
    full = [k for k in keys if close and k.endswith("." + close[0])]
    return f"; did you mean '{prefix}{full[0]}'?" if full else ""


def _resolve_key(section: str, key: str) -> tuple[str, str]:
    """Map (section, key or alias) to the canonical pair, or raise with a suggestion."""
    if section not in SECTIONS:
        close = difflib.get_close_matches(section, list(SECTIONS), n=1, cutoff=0.6)
        hint = f"did you mean '{close[0]}.{key}'?" if close else f"valid sections: {', '.join(SECTIONS)}"
        raise ConfigError(f"unknown section '{section}'; {hint}")
    key = ALIASES.get(section, {}).get(key, key)
    names = [f.name for f in dataclasses.fields(SECTIONS[section])]
    if key not in names:
        candidates = names + list(ALIASES.get(section, {}))
        close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
        if close:
            hint = f"did you mean '{section}.{close[0]}'?"
        else:
            hint = f"valid keys in [{section}]: {', '.join(names)}"
        raise ConfigError(f"unknown key '{section}.{key}'; {hint}")
    return section, key


def _set(cfg: JobConfig, section: str, key: str, value: Any, from_cli: bool) -> None:
    section, key = _resolve_key(section, key)
    tp = _field_types(SECTIONS[section])[key]
    setattr(getattr(cfg, section), key, _coerce(f"{section}.{key}", tp, value, from_cli))


def _apply_mapping(cfg: JobConfig, data: dict[str, Any], source: str) -> None:
    for section, values in data.items():
        if not isinstance(values, dict):
            raise ConfigError(
                f"{source}: top-level key '{section}' must be inside a [section] table{_leaf_hint(section)}"
            )
        for key, value in values.items():
            _set(cfg, section, key, value, from_cli=False)


# ------------------------------------------------------------------------ loading


def resolve_config_path(path: str) -> str:
    """Find a config: as given, else a bare name (with or without .toml) in train_configs/."""
    candidates = [path]
    if os.sep not in path and "/" not in path:
        candidates.append(os.path.join(CONFIG_DIR, path))
        if not path.endswith(".toml"):
            candidates.append(os.path.join(CONFIG_DIR, path + ".toml"))
    for c in candidates:
        if os.path.isfile(c):
            return c
    available = sorted(f for f in os.listdir(CONFIG_DIR) if f.endswith(".toml")) if os.path.isdir(CONFIG_DIR) else []
    raise ConfigError(
        f"config file '{path}' not found (looked at: {', '.join(candidates)}); "
        f"pass a path or one of the shipped configs: {', '.join(available) or 'none'}"
    )


def load_toml(path: str) -> dict[str, Any]:
    with open(path, "rb") as f:
        try:
            return tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path} is not valid TOML: {e}") from None


def load_config(argv: list[str] | None = None) -> JobConfig:
    """Defaults < ``--config FILE`` < ``--section.key value`` overrides, then validate.

    ``argv`` excludes the program name (defaults to ``sys.argv[1:]``). ``-h``/``--help``
    prints every key with its default and exits.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    config_path: str | None = None
    overrides: list[tuple[str, str, Any]] = []  # (arg as typed, dotted key, raw value)
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help"):
            print(format_help())
            raise SystemExit(0)
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument '{arg}'; options look like --section.key value")
        name, eq, value = arg[2:].partition("=")
        if not eq:
            has_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
            value = argv[i + 1] if has_value else None
            i += 1 if has_value else 0
        i += 1
        if name in ("config", "job.config_file"):
            if value is None:
                raise ConfigError("--config needs a path, e.g. --config llama3.toml")
            config_path = value
            continue
        if "." not in name:
            hint = _leaf_hint(name, prefix="--") or "; options look like --section.key value"
            raise ConfigError(f"unknown option '--{name}'{hint}")
        overrides.append((arg, name, value))

    cfg = JobConfig()
    if config_path is not None:
        resolved = resolve_config_path(config_path)
        _apply_mapping(cfg, load_toml(resolved), source=resolved)
    for _arg, name, value in overrides:
        section, key = name.split(".", 1)
        section_c, key_c = _resolve_key(section, key)
        tp = _field_types(SECTIONS[section_c])[key_c]
        if value is None:
            if tp is not bool:
                raise ConfigError(f"--{section_c}.{key_c} needs a value ({_describe(tp)})")
            value = "true"
        _set(cfg, section_c, key_c, value, from_cli=True)
    cfg.validate()
    return cfg


def format_help() -> str:
    lines = ["usage: train.py [--config FILE] [--section.key VALUE ...]", ""]
    for section, cls in SECTIONS.items():
        lines.append(f"[{section}]")
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            choices = f.metadata.get("choices")
            extra = f" (one of: {', '.join(map(str, choices))})" if choices else ""
            lines.append(f"  --{section}.{f.name} = {default!r}{extra}\n      {f.metadata.get('help', '')}")
        lines.append("")
    lines.append("aliases: " + ", ".join(f"--parallelism.{a} -> {k}" for a, k in PARALLELISM_ALIASES.items()))
    return "\n".join(lines)


# -------------------------------------------------------------------- TOML writing


def _copy_value(v: Any) -> Any:
    return list(v) if isinstance(v, list) else v


def _toml_scalar(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)  # always has '.', 'e' or both, which TOML requires of floats
    if isinstance(v, str):
        out = []
        for ch in v:
            if ch == "\\":
                out.append("\\\\")
            elif ch == '"':
                out.append('\\"')
            elif ch == "\n":
                out.append("\\n")
            elif ch == "\t":
                out.append("\\t")
            elif ord(ch) < 0x20 or ord(ch) == 0x7F:
                out.append(f"\\u{ord(ch):04x}")
            else:
                out.append(ch)
        return '"' + "".join(out) + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_scalar(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} value {v!r} as TOML")


def dump_toml(data: dict[str, dict[str, Any]], header: str = "") -> str:
    """Minimal writer for one level of tables of scalars/lists; None values are omitted
    (TOML has no null) and therefore fall back to their default when read back."""
    lines = [f"# {header}"] if header else []
    for section, values in data.items():
        if lines:
            lines.append("")
        lines.append(f"[{section}]")
        for key, value in values.items():
            if value is None:
                lines.append(f"# {key} = none (unset)")
            else:
                lines.append(f"{key} = {_toml_scalar(value)}")
    return "\n".join(lines) + "\n"
