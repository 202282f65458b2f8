"""Which kernels the models' norms and attention run on a device: the trainer's start-up line.

The choices are made where the work happens (``models/common/norms.py`` ``rms_norm_path``,
``models/common/attention.py`` ``value_head_plan``) from the device, the compute dtype and the
shapes the model declares; this module asks the same functions the same questions, so the line
says what the forward runs, not a guess beside it.
"""

from __future__ import annotations

import torch
from torch import nn

from models.common.attention import value_head_plan
from models.common.norms import RMSNorm, rms_norm_path
from models.deepseek_v3.model import Attention as MLAttention

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
        mla = sorted(
            {
                value_head_plan(m.core, device, dtype, m.qk_head_dim, m.v_head_dim).describe(
                    m.qk_head_dim, m.v_head_dim
                )
                for m in modules
                if isinstance(m, MLAttention) and m.v_head_dim < m.qk_head_dim
            }
        )
        if mla:
            attention += ", MLA " + "; ".join(mla)
        parts.append(attention)
    return "kernels: " + ("; ".join(parts) if parts else "no norms or attention on this rank")
