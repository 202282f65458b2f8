"""The reference model of the preference objective (trainer/objectives/dpo.py).

* ``adapters_off`` (``dpo.reference = "auto"`` with LoRA): the policy itself with every adapter's
  scale set to 0 for the reference forward (``output + 0 * B A``: exactly the frozen base's
  output), under ``no_grad``; no second copy of the weights. The MoE layers' routing counters
  and aux-loss totals are put back afterwards, so the reference pass leaves no trace in the
  expert-bias update or the reported loss. It routes with the policy's CURRENT expert bias
  (DeepSeek-V3's load-balancing bias is a buffer the training updates, not a weight the adapters
  touch), where the frozen copy keeps the initial bias: with that bias update on, the two
  references differ once the bias has moved.
* ``copy`` (else): a second model built from the same plan (trainer/preference.py, with
  ``trainer/build.py`` ``build_model_parts``: parallelized like the policy, FSDP shards and all,
  and initialized from the same seed), then loaded here (:func:`load_initial_weights`) from
  ``checkpoint.initial_load_path`` as the policy's initial weights are (a Hugging Face folder
  or a DCP folder, model weights only; a LoRA copy loads the base and keeps its
  zero-initialized adapters' B = 0). Its parameters never need gradients.
  On resume it is rebuilt the same way, so it always holds the run's INITIAL weights, never a
  step checkpoint's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn

__all__ = ["adapters_off", "load_initial_weights"]


@contextlib.contextmanager
def adapters_off(model_parts: Sequence[nn.Module]) -> Iterator[None]:
    """Every LoRA adapter of ``model_parts`` scaled by 0 (and the MoE counters restored) inside."""
    adapted = [m for part in model_parts for m in part.modules() if hasattr(m, "lora_scale")]
    scales = [m.lora_scale for m in adapted]
    kept = [
        (buf, buf.clone())
        for part in model_parts
        for m in part.modules()
        for name, buf in m.named_buffers(recurse=False)
        if name in ("tokens_per_expert", "aux_loss_total")
    ]
    for m in adapted:
        m.lora_scale = 0.0
    try:
        yield
    finally:
        for m, s in zip(adapted, scales):
            m.lora_scale = s
        with torch.no_grad():
            for buf, value in kept:
                buf.copy_(value)


def load_initial_weights(cfg, plan, parts: list[nn.Module], initial_hf, log) -> None:
    """The frozen copy's weights: ``parts`` (built and seeded like the policy) loaded from the
    run's initial weights and frozen (see the module docstring)."""
    from models.parallel.lora import is_adapter_key
    from trainer.checkpoint.dcp import load_checkpoint
    from trainer.checkpoint.hf_load import load_hf_into_model

    c = cfg.checkpoint
    if c.initial_load_path and c.initial_load_in_hf:
        load_hf_into_model(parts, c.initial_load_path, cfg.model.name, plan.model.args, checkpoint=initial_hf)
    elif c.initial_load_path:
        lora = plan.parallelize.lora is not None
        load_checkpoint(c.initial_load_path, parts, select=(lambda k: not is_adapter_key(k)) if lora else None)
    for part in parts:
        part.requires_grad_(False)
        part.loss_chunk_tokens = cfg.training.loss_chunk_tokens  # the head returns per-token losses too
    f8 = plan.parallelize.float8
    if f8 is not None and f8.precompute_scale:  # the frozen weights' float8 scales, once: they never change
        from models.parallel.float8 import precompute_float8_scales

        precompute_float8_scales(parts)
    where = c.initial_load_path or f"the seeded init, training.seed = {cfg.training.seed}"
    log(f"dpo reference: a frozen copy of the initial weights ({where}), sharded like the policy")
