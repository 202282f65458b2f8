"""The config sections of what a run writes ([checkpoint], [metrics], [profiling]), beside the
other sections in :mod:`trainer.config.schema`, which re-exports them."""

from __future__ import annotations

from dataclasses import dataclass

from trainer.config.fields import opt as _opt

__all__ = ["Checkpoint", "Metrics", "Profiling"]


@dataclass
class Checkpoint:
    enable: bool = _opt(False, "Save resumable checkpoints and resume from the latest one.")
    folder: str = _opt("checkpoint", "Checkpoint folder, relative to job.dump_folder.")
    interval: int = _opt(500, "Save every N steps (the last step is always saved).")
    keep_latest_k: int = _opt(10, "Keep the newest K checkpoints; 0 keeps all.")
    async_mode: str = _opt(
        "disabled",
        "How a resumable checkpoint is written: disabled = training waits for the whole save; async = "
        "the state is copied to CPU memory (training waits for that only) and written by a background "
        "thread while training goes on; async_with_pinned_mem (CUDA) = the copy goes into pinned host "
        "buffers reused by every save, in the background, and a separate process writes. At most one "
        "save is in flight; a failed background write stops the run (exit 1).",
        choices=("disabled", "async", "async_with_pinned_mem"),
    )
    load_step: int = _opt(-1, "Step to resume from; -1 = latest found in the folder.")
    create_seed_checkpoint: bool = _opt(
        False, "Only initialise the model, save it as step-0 and exit (run with 1 process)."
    )
    initial_load_path: str = _opt("", "Checkpoint folder to initialise from when the run folder has no checkpoint yet.")
    initial_load_model_only: bool = _opt(
        True, "Take only model weights from initial_load_path (not optimizer/data state)."
    )
    initial_load_in_hf: bool = _opt(
        False,
        "initial_load_path is a Hugging Face folder (config.json + model.safetensors or "
        "model.safetensors.index.json and shards): its config.json is checked against the model "
        "flavor and overrides, then each rank reads only its shard of every tensor, in any layout.",
    )
    export_dtype: str = _opt("float32", "Dtype of exported weights.", choices=("float32", "bfloat16", "float16"))
    last_save_model_only: bool = _opt(
        False,
        "At the final step write consolidated weights (export_dtype) instead of a resumable checkpoint.",
    )
    last_save_in_hf: bool = _opt(
        False,
        "At the final step also write the model as a Hugging Face folder (transformers' "
        "from_pretrained loads it; export_dtype) to <dump_folder>/<checkpoint.folder>/step-N-hf; "
        "works without checkpoint.enable. With checkpoint.enable the resumable step-N is still "
        "written, unless last_save_model_only, where the folder replaces the .pt export.",
    )
    save_in_hf_every: int = _opt(
        0,
        "Also write a Hugging Face folder step-N-hf (export_dtype) every N steps, from the live model "
        "(each rank writes its files; training waits for it); 0 = off. Works without checkpoint.enable.",
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
    enable_wandb: bool = _opt(False, "Log the same rows to Weights & Biases (rank 0; needs the wandb extra).")
    wandb_project: str = _opt("", "W&B project; empty: $WANDB_PROJECT, else 'meshtrain'.")
    wandb_entity: str = _opt("", "W&B entity (team or user); empty: $WANDB_ENTITY, else your default.")
    wandb_run_name: str = _opt("", "W&B run name; empty: $WANDB_NAME, else job.dump_folder's name.")
    straggler_interval: int = _opt(
        0,
        "Every N steps the ranks gather their step times (compute, data wait) into the metrics row "
        "(min / median / max, the slowest rank); 0 = metrics.log_freq. Not with one rank.",
    )
    straggler_threshold: float = _opt(
        0.25,
        "A rank whose step time is more than this fraction above the ranks' median is named in one line "
        "with its host (docs/long_runs.md).",
    )


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
    matmul_census_step: int = _opt(
        0,
        "Count the FLOPs of every matmul-class op (GEMMs, attention, forward and backward, this "
        "rank's local shards) of training step N per dtype on every rank and write "
        "<dump_folder>/matmul_census_rank<R>.json; 0 = off. Counting slows that step.",
    )
