"""The config sections of the optimizer and the learning-rate schedule ([optimizer],
[lr_scheduler], with the keys of a [[optimizer.param_groups]] table), beside the other sections
in :mod:`trainer.config.schema`, which re-exports them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainer.config.fields import opt as _opt

__all__ = ["PARAM_GROUP_KEYS", "TABLE_KEYS", "LRScheduler", "Optimizer"]


# The keys of one [[optimizer.param_groups]] table and their types (trainer/config/loader.py
# checks and converts them; trainer/optim/groups.py applies them). Only `pattern` is required.
PARAM_GROUP_KEYS: dict[str, Any] = {
    "pattern": str,
    "lr_mult": float,
    "weight_decay": float,
    "betas": list[float],
    "eps": float,
    "optimizer": str,
}
# config keys whose value is an array of tables, with the keys of each table
TABLE_KEYS: dict[str, dict[str, Any]] = {"optimizer.param_groups": PARAM_GROUP_KEYS}


@dataclass
class Optimizer:
    name: str = _opt(
        "AdamW",
        "Optimizer: AdamW, or Muon (Newton-Schulz-orthogonalised momentum for the hidden matrices, "
        "AdamW for embeddings, head, norms, biases and groups routed to it; docs/optimizers.md).",
        choices=("AdamW", "Muon"),
    )
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
    state_dtype: str = _opt(
        "float32",
        "Dtype of the optimizer state (AdamW's moments, Muon's momentum): float32, or bfloat16 (half "
        "the bytes; stochastically rounded, the weights and the update stay float32; with bfloat16, "
        "AdamW runs meshtrain's own per-parameter kernel whatever optimizer.implementation says). "
        "Resuming across state dtypes casts the stored state (docs/optimizers.md).",
        choices=("float32", "bfloat16"),
    )
    param_groups: list[dict] = _opt(
        [],
        "Parameter groups, as [[optimizer.param_groups]] tables (on the command line a TOML array of "
        "inline tables): pattern (regex searched in each parameter's FQN; the first group that matches "
        "wins), and any of lr_mult, weight_decay, betas, eps, optimizer (AdamW or Muon, with "
        "optimizer.name = Muon). A pattern that matches no parameter is an error.",
    )
    muon_momentum: float = _opt(0.95, "Muon: momentum coefficient (Nesterov).")
    muon_nesterov: bool = _opt(True, "Muon: Nesterov momentum (false = plain heavy-ball momentum).")
    muon_ns_steps: int = _opt(5, "Muon: Newton-Schulz iterations.")
    muon_ns_coefficients: list[float] = _opt(
        [3.4445, -4.775, 2.0315],
        "Muon: (a, b, c) of the Newton-Schulz quintic a X + b (X X^T) X + c (X X^T)^2 X "
        "(Keller Jordan's, used by torchtitan and Moonlight).",
    )
    muon_distribution: str = _opt(
        "round_robin",
        "Muon under FSDP/TP: how Newton-Schulz gets each sharded matrix whole. round_robin: one owner "
        "rank of the sharding group per matrix (balanced by FLOPs) orthogonalises it and sends each rank "
        "its shard back; gather: every rank all-gathers every matrix and orthogonalises it "
        "(redundant FLOPs). Same update bitwise; docs/optimizers.md.",
        choices=("round_robin", "gather"),
    )
    muon_update_rms: float = _opt(
        0.2,
        "Muon: the orthogonalised update is scaled by muon_update_rms x sqrt(max(rows, cols)), an update "
        "RMS of about muon_update_rms per unit lr at every shape. 0.2 is Moonlight's (arXiv:2502.16982), "
        "which carries AdamW's lr and weight_decay over in long large runs; on small models and short runs "
        "1.0 does and 0.2 learns slower (measured: docs/optimizers.md).",
    )


@dataclass
class LRScheduler:
    warmup_steps: int = _opt(200, "Steps of linear warmup to the peak lr.")
    decay_style: str = _opt(
        "cosine",
        "Shape of the decay after warmup: cosine/linear over all remaining steps, constant, or wsd "
        "(warmup-stable-decay: the peak until the last decay_ratio of the steps, then decay_shape).",
        choices=("cosine", "linear", "constant", "wsd"),
    )
    min_lr_ratio: float = _opt(0.1, "Final lr as a fraction of the peak (ignored by 'constant').")
    decay_ratio: float = _opt(
        0.1,
        "wsd: fraction of training.steps in the final decay (round(ratio x steps) steps); resuming with "
        "more steps moves the decay to the new end and lengthens the stable phase.",
    )
    decay_shape: str = _opt(
        "1-sqrt",
        "wsd: shape of the final decay (1-sqrt: Hagele et al. 2024, arXiv:2405.18392).",
        choices=("linear", "cosine", "1-sqrt"),
    )
