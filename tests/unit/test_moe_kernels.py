"""MoE expert kernels: grouped GEMM vs the per-expert loop (agreement within a rounding-error
bound, automatic choice, compute dtype under autocast), the loop's O(E) backward, and the absence
of host syncs.

Ops are observed with ``TorchDispatchMode`` (what ATen runs, forward and backward) and, for host
reads that never reach the dispatcher on CPU (``Tensor.tolist`` copies the data out directly),
with ``TorchFunctionMode``.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from models.common.experts import GroupedExperts, grouped_mm_by_default
from models.common.moe import MoE
from models.deepseek_v3.args import deepseek_v3_flavors

pytestmark = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no torch._grouped_mm")

DIM, HIDDEN = 32, 16  # 16-byte-aligned rows for float32, bfloat16 and float16


class _Ops(TorchDispatchMode):
    """Records every ATen op: name, input dtypes and the number of elements it wrote (outputs
    of non-view ops, including the mutated argument of in-place/out= ops; views write
    nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, list[torch.dtype], int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        written = 0
        for ret, value in zip(func._schema.returns, out if isinstance(out, tuple) else (out,)):
            if ret.alias_info is not None and not ret.alias_info.is_write:
                continue  # a view
            for t in value if isinstance(value, list) else [value]:
                if isinstance(t, torch.Tensor):
                    written += t.numel()
        dtypes = [a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
        self.calls.append((func._overloadpacket.__name__, dtypes, written))
        return out

    def names(self) -> list[str]:
        return [name for name, _, _ in self.calls]

    def count(self, name: str) -> int:
        return self.names().count(name)

    def dtypes(self, name: str) -> list[list[torch.dtype]]:
        return [d for n, d, _ in self.calls if n == name]

    def elements_written(self) -> int:
        return sum(w for _, _, w in self.calls)


# Host reads a Python caller can make on a tensor. ``item``/``int()``/``bool()`` also dispatch
# ``aten._local_scalar_dense``; ``tolist``/``numpy`` read the data without any ATen op on CPU.
_HOST_READS = {"tolist", "item", "numpy", "__bool__", "__int__", "__float__", "__index__"}
# Ops whose CUDA kernels read device values on the host internally (invisible to a CPU run's
# dispatch mode, so they are banned by name).
_SYNCING_OPS = {"bincount", "nonzero", "_unique2", "unique_consecutive", "masked_select",
                "_local_scalar_dense", "item"}  # fmt: skip


class _HostReads(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in _HOST_READS:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


def _experts(e: int, dtype=torch.float32, dim=DIM, hidden=HIDDEN, seed=0) -> GroupedExperts:
    experts = GroupedExperts(dim=dim, hidden_dim=hidden, num_experts=e)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for w in experts.parameters():
            w.copy_(torch.randn(w.shape, generator=g) * 0.3)
    return experts.to(dtype)


def _run(experts, x, counts, grad_out, mode):
    """out, x.grad, w1/w2/w3 grads for one forward+backward with use_grouped_mm=mode."""
    experts.use_grouped_mm = mode
    experts.zero_grad(set_to_none=True)
    xg = x.clone().requires_grad_()
    out = experts(xg, counts)
    out.backward(grad_out)
    return [out.detach(), xg.grad, experts.w1.grad, experts.w2.grad, experts.w3.grad]


def _reference(experts, x, counts, grad_out):
    """float64 per-expert math on the same (possibly low-precision) values."""
    w = [p.detach().double().requires_grad_() for p in (experts.w1, experts.w2, experts.w3)]
    xd = x.double().requires_grad_()
    rows, start, outs = x.shape[0], 0, []
    for e, n in enumerate(counts.tolist()):
        x_e = xd[start : start + n]
        outs.append((F.silu(x_e @ w[0][e].T) * (x_e @ w[2][e].T)) @ w[1][e].T)
        start += n
    outs.append(xd.new_zeros(rows - start, x.shape[1]))
    out = torch.cat(outs)
    grads = torch.autograd.grad(out, [xd, *w], grad_out.double())
    return [out.detach(), *grads]


# --------------------------------------------------------------------------------------------
# How far a correct kernel may be from exact math
#
# The grouped path and the loop are different GEMM calls (torch._grouped_mm's per-group kernels
# vs one mm per expert, forward and backward). Which kernel MKL/oneDNN picks, and so the order
# of each dot product's additions, depends on the CPU, the shapes and the padding, so the two
# may differ in the last bits (seen: 1 ulp of float32 outputs on an AVX-512 machine). They are
# compared with a per-element bound E on each path's distance from exact math on the same
# inputs, from standard forward error analysis (Higham, "Accuracy and Stability of Numerical
# Algorithms", 2nd ed., sections 2.2 and 3.1), valid for any summation order:
#
# * a rounding to a dtype errs by at most u |v| + eta: u its unit round-off, eta half its
#   subnormal spacing (gradual underflow: float16's subnormals start at 6.1e-5, a size small
#   entries of these tensors reach);
# * GEMM, K products per element summed in float32 in any order or blocking, with or without
#   FMA (float32 accumulation is also what oneDNN's and ATen's bfloat16/float16 GEMMs do), then
#   rounded once to the compute dtype: |C^ - C| <= gamma_K |A||B| + K eta32 + u |C| + eta,
#   gamma_K = K u32 / (1 - K u32), u32 = 2**-24, eta32 = 2**-150; errors already in the
#   operands (bounds eA, eB) add eA |B| + |A| eB + eA eB. x.grad, the sum of two GEMMs (one per
#   use of x), is bounded as one GEMM over both (K = 2 hidden), which also covers "two GEMMs,
#   then an add";
# * an elementwise product: the carried errors plus one rounding, u |ab| + eta;
# * silu(z) = z sigmoid(z): Lipschitz 1.1 (max |silu'| = 1.0998), evaluated in float32 within
#   SILU_ULPS unit round-offs (exp, add, divide) and rounded to the compute dtype; its derivative,
#   used by the backward, is Lipschitz 0.5 (max |silu''|) and evaluated in float32 with an
#   absolute error below 16 u32 (1 + |z|) (1 - sigmoid cancels near 1, then is scaled by z).
#
# Each path is then within E of exact math element by element, so the two paths are within 2 E
# of each other whatever kernels the CPU picks. Structural zeros (padding rows, experts without
# tokens: empty sums) get E = 0 and stay exact. Both are asserted: each path against float64
# math (so E really bounds the rounding), and grouped against loop (2 E).
U32, ETA32 = 2.0**-24, 2.0**-150
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
UNDERFLOW = {torch.float32: 2.0**-150, torch.bfloat16: 2.0**-134, torch.float16: 2.0**-25}
SILU_ULPS = 8
NAMES = ["out", "x.grad", "w1.grad", "w2.grad", "w3.grad"]


def _gemm_err(a, ea, b, eb, u, eta):
    """Bound on |fl(a^ @ b^) - a @ b| for a^, b^ within ea, eb of a, b (float64, elementwise)."""
    k = a.shape[-1]
    if k == 0:  # an empty sum: exactly 0
        return torch.zeros(a.shape[0], b.shape[-1], dtype=a.dtype)
    gamma = k * U32 / (1 - k * U32)
    carried = ea @ b.abs() + a.abs() @ eb + ea @ eb
    summed = gamma * ((a.abs() + ea) @ (b.abs() + eb)) + k * ETA32
    return carried + summed + u * ((a @ b).abs() + carried + summed) + eta


def _mul_err(a, ea, b, eb, u, eta):
    """Bound on |fl(a^ * b^) - a * b| (elementwise)."""
    carried = ea * b.abs() + a.abs() * eb + ea * eb
    return carried + u * ((a * b).abs() + carried) + eta


def _error_bounds(experts, x, counts, grad_out) -> list[torch.Tensor]:
    """E for [out, x.grad, w1.grad, w2.grad, w3.grad] (float64): the largest distance from exact
    math that any correct evaluation of ``experts(x, counts).backward(grad_out)`` in the inputs'
    dtype can have, per element (see the comment above)."""
    u, eta = UNIT_ROUNDOFF[x.dtype], UNDERFLOW[x.dtype]
    w1, w2, w3 = (p.detach().double() for p in (experts.w1, experts.w2, experts.w3))
    xd, gd = x.double(), grad_out.double()
    e_out, e_x = torch.zeros_like(xd), torch.zeros_like(xd)
    e_w1, e_w2, e_w3 = torch.zeros_like(w1), torch.zeros_like(w2), torch.zeros_like(w3)
    start = 0
    for e, n in enumerate(counts.tolist()):
        rows = slice(start, start + n)
        xe, g, a, b, c = xd[rows], gd[rows], w1[e], w2[e], w3[e]
        zx, zg = torch.zeros_like(xe), torch.zeros_like(g)
        # forward: h1 = x a^T, h3 = x c^T, s = silu(h1), y = s h3, out = y b^T
        h1, h3 = xe @ a.T, xe @ c.T
        e_h1 = _gemm_err(xe, zx, a.T, torch.zeros_like(a.T), u, eta)
        e_h3 = _gemm_err(xe, zx, c.T, torch.zeros_like(c.T), u, eta)
        sig = torch.sigmoid(h1)
        s = h1 * sig
        e_s = 1.1 * e_h1 + (SILU_ULPS * U32 + u) * (s.abs() + 1.1 * e_h1) + SILU_ULPS * ETA32 + eta
        y, e_y = s * h3, _mul_err(s, e_s, h3, e_h3, u, eta)
        e_out[rows] = _gemm_err(y, e_y, b.T, torch.zeros_like(b.T), u, eta)
        # backward: gy = g b, gs = gy h3, g3 = gy s, g1 = gs silu'(h1)
        gy, e_gy = g @ b, _gemm_err(g, zg, b, torch.zeros_like(b), u, eta)
        e_w2[e] = _gemm_err(g.T, zg.T, y, e_y, u, eta)
        gs, e_gs = gy * h3, _mul_err(gy, e_gy, h3, e_h3, u, eta)
        g3, e_g3 = gy * s, _mul_err(gy, e_gy, s, e_s, u, eta)
        d = sig * (1 + h1 * (1 - sig))
        e_d = 0.5 * e_h1 + 16 * U32 * (1 + h1.abs() + e_h1) + SILU_ULPS * ETA32
        g1, e_g1 = gs * d, _mul_err(gs, e_gs, d, e_d, u, eta)
        ac = torch.cat([a, c])
        e_x[rows] = _gemm_err(torch.cat([g1, g3], 1), torch.cat([e_g1, e_g3], 1), ac, torch.zeros_like(ac), u, eta)
        e_w1[e] = _gemm_err(g1.T, e_g1.T, xe, zx, u, eta)
        e_w3[e] = _gemm_err(g3.T, e_g3.T, xe, zx, u, eta)
        start += n
    return [e_out, e_x, e_w1, e_w2, e_w3]


def _excess(got: torch.Tensor, want: torch.Tensor, tol: torch.Tensor) -> float:
    """max |got - want| / tol over the elements (inf where tol is 0 and they differ)."""
    diff = (got.double() - want.double()).abs()
    if (diff[tol == 0] != 0).any():
        return float("inf")
    return (diff[tol > 0] / tol[tol > 0]).max().item() if (tol > 0).any() else 0.0


def _swap_experts(experts: GroupedExperts, a: int, b: int) -> GroupedExperts:
    """A copy whose experts a and b trade weights: a wrong expert mapping."""
    wrong = copy.deepcopy(experts)
    with torch.no_grad():
        for w in wrong.parameters():
            w[[a, b]] = w[[b, a]].clone()
    return wrong


# A wrong expert mapping must fail the grouped-vs-loop comparison by orders of magnitude: by
# >= 100x on its worst element, and every one of the five tensors by >= 10x. Measured with the
# two busiest experts swapped (excess over 2 E per tensor, min-max over the cases): float32
# 2.0e4-8.4e5, float16 220-4.9e4, bfloat16 28-6400 (its 8-bit significand leaves the least
# room; the worst element 210-6400). Against that, each path's distance from float64 math is at
# most 0.034 E (float32) / 0.63 E (bfloat16) / 0.54 E (float16: few roundings, each close to
# its bound), and a correctly rounded evaluation (float64 per op, rounded to the dtype after
# each op: another valid summation order) is within 0.019 x 2 E (float32) / 0.088 x 2 E (bf16,
# fp16) of the grouped path; the same with ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE.
CONTROL_MIN_WORST, CONTROL_MIN_EACH = 100.0, 10.0


# Ragged groups: empty experts (first, middle, last), groups of one, everything in one expert,
# and padding rows past the counts' sum.
CASES = {
    "ragged_with_empty": ([0, 5, 13, 1, 0, 27, 3, 7], 0),
    "ragged_with_padding": ([0, 5, 13, 1, 0, 27, 3, 0], 6),
    "all_in_one_expert": ([0, 0, 64, 0, 0, 0, 0, 0], 0),
    "groups_of_one_with_padding": ([1, 1, 1, 1, 1, 1, 1, 1], 3),
    "no_tokens_routed_only_padding": ([0, 0, 0, 0, 0, 0, 0, 0], 4),
}
# Max error of either path against float64 math on the same values, relative to the largest
# reference value (a coarser check than the per-element bound E, kept as the simple one).
# float32: 2**-18, 64 unit round-offs (2**-24) for sums of up to 64 products; bfloat16 /
# float16: 2**-6 / 2**-8, 4 / 8 unit round-offs (2**-8 / 2**-11), since the GEMM outputs and
# the SwiGLU intermediate are rounded to the low precision and a few roundings compound.
# Measured max over these cases: 3.8e-7 (float32), 7.8e-3 (bfloat16), 1.5e-3 (float16).
REL_TOL = {torch.float32: 2**-18, torch.bfloat16: 2**-6, torch.float16: 2**-8}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", sorted(CASES))
def test_grouped_matches_loop_outputs_and_all_grads(case, dtype):
    counts_list, padding = CASES[case]
    counts = torch.tensor(counts_list)
    rows = sum(counts_list) + padding
    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows, DIM, generator=g).to(dtype)
    grad_out = torch.randn(rows, DIM, generator=g).to(dtype)
    experts = _experts(len(counts_list), dtype)

    grouped = _run(experts, x, counts, grad_out, True)
    loop = _run(experts, x, counts, grad_out, False)
    bound = _error_bounds(experts, x, counts, grad_out)
    ref = _reference(experts, x, counts, grad_out)
    for name, a, b, e, r in zip(NAMES, grouped, loop, bound, ref):
        assert a.dtype == b.dtype == dtype, name
        # each path within E of exact math (E bounds the rounding), so within 2 E of each other
        for path, t in (("grouped", a), ("loop", b)):
            assert _excess(t, r, e) <= 1, (name, path, _excess(t, r, e))
        assert _excess(a, b, 2 * e) <= 1, (name, _excess(a, b, 2 * e), (a.double() - b.double()).abs().max().item())
        # and the coarser check against float64 math, relative to the largest reference value
        err = (a.double() - r).abs().max().item()
        scale = max(r.abs().max().item(), 1e-30)
        assert err <= REL_TOL[dtype] * scale, (name, err, scale)

    out, x_grad, w1_grad = grouped[0], grouped[1], grouped[2]
    total = sum(counts_list)
    # structural zeros are exact on both paths (E = 0 there, so the comparison above demands it)
    assert torch.equal(out[total:], torch.zeros(padding, DIM, dtype=dtype))
    assert torch.equal(x_grad[total:], torch.zeros(padding, DIM, dtype=dtype))
    for e, n in enumerate(counts_list):
        if n == 0:  # an expert with no tokens: a zero, not a missing, gradient
            assert torch.equal(w1_grad[e], torch.zeros(HIDDEN, DIM, dtype=dtype))

    # Negative control: the two busiest experts trade weights. (With no token routed every
    # output is a structural zero, compared exactly above.)
    if total:
        a, b = sorted(range(len(counts_list)), key=lambda e: -counts_list[e])[:2]
        wrong = _run(_swap_experts(experts, a, b), x, counts, grad_out, True)
        excess = {name: _excess(w, lo, 2 * e) for name, w, lo, e in zip(NAMES, wrong, loop, bound)}
        assert max(excess.values()) >= CONTROL_MIN_WORST and min(excess.values()) >= CONTROL_MIN_EACH, excess


def test_grouped_matches_loop_at_benchmark_size():
    """benchmarks/moe.py's shape (dim 256, hidden 128, 4096 random rows over 16 experts of
    232-271 rows, float32): the two paths within 2 E (reductions of 256, 2 x 128 and up to 271
    products); a swapped pair of experts outside it by 480x-1700x per tensor (measured; a
    correctly rounded evaluation is within 8e-4 x 2 E of the grouped path)."""
    g = torch.Generator().manual_seed(2)
    counts = torch.bincount(torch.randint(0, 16, (4096,), generator=g), minlength=16)
    x, grad_out = torch.randn(4096, 256, generator=g), torch.randn(4096, 256, generator=g)
    experts = _experts(16, dim=256, hidden=128)
    grouped = _run(experts, x, counts, grad_out, True)
    loop = _run(experts, x, counts, grad_out, False)
    bound = _error_bounds(experts, x, counts, grad_out)
    for name, a, b, e in zip(NAMES, grouped, loop, bound):
        assert _excess(a, b, 2 * e) <= 1, (name, _excess(a, b, 2 * e), (a - b).abs().max().item())
    wrong = _run(_swap_experts(experts, 0, 1), x, counts, grad_out, True)
    excess = {name: _excess(w, lo, 2 * e) for name, w, lo, e in zip(NAMES, wrong, loop, bound)}
    assert min(excess.values()) >= CONTROL_MIN_WORST, excess


# --------------------------------------------------------------------------------------------
# The loop's backward is O(E)


def _backward_elements(e: int, mode: bool, rows: int = 256) -> int:
    """Elements written by the backward of one experts call with ``e`` experts, the same
    ``rows`` tokens split evenly, same per-expert shapes."""
    experts = _experts(e)
    experts.use_grouped_mm = mode
    x = torch.randn(rows, DIM, requires_grad=True)
    out = experts(x, torch.full((e,), rows // e))
    grad = torch.randn_like(out)
    with _Ops() as ops:
        out.backward(grad)
    return ops.elements_written()


@pytest.mark.parametrize("mode", [False, True], ids=["loop", "grouped"])
def test_backward_work_is_linear_in_num_experts(mode):
    """Catches the O(E^2) backward of indexing the stacked weights per expert (``w1[e]``):
    autograd's SelectBackward then writes a full [E, hidden, dim] zero gradient per expert and
    accumulates them (an E-sized add_ each), so the work per added expert grows with E. With
    that code this test fails: 98k / 836k / 12.6M elements for E = 4 / 16 / 64, the slope
    between 16 and 64 experts 4.0x the slope between 4 and 16. With ``unbind`` (one stack of
    the E gradients) the slope is constant: 61k / 98k / 246k elements, 2 weight-gradient sets
    per added expert (the grouped path: 1 set)."""
    f4, f16, f64 = (_backward_elements(e, mode) for e in (4, 16, 64))
    slope_low = (f16 - f4) / 12  # elements per added expert, between 4 and 16 experts
    slope_high = (f64 - f16) / 48  # and between 16 and 64
    per_expert_grads = 3 * HIDDEN * DIM  # w1, w2, w3 gradient slices of one expert
    assert slope_high <= 1.25 * slope_low, (f4, f16, f64)
    assert slope_high <= 5 * per_expert_grads, (f4, f16, f64)


# --------------------------------------------------------------------------------------------
# Which path runs


def _path(experts, x, counts) -> str:
    with _Ops() as ops, _HostReads() as reads:
        experts(x, counts)
    if ops.count("_grouped_mm"):
        assert ops.count("_grouped_mm") == 3 and not reads.reads
        return "grouped"
    assert reads.reads == ["tolist"]
    return "loop"


@pytest.mark.parametrize(
    "dtype, dim, hidden, expected",
    [
        (torch.float32, 32, 16, "grouped"),
        (torch.bfloat16, 32, 16, "grouped"),
        (torch.float16, 32, 16, "grouped"),
        (torch.float32, 30, 16, "loop"),  # 120-byte rows of x
        (torch.float32, 32, 6, "loop"),  # 24-byte rows of the hidden activations
        (torch.bfloat16, 32, 12, "loop"),  # 24-byte rows in bf16 (48 bytes in fp32 would do)
        (torch.float64, 32, 16, "loop"),  # _grouped_mm rejects float64
    ],
)
def test_automatic_choice_on_cpu(dtype, dim, hidden, expected):
    experts = _experts(4, dtype, dim=dim, hidden=hidden)
    counts = torch.tensor([3, 0, 5, 2])
    x = torch.randn(10, dim, dtype=dtype)
    assert grouped_mm_by_default(x.device, dtype, dim, hidden) == (expected == "grouped")
    assert _path(experts, x, counts) == expected
    # Forced choices are honoured.
    experts.use_grouped_mm = False
    assert _path(experts, x, counts) == "loop"
    experts.use_grouped_mm = True
    if expected == "grouped":
        assert _path(experts, x, counts) == "grouped"
    else:  # forcing reaches torch._grouped_mm, which rejects these strides/dtypes
        with pytest.raises(RuntimeError, match="16 bytes|Float32, BFloat16 or Float16"):
            experts(x, counts)


@pytest.mark.parametrize(
    "capability, dtype, hip, expected",
    [
        ((9, 0), torch.bfloat16, None, True),  # H100/H200: CUTLASS kernel, no sync
        ((10, 0), torch.bfloat16, None, True),  # B200
        ((9, 0), torch.float32, None, False),  # ATen fallback: offs.cpu() in every call
        ((9, 0), torch.float16, None, False),
        ((8, 0), torch.bfloat16, None, False),  # A100: fallback
        ((12, 0), torch.bfloat16, None, False),  # consumer Blackwell: fallback
        ((9, 0), torch.bfloat16, "6.4", False),  # ROCm: fallback
    ],
)
def test_automatic_choice_on_cuda_rule(monkeypatch, capability, dtype, hip, expected):
    """The CUDA branch of the rule, without a GPU: the capability query is stubbed."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.version, "hip", hip)
    assert grouped_mm_by_default(torch.device("cuda", 0), dtype, 256, 128) is expected
    assert not grouped_mm_by_default(torch.device("cuda", 0), dtype, 250, 128)


def test_automatic_choice_elsewhere():
    for device in ("meta", "mps", "xpu"):
        assert not grouped_mm_by_default(torch.device(device), torch.bfloat16, 256, 128)


# --------------------------------------------------------------------------------------------
# Compute dtype


@pytest.mark.parametrize("mode", [None, False], ids=["grouped", "loop"])
def test_autocast_runs_the_expert_gemms_in_bf16(mode):
    experts = _experts(4)  # float32 weights
    experts.use_grouped_mm = mode
    counts = torch.tensor([3, 0, 5, 2])
    x = torch.randn(12, DIM, requires_grad=True)  # float32 tokens, 2 padding rows
    gemm = "_grouped_mm" if mode is None else "mm"
    with _Ops() as ops:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = experts(x, counts)
        n_forward = ops.count(gemm)
        out.float().pow(2).sum().backward()
    assert out.dtype == torch.bfloat16
    assert n_forward == (3 if mode is None else 3 * 4)
    assert ops.count(gemm) > n_forward  # the backward GEMMs were seen too
    assert all(d == [torch.bfloat16, torch.bfloat16] for d in ops.dtypes(gemm)[:n_forward])
    assert all(set(d) == {torch.bfloat16} for d in ops.dtypes(gemm)), ops.dtypes(gemm)
    # Gradients come back in the dtypes of the leaves.
    assert x.grad.dtype == torch.float32 and experts.w1.grad.dtype == torch.float32

    # Same numbers as running a bf16 copy of the module on bf16 tokens. Bitwise by construction:
    # GroupedExperts casts tokens and weights to bf16 itself (the same .to() rounding of the same
    # float32 values as the copy's) before any GEMM, then runs the same path on the same shapes;
    # autocast's mm wrapper finds bf16 operands and calls the same kernel, and _grouped_mm,
    # silu, mul, cat and where are not autocast ops.
    bf16 = _experts(4, torch.bfloat16)
    bf16.use_grouped_mm = mode
    assert torch.equal(out, bf16(x.detach().bfloat16(), counts))


def test_low_precision_weights_set_the_compute_dtype():
    """FSDP2 mixed precision: bf16 weights, float32 tokens, no autocast -> bf16 GEMMs."""
    experts = _experts(4, torch.bfloat16)
    counts = torch.tensor([3, 0, 5, 2])
    x = torch.randn(10, DIM)
    with _Ops() as ops:
        out = experts(x, counts)
    assert out.dtype == torch.bfloat16
    assert ops.dtypes("_grouped_mm") == [[torch.bfloat16, torch.bfloat16]] * 3
    # bitwise by construction: the module's own x.to(bf16) is this cast, then the same path runs
    assert torch.equal(out, experts(x.bfloat16(), counts))


# --------------------------------------------------------------------------------------------
# Host syncs


def _moe_args(**overrides):
    # Limited groups (the group mask), the sequence aux loss and a shared expert all on, so
    # every part of MoE.forward runs.
    base = dataclasses.replace(deepseek_v3_flavors["debugmodel"], dim=DIM, moe_inter_dim=HIDDEN, aux_loss_coeff=0.01)
    return dataclasses.replace(base, **overrides)


def _two_moe_layers_step(use_grouped_mm):
    torch.manual_seed(0)
    layers = [MoE(_moe_args(), use_grouped_mm=use_grouped_mm) for _ in range(2)]
    x = torch.randn(2, 16, DIM, requires_grad=True)
    with _Ops() as ops, _HostReads() as reads:
        h = x
        for moe in layers:
            h = h + moe(h)
        # each layer's aux loss gets its gradient in this backward (MoE's _AuxLossGrad)
        h.pow(2).mean().backward()
    assert all(p.grad is not None for moe in layers for p in moe.parameters())
    assert all(moe.aux_loss_total > 0 for moe in layers)  # the aux loss ran in the recorded forward
    return ops, reads


def test_moe_grouped_path_has_no_host_sync():
    ops, reads = _two_moe_layers_step(None)
    assert ops.count("_grouped_mm") == 2 * 9  # 3 forward + 6 backward per layer
    assert reads.reads == []
    assert not _SYNCING_OPS & set(ops.names()), _SYNCING_OPS & set(ops.names())


def test_moe_loop_path_syncs_once_per_layer():
    ops, reads = _two_moe_layers_step(False)
    assert ops.count("_grouped_mm") == 0
    assert reads.reads == ["tolist", "tolist"]  # the group sizes, one read per layer
    assert not _SYNCING_OPS & set(ops.names())


def test_moe_compiles_to_one_graph_with_grouped_mm():
    """No graph break anywhere in MoE forward+backward (a host read would be one). bf16:
    torch._grouped_mm's meta kernel, which tracing runs, only accepts bf16."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    moe = MoE(_moe_args()).to(torch.bfloat16)
    compiled = torch.compile(moe, backend="aot_eager", fullgraph=True)
    x = torch.randn(2, 8, DIM, dtype=torch.bfloat16, requires_grad=True)
    out = compiled(x)
    out.float().pow(2).mean().backward()  # the aux loss's gradient comes with it (_AuxLossGrad)
    assert torch.isfinite(out).all() and moe.experts.w1.grad is not None
    # Bitwise by construction: aot_eager runs the captured ATen graph op by op with the eager
    # kernels (no inductor code generation, no fusion, no decompositions beyond the
    # CompositeImplicit ones eager runs too); functionalization only swaps the in-place ops
    # (scatter_/scatter_add_/add_ on the routing counts and the reported aux loss, the combine's
    # index_put_) for their out-of-place twins.
    assert torch.equal(out, moe(x.detach()))
    torch._dynamo.reset()


def test_grouped_path_checks_counts_on_device():
    experts = _experts(4)
    x = torch.randn(10, DIM)
    experts.use_grouped_mm = True
    for bad in ([5, 5, 5, 0], [3, -1, 4, 2]):
        with pytest.raises(RuntimeError, match="non-negative and sum to at most"):
            experts(x, torch.tensor(bad))
    experts.use_grouped_mm = False
    with pytest.raises(ValueError, match="counts must be non-negative"):
        experts(x, torch.tensor([3, -1, 4, 2]))
    with pytest.raises(ValueError, match="must be integer"):
        experts(x, torch.tensor([1.0, 2.0, 3.0, 4.0]))


@pytest.mark.parametrize("mode", [None, False], ids=["grouped", "loop"])
def test_no_tokens_gives_zero_weight_grads(mode):
    """An EP rank that received no tokens: zero gradients for every local weight; the
    grouped path gets there without reading the counts on the host."""
    experts = _experts(4)
    experts.use_grouped_mm = mode
    x = torch.randn(0, DIM, requires_grad=True)
    with _HostReads() as reads:
        out = experts(x, torch.zeros(4, dtype=torch.long))
    assert out.shape == (0, DIM)
    (out.sum() + 0.0).backward()
    assert reads.reads == ([] if mode is None else ["tolist"])
    for w in experts.parameters():
        assert torch.equal(w.grad, torch.zeros_like(w))
