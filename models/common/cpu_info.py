"""The CPU this process runs on: its model name and the instruction-set flags that decide which
CPU kernels torch picks (Linux ``/proc/cpuinfo``; elsewhere ``platform``'s answer and no flags).

A kernel that is cheap on one x86 host can be pathological on another: torch's CPU
``_scaled_mm`` hands tensorwise float8 GEMMs to oneDNN where the CPU has AMX-INT8, about a
second per small GEMM there (models/parallel/float8.py); bfloat16 matmuls run oneDNN where the
CPU has AVX-512 and ATen's own, much slower, kernel elsewhere. The float8 start-up line, the test
suite's cost table and ``make bench`` name the host with this, so a slow run on a new kind of
host can be explained from its log.
"""

from __future__ import annotations

import functools
import platform

__all__ = ["KERNEL_FLAGS", "cpu_flags", "cpu_model", "describe_cpu", "has_amx_int8"]

# the flags that change which CPU kernels torch runs (oneDNN's bf16 / float8 paths, ATen's
# vectorized builds), in the order they are printed
KERNEL_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_int8")


@functools.cache
def _cpuinfo() -> tuple[str, frozenset[str]]:
    model, flags = "", frozenset()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not model:
                    model = " ".join(value.split())
                elif key == "flags" and not flags:
                    flags = frozenset(value.split())
                if model and flags:
                    break
    except OSError:
        pass
    return model or platform.processor() or platform.machine(), flags


def cpu_model() -> str:
    """The CPU's model name ("AMD EPYC 9R14 96-Core Processor", "Intel(R) Xeon(R) Processor")."""
    return _cpuinfo()[0]


def cpu_flags() -> frozenset[str]:
    """Every instruction-set flag the kernel reports for this CPU (empty off Linux)."""
    return _cpuinfo()[1]


def has_amx_int8() -> bool:
    """Whether the CPU has AMX-INT8 (Intel Xeon since Sapphire Rapids), where torch's CPU
    ``_scaled_mm`` runs tensorwise GEMMs through oneDNN."""
    return "amx_int8" in cpu_flags()


def describe_cpu() -> str:
    """One line: the model and which of :data:`KERNEL_FLAGS` it has, e.g. ``Intel(R) Xeon(R)
    Processor (avx2 avx512f avx512_bf16 avx512_fp16 amx_bf16 amx_int8)``; ``(none of ...)``
    when it has none of them."""
    have = [f for f in KERNEL_FLAGS if f in cpu_flags()]
    return f"{cpu_model()} ({' '.join(have) if have else 'none of ' + ' '.join(KERNEL_FLAGS)})"
