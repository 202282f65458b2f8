"""The document structure and attention mask are built once per micro-batch, not per layer, and
activation checkpointing neither rebuilds them nor keeps a copy per layer (issue 26).

Counted, not timed: ``core.prepare`` calls and the identity of the mask object every layer's
kernel receives, for both models, without AC and under full and selective AC (forward and
backward, so a recomputation that rebuilt the mask would be counted)."""

from __future__ import annotations

import pytest
import torch

from models.common.attention import AttentionCore
from models.parallel.activation_checkpoint import apply_activation_checkpointing
from models.registry import build_model

EOS = 3


def _model(name: str, mode: str):
    model = build_model(
        name, "debugmodel", device="cpu", vocab_size=64, max_seq_len=32, n_layers=3, eos_id=EOS,
        attn_mask_type="block_causal",
    )  # fmt: skip
    model.init_weights(0)
    apply_activation_checkpointing(model, mode)
    return model


def _instrument(model) -> tuple[list, list]:
    prepared: list = []
    used: list = []
    for block in model.layers.values():
        core = block.attention.core
        assert type(core) is AttentionCore
        original_prepare, original_forward = core.prepare, core.forward

        def prepare(*args, _p=original_prepare, **kwargs):
            mask = _p(*args, **kwargs)
            prepared.append(mask)
            return mask

        def forward(q, k, v, mask=None, scale=None, _f=original_forward):
            used.append(mask)
            return _f(q, k, v, mask, scale)

        core.prepare, core.forward = prepare, forward
    return prepared, used


@pytest.mark.parametrize("name", ["llama3", "deepseek_v3"])
@pytest.mark.parametrize("mode", ["none", "full", "selective"])
def test_mask_built_once_per_micro_batch_and_shared_by_every_layer(name, mode):
    model = _model(name, mode)
    prepared, used = _instrument(model)
    tokens = torch.randint(4, 64, (2, 32), generator=torch.Generator().manual_seed(0))
    tokens[:, [7, 20]] = EOS
    for step in range(2):  # two micro-batches
        model(tokens).float().square().mean().backward()
        assert len(prepared) == step + 1, "the mask must be built once per forward, not per layer"
    masks = {id(m) for m in prepared}
    assert len(masks) == 2
    # every layer's kernel got its micro-batch's one mask object: 3 layers x 2 forwards, plus
    # the recomputed forwards of the checkpointed blocks (full AC: every block once more)
    per_forward = 3 * (2 if mode in ("full", "selective") else 1)
    assert len(used) == 2 * per_forward
    assert {id(m) for m in used} == masks
    assert all(isinstance(m, torch.Tensor) and m.dtype == torch.bool for m in used)
