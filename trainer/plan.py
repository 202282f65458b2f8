"""The job plan: everything a config means for a world size, computed and validated once, with
no process group and no weights.

``plan_job(cfg, world_size)`` returns the validated degrees and rank layout, the model's args
(the flavor with the config's overrides), the batch plan (global/local batch, batch degree,
gradient accumulation), the parallelize options and, with pp > 1, the pipeline stage plan -- or
raises ONE ``ValueError`` listing every problem it found. The trainer, the loss-comparison tool's
preflight, the shipped-config tests and the test harnesses call it; nothing else re-derives
these. ``python -m trainer.plan_report --config X.toml --world-size N`` prints it, with a dry run of
one rank's sharding on the fake backend (trainer/plan_report.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from models.common.args import DecoderArgs
from models.parallel.float8 import (
    FLOAT8_CONVERTERS,
    FLOAT8_EXPERT_CONVERTERS,
    Float8Options,
    check_float8_experts,
    check_float8_support,
)
from models.parallel.lora import LORA_CONVERTERS, LoRAOptions, check_lora
from models.parallel.pipeline import StagePlan, plan_stages
from models.parallel.pipeline.plan import schedule_facts
from models.parallelize import ParallelizeOptions
from models.registry import ModelSpec, model_rules
from parallel_dims import ModelRules, ParallelDims, check_model_layout
from parallel_dims.axes import AXES
from trainer.config import (
    ConfigError,
    JobConfig,
    gradient_accumulation_steps,
    resolve_global_batch_size,
)
from trainer.config.derived import attn_mask_type
from trainer.model_spec import config_model_spec

__all__ = [
    "BatchPlan",
    "JobPlan",
    "model_overrides",
    "parallel_dims_from_config",
    "parallelize_options",
    "plan_job",
    "plan_model",
    "validation_batch",
]


@dataclass(frozen=True)
class BatchPlan:
    """How the global batch of every optimizer step is split (the same on every layout)."""

    global_batch_size: int  # sequences per optimizer step, all ranks together
    local_batch_size: int  # sequences per micro-batch on one rank
    batch_degree: int  # ranks reading different samples: dp_replicate * dp_shard
    grad_accum_steps: int  # micro-batches per rank per step
    seq_len: int

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.seq_len


@dataclass(frozen=True)
class JobPlan:
    config: JobConfig
    world_size: int
    parallel_dims: ParallelDims  # validated degrees and rank layout; meshes not built
    model: ModelSpec  # spec.args carry the config's overrides
    batch: BatchPlan
    parallelize: ParallelizeOptions
    stages: StagePlan | None  # pp > 1 only

    @property
    def model_args(self) -> DecoderArgs:
        return self.model.args


def parallel_dims_from_config(cfg: JobConfig, world_size: int) -> ParallelDims:
    """Validated, unbuilt ParallelDims from ``[parallelism]`` (one keyword per axis)."""
    p = cfg.parallelism
    return ParallelDims(world_size=world_size, **{a.name: getattr(p, a.config_key) for a in AXES})


def model_overrides(cfg: JobConfig, tokenizer_vocab: int, tokenizer_eos: int | None = None) -> dict[str, Any]:
    """The model args the config changes: the vocabulary (>= the tokenizer's), the RoPE table
    length (>= seq_len, and >= validation.seq_len when validation is on), with
    ``model.n_layers`` the depth, and the attention settings (``model.attn_mask_type``,
    ``attn_type``, ``document_positions``; ``eos_id`` is the tokenizer's EOS, which ends each
    packed document)."""
    spec = config_model_spec(cfg)
    vocab = cfg.model.vocab_size or spec.args.vocab_size
    if vocab < tokenizer_vocab:
        raise ConfigError(
            f"model.vocab_size={vocab} is smaller than the tokenizer's vocabulary "
            f"({tokenizer_vocab} tokens); set --model.vocab_size {tokenizer_vocab} or larger"
        )
    overrides: dict[str, Any] = {
        "vocab_size": vocab,
        "max_seq_len": max(
            spec.args.max_seq_len, cfg.training.seq_len, cfg.validation.seq_len if cfg.validation.enable else 0
        ),
    }
    if cfg.model.n_layers is not None:
        overrides["n_layers"] = cfg.model.n_layers
    m = cfg.model
    if m.mtp_layers is not None:
        if not any(f.name == "mtp_layers" for f in dataclasses.fields(spec.args)):
            raise ConfigError(
                f"model.mtp_layers={m.mtp_layers}: multi-token prediction is a DeepSeek-V3 feature, and "
                f"model.name={m.name!r} has none; remove model.mtp_layers or use model.name = 'deepseek_v3'"
            )
        overrides["mtp_layers"] = m.mtp_layers
    mask = attn_mask_type(cfg)  # 'auto' resolved (trainer/config/derived.py)
    if m.document_positions and mask != "block_causal":
        raise ConfigError(
            "model.document_positions = true restarts RoPE positions at each document start, which only "
            "makes sense when documents cannot see each other; set model.attn_mask_type = 'block_causal' too"
        )
    if m.attn_type == "varlen" and mask != "block_causal":
        raise ConfigError(
            "model.attn_type = 'varlen' runs one attention per document, so it needs "
            "model.attn_mask_type = 'block_causal'; use 'sdpa' or 'flex' for plain causal attention"
        )
    overrides.update(attn_mask_type=mask, attn_type=m.attn_type, document_positions=m.document_positions)
    if mask == "block_causal" or m.document_positions:
        if tokenizer_eos is None:
            raise ConfigError(
                f"model.attn_mask_type={mask!r} needs the tokenizer's EOS token, which ends each "
                "packed document, and this tokenizer has none; use a tokenizer with an EOS token or "
                "model.attn_mask_type = 'causal'"
            )
        overrides["eos_id"] = tokenizer_eos
    return overrides


def check_attention_device(cfg: JobConfig, device_type: str, cp: int) -> None:
    """``model.attn_type`` against the device the job trains on and the cp degree: FlexAttention
    has no CPU backward in torch 2.13, varlen attention is a CUDA kernel over whole documents
    (no cp)."""
    attn_type = cfg.model.attn_type
    if attn_type == "flex" and device_type != "cuda":
        raise ConfigError(
            f"model.attn_type='flex' needs a CUDA device (torch {_torch_version()}'s FlexAttention has no "
            f"backward on {device_type}); use model.attn_type = 'sdpa', which runs block_causal masks "
            "everywhere"
        )
    if attn_type == "varlen":
        if device_type != "cuda" or not _has_varlen():
            raise ConfigError(
                f"model.attn_type='varlen' needs a CUDA device and torch.nn.attention.varlen (torch "
                f"{_torch_version()} on {device_type}); use model.attn_type = 'sdpa' or 'flex'"
            )
    _check_varlen_cp(cfg, cp)


def check_checkpoint_device(cfg: JobConfig, device_type: str) -> None:
    """``checkpoint.async_mode = async_with_pinned_mem`` stages into pinned host memory with
    non-blocking copies from a CUDA side stream: there is no such thing on other devices."""
    if cfg.checkpoint.enable and cfg.checkpoint.async_mode == "async_with_pinned_mem" and device_type != "cuda":
        raise ConfigError(
            f"checkpoint.async_mode='async_with_pinned_mem' copies from CUDA into pinned host memory; this run "
            f"trains on {device_type}: use checkpoint.async_mode = 'async' (the background write is the same)"
        )


def _torch_version() -> str:
    import torch

    return torch.__version__


def _has_varlen() -> bool:
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def parallelize_options(cfg: JobConfig) -> ParallelizeOptions:
    p = cfg.parallelism
    return ParallelizeOptions(
        sequence_parallel=p.enable_sequence_parallel,
        loss_parallel=p.enable_loss_parallel,
        chunked_head=cfg.training.loss_chunk_tokens > 0,
        param_dtype=p.mixed_precision_param,
        reduce_dtype=p.mixed_precision_reduce,
        reshard_after_forward=p.fsdp_reshard_after_forward,
        ac_mode=cfg.activation_checkpoint.mode,
        ac_selective_option=cfg.activation_checkpoint.selective_ac_option,
        compile=cfg.compile.enable and "model" in cfg.compile.components,
        float8=float8_options(cfg),
        lora=lora_options(cfg),
        cpu_offload=cfg.training.cpu_offload,
        ac_offload=cfg.activation_checkpoint.offload,
    )


def lora_options(cfg: JobConfig) -> LoRAOptions | None:
    """The ``[lora]`` section as the parallelize plan takes it; None unless ``model.converters``
    has ``"lora"``."""
    if not any(name in LORA_CONVERTERS for name in cfg.model.converters):
        return None
    lo = cfg.lora
    return LoRAOptions(
        rank=lo.rank,
        alpha=lo.alpha,
        dropout=lo.dropout,
        target_modules=tuple(lo.target_modules),
        experts=lo.experts,
        frozen_dtype=lo.frozen_dtype,
    )


def float8_options(cfg: JobConfig) -> Float8Options | None:
    """The ``[float8]`` section as the parallelize plan takes it; None unless
    ``model.converters`` asks for float8 (linears, routed experts, or both)."""
    linears = any(name in FLOAT8_CONVERTERS for name in cfg.model.converters)
    experts = any(name in FLOAT8_EXPERT_CONVERTERS for name in cfg.model.converters)
    if not (linears or experts):
        return None
    f8 = cfg.float8
    return Float8Options(
        linears=linears,
        moe_fqns=tuple(f8.moe_fqns) if experts else (),
        recipe=f8.recipe_name,
        fsdp_float8_all_gather=f8.enable_fsdp_float8_all_gather,
        # under tp the float8 all-gather alone scales each tp rank's slice by its own amax; the
        # precompute takes the amax over the whole weight (tests/distributed/test_float8_layouts.py)
        precompute_scale=f8.precompute_float8_dynamic_scale_for_fsdp
        or (f8.enable_fsdp_float8_all_gather and cfg.parallelism.tensor_parallel_degree > 1),
        filter_fqns=tuple(f8.filter_fqns),
        emulate=f8.emulate,
        cpu_gemm=f8.cpu_gemm,
    )


def plan_job(
    cfg: JobConfig,
    world_size: int,
    tokenizer_vocab: int | None = None,
    *,
    tokenizer_eos: int | None = None,
    device_type: str | None = None,
) -> JobPlan:
    """The validated plan of ``cfg`` on ``world_size`` ranks. ``tokenizer_vocab``: the
    tokenizer's vocabulary size (None loads ``model.tokenizer_path`` to find it and its EOS id),
    ``tokenizer_eos`` its EOS id (needed by block-causal masking). ``device_type``: the device
    the job trains on, to check ``model.attn_type`` against (None skips that check, e.g. when
    planning for another machine; varlen with cp > 1 is refused either way). Raises one
    ``ValueError`` (a ``ConfigError`` when every problem is one) listing every problem; checks
    that need an earlier result which failed are skipped."""
    problems: list[str] = []

    def attempt(check: Callable[[], Any]) -> Any:
        try:
            return check()
        except ValueError as exc:
            problems.append(str(exc))
            return None

    p = cfg.parallelism
    pd = attempt(lambda: parallel_dims_from_config(cfg, world_size))
    if tokenizer_vocab is None:
        from trainer.data.tokenizer import load_tokenizer

        tokenizer = attempt(lambda: load_tokenizer(cfg.model.tokenizer_path))
        tokenizer_vocab = tokenizer.vocab_size if tokenizer is not None else None
        tokenizer_eos = getattr(tokenizer, "eos_id", None)
    spec = None
    if tokenizer_vocab is not None:
        spec = attempt(lambda: plan_model(cfg, tokenizer_vocab, tokenizer_eos))
    opts = parallelize_options(cfg)
    if pd is not None:
        if device_type is not None:
            attempt(lambda: check_attention_device(cfg, device_type, pd.cp))
            attempt(lambda: check_checkpoint_device(cfg, device_type))
            if opts.float8 is not None:
                attempt(lambda: check_float8_support(opts.float8, device_type, opts.compile))
        else:
            attempt(lambda: _check_varlen_cp(cfg, pd.cp))
    if pd is not None and spec is not None:
        attempt(
            lambda: check_model_layout(pd.degrees, model_rules(spec.args, cfg.training.seq_len, opts.sequence_parallel))
        )
        if opts.float8 is not None and opts.float8.moe_fqns:
            attempt(lambda: _check_float8_experts(spec, cfg.model.name, opts.float8, pd.etp))
        if opts.lora is not None:
            attempt(lambda: check_lora(spec.model_cls, spec.args, opts.lora))
    batch = None
    if pd is not None:
        batch = attempt(lambda: _batch_plan(cfg, pd))
        if cfg.validation.enable:
            attempt(lambda: validation_batch(cfg, pd.size("batch")))
    stages = None
    if pd is not None and pd.pp > 1 and spec is not None:
        stages = attempt(
            lambda: plan_stages(
                spec.args.n_layers,
                pd.pp,
                p.pipeline_parallel_schedule,
                p.pipeline_microbatches(),
                cfg.training.local_batch_size,
                p.pipeline_parallel_split_points or None,
                p.pipeline_parallel_layers_per_stage,
            )
        )
    if pd is not None and pd.pp > 1:
        attempt(lambda: _check_reshard_with_schedule(p.fsdp_reshard_after_forward, p.pipeline_parallel_schedule))
    if problems:
        if len(problems) == 1:
            raise ConfigError(problems[0])
        listed = "\n".join(f"  - {problem}" for problem in problems)
        raise ConfigError(f"{len(problems)} problems with this job on world_size={world_size}:\n{listed}")
    return JobPlan(cfg, world_size, pd, spec, batch, opts, stages)


def _check_reshard_with_schedule(policy: str, schedule: str) -> None:
    """Resharding after forward cannot be combined with a split-backward (zero-bubble)
    schedule: torch's input-gradient half lists the stage's parameters before FSDP2's
    pre-backward hook gathers the groups resharded after forward, so it lists their sharded
    parameters, which are not in the forward graph, and the weight half never computes those
    groups' gradients (fewer reduce-scatters, a smaller gradient norm: training goes on with
    wrong gradients, no error)."""
    try:
        name, facts = schedule_facts(schedule)
    except ValueError:
        return  # plan_stages reports the unknown schedule
    if policy == "always" and facts.split_backward:
        raise ConfigError(
            f"parallelism.fsdp_reshard_after_forward='always' with the {name} schedule would drop "
            f"the weight gradients of every FSDP group resharded after forward (its input-gradient "
            f"half runs on the sharded parameters); use 'default' (no resharding under pp) or "
            f"'never', or a schedule without split backward"
        )


def _check_varlen_cp(cfg: JobConfig, cp: int) -> None:
    if cfg.model.attn_type == "varlen" and cp > 1:
        raise ConfigError(
            f"model.attn_type='varlen' does not compose with context parallelism (cp={cp}): it runs "
            "whole documents, not one rank's load-balanced chunks; use 'flex' or 'sdpa' with cp > 1"
        )


def _check_float8_experts(spec: ModelSpec, name: str, opts: Float8Options, etp: int) -> None:
    """float8 routed experts asked for: some routed-expert module of the model converts (a meta
    build: shapes only)."""
    import torch

    with torch.device("meta"):
        model = spec.model_cls(spec.args)
    check_float8_experts(model, name, opts, etp)


def plan_model(cfg: JobConfig, tokenizer_vocab: int, tokenizer_eos: int | None = None) -> ModelSpec:
    """The job's model (``JobPlan.model``, and the seed checkpoint's): flavor, overrides, vocabulary."""
    spec = config_model_spec(cfg)
    args = dataclasses.replace(spec.args, **model_overrides(cfg, tokenizer_vocab, tokenizer_eos))
    args.validate()
    return dataclasses.replace(spec, args=args)


def _batch_plan(cfg: JobConfig, pd: ParallelDims) -> BatchPlan:
    t = cfg.training
    batch_degree = pd.size("batch")
    global_batch_size = resolve_global_batch_size(t.global_batch_size, t.local_batch_size, batch_degree)
    # the batch rules with the layout's wording (which degree to change), then the accumulation
    check_model_layout(pd.degrees, ModelRules(global_batch_size=global_batch_size, local_batch_size=t.local_batch_size))
    return BatchPlan(
        global_batch_size=global_batch_size,
        local_batch_size=t.local_batch_size,
        batch_degree=batch_degree,
        grad_accum_steps=gradient_accumulation_steps(t.global_batch_size, t.local_batch_size, batch_degree),
        seq_len=t.seq_len,
    )


def validation_batch(cfg: JobConfig, batch_degree: int) -> tuple[int, int]:
    """(global validation batch, micro-batches per rank per validation step) of
    ``[validation]`` on ``batch_degree`` batch ranks; ConfigError naming the validation keys."""
    v = cfg.validation
    g = v.global_batch_size if v.global_batch_size > 0 else v.local_batch_size * batch_degree
    unit = batch_degree * v.local_batch_size
    if g % unit:
        per_rank = [
            d for d in range(1, g // batch_degree + 1) if g % batch_degree == 0 and (g // batch_degree) % d == 0
        ]
        raise ConfigError(
            f"validation.global_batch_size ({g}) must be a multiple of batch degree ({batch_degree}) x "
            f"validation.local_batch_size ({v.local_batch_size}) = {unit}; set it to a multiple of {unit}"
            + (f", or set validation.local_batch_size to one of {per_rank}" if per_rank else "")
        )
    return g, g // unit
