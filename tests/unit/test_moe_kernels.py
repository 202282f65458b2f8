"""MoE expert kernels: grouped GEMM vs the per-expert loop (equality, automatic choice, compute
dtype under autocast), the loop's O(E) backward, and the absence of host syncs.

Ops are observed with ``TorchDispatchMode`` (what ATen runs, forward and backward) and, for host
reads that never reach the dispatcher on CPU (``Tensor.tolist`` copies the data out directly),
with ``TorchFunctionMode``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from models.deepseek_v3.args import deepseek_v3_flavors
from models.deepseek_v3.moe import GroupedExperts, MoE, grouped_mm_by_default

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
# reference value. float32: 2**-18, 64 unit round-offs (2**-24) for sums of up to 64 products;
# bfloat16 / float16: 2**-6 / 2**-8, 8 unit round-offs (2**-9 / 2**-11), since the GEMM outputs
# and the SwiGLU intermediate are rounded to the low precision and a few roundings compound.
# Measured max over these cases: 3.8e-7 (float32), 7.8e-3 (bfloat16), 1.5e-3 (float16).
REL_TOL = {torch.float32: 2**-18, torch.bfloat16: 2**-6, torch.float16: 2**-8}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", sorted(CASES))
def test_grouped_equals_loop_outputs_and_all_grads(case, dtype):
    counts_list, padding = CASES[case]
    counts = torch.tensor(counts_list)
    rows = sum(counts_list) + padding
    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows, DIM, generator=g).to(dtype)
    grad_out = torch.randn(rows, DIM, generator=g).to(dtype)
    experts = _experts(len(counts_list), dtype)

    grouped = _run(experts, x, counts, grad_out, True)
    loop = _run(experts, x, counts, grad_out, False)
    # Measured on CPU (ATen's grouped_mm fallback runs the same mm kernels as the loop):
    # bitwise equal in float32, bfloat16 and float16.
    names = ["out", "x.grad", "w1.grad", "w2.grad", "w3.grad"]
    for name, a, b in zip(names, grouped, loop):
        assert a.dtype == b.dtype == dtype, name
        assert torch.equal(a, b), (name, (a.float() - b.float()).abs().max().item())

    # Both paths against float64 math on the same values.
    ref = _reference(experts, x, counts, grad_out)
    for name, a, r in zip(names, grouped, ref):
        err = (a.double() - r).abs().max().item()
        scale = max(r.abs().max().item(), 1e-30)
        assert err <= REL_TOL[dtype] * scale, (name, err, scale)

    out, x_grad, w1_grad = grouped[0], grouped[1], grouped[2]
    total = sum(counts_list)
    assert torch.equal(out[total:], torch.zeros(padding, DIM, dtype=dtype))
    assert torch.equal(x_grad[total:], torch.zeros(padding, DIM, dtype=dtype))
    for e, n in enumerate(counts_list):
        if n == 0:  # an expert with no tokens: a zero, not a missing, gradient
            assert torch.equal(w1_grad[e], torch.zeros(HIDDEN, DIM, dtype=dtype))


def test_grouped_equals_loop_bitwise_at_benchmark_size():
    """benchmarks/moe.py's shape (dim 256, hidden 128, 4096 random rows over 16 experts)."""
    g = torch.Generator().manual_seed(2)
    counts = torch.bincount(torch.randint(0, 16, (4096,), generator=g), minlength=16)
    x, grad_out = torch.randn(4096, 256, generator=g), torch.randn(4096, 256, generator=g)
    experts = _experts(16, dim=256, hidden=128)
    grouped = _run(experts, x, counts, grad_out, True)
    loop = _run(experts, x, counts, grad_out, False)
    for a, b in zip(grouped, loop):
        assert torch.equal(a, b)


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

    # Same numbers as running a bf16 copy of the module on bf16 tokens.
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
        h, aux = x, 0.0
        for moe in layers:
            h = h + moe(h)
            aux = aux + moe.aux_loss_sum
        (h.pow(2).mean() + aux).backward()
    assert all(p.grad is not None for moe in layers for p in moe.parameters())
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
    (out.float().pow(2).mean() + moe.aux_loss_sum.float()).backward()
    assert torch.isfinite(out).all() and moe.experts.w1.grad is not None
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
