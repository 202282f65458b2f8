"""The second lane of ``make test``: the numerics-sensitive tests again, on CPU kernels other than
the ones torch picks for this machine, and in the same session the mesh tests again under the
portable mesh builder.

    python -m tests.kernel_lane [pytest args]      # what `make test` runs after the main suite

One pytest session for both (pytest's start-up and collection paid once, both file sets shared
by the workers): the whole lane runs with ``MESHTRAIN_MESH_BUILDER=portable`` (the builder
only decides how the meshes are made, and both builders make the same groups: test_fake_build,
test_parallel_dims_gloo), so the mesh, scale and parity tests also run on the other kernels,
and the numerics tests' meshes come from the portable builder.

A test that compares two code paths too tightly passes on the machine it was written on and
fails on another CPU, whose kernels sum in another order (seen: one ulp between a loop of ``mm``
and ``_grouped_mm`` on an AVX-512 host, equal on AVX2). This lane runs the same tests under
other kernels of the same torch build, so such a test fails here, on any x86 host, instead of
on a user's machine. What each variable changes (torch 2.13.0 CPU wheel, checked by hashing
the outputs of each op on fixed inputs, tests/unit/test_kernel_lane.py):

* ``ATEN_CPU_CAPABILITY=default``: ATen's vectorized CPU kernels run their scalar build instead
  of AVX2/AVX-512: softmax, SiLU, SDPA's math, and ``normal_``/``randn`` (so seeded initial
  weights differ too: every test must hold for other weights); not ``sum``, ``exp``,
  ``rms_norm`` on these shapes.
* ``MKL_CBWR=COMPATIBLE``: MKL's conditional numerical reproducibility mode, the SSE2-level
  code path on every x86 CPU: float32 ``mm``, ``bmm``, ``_grouped_mm``'s CPU fallback and the
  GEMMs inside SDPA.
* Not used: ``MKL_ENABLE_INSTRUCTIONS`` (AVX and SSE4_2 changed nothing measured here) and
  ``ONEDNN_MAX_CPU_ISA`` (bfloat16 matmuls on CPUs without AVX-512 BF16 run ATen's own
  kernel, which neither variable changes; on AVX-512 BF16 hosts oneDNN runs them).

On a host with AMX (Intel Xeon) torch 2.13's bf16 CPU flash attention cannot run under these
kernels (it packs for oneDNN's AMX GEMMs with a helper only ATen's AVX-512 build has): the models
guard it there (the ``cpu_flash_attention_pack`` row of parallel_dims/torch_compat.py, proven by
tests/unit/test_torch_compat_flash.py, which runs here too). Inductor's cache does not record the
vector ISA it compiled for, so a session that sets ``ATEN_CPU_CAPABILITY`` compiles into a cache
folder of its own (tests/conftest.py).

The lane sets ``MESHTRAIN_KERNEL_LANE=portable`` so a test can tell where it runs
(tests/unit/test_kernel_lane.py checks that the kernels really are the scalar/compatible ones).
Child processes (the gloo ranks of the distributed tests) inherit the environment.
"""

from __future__ import annotations

import os
import sys

LANE_ENV = {
    "ATEN_CPU_CAPABILITY": "default",
    "MKL_CBWR": "COMPATIBLE",
    "MESHTRAIN_KERNEL_LANE": "portable",
    "MESHTRAIN_MESH_BUILDER": "portable",  # parallel_dims.md#how-it-is-built
}

# models, MoE kernels (and their float8 form), optimizer, mixed precision, context parallel,
# Hugging Face adapters, LoRA against PEFT, activation checkpointing, block-causal document masking, the kernels
# chosen at run time (fused vs op-by-op norm, padded vs unpadded MLA values), and the lane's own check
NUMERICS_TESTS = [
    "tests/unit/test_kernel_lane.py",
    "tests/unit/test_models.py",
    "tests/unit/test_moe_kernels.py",
    "tests/unit/test_moe_combine.py",
    "tests/unit/test_float8_experts.py",
    "tests/unit/test_optim.py",
    "tests/unit/test_hf_adapters.py",
    "tests/unit/test_lora.py",
    "tests/unit/test_activation_checkpoint.py",
    "tests/unit/test_document_masking.py",
    "tests/unit/test_kernel_choice.py",
    "tests/unit/test_torch_compat_flash.py",
    "tests/distributed/test_mixed_precision.py",
    "tests/distributed/test_context_parallel.py",
]


# the mesh builder's proofs: every group of both builders identical at scale (fake backend),
# the groups of real gloo meshes, and the parallel layouts' training step against one process
PORTABLE_BUILDER_TESTS = [
    "tests/unit/test_fake_build.py",
    "tests/distributed/test_parallel_dims_gloo.py",
    "tests/distributed/test_parallelize_equivalence.py",
]


def main(argv: list[str]) -> None:
    env = dict(os.environ, **LANE_ENV)
    if env.get("MESHTRAIN_TEST_TIMES"):  # the main session's figures stay where they were written
        env["MESHTRAIN_TEST_TIMES"] += ".lane.json"
    print(f"== second lane: {' '.join(f'{k}={v}' for k, v in LANE_ENV.items())}", flush=True)
    tests = [*NUMERICS_TESTS, *(t for t in PORTABLE_BUILDER_TESTS if t not in NUMERICS_TESTS)]
    os.execve(sys.executable, [sys.executable, "-m", "pytest", *argv, *tests], env)


if __name__ == "__main__":
    main(sys.argv[1:])
