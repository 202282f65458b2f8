"""The ``cpu_flash_attention_pack`` row of :data:`parallel_dims.torch_compat.OVERRIDES`: torch's
CPU flash attention run without oneDNN's packing where the packing cannot run (an ATen build below
AVX-512 on a host whose oneDNN uses AMX). Its own module for length only (torch_compat.py re-exports
both functions; the row's checks, tests/unit/test_torch_compat.py and test_torch_compat_flash.py,
read them there); what it fixes is in the row."""

from __future__ import annotations

import warnings

import torch

__all__ = ["flash_attention_pack_fails", "guard_cpu_flash_attention"]

_FLASH_CPU_OP = "aten::_scaled_dot_product_flash_attention_for_cpu"
_flash_cpu_library: torch.library.Library | None = None  # the registration, while installed
_flash_cpu_kernel = None  # torch's own CPU kernel (a SafeKernelFunction), kept while guarded
_flash_cpu_guarded: tuple[torch.dtype, ...] = ()


def flash_attention_pack_fails(dtype: torch.dtype) -> bool:
    """Whether torch's own CPU flash attention kernel fails in this process for ``dtype`` inputs
    it packs for oneDNN's AMX GEMMs: the kernel packs when oneDNN may use AMX for ``dtype``
    (``cpublas::could_pack``: oneDNN's ISA, read from the hardware) and calls ATen's
    ``pack_vnni2``, which only ATen's AVX-512 build has; the DEFAULT and AVX2 builds
    (``ATEN_CPU_CAPABILITY=default`` or ``avx2``, or a CPU without AVX-512) raise "pack_vnni2 is
    only supported when avx512 is supported". Tried on one small call that the kernel packs
    (64 queries and keys, 4 heads of 64: both of torch's packing heuristics say yes), with oneDNN
    enabled, through torch's kernel even while :func:`guard_cpu_flash_attention` is installed."""
    kernel = _flash_cpu_kernel or torch.library.get_kernel(_FLASH_CPU_OP, "CPU")
    q = torch.zeros(1, 4, 64, 64, dtype=dtype)
    was = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = True
    try:
        kernel.call_boxed(torch._C.DispatchKeySet(torch._C.DispatchKey.CPU), q, q, q)
    except Exception as exc:  # any other failure is not this one, and not the guard's to mend
        return "pack_vnni" in str(exc)
    finally:
        torch.backends.mkldnn.enabled = was
    return False


def guard_cpu_flash_attention() -> tuple[torch.dtype, ...]:
    """Where torch's CPU flash attention kernel fails for bfloat16 or float16 inputs
    (:func:`flash_attention_pack_fails`: an ATen build below AVX-512 on a host with AMX), run it
    for those dtypes with oneDNN disabled for the call (``torch.backends.mkldnn.enabled``, which
    ``could_pack`` reads first): the same kernel and algorithm without the packing, its GEMMs
    ATen's own instead of oneDNN's (other roundings, same float32 accumulation), the same
    tensors saved for backward (the backward kernel never packs).
    Process-wide (a kernel registered for the op at the CPU dispatch key, around torch's own, so
    every caller of ``scaled_dot_product_attention`` on CPU takes it, eager or compiled); installed
    once, nothing registered where the kernel works (every AVX-512 ATen build, every host without
    AMX): returns the guarded dtypes. The switch is process-global for the call's duration: another
    thread's oneDNN op at that moment would run ATen's kernel instead (only in a process that would
    otherwise fail). See the ``cpu_flash_attention_pack`` row for why."""
    global _flash_cpu_library, _flash_cpu_kernel, _flash_cpu_guarded
    if _flash_cpu_library is not None:
        return _flash_cpu_guarded
    if torch.backends.cpu.get_cpu_capability() not in ("DEFAULT", "AVX2") or not torch.backends.mkldnn.is_available():
        return ()  # ATen's AVX-512 build has pack_vnni2; without oneDNN nothing packs
    if not hasattr(torch.library, "get_kernel"):  # a torch without it: no way to wrap its kernel
        return ()
    # one intra-op thread for the probe: a process that forks workers afterwards (the launcher's
    # server imports the models) must not have started OpenMP's thread pool
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        guarded = tuple(dt for dt in (torch.bfloat16, torch.float16) if flash_attention_pack_fails(dt))
    finally:
        torch.set_num_threads(threads)
    if not guarded:
        return ()
    kernel = torch.library.get_kernel(_FLASH_CPU_OP, "CPU")

    def without_packing(keyset, query, *args, **kwargs):
        if query.dtype not in guarded:
            return kernel.call_boxed(keyset, query, *args, **kwargs)
        was = torch.backends.mkldnn.enabled
        torch.backends.mkldnn.enabled = False
        try:
            return kernel.call_boxed(keyset, query, *args, **kwargs)
        finally:
            torch.backends.mkldnn.enabled = was

    library = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():  # "Overriding a previously registered kernel": that is the point
        warnings.simplefilter("ignore", UserWarning)
        library.impl(_FLASH_CPU_OP.split("::")[1], without_packing, "CPU", with_keyset=True)
    _flash_cpu_library, _flash_cpu_kernel, _flash_cpu_guarded = library, kernel, guarded
    return guarded
