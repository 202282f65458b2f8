"""The ``[dpo]`` section (``training.objective = "dpo"``; trainer/objectives/, docs/fine_tuning.md)
and its checks, apart from trainer/config/schema.py so the schema stays one page; it registers
the section there and trainer/config/validate.py calls :func:`validate_dpo`."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["DPO_LOSS_TYPES", "OBJECTIVES", "REFERENCES", "Dpo", "validate_dpo"]

OBJECTIVES = ("lm", "dpo")
DPO_LOSS_TYPES = ("sigmoid", "ipo", "simpo")
REFERENCES = ("auto", "copy", "none")


def _opt(default, help: str, choices: tuple | None = None):
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class Dpo:
    beta: float = _opt(
        0.1,
        "beta of the preference loss: the reward is beta x (policy - reference) log-probability of a "
        "completion (TRL's DPOConfig.beta); IPO's regularization tau; SimPO's reward scale (e.g. 2.0).",
    )
    loss_type: str = _opt(
        "sigmoid",
        "'sigmoid' (DPO), 'ipo' (squared loss on the per-token-averaged log-ratio margin, as TRL 1.16 "
        "defines it), 'simpo' (reference-free, length-normalized log-probs with the margin dpo.gamma).",
        choices=DPO_LOSS_TYPES,
    )
    label_smoothing: float = _opt(
        0.0,
        "sigmoid only: conservative DPO, the assumed probability that a pair's preference is flipped: "
        "loss = -(1 - e) logsigmoid(beta d) - e logsigmoid(-beta d); in [0, 0.5).",
    )
    gamma: float = _opt(0.5, "simpo only: the target reward margin gamma: loss = -logsigmoid(beta d_avg - gamma).")
    reference: str = _opt(
        "auto",
        "The reference model: 'copy' (a frozen copy of the initial weights, sharded like the policy), "
        "'auto' (with LoRA the same model with its adapters off, no second copy; else 'copy'), 'none' "
        "(simpo only: reference-free).",
        choices=REFERENCES,
    )


def validate_dpo(cfg) -> None:
    """One-line ConfigErrors for the combinations the preference objective cannot run with."""
    from trainer.config.errors import ConfigError

    t, d = cfg.training, cfg.dpo
    if t.objective != "dpo":
        return
    kinds = [src["kind"] for src in t.sources] or [t.dataset]
    if any(k != "preference" for k in kinds):
        raise ConfigError(
            "training.objective = 'dpo' trains on (chosen, rejected) pairs: set training.dataset = 'preference' "
            "(rows with prompt / chosen / rejected, docs/fine_tuning.md)"
        )
    if d.beta <= 0:
        raise ConfigError(f"dpo.beta must be > 0, got {d.beta}; 0.1 is TRL's default")
    if not 0 <= d.label_smoothing < 0.5:
        raise ConfigError(f"dpo.label_smoothing must be in [0, 0.5), got {d.label_smoothing}")
    if d.label_smoothing and d.loss_type != "sigmoid":
        raise ConfigError(f"dpo.label_smoothing applies to loss_type 'sigmoid' only; set it to 0 for '{d.loss_type}'")
    if d.loss_type == "simpo" and d.reference != "none":
        raise ConfigError("dpo.loss_type = 'simpo' is reference-free: set dpo.reference = 'none'")
    if d.loss_type != "simpo" and d.reference == "none":
        raise ConfigError(f"dpo.loss_type = '{d.loss_type}' needs a reference model: set dpo.reference = 'auto'")
    if d.reference == "auto" and "lora" in cfg.model.converters and cfg.lora.dropout > 0:
        raise ConfigError("dpo.reference = 'auto' with LoRA: set lora.dropout = 0 (the adapters-off reference)")
    # an even local batch and pipeline micro-batch: trainer/config/preference_checks.py (preference data)
    if getattr(cfg.model, "mtp_layers", 0):
        raise ConfigError("training.objective = 'dpo' does not train DeepSeek-V3 MTP depths: set model.mtp_layers = 0")
    if cfg.comm.mode == "local_tensor":
        raise ConfigError("training.objective = 'dpo' runs on real ranks: set comm.mode to its default")
