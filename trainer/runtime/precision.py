"""What a run's kernels compute, stated by device: how float32 matmuls run on CUDA (TF32 or
IEEE fp32), whether kernels must be deterministic, and which precision MFU is priced at.

Both options are applied by :func:`apply_precision_policy`, which ``Trainer.__init__`` calls
first, before the process group, ``torch.cuda.set_device`` or any CUDA work: the cuBLAS workspace
variable must be in the environment before the first cuBLAS handle (created by the first matmul)
and torch reads it once for the workspace size.

``training.enable_tf32`` (default false), on CUDA only: true runs float32 matmuls on TF32 tensor
cores (``torch.backends.cuda.matmul.allow_tf32``, and ``torch.backends.cudnn.allow_tf32``), about
7x the IEEE fp32 peak on an H100 (494.5 against 67 TFLOP/s) with inputs rounded to a 10-bit
mantissa. False keeps torch's default, IEEE fp32. The legacy ``allow_tf32`` flags are used, not
``torch.backends.cuda.matmul.fp32_precision``: after the new per-backend setter, torch 2.13's
legacy getters (``torch.get_float32_matmul_precision()``, which inductor calls) raise "mix of the
legacy and new APIs", while after the legacy setter both APIs read back consistently ("tf32",
"high"). ``torch.set_float32_matmul_precision`` is not used either: it also sets oneDNN's CPU
matmuls (``torch.backends.mkldnn.matmul.fp32_precision``) and would change CPU numerics. With
bfloat16 mixed precision the option changes only the few matmuls left in float32.

``training.deterministic`` (default false): ``torch.use_deterministic_algorithms(True)`` (an op
without a deterministic implementation raises rather than run), ``CUBLAS_WORKSPACE_CONFIG``
(:func:`ensure_cublas_workspace_config`), and on CUDA ``torch.backends.cudnn.deterministic`` with
``cudnn.benchmark`` off. What that covers on CUDA for this code (torch 2.13's
``use_deterministic_algorithms`` documentation and ATen sources):

* the MoE combine ``index_add``, ``index_select``'s backward, ``gather``'s backward and the
  ``scatter_add_`` token counts switch to deterministic (sort-based) kernels;
* SDPA: the flash backend's backward runs its deterministic variant, the memory-efficient
  backend's backward uses one key split (``attention_backward.cu``), and the cuDNN backend is
  not selected (``check_cudnn_deterministic`` in ``sdp_utils.cpp``);
* ops that raise in this mode on CUDA (float ``cumsum``, ``histc``, ``bincount`` with weights,
  ``put_``, ``nll_loss2d``, ...): the models use none of them (counts are ``scatter_add_`` and
  integer ``cumsum``; the loss is ``cross_entropy`` on 2-D logits);
* not covered: NCCL collectives (same algorithm choice on the same topology gives the same
  reduction order; in-switch NVLS/CollNet reductions are a GPU-check item), ``torch._grouped_mm``
  (no alert exists for it: a GPU-check item), and anything in a different process layout.

On CPU the kernels this code uses are deterministic run to run on one machine without the
option; with it, torch also fills uninitialized memory (``torch.utils.deterministic``) and refuses
the few CPU ops without a deterministic kernel.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from trainer.config import JobConfig

__all__ = [
    "CUBLAS_WORKSPACE_VAR",
    "DETERMINISTIC_CUBLAS_CONFIGS",
    "apply_precision_policy",
    "cuda_tf32_enabled",
    "ensure_cublas_workspace_config",
    "matmul_precision",
]

CUBLAS_WORKSPACE_VAR = "CUBLAS_WORKSPACE_CONFIG"
# the two settings cuBLAS documents as reproducible (one workspace per handle and stream);
# torch's deterministic-mode check accepts exactly these
DETERMINISTIC_CUBLAS_CONFIGS = (":4096:8", ":16:8")


def matmul_precision(param_dtype: str, tf32: bool) -> str:
    """The precision the model's matmuls run in on CUDA, the key of the peak table
    (``trainer/reporting/metrics.py`` ``PRECISIONS``) MFU divides by: the FSDP compute dtype
    (``parallelism.mixed_precision_param``), with float32 split into "tf32" and IEEE "float32"."""
    if param_dtype == "float32":
        return "tf32" if tf32 else "float32"
    return param_dtype


def cuda_tf32_enabled() -> bool:
    """Whether float32 CUDA matmuls run on TF32 tensor cores now (torch's global flag)."""
    try:
        return bool(torch.backends.cuda.matmul.allow_tf32)
    except RuntimeError:  # someone mixed the legacy and new TF32 APIs: ask the new one
        return torch.backends.cuda.matmul.fp32_precision == "tf32"


def ensure_cublas_workspace_config() -> str | None:
    """Put a reproducible ``CUBLAS_WORKSPACE_CONFIG`` (``:4096:8``) in the environment unless it
    holds one of :data:`DETERMINISTIC_CUBLAS_CONFIGS` already. Returns a note when it replaced
    another value (under deterministic mode torch raises at the first cuBLAS call otherwise)."""
    current = os.environ.get(CUBLAS_WORKSPACE_VAR)
    if current in DETERMINISTIC_CUBLAS_CONFIGS:
        return None
    os.environ[CUBLAS_WORKSPACE_VAR] = DETERMINISTIC_CUBLAS_CONFIGS[0]
    if current is None:
        return None
    return (
        f"training.deterministic: {CUBLAS_WORKSPACE_VAR}={current!r} is not one of cuBLAS's reproducible "
        f"settings ({', '.join(DETERMINISTIC_CUBLAS_CONFIGS)}); using {DETERMINISTIC_CUBLAS_CONFIGS[0]}"
    )


def apply_precision_policy(cfg: JobConfig, device_type: str) -> list[str]:
    """Apply ``training.deterministic`` and ``training.enable_tf32`` for a run on
    ``device_type`` ("cuda" or "cpu"); call it before any CUDA work. Returns lines to print."""
    t = cfg.training
    notes: list[str] = []
    if t.deterministic:
        note = ensure_cublas_workspace_config()
        if note:
            notes.append(note)
        torch.use_deterministic_algorithms(True)
        if device_type == "cuda":
            torch.backends.cudnn.deterministic = True
            torch.backends.cudnn.benchmark = False
    if device_type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = t.enable_tf32
        torch.backends.cudnn.allow_tf32 = t.enable_tf32
    return notes
