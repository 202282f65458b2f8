"""Which kernels the models' norms and attention run on a device: the trainer's start-up line.

The choices are made where the work happens (``models/common/norms.py`` ``rms_norm_path``,
``models/common/attention.py`` ``value_head_plan``) from the device, the compute dtype and the
shapes the model declares; this module asks the same functions the same questions, so the line
says what the forward runs, not a guess beside it.

It reads the models through the shared contract only (``RMSNorm``, an attention's ``core`` and
``DecoderAttention.narrow_value_heads``), never a model's folder: MLA stays DeepSeek-V3's
(``models/deepseek_v3/block.py`` says why) and still appears here, as would any new attention
with narrow values, without an edit to this file.
"""

from __future__ import annotations

import torch
from torch import nn

from models.common.attention import value_head_plan
from models.common.decoder import DecoderAttention
from models.common.norms import RMSNorm, rms_norm_path

__all__ = ["kernels_line"]


def kernels_line(model_parts: list[nn.Module], device: torch.device, dtype: torch.dtype) -> str:
    """One line, e.g. ``kernels: rms_norm fused (F.rms_norm); attention sdpa, MLA V unpadded
    (cudnn)``, for this rank's model parts training on ``device`` with ``dtype`` activations
    (the mixed-precision compute dtype: the norms' gains are cast to it too)."""
    modules = [m for part in model_parts for m in part.modules()]
    parts = []
    if any(isinstance(m, RMSNorm) for m in modules):
        if rms_norm_path(device.type, dtype, dtype) == "fused":
            parts.append("rms_norm fused (F.rms_norm)")
        else:
            parts.append(f"rms_norm op by op (no fused kernel on {device.type})")
    cores = sorted({m.core.attn_type for m in modules if isinstance(getattr(m, "core", None), nn.Module)})
    if cores:
        attention = "attention " + "/".join(cores)
        plans: dict[str, set[str]] = {}
        for m in modules:
            narrow = m.narrow_value_heads() if isinstance(m, DecoderAttention) else None
            if narrow is not None:
                label, qk_dim, v_dim = narrow
                plan = value_head_plan(m.core, device, dtype, qk_dim, v_dim)
                plans.setdefault(label, set()).add(plan.describe(qk_dim, v_dim))
        for label in sorted(plans):
            attention += f", {label} " + "; ".join(sorted(plans[label]))
        parts.append(attention)
    return "kernels: " + ("; ".join(parts) if parts else "no norms or attention on this rank")
