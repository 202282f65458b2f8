"""The second-kernel lane (tests/kernel_lane.py) really runs other kernels.

Each op runs on fixed inputs (from NumPy, so the inputs do not depend on torch's kernels) in a
subprocess with the machine's native kernels and in one with the lane's environment; the
output bits must differ for the ops the lane is meant to change, and agree for an integer op
(the control: same inputs, no rounding). Inside the lane, the process must run ATen's scalar
kernels.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.kernel_lane import LANE_ENV, NUMERICS_TESTS, PORTABLE_BUILDER_TESTS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROBE = r"""
import hashlib, json
import numpy as np
import torch
rng = np.random.default_rng(0)
def T(*shape):
    return torch.from_numpy(rng.standard_normal(shape).astype(np.float32))
def h(t):
    return hashlib.md5(t.contiguous().numpy().tobytes()).hexdigest()
a, b = T(257, 129), T(129, 65)
q, k, v = T(1, 2, 64, 32), T(1, 2, 64, 32), T(1, 2, 64, 32)
ints = torch.from_numpy(rng.integers(-1000, 1000, (257, 129)))
out = {
    "capability": torch.backends.cpu.get_cpu_capability(),
    "mkl": torch.backends.mkl.is_available(),
    "mm": h(a @ b),
    "softmax": h(torch.softmax(a, -1)),
    "silu": h(torch.nn.functional.silu(a)),
    "sdpa": h(torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)),
    "randn": h(torch.randn(1000, generator=torch.Generator().manual_seed(0))),
    "int_sum": h(ints.sum(1)),
}
print(json.dumps(out))
"""


def _probe(extra_env: dict[str, str]) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LANE_ENV}
    env.update(extra_env, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def native_and_lane():
    return _probe({}), _probe(LANE_ENV)


def test_lane_changes_the_gemm_and_vectorized_kernels(native_and_lane):
    native, lane = native_and_lane
    if native["capability"] == "DEFAULT":
        pytest.skip("this CPU already runs ATen's scalar kernels natively: the lane cannot differ")
    assert lane["capability"] == "DEFAULT", lane
    # MKL_CBWR=COMPATIBLE: another GEMM code path (float32 mm); ATEN_CPU_CAPABILITY=default:
    # the scalar builds of the vectorized kernels (softmax, SiLU, SDPA, the normal sampler)
    expected = ["softmax", "silu", "sdpa", "randn"] + (["mm"] if native["mkl"] else [])
    changed = [op for op in expected if native[op] != lane[op]]
    assert changed == expected, (native, lane)
    assert native["int_sum"] == lane["int_sum"]  # control: integer math has one answer


def test_this_process_runs_the_lane_kernels_when_in_the_lane():
    if os.environ.get("MESHTRAIN_KERNEL_LANE") != "portable":
        pytest.skip("runs in the kernel lane (python -m tests.kernel_lane)")
    assert torch.backends.cpu.get_cpu_capability() == "DEFAULT"
    assert os.environ.get("MKL_CBWR") == "COMPATIBLE"
    # the same session runs the mesh tests under the portable builder
    from parallel_dims.builders import resolve_mesh_builder

    assert resolve_mesh_builder() == "portable"
    # inductor caches in a folder of the capability's own (tests/conftest.py): no kernel a
    # native run cached is handed to this one
    from tests.distributed.inductor_probe import capability_cache_dir

    assert capability_cache_dir() is not None
    assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") == capability_cache_dir()


def test_lane_files_exist():
    missing = [p for p in NUMERICS_TESTS + PORTABLE_BUILDER_TESTS if not os.path.isfile(os.path.join(ROOT, p))]
    assert not missing, missing
