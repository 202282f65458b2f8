"""The configuration schema: one dataclass per TOML section, with each key's default, help text
and (for enums) legal values, and :class:`JobConfig` that holds them all.

Validation of values lives in :mod:`trainer.config.validate` (:func:`validate_config`), reading
TOML and command lines in :mod:`trainer.config.loader` (:func:`load_config`,
:func:`config_from_dict`), writing TOML in :mod:`trainer.config.toml_writer`, the batch-size
arithmetic in :mod:`trainer.config.batch`, :class:`ConfigError` in :mod:`trainer.config.errors`.
This module imports none of them but the writer and the arithmetic.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field, make_dataclass
from typing import Any

from models.parallel.float8 import CPU_GEMMS, FLOAT8_RECIPES
from models.registry import model_names
from parallel_dims.axes import AXES
from trainer.config.batch import gradient_accumulation_steps, resolve_global_batch_size
from trainer.config.dpo_section import OBJECTIVES, Dpo
from trainer.config.eval_section import Eval
from trainer.config.fields import DATASETS, TEXT_DOCUMENTS
from trainer.config.fields import opt as _opt
from trainer.config.lora_section import Lora
from trainer.config.optim_schema import LRScheduler, Optimizer
from trainer.config.output_schema import Checkpoint, Metrics, Profiling
from trainer.config.run_schema import Comm, Debug, Validation
from trainer.config.toml_writer import dump_toml

# trainer/config/schema.py -> the repository root, three levels up
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG_DIR = os.path.join(REPO_ROOT, "train_configs")

# every axis by its short name, and the names users also write (fsdp = dp_shard)
PARALLELISM_ALIASES: dict[str, str] = {alias: a.config_key for a in AXES for alias in (a.name, *a.layout_aliases)}
ALIASES: dict[str, dict[str, str]] = {"parallelism": PARALLELISM_ALIASES}


# --------------------------------------------------------------------------- sections


@dataclass
class Job:
    name: str = _opt("default", "Run name, shown in logs.")
    dump_folder: str = _opt("./outputs", "Run folder; relative checkpoint/TensorBoard/metrics paths live under it.")
    description: str = _opt("", "Free-form description, recorded with the resolved config.")
    print_config: bool = _opt(
        False,
        "Print the resolved config whole at start (it is always written to <dump_folder>/config.toml, "
        "whose path is printed).",
    )
    device_memory_gib: float = _opt(
        0.0,
        "Memory of one accelerator in GiB, for the launcher's check that the model fits every node count of "
        "--nnodes MIN:MAX (docs/long_runs.md); 0 = the launcher host's GPU's own (torch.cuda), and on a host "
        "without an accelerator nothing is checked.",
    )


@dataclass
class Model:
    name: str = _opt("llama3", "Model family (models/registry.py).", choices=tuple(model_names()))
    flavor: str = _opt(
        "debugmodel",
        "Size preset of the model family, or 'hf': every size from a Hugging Face config.json (model.hf_config, "
        "else the folder of checkpoint.initial_load_path with initial_load_in_hf = true).",
    )
    hf_config: str = _opt(
        "",
        "With model.flavor = 'hf': the Hugging Face folder (or its config.json) whose sizes the model takes; "
        "'' = checkpoint.initial_load_path (initial_load_in_hf = true).",
    )
    hf_path: str = _opt(
        "",
        "Start from a Hugging Face model folder, in one option: its config.json picks model.name (from "
        "'architectures') and every size (model.flavor = 'hf'), its weights are the starting point "
        "(checkpoint.initial_load_path, initial_load_in_hf = true) and its tokenizer the run's (unless "
        "model.tokenizer_path is set).",
    )
    tokenizer_path: str = _opt(
        "",
        "'' = the tokenizer shipped in assets/tokenizer, 'bytes' = byte-level tokenizer, "
        "otherwise a tokenizer.json file, Meta's tiktoken tokenizer.model, or a folder holding either "
        "(tokenizer.json first, then tokenizer.model, then original/tokenizer.model).",
    )
    vocab_size: int | None = _opt(None, "Override the flavor's vocabulary size; must be >= the tokenizer's vocab size.")
    n_layers: int | None = _opt(
        None,
        "Override the flavor's number of transformer layers (e.g. a real-size model with a "
        "few layers for benchmarks); none = the flavor's.",
    )
    attn_mask_type: str = _opt(
        "auto",
        "causal = every token attends to every earlier token of its packed row; block_causal = only "
        "to the earlier tokens of its own document (documents end at the tokenizer's EOS token); "
        "auto = block_causal when the training data packs chat conversations (training.dataset = 'chat' "
        "or a chat source, chat_packing = 'packed'), else causal.",
        choices=("auto", "causal", "block_causal"),
    )
    attn_type: str = _opt(
        "sdpa",
        "Attention kernel: sdpa (any device), flex (FlexAttention, compiled; CUDA), varlen "
        "(torch's varlen_attn over whole documents; CUDA, block_causal, no cp).",
        choices=("sdpa", "flex", "varlen"),
    )
    document_positions: bool = _opt(
        False,
        "Restart RoPE positions at each document start (needs attn_mask_type = block_causal).",
    )
    mtp_layers: int | None = _opt(
        None,
        "DeepSeek-V3 multi-token prediction depths (the MTP modules of the DeepSeek-V3 report, "
        "num_nextn_predict_layers in config.json; the published model has 1); none = the flavor's (0: off). "
        "Their loss is added with training.mtp_loss_weight. Other models refuse it.",
    )
    converters: list[str] = _opt(
        [],
        "Model converters applied before parallelization: 'float8' (alias 'quantize.linear.float8', "
        "torchtitan 0.2.2's name) trains the linear layers with torchao's float8 GEMMs; 'float8_experts' "
        "(alias 'quantize.grouped_mm.float8') runs the routed experts' grouped GEMMs in float8 "
        "(rowwise); see [float8]. 'lora' trains low-rank adapters on a frozen base; see [lora].",
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
    steps: int = _opt(10000, "Optimizer steps to train for (the learning-rate schedule's length).")
    epochs: int = _opt(
        0,
        "Stop after this many complete passes over the data (0 = off); with training.steps, whichever "
        "comes first. A mixture's epoch is the most passes among its finite sources (docs/data.md).",
    )
    max_norm: float = _opt(1.0, "Gradient-norm clipping threshold; 0 disables clipping.")
    mtp_loss_weight: float = _opt(
        0.3,
        "lambda of DeepSeek-V3 multi-token prediction (model.mtp_layers > 0): the loss is main + lambda / D * "
        "sum of the D depths' losses. 0.3 is the report's value for the first 10T of its 14.8T tokens (0.1 after).",
    )
    loss_chunk_tokens: int = _opt(
        0,
        "Compute the output head and the cross-entropy this many tokens at a time (0 = off): no "
        "[tokens, vocab] logits tensor or its gradient is alive at once; the backward recomputes each "
        "chunk's logits (one more head matmul). Works with TP (vocabulary-sharded head), CP, PP, MTP, "
        "tied embeddings and masks (docs/memory.md).",
    )
    objective: str = _opt(
        "lm",
        "'lm' (next-token cross-entropy on every target token) or 'dpo' (a preference loss on "
        "(chosen, rejected) pairs, see [dpo]; training.dataset = 'preference', docs/fine_tuning.md).",
        choices=OBJECTIVES,
    )
    seed: int = _opt(0, "Seed for parameter init and the synthetic corpus.")
    deterministic: bool = _opt(
        False,
        "Deterministic kernels, so a run repeats bitwise on the same hardware: "
        "torch.use_deterministic_algorithms(True) (an op without a deterministic kernel raises), "
        "CUBLAS_WORKSPACE_CONFIG=:4096:8 set before any CUDA work, and on CUDA cudnn.deterministic; "
        "flash/memory-efficient attention then run their deterministic backward. Slower on GPU; "
        "CPU kernels are deterministic without it (trainer/runtime/precision.py).",
    )
    enable_tf32: bool = _opt(
        False,
        "CUDA only: run float32 matmuls on TF32 tensor cores (torch.backends.cuda.matmul.allow_tf32), "
        "~7x the IEEE fp32 peak on H100 with inputs rounded to a 10-bit mantissa; MFU then uses the "
        "TF32 peak. false (torch's and torchtitan's default) keeps float32 exact IEEE fp32, the "
        "precision the layout-comparison tolerances were measured in; speed runs use "
        "parallelism.mixed_precision_param = bfloat16, which this does not affect.",
    )
    dataset: str = _opt(
        "synthetic",
        "'synthetic' (built-in generated corpus), 'text' (.txt file or folder), "
        "'jsonl' (.jsonl file or folder, field 'text'), 'tokens' (token shards written by "
        "scripts/tokenize_dataset.py: each rank reads only its own samples), 'hf' (column 'text' of a "
        ".parquet file or folder, or a datasets save_to_disk folder), 'chat' (rows with 'messages' in "
        ".jsonl/.parquet files or a save_to_disk folder, loss on the assistant's tokens: docs/fine_tuning.md), "
        "'preference' (rows with prompt, chosen, rejected: a pair of windows each, docs/data.md).",
        choices=DATASETS,
    )
    dataset_path: str = _opt(
        "",
        "File or folder for the 'text', 'jsonl', 'hf', 'chat' and 'preference' datasets; the shards folder for 'tokens'.",
    )
    chat_packing: str = _opt(
        "packed",
        "'chat' data: 'packed' = whole conversations in order into each window (one document each under "
        "model.attn_mask_type = block_causal), the rest padded; 'padded' = one conversation per window.",
        choices=("packed", "padded"),
    )
    chat_too_long: str = _opt(
        "truncate",
        "'chat' data: a conversation longer than seq_len + 1 tokens is cut to fit ('truncate') or skipped ('drop'); "
        "'preference' data: a pair with a sequence that long has both cut after the first seq_len + 1 tokens, or is skipped.",
        choices=("truncate", "drop"),
    )
    row_reading: str = _opt(
        "auto",
        "How 'hf', 'chat' and 'preference' rows are read: 'striped' = cut into one stripe of rows per sample of the "
        "global batch, each packed on its own, so each rank reads only its own rows (parquet and "
        "save_to_disk data); 'sequential' = one stream of windows over all rows, read in full by every "
        "rank (.jsonl needs it); 'auto' = striped where the rows allow it (docs/data.md).",
        choices=("auto", "striped", "sequential"),
    )
    sources: list[dict] = _opt(
        [],
        "A mixture instead of dataset/dataset_path: [[training.sources]] tables (path, kind = a dataset "
        "kind, weight > 0, optional name), each global sample drawn from one by a seeded schedule "
        "(CLI: kind:weight:path,...; docs/data.md).",
    )
    text_documents: str = _opt(
        "file",
        "What one document of a 'text' dataset's .txt files is (where block-causal masking and the "
        "EOS token cut): 'file' (the whole file), 'blank_line' (paragraphs between blank lines) or "
        "'line' (every line that is not blank).",
        choices=TEXT_DOCUMENTS,
    )
    on_nonfinite: str = _opt(
        "stop",
        "What a step with a non-finite loss or gradient norm (or a loss spike: loss_spike_factor) does: 'stop' "
        "the run (one line, exit 1), 'skip' its update on every rank (counted in skipped_steps; stops after "
        "max_consecutive_skips in a row) or 'rollback' to the newest complete checkpoint and go on past the "
        "step's samples (needs checkpoint.enable; docs/long_runs.md).",
        choices=("stop", "skip", "rollback"),
    )
    max_consecutive_skips: int = _opt(
        5,
        "on_nonfinite = skip / rollback: this many bad steps in a row (no good step between) stop the run: "
        "the weights themselves, not a batch, are then the problem.",
    )
    loss_spike_factor: float = _opt(
        0.0,
        "A step whose loss is above this factor x the median of the last loss_spike_window good steps' losses "
        "is a bad step too (handled by on_nonfinite); 0 = off.",
    )
    loss_spike_window: int = _opt(
        50, "Good steps whose losses the loss-spike median is taken over (the rule waits until it has 10)."
    )
    skip_samples: list[str] = _opt(
        [],
        "Global sample ranges 'START:END' (END excluded) never trained on: a step whose first sample lies in "
        "a range reads on from END (what a rollback adds; docs/long_runs.md).",
    )
    cpu_offload: bool = _opt(
        False,
        "Keep the sharded parameters, their gradients and the optimizer state in host memory and step the "
        "optimizer there (FSDP2's CPUOffloadPolicy; FSDP2 then wraps every layout): the device holds only what "
        "a step gathers (docs/memory.md).",
    )
    prefetch: bool = _opt(
        True,
        "Prepare the next step's micro-batches on a background thread while the current step "
        "runs (on GPU: pinned memory, non-blocking copies); same samples and resume state. "
        "false = on the training thread.",
    )

    def resolve_global_batch_size(self, batch_degree: int) -> int:
        return resolve_global_batch_size(self.global_batch_size, self.local_batch_size, batch_degree)

    def gradient_accumulation_steps(self, batch_degree: int) -> int:
        """Derived, not a key: it depends on the batch degree, known only at launch."""
        return gradient_accumulation_steps(self.global_batch_size, self.local_batch_size, batch_degree)


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
    offload: bool = _opt(
        False,
        "Move what the transformer blocks save for backward (with mode = 'full': their inputs) to host memory "
        "in the forward, back in the backward (docs/memory.md).",
    )


@dataclass
class Float8:
    recipe_name: str = _opt(
        "tensorwise",
        "Float8 scaling (model.converters = ['float8']): tensorwise = one scale per tensor (the only "
        "recipe FSDP float8 all-gather works with); rowwise = one scale per row of each operand; "
        "rowwise_with_gw_hp = rowwise with the weight-gradient GEMM in high precision.",
        choices=FLOAT8_RECIPES,
    )
    enable_fsdp_float8_all_gather: bool = _opt(
        False,
        "FSDP all-gathers the converted weights in float8 (half of bf16's bytes); tensorwise only.",
    )
    precompute_float8_dynamic_scale_for_fsdp: bool = _opt(
        False,
        "With the float8 all-gather: compute all the weights' scales after the optimizer step in "
        "one all-reduce instead of one per weight in forward.",
    )
    filter_fqns: list[str] = _opt(
        [],
        "Linear layers to keep in high precision: those whose FQN contains one of these strings "
        "(e.g. 'attention.wq'). The output projection and MoE routers always stay; so do layers "
        "with a dimension that is not a multiple of 16.",
    )
    emulate: bool = _opt(
        False,
        "Run the float8 GEMMs emulated in high precision (GPUs before sm89; eager only). Not needed "
        "on CPU: see cpu_gemm.",
    )
    cpu_gemm: str = _opt(
        "emulated",
        "How a run on CPU computes the float8 GEMMs (torch._scaled_mm): 'emulated' = torch's own "
        "float32 arithmetic for them (float8 operands times their scales, one float32 GEMM, then the "
        "output dtype) on every CPU; 'scaled_mm' = torch's CPU kernel, which on hosts with AMX-INT8 "
        "(Intel Xeon) hands them to oneDNN at about a second per small GEMM. GPUs ignore it.",
        choices=CPU_GEMMS,
    )
    moe_fqns: list[str] = _opt(
        ["experts"],
        "With 'float8_experts' in model.converters: the routed-expert modules whose FQN contains one of "
        "these strings run their grouped GEMMs in float8 (torchtitan: [quantize.grouped_mm.float8] fqns).",
    )


@dataclass
class Compile:
    enable: bool = _opt(False, "torch.compile the components below.")
    components: list[str] = _opt(["model", "loss"], "What to compile: model, loss.")


SECTIONS: dict[str, type] = {
    "job": Job,
    "model": Model,
    "training": Training,
    "optimizer": Optimizer,
    "lr_scheduler": LRScheduler,
    "parallelism": Parallelism,
    "activation_checkpoint": ActivationCheckpoint,
    "float8": Float8,
    "lora": Lora,
    "dpo": Dpo,
    "compile": Compile,
    "checkpoint": Checkpoint,
    "metrics": Metrics,
    "profiling": Profiling,
    "comm": Comm,
    "validation": Validation,
    "eval": Eval,
    "debug": Debug,
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
    float8: Float8 = field(default_factory=Float8)
    lora: Lora = field(default_factory=Lora)
    dpo: Dpo = field(default_factory=Dpo)
    compile: Compile = field(default_factory=Compile)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    metrics: Metrics = field(default_factory=Metrics)
    profiling: Profiling = field(default_factory=Profiling)
    comm: Comm = field(default_factory=Comm)
    validation: Validation = field(default_factory=Validation)
    eval: Eval = field(default_factory=Eval)
    debug: Debug = field(default_factory=Debug)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {
            name: {f.name: _copy_value(getattr(getattr(self, name), f.name)) for f in dataclasses.fields(cls)}
            for name, cls in SECTIONS.items()
        }

    def to_toml(self) -> str:
        return dump_toml(self.to_dict(), header="Resolved job config; load it with --config <file>.")

    def resolve_path(self, path: str) -> str:
        """Relative output paths are anchored at job.dump_folder so one run = one folder."""
        return path if os.path.isabs(path) else os.path.join(self.job.dump_folder, path)


def _copy_value(v: Any) -> Any:
    return [dict(x) if isinstance(x, dict) else x for x in v] if isinstance(v, list) else v
