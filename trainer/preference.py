"""How the trainer's step runs the preference objective (trainer/objectives/) (``training.objective = "dpo"``).

:func:`build_objective` (start-up) replaces the trainer's loss with a
:class:`~trainer.objectives.dpo.PreferenceLoss` (before the pipeline is built, so the last
stage runs it) and :class:`PreferenceStep` then does, every step:

1. :meth:`PreferenceStep.before_step`: the reference pass over the step's micro-batches (the
   same micro-batches, in the same order, split the same way by the pipeline) under
   ``no_grad``, which queues each micro-batch's reference row log-probs in the loss; it
   returns the step's loss divisor, the number of pairs in the global batch (``global batch
   size / 2``: every batch rank, every micro-batch), used where the next-token objective
   divides by the global target count.
2. the trainer's usual forward + backward, the loss taking the queued references.
3. :meth:`PreferenceStep.metrics`: the metric sums, reduced with the loss (over pp and the loss
   mesh), divided by the pairs: TRL's global means.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from torch import nn

from trainer.objectives.dpo import METRIC_NAMES, PreferenceLoss
from trainer.objectives.reference import adapters_off, load_initial_weights

__all__ = ["PreferenceStep", "build_objective"]


def build_objective(cfg, plan, device: torch.device) -> PreferenceLoss | None:
    """The preference loss (None for ``training.objective = "lm"``)."""
    if cfg.training.objective != "dpo":
        return None
    from trainer.config.errors import ConfigError

    if getattr(plan.model.args, "mtp_layers", 0):
        raise ConfigError("training.objective = 'dpo' does not train DeepSeek-V3 MTP depths: set model.mtp_layers = 0")
    pd = plan.parallel_dims
    cp_mesh = pd.get_optional_mesh("cp")
    cp_group = cp_mesh.get_group() if cp_mesh is not None and pd.cp > 1 else None
    return PreferenceLoss(cfg.dpo, cp_group, pd.cp, reference_free=cfg.dpo.reference == "none")


class PreferenceStep:
    """The per-step part of the objective (see the module docstring). ``forward``: the
    trainer's :class:`~trainer.forward.ModelForward` over the policy."""

    def __init__(
        self, cfg, plan, loss: PreferenceLoss, model_parts: Sequence[nn.Module], forward, device, log, initial_hf=None
    ):
        self.loss, self.device = loss, device
        self.pairs = plan.batch.global_batch_size // 2
        self.ref_forward = None
        self.ref_context = None
        d = cfg.dpo
        lora = plan.parallelize.lora is not None
        if d.reference == "none":
            log(f"dpo: loss_type {d.loss_type} (beta {d.beta}, gamma {d.gamma}), reference-free")
            return
        mode = "adapters_off" if d.reference == "auto" and lora else "copy"
        if mode == "adapters_off":
            self.ref_forward, self.ref_context = forward, lambda: adapters_off(model_parts)
            log("dpo reference: the policy with its LoRA adapters off (no second copy of the weights)")
        else:
            from trainer.build import build_model_parts, build_pipeline
            from trainer.forward import ModelForward

            with torch.device("meta"):
                model = plan.model.model_cls(plan.model.args)
            parts = build_model_parts(plan, model, device, cfg.training.seed)
            load_initial_weights(cfg, plan, parts, initial_hf, log)
            pipeline = build_pipeline(plan, parts, loss, loss_parallel=forward.loss_parallel)
            self.ref_forward = ModelForward(
                plan.parallel_dims, parts, loss, device, loss_parallel=forward.loss_parallel, pipeline=pipeline
            )
            self.ref_context = contextlib.nullcontext
        log(
            f"dpo: loss_type {d.loss_type} (beta {d.beta}"
            + (f", label_smoothing {d.label_smoothing}" if d.label_smoothing else "")
            + f"), reference: {mode}; the loss is the mean over the global batch's {self.pairs} pairs"
        )

    def before_step(self, microbatches: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
        """The reference pass (see the module docstring); returns the step's pair count."""
        if self.ref_forward is not None:
            self.loss.refs.clear()
            self.loss.collecting = True
            try:
                with torch.no_grad(), self.ref_context():
                    for inputs, labels in microbatches:
                        self.ref_forward(inputs, labels, self.pairs, backward=False)
            finally:
                self.loss.collecting = False
        return self.pairs

    def take_metrics(self) -> torch.Tensor:
        """This rank's metric sums of the step (they ride with the loss's reductions)."""
        return self.loss.take_metrics(self.device)

    def metrics(self, totals: Sequence[float]) -> dict[str, float]:
        """The step's metrics with TRL's names from the reduced sums."""
        return {name: float(v) / self.pairs for name, v in zip(METRIC_NAMES, totals)}
