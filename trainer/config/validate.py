"""Validation of one :class:`~trainer.config.schema.JobConfig`'s values (enum choices, ranges,
model names and flavors from the model registry) and the batch-size arithmetic.

What depends on the world size (degrees, divisibility by the batch degree, the model against the
layout) is checked once, by the job plan (:func:`trainer.plan.plan_job`).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import math
import re
from collections.abc import Callable
from typing import Any

import torch

from models.parallel.float8 import FLOAT8_CONVERTERS, FLOAT8_EXPERT_CONVERTERS
from models.parallel.lora import LORA_CONVERTERS
from models.registry import HF_FLAVOR, flavor_names, has_experts
from trainer.config.derived import apply_hf_path, attn_mask_type
from trainer.config.dpo_section import validate_dpo
from trainer.config.errors import ConfigError
from trainer.config.long_run_checks import validate_long_run
from trainer.config.preference_checks import validate_preference
from trainer.config.schema import SECTIONS, JobConfig


def validate_config(cfg: JobConfig) -> None:
    """Raise ConfigError for the first value the trainer could not run with."""
    for name, cls in SECTIONS.items():
        section = getattr(cfg, name)
        for f in dataclasses.fields(cls):
            choices = f.metadata.get("choices")
            value = getattr(section, f.name)
            if choices is not None and value not in choices:
                raise ConfigError(_choice_message(f"{name}.{f.name}", value, choices))
    apply_hf_path(cfg)  # model.hf_path: the family, sizes, weights and tokenizer of one folder
    _validate_values(cfg)


def _validate_float8(cfg: JobConfig) -> None:
    known = FLOAT8_CONVERTERS + FLOAT8_EXPERT_CONVERTERS + LORA_CONVERTERS
    for name in cfg.model.converters:
        if name not in known:
            raise ConfigError(_choice_message("model.converters entry", name, known))
    f8 = cfg.float8
    if any(name in FLOAT8_EXPERT_CONVERTERS for name in cfg.model.converters) and not f8.moe_fqns:
        raise ConfigError(
            "model.converters has 'float8_experts' but float8.moe_fqns is empty, so no routed experts would "
            "convert: set float8.moe_fqns = ['experts'] (every MoE layer), or remove 'float8_experts'"
        )
    if f8.enable_fsdp_float8_all_gather and f8.recipe_name != "tensorwise":
        raise ConfigError(
            f"float8.enable_fsdp_float8_all_gather needs tensorwise scaling (FSDP all-gathers one float8 "
            f"weight with one scale), but float8.recipe_name is '{f8.recipe_name}': set float8.recipe_name = "
            "'tensorwise', or float8.enable_fsdp_float8_all_gather = false"
        )
    if f8.precompute_float8_dynamic_scale_for_fsdp and not f8.enable_fsdp_float8_all_gather:
        raise ConfigError(
            "float8.precompute_float8_dynamic_scale_for_fsdp precomputes the scales of the float8 all-gather, "
            "which is off: set float8.enable_fsdp_float8_all_gather = true, or turn the precompute off"
        )


def _validate_lora(cfg: JobConfig) -> None:
    lo = cfg.lora
    if lo.rank <= 0:
        raise ConfigError(f"lora.rank must be a positive integer, got {lo.rank}; 8 or 16 are common")
    if not lo.alpha > 0:
        raise ConfigError(f"lora.alpha must be > 0, got {lo.alpha}; e.g. twice lora.rank")
    if not 0 <= lo.dropout < 1:
        raise ConfigError(f"lora.dropout must be in [0, 1), got {lo.dropout}")
    if lo.frozen_dtype != "float32" and cfg.parallelism.mixed_precision_param != lo.frozen_dtype:
        raise ConfigError(
            f"lora.frozen_dtype = '{lo.frozen_dtype}' stores the frozen base in the compute dtype, but "
            f"parallelism.mixed_precision_param is '{cfg.parallelism.mixed_precision_param}': set it to "
            f"'{lo.frozen_dtype}', or lora.frozen_dtype = 'float32'"
        )
    lora_on = "lora" in cfg.model.converters
    if lora_on and cfg.comm.mode == "local_tensor" and cfg.checkpoint.initial_load_path:
        raise ConfigError(
            "comm.mode = 'local_tensor' reads checkpoint.initial_load_path as full weights for every simulated "
            "rank, which a LoRA base load (model weights only, adapters apart) does not do: run the LoRA job "
            "with real processes, or without initial_load_path"
        )
    if not lo.target_modules and not lo.experts:
        raise ConfigError(
            "lora.target_modules is empty and lora.experts is false: nothing would train; "
            "use e.g. lora.target_modules = ['attention.*', 'feed_forward.*']"
        )


def _validate_values(cfg: JobConfig) -> None:
    def need(cond: bool, message: str) -> None:
        if not cond:
            raise ConfigError(message)

    t, o, s, p = cfg.training, cfg.optimizer, cfg.lr_scheduler, cfg.parallelism

    flavors = tuple(flavor_names(cfg.model.name))
    hf_sized = cfg.model.flavor == HF_FLAVOR  # sizes from a config.json: checked by the job plan
    need(
        not cfg.model.hf_config or hf_sized,
        f"model.hf_config sizes the model only with model.flavor = '{HF_FLAVOR}' (a flavor has its own sizes): set "
        f"model.flavor = '{HF_FLAVOR}' or unset model.hf_config",
    )
    if not hf_sized and cfg.model.flavor not in flavors:
        raise ConfigError(_choice_message("model.flavor", cfg.model.flavor, flavors, f" for model '{cfg.model.name}'"))
    need(
        cfg.model.vocab_size is None or cfg.model.vocab_size > 0,
        f"model.vocab_size must be > 0 (or none for the flavor default), got {cfg.model.vocab_size}",
    )
    need(
        cfg.model.n_layers is None or cfg.model.n_layers > 0,
        f"model.n_layers must be > 0 (or none for the flavor's), got {cfg.model.n_layers}",
    )

    _validate_float8(cfg)
    _validate_lora(cfg)
    validate_dpo(cfg)

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
    need(t.epochs >= 0, f"training.epochs must be >= 0 (0 = off), got {t.epochs}")
    kinds = [src["kind"] for src in t.sources] or [t.dataset]
    need(
        not t.epochs or any(k != "synthetic" for k in kinds),
        f"training.epochs = {t.epochs} counts passes over the data, but synthetic data never ends; "
        "set training.steps instead (and training.epochs = 0), or train on a dataset",
    )
    need(t.max_norm >= 0, f"training.max_norm must be >= 0 (0 disables clipping), got {t.max_norm}")
    need(t.mtp_loss_weight >= 0, f"training.mtp_loss_weight must be >= 0, got {t.mtp_loss_weight}")
    need(
        t.loss_chunk_tokens >= 0,
        f"training.loss_chunk_tokens must be >= 0 (0 = off), got {t.loss_chunk_tokens}; e.g. 1024",
    )
    need(
        t.dataset == "synthetic" or t.dataset_path != "",
        f"training.dataset = '{t.dataset}' needs training.dataset_path (a file or folder)",
    )
    need(
        not t.sources or (t.dataset == "synthetic" and t.dataset_path == ""),
        "training.sources (a mixture) replaces training.dataset and training.dataset_path; leave those unset",
    )
    chat = t.dataset == "chat" or any(src["kind"] == "chat" for src in t.sources)
    need(  # only an explicit 'causal' (the default, 'auto', picks block_causal here)
        not chat or t.chat_packing == "padded" or attn_mask_type(cfg) == "block_causal",
        "training.chat_packing = 'packed' puts several conversations in one window, where causal attention "
        "lets each see the ones before it; set model.attn_mask_type = 'block_causal' or 'auto' (one document "
        "per conversation) or training.chat_packing = 'padded'",
    )

    need(o.lr >= 0 and math.isfinite(o.lr), f"optimizer.lr must be a finite number >= 0, got {o.lr}")
    need(
        len(o.betas) == 2 and all(0.0 <= b < 1.0 for b in o.betas),
        f"optimizer.betas must be two numbers in [0, 1), got {o.betas}",
    )
    need(o.eps > 0, f"optimizer.eps must be > 0, got {o.eps}")
    need(o.weight_decay >= 0, f"optimizer.weight_decay must be >= 0, got {o.weight_decay}")
    _validate_optimizer_extras(o, need)

    need(s.warmup_steps >= 0, f"lr_scheduler.warmup_steps must be >= 0, got {s.warmup_steps}")
    need(0.0 <= s.min_lr_ratio <= 1.0, f"lr_scheduler.min_lr_ratio must be in [0, 1], got {s.min_lr_ratio}")
    need(0.0 <= s.decay_ratio <= 1.0, f"lr_scheduler.decay_ratio must be in [0, 1], got {s.decay_ratio}")

    # the degrees themselves are validated (with the fix) by the job plan, which knows the
    # world size: trainer/plan.py -> parallel_dims.validate_degrees
    if not hf_sized and not has_experts(cfg.model.name, cfg.model.flavor):
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
    need(c.save_in_hf_every >= 0, f"checkpoint.save_in_hf_every must be >= 0 (0 = off), got {c.save_in_hf_every}")
    need(c.keep_latest_k >= 0, f"checkpoint.keep_latest_k must be >= 0 (0 keeps all), got {c.keep_latest_k}")
    need(c.load_step >= -1, f"checkpoint.load_step must be >= 0 or -1 (latest), got {c.load_step}")
    if c.initial_load_in_hf:
        need(
            c.initial_load_path != "",
            "checkpoint.initial_load_in_hf = true needs checkpoint.initial_load_path: the Hugging Face "
            "folder (config.json + model.safetensors) to start from",
        )
        need(
            c.initial_load_model_only,
            "checkpoint.initial_load_in_hf = true loads model weights only (a Hugging Face folder has no "
            "optimizer or data state): set checkpoint.initial_load_model_only = true",
        )
    excludable = ("optimizer", "lr_scheduler", "dataloader", "rng")
    for part in c.exclude_from_loading:
        if part not in excludable:
            raise ConfigError(_choice_message("checkpoint.exclude_from_loading entry", part, excludable))

    need(cfg.metrics.log_freq > 0, f"metrics.log_freq must be > 0, got {cfg.metrics.log_freq}")
    need(
        not cfg.metrics.enable_wandb or importlib.util.find_spec("wandb") is not None,
        "metrics.enable_wandb needs the wandb package, which is not installed: pip install 'meshtrain[wandb]' "
        "(or pip install wandb), or set metrics.enable_wandb = false",
    )
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
        f"comm.init_timeout_seconds and comm.train_timeout_seconds must be > 0, got "
        f"{cfg.comm.init_timeout_seconds} and {cfg.comm.train_timeout_seconds}",
    )
    _validate_comm(cfg, need)
    validate_long_run(cfg, need)  # trainer/config/long_run_checks.py
    validate_preference(cfg, need)  # trainer/config/preference_checks.py
    if cfg.validation.enable:
        _validate_validation(cfg, need)


def _validate_validation(cfg: JobConfig, need) -> None:
    v, p = cfg.validation, cfg.parallelism
    need(v.freq > 0, f"validation.freq must be > 0 (evaluate every N training steps), got {v.freq}")
    need(
        v.local_batch_size > 0,
        f"validation.local_batch_size must be > 0 (samples per rank per validation step), got {v.local_batch_size}",
    )
    need(
        v.global_batch_size > 0 or v.global_batch_size == -1,
        f"validation.global_batch_size must be > 0 or -1 (= validation.local_batch_size x batch degree), "
        f"got {v.global_batch_size}",
    )
    if v.global_batch_size > 0:
        need(
            v.global_batch_size % v.local_batch_size == 0,
            f"validation.global_batch_size ({v.global_batch_size}) must be a multiple of "
            f"validation.local_batch_size ({v.local_batch_size})",
        )
    need(v.seq_len > 0, f"validation.seq_len must be > 0, got {v.seq_len}")
    need(
        v.steps > 0 or v.steps == -1,
        f"validation.steps must be > 0, or -1 for one pass over a 'tokens' dataset, got {v.steps}",
    )
    need(
        v.steps != -1 or v.dataset == "tokens",
        f"validation.steps = -1 means one pass over the validation data, but validation.dataset = "
        f"'{v.dataset}' has no end (it starts over); set validation.steps to a number of steps, e.g. "
        f"--validation.steps 10, or use a 'tokens' dataset",
    )
    need(
        v.dataset == "synthetic" or v.dataset_path != "",
        f"validation.dataset = '{v.dataset}' needs validation.dataset_path (a file or folder"
        + (", the shards folder written by scripts/tokenize_dataset.py)" if v.dataset == "tokens" else ")"),
    )
    tp, cp = p.tensor_parallel_degree, p.context_parallel_degree
    divisor = (tp if p.enable_sequence_parallel else 1) * (2 * cp if cp > 1 else 1)
    need(
        v.seq_len % divisor == 0,
        f"validation.seq_len ({v.seq_len}) must be divisible by {divisor}, like training.seq_len (context "
        f"parallelism splits the sequence into 2*cp chunks, sequence parallelism over tp); set it to a "
        f"multiple of {divisor}",
    )
    if p.pipeline_parallel_degree > 1:
        need(
            p.pipeline_parallel_schedule != "ZBVZeroBubble",
            "validation.enable = true with parallelism.pipeline_parallel_schedule = 'ZBVZeroBubble': torch's "
            "ZBV schedule has no forward-only (eval) path, which validation runs; use another schedule "
            "(e.g. 'Interleaved1F1B', 'InterleavedZeroBubble', '1F1B') or set validation.enable = false",
        )
        m = p.pipeline_microbatches()
        need(
            v.local_batch_size % m == 0,
            f"validation.local_batch_size ({v.local_batch_size}) must be divisible by the pipeline "
            f"microbatch count {m} (parallelism.pipeline_parallel_microbatches, default = "
            f"pipeline_parallel_degree): the validation batch runs through the same pipeline schedule",
        )


def _validate_comm(cfg: JobConfig, need) -> None:
    c = cfg.comm
    need(
        c.trace_buf_size >= 0,
        f"comm.trace_buf_size must be >= 0 (collectives the NCCL flight recorder keeps per rank, "
        f"0 = off; torchtitan's default is 20000), got {c.trace_buf_size}",
    )
    need(
        c.record_step >= 0,
        f"comm.record_step must be >= 0 (a training step to record collectives of, 0 = off), got {c.record_step}",
    )
    need(
        c.record_step <= cfg.training.steps,
        f"comm.record_step ({c.record_step}) is after the last step (training.steps = {cfg.training.steps}): "
        f"choose a step in 1 .. {cfg.training.steps}, or 0 to record nothing",
    )
    if c.mode == "local_tensor":
        _validate_local_tensor(cfg, need)
        return
    if c.mode != "fake_backend":
        need(
            c.fake_world_size is None and c.fake_rank == 0,
            "comm.fake_world_size and comm.fake_rank are used only with comm.mode = 'fake_backend' "
            "(one rank of a larger job, no real collectives): add --comm.mode fake_backend, or remove them",
        )
        return
    w = c.fake_world_size
    need(
        w is not None and w >= 1,
        f"comm.mode = 'fake_backend' needs comm.fake_world_size, the number of ranks (GPUs) of the job "
        f"to simulate, >= 1; got {w}: e.g. --comm.fake_world_size 64",
    )
    need(
        0 <= c.fake_rank < w,
        f"comm.fake_rank ({c.fake_rank}) must be a rank of the simulated job: 0 .. {w - 1} "
        f"(comm.fake_world_size = {w})",
    )
    need(
        not cfg.checkpoint.create_seed_checkpoint,
        "checkpoint.create_seed_checkpoint writes real initial weights on one process; it cannot run "
        "with comm.mode = 'fake_backend': drop one of the two",
    )
    need(*_fake_backend_torch(torch.__version__))


FAKE_BACKEND_MIN_TORCH = (2, 13)


def _validate_local_tensor(cfg: JobConfig, need) -> None:
    """comm.mode = 'local_tensor' (trainer/simulation/local_tensor.py): every rank in this process."""
    c, p, ck = cfg.comm, cfg.parallelism, cfg.checkpoint
    w = c.fake_world_size
    need(
        w is not None and w >= 1,
        f"comm.mode = 'local_tensor' needs comm.fake_world_size, the number of ranks (GPUs) of the job "
        f"to simulate in this process, >= 1; got {w}: e.g. --comm.fake_world_size 8",
    )
    need(
        c.fake_rank == 0,
        "comm.fake_rank is used only with comm.mode = 'fake_backend' (local_tensor simulates every rank): remove it",
    )
    need(
        p.pipeline_parallel_degree == 1,
        f"comm.mode = 'local_tensor' cannot simulate pipeline parallelism (parallelism.pp = {p.pipeline_parallel_degree}): each "
        "pp rank runs different stage modules, which one SPMD program in one process cannot express; "
        "use --parallelism.pp 1, or a real launch (torchrun) for pipeline layouts",
    )
    need(
        not (p.context_parallel_degree > 1 and cfg.model.attn_type == "flex"),
        "comm.mode = 'local_tensor' does not simulate context parallelism with model.attn_type = 'flex' "
        "(each simulated rank needs its own FlexAttention block mask); use --model.attn_type sdpa, or a real "
        "launch (torchrun)",
    )
    need(
        not ck.create_seed_checkpoint,
        "checkpoint.create_seed_checkpoint writes the initial weights on one real process; it cannot run "
        "with comm.mode = 'local_tensor': drop one of the two",
    )
    need(
        not (ck.initial_load_path and ck.initial_load_in_hf),
        "comm.mode = 'local_tensor' reads initial weights from a DCP checkpoint only: convert the Hugging "
        "Face folder first (scripts/convert_hf.py) or unset checkpoint.initial_load_in_hf",
    )
    need(
        not cfg.compile.enable,
        "comm.mode = 'local_tensor' runs eagerly (LocalTensor is a tensor subclass that runs each op once "
        "per simulated rank; torch.compile does not trace it): drop --compile.enable",
    )
    ok, message = _fake_backend_torch(torch.__version__)
    need(ok, message.replace("'fake_backend'", "'local_tensor'"))
    need(
        _local_tensor_available(),
        f"comm.mode = 'local_tensor' needs torch.distributed._local_tensor (LocalTensorMode), which torch "
        f"{torch.__version__} lacks: install torch >= {'.'.join(map(str, FAKE_BACKEND_MIN_TORCH))}",
    )


def _local_tensor_available() -> bool:
    try:
        from torch.distributed._local_tensor import LocalTensorMode  # noqa: F401
    except ImportError:
        return False
    return True


def _fake_backend_torch(version: str) -> tuple[bool, str]:
    """(whether ``version`` runs the fake backend as documented, the error otherwise)."""
    from parallel_dims._torch_support import MAX_TORCH_EXCLUSIVE, parse_torch_version

    parsed = parse_torch_version(version)
    ok = parsed is None or parsed >= FAKE_BACKEND_MIN_TORCH
    need = ".".join(map(str, FAKE_BACKEND_MIN_TORCH))
    below = ".".join(map(str, MAX_TORCH_EXCLUSIVE))
    return ok, (
        f"comm.mode = 'fake_backend' needs torch >= {need} (found {version}): older torch's fake process "
        "group leaves a reduce-scatter's output unwritten, so FSDP's reduced gradients would be "
        f'uninitialized memory; pip install "torch>={need},<{below}", or run with real collectives'
    )


def _validate_optimizer_extras(o: Any, need: Callable[[bool, str], None]) -> None:
    """Muon's keys and each [[optimizer.param_groups]] table (whose keys and types the loader
    checked): a valid regex, values in range, optimizer routing only under Muon."""
    need(0.0 <= o.muon_momentum < 1.0, f"optimizer.muon_momentum must be in [0, 1), got {o.muon_momentum}")
    need(o.muon_ns_steps >= 1, f"optimizer.muon_ns_steps must be >= 1, got {o.muon_ns_steps}")
    need(
        len(o.muon_ns_coefficients) == 3,
        f"optimizer.muon_ns_coefficients must be three numbers (a, b, c), got {o.muon_ns_coefficients}",
    )
    need(o.muon_update_rms > 0, f"optimizer.muon_update_rms must be > 0, got {o.muon_update_rms}")
    for i, g in enumerate(o.param_groups):
        key = f"optimizer.param_groups[{i}]"
        need("pattern" in g, f"{key} needs a pattern (a regex over parameter names, e.g. 'tok_embeddings')")
        try:
            re.compile(g["pattern"])
        except re.error as e:
            raise ConfigError(f"{key}.pattern {g['pattern']!r} is not a valid regex ({e})") from None
        need(g.get("lr_mult", 1.0) >= 0, f"{key}.lr_mult must be >= 0, got {g.get('lr_mult')}")
        need(g.get("weight_decay", 0.0) >= 0, f"{key}.weight_decay must be >= 0, got {g.get('weight_decay')}")
        need(g.get("eps", 1.0) > 0, f"{key}.eps must be > 0, got {g.get('eps')}")
        betas = g.get("betas", [0.0, 0.0])
        need(
            len(betas) == 2 and all(0.0 <= b < 1.0 for b in betas),
            f"{key}.betas must be two numbers in [0, 1), got {betas}",
        )
        if "optimizer" in g:
            need(
                g["optimizer"] in ("AdamW", "Muon"),
                f"{key}.optimizer must be 'AdamW' or 'Muon', got {g['optimizer']!r}",
            )
            need(
                o.name == "Muon" or g["optimizer"] == "AdamW",
                f"{key}.optimizer = 'Muon' needs optimizer.name = 'Muon' (got {o.name!r}); set it, or drop the key",
            )


def _choice_message(key: str, value: Any, choices: tuple, context: str = "") -> str:
    msg = f"{key} must be one of {', '.join(repr(c) for c in choices)}{context}, got {value!r}"
    close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1, cutoff=0.5)
    if not close:  # case-only typos such as 'adamw' are below difflib's cutoff
        close = [c for c in map(str, choices) if c.lower() == str(value).lower()]
    if close:
        msg += f"; did you mean {close[0]!r}?"
    return msg
