"""The config sections of how a run behaves around its steps ([comm]: timeouts and simulated
worlds, [validation], [debug]: drills), beside the other sections in :mod:`trainer.config.schema`,
which re-exports them."""

from __future__ import annotations

from dataclasses import dataclass

from trainer.config.fields import DATASETS, TEXT_DOCUMENTS
from trainer.config.fields import opt as _opt

__all__ = ["Comm", "Debug", "Validation"]


@dataclass
class Comm:
    init_timeout_seconds: int = _opt(
        300,
        "Process-group timeout (every group) until the first step ends; also the limit of the first "
        "step, of each checkpoint save and of each validation pass (the step watchdog).",
    )
    train_timeout_seconds: int = _opt(
        100,
        "Collective timeout once training runs, and the limit of each training step after the first: "
        "past it, the rank prints one line (step, this option, the flight-recorder dump) and exits "
        "with code 3. On NCCL the step watchdog fires at this limit and the process groups time out "
        "30 s later; on gloo the collective times out at this limit.",
    )
    trace_buf_size: int = _opt(
        20000,
        "NCCL flight recorder: collectives kept per rank (TORCH_NCCL_TRACE_BUFFER_SIZE), dumped on a "
        "timeout to <dump_folder>/comm_traces/rank_<R>; 0 = off. Environment variables set before "
        "launch win.",
    )
    mode: str = _opt(
        "default",
        "'default' = real collectives; 'fake_backend' = run ONE rank (comm.fake_rank) of a "
        "comm.fake_world_size-rank job in this single process, on torch's fake backend: the "
        "layout is built and the model parallelized as on the cluster, collectives are no-ops; "
        "reports this rank's peak memory and compute time per step (loss values are meaningless); "
        "'local_tensor' = run ALL comm.fake_world_size ranks in this single process with real values "
        "(torch's LocalTensorMode): the loss and weights are the real job's.",
        choices=("default", "fake_backend", "local_tensor"),
    )
    fake_world_size: int | None = _opt(
        None, "comm.mode = 'fake_backend' / 'local_tensor': the world size (number of GPUs) of the job to simulate."
    )
    fake_rank: int = _opt(0, "comm.mode = 'fake_backend': the rank of that job this process plays.")
    record_step: int = _opt(
        0,
        "Record every collective of training step N on every rank (kind, mesh, count, bytes) and "
        "write <dump_folder>/comm_rank<R>.json; 0 = off. Recording slows that step.",
    )


@dataclass
class Validation:
    enable: bool = _opt(False, "Evaluate on held-out data every `freq` steps and at the last step.")
    dataset: str = _opt(
        "synthetic",
        "Validation data, the same kinds as training.dataset ('synthetic' draws from another seed "
        "than training, so it is held out; 'chat' windows follow training.chat_packing and chat_too_long).",
        choices=DATASETS,
    )
    dataset_path: str = _opt("", "File or folder for 'text'/'jsonl'/'hf'/'chat'; the shards folder for 'tokens'.")
    text_documents: str = _opt(
        "file",
        "What one document of a 'text' dataset's .txt files is, as training.text_documents.",
        choices=TEXT_DOCUMENTS,
    )
    local_batch_size: int = _opt(8, "Validation micro-batch size per rank (samples per forward).")
    global_batch_size: int = _opt(
        -1,
        "Validation samples per validation step across all data-parallel ranks, like "
        "training.global_batch_size; -1 = local_batch_size x batch degree. Set it to compare "
        "validation losses across layouts (the same samples whatever the batch degree).",
    )
    seq_len: int = _opt(2048, "Tokens per validation sample.")
    freq: int = _opt(10, "Evaluate after every `freq` training steps (and after the last one).")
    steps: int = _opt(
        -1,
        "Validation steps per evaluation (each reads validation.local_batch_size x batch degree "
        "samples, from the start of the validation data every time); -1 = one pass over a "
        "'tokens' dataset (the other datasets have no end: give a number).",
    )


@dataclass
class Debug:
    fault: list[str] = _opt(
        [],
        "Faults injected for drills (docs/long_runs.md): 'nan_loss@STEP', 'kill@STEP', 'hang@STEP', "
        "'slow:factor=F' (every step from @STEP, default 1), each with an optional ':rank=R' (default: "
        "every rank); several comma-separated.",
    )
