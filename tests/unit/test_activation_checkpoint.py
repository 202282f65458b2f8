"""Selective (per-op) activation checkpointing keeps every matmul-class output: backward
recomputes only cheap elementwise ops, never a GEMM, grouped expert GEMM or attention kernel."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models.parallel.activation_checkpoint import apply_activation_checkpointing
from models.registry import build_model
from trainer.instruments.matmul_census import MatmulCensus


def _matmul_calls(model_name: str, mode: str) -> dict:
    torch.manual_seed(0)
    model = build_model(model_name, "debugmodel", device="cpu", n_layers=3, vocab_size=512, max_seq_len=64)
    model.init_weights(0)
    apply_activation_checkpointing(model, mode, "op")
    tokens = torch.randint(0, 512, (2, 32))
    with MatmulCensus() as census:
        logits = model(tokens)
        F.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    return {name: n for (name, _), n in census.calls.items()}


@pytest.mark.parametrize("model_name", ["llama3", "deepseek_v3"])
def test_selective_op_recomputes_no_matmul(model_name):
    plain = _matmul_calls(model_name, "none")
    if model_name == "deepseek_v3":
        assert plain.get("_grouped_mm", 0) > 0, plain
    assert _matmul_calls(model_name, "selective") == plain
    # full checkpointing does recompute them: the census can tell
    full = _matmul_calls(model_name, "full")
    assert sum(full.values()) > sum(plain.values()), (full, plain)
