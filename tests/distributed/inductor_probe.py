"""Whether inductor can build CPU kernels in this process: the skip condition of the tests that
compile with it (tests/unit/test_document_masking.py's compiled tests, test_parallel_features'
``compile=True`` layout).

The skip follows what the test needs on this machine, not which lane runs it: inductor's CPU
backend compiles C++ with the system compiler against ATen's vectorized headers, and whether that
works depends on the host and its environment (seen with torch 2.13: under
``ATEN_CPU_CAPABILITY=default``, the kernel lane's setting, FlexAttention's CPU lowering refuses
to run, and a kernel that inductor's cache holds from a run under another capability fails to
build against the scalar headers). So a user who sets the capability, or a host without a
working compiler, sees a skip that says why, not a failure; where inductor works, the tests run.

Each probe runs once per process (``functools.cache``) and costs at most one tiny compile
(cached by inductor across runs).
"""

from __future__ import annotations

import functools
import os


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    lines = [line for line in text.splitlines() if "error" in line.lower()] or text.splitlines() or [""]
    return f"{type(exc).__name__}: {lines[0].strip()[:300]}"


def _capability() -> str:
    return f"ATEN_CPU_CAPABILITY={os.environ.get('ATEN_CPU_CAPABILITY', '(unset)')}"


def capability_cache_dir() -> str | None:
    """Inductor's cache folder for a process whose ``ATEN_CPU_CAPABILITY`` is set: beside
    inductor's default one (``<tmp>/torchinductor_<user>``), named after the capability, so
    kernels generated for one vector ISA are never handed to a run that generates for another
    (tests/conftest.py sets it); None when the variable is unset (the default folder, shared by
    every run on the host's own ISA). Computed without importing inductor, whose import sets
    ``TORCHINDUCTOR_CACHE_DIR`` to its default folder."""
    import re
    import tempfile

    capability = re.sub(r"[^a-z0-9]", "_", os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower())
    if not capability:
        return None
    try:
        import getpass

        user = getpass.getuser()
    except (KeyError, ModuleNotFoundError, OSError):
        user = f"uid_{os.getuid()}" if hasattr(os, "getuid") else "unknown_user"
    user = re.sub(r'[\\/:*?"<>|]', "_", user)
    return os.path.join(tempfile.gettempdir(), f"torchinductor_{user}_aten_cpu_capability_{capability}")


@functools.cache
def inductor_cpu_unavailable() -> str | None:
    """None when inductor can build the CPU kernels of a compiled model here; otherwise why not,
    for a skip message. Two conditions:

    * inductor generates scalar code here although the host has vector ISAs (an
      ``ATEN_CPU_CAPABILITY`` below the host's: inductor follows it) while its FX graph cache
      is on in a folder shared with runs that vectorize: torch 2.13 does not key that cache by
      the vector ISA, so it hands back vectorized kernels, which then fail to build against the
      scalar headers (seen: the kernel lane after the main suite; with a clean cache, with
      ``TORCHINDUCTOR_FX_GRAPH_CACHE=0``, or in the folder of :func:`capability_cache_dir`,
      which tests/conftest.py gives such a session, the same tests pass under the scalar
      capability);
    * inductor does not build and run a small vectorizable kernel in this process (no working
      compiler, broken headers)."""
    import torch
    from torch._inductor import config, cpu_vec_isa
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    own_cache = capability_cache_dir() is not None and cache_dir() == os.path.abspath(capability_cache_dir())
    if not cpu_vec_isa.pick_vec_isa() and cpu_vec_isa.valid_vec_isa_list() and config.fx_graph_cache and not own_cache:
        return (
            f"inductor generates scalar CPU code here ({_capability()}) and its FX graph cache, shared "
            "with runs that vectorize and not keyed by the vector ISA, hands back vectorized kernels that "
            "do not build against the scalar headers (TORCHINDUCTOR_FX_GRAPH_CACHE=0, or a cache folder of "
            "its own as tests/conftest.py gives a session that sets the capability, runs this test here)"
        )
    try:
        x = torch.linspace(-2.0, 2.0, 67)  # not a multiple of any vector width: a tail loop too
        got = torch.compile(lambda t: torch.sin(t * 2.0) + t, backend="inductor", fullgraph=True)(x)
    except Exception as exc:
        return f"inductor cannot build a CPU kernel here ({_capability()}): {_first_line(exc)}"
    if not torch.allclose(got, torch.sin(x * 2.0) + x, rtol=1e-5, atol=1e-6):
        return f"inductor's CPU kernel computes a wrong result here ({_capability()})"
    return None


@functools.cache
def flex_cpu_unavailable() -> str | None:
    """None when compiled FlexAttention can run on the CPU here: inductor builds CPU kernels and
    its FlexAttention CPU lowering accepts this machine (torch's own gate,
    ``torch._inductor.kernel.flex.flex_cpu.check_cpu_supported``: AVX2 kernels, not
    ``ATEN_CPU_CAPABILITY=default``); otherwise why not."""
    # torch's own gate first: it reads the capability, where the compile probe below builds a
    # kernel (on a cold inductor cache, ~14 CPU s in a fresh process) only to be refused after
    try:
        from torch._inductor.kernel.flex.flex_cpu import check_cpu_supported
    except ImportError:  # another torch: no separate gate, the test itself decides
        check_cpu_supported = None
    if check_cpu_supported is not None and not check_cpu_supported():
        return (
            f"inductor's FlexAttention CPU lowering does not run here ({_capability()}; it needs "
            "AVX2 kernels: torch._inductor.kernel.flex.flex_cpu.check_cpu_supported() is False)"
        )
    return inductor_cpu_unavailable()


def skip_without_inductor_cpu() -> None:
    """``pytest.skip`` with the reason when :func:`inductor_cpu_unavailable`."""
    import pytest

    reason = inductor_cpu_unavailable()
    if reason is not None:
        pytest.skip(reason)


def skip_without_flex_cpu() -> None:
    """``pytest.skip`` with the reason when :func:`flex_cpu_unavailable`."""
    import pytest

    reason = flex_cpu_unavailable()
    if reason is not None:
        pytest.skip(reason)
