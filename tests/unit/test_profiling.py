"""trainer/instruments/profiler.py and matmul_census.py: the profiler's step windows and the matmul dtype census."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerAction

from trainer.instruments.matmul_census import MatmulCensus
from trainer.instruments.profiler import profiler_action

R, W, N = ProfilerAction.RECORD, ProfilerAction.WARMUP, ProfilerAction.NONE
S = ProfilerAction.RECORD_AND_SAVE


def test_windows_end_at_multiples_of_profile_freq():
    # freq 10, warmup 3, active 2: steps 6-7 warm up, 8-9 record, 10 records and saves
    got = [profiler_action(s, 10, 3, 2) for s in range(1, 21)]
    one = [N, N, N, N, N, W, W, W, R, S]
    assert got == one + one
    # warmup + active == freq: no idle steps
    assert [profiler_action(s, 4, 3, 1) for s in range(1, 9)] == [W, W, W, S] * 2
    # a resumed run (steps 23, 24, ...) sees the same actions as an uninterrupted one
    assert [profiler_action(s, 10, 3, 2) for s in range(23, 31)] == one[2:]


def test_census_counts_flops_per_dtype():
    a32, b32 = torch.randn(8, 16), torch.randn(16, 4)
    with MatmulCensus() as census:
        a32 @ b32  # mm: 2*8*16*4
        torch.addmm(torch.zeros(4), a32, b32)
        a32.bfloat16() @ b32.bfloat16()
        torch.randn(3, 8, 16) @ torch.randn(3, 16, 4)  # bmm
        a32 + 1  # not a matmul
    assert census.flops[torch.float32] == 2 * (2 * 8 * 16 * 4) + 3 * 2 * 8 * 16 * 4
    assert census.flops[torch.bfloat16] == 2 * 8 * 16 * 4
    assert census.share(torch.bfloat16) == 1 / 6
    assert {name for name, _ in census.calls} == {"mm", "addmm", "bmm"}


def test_census_sees_backward_grouped_mm_and_attention():
    x = torch.randn(12, 16, requires_grad=True)
    w = torch.randn(3, 8, 16, requires_grad=True)
    offs = torch.tensor([4, 4, 12], dtype=torch.int32)
    q = torch.randn(1, 2, 8, 16, dtype=torch.bfloat16, requires_grad=True)
    with MatmulCensus() as census:
        out = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
        out.backward(torch.randn_like(out))  # a dense gradient (the CPU kernel rejects stride 0)
        F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
    fwd_grouped = 2 * 12 * 16 * 8
    # forward, grad of x (rows split) and grad of w (contraction split): the same FLOPs each
    assert census.calls[("_grouped_mm", torch.float32)] == 3
    assert census.flops[torch.float32] == 3 * fwd_grouped
    attn = 2 * 1 * 2 * 8 * 8 * (16 + 16)
    assert census.flops[torch.bfloat16] == attn + 2 * attn  # forward + backward
