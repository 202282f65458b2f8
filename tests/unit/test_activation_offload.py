"""Activation offload (models/parallel/activation_offload.py) on the llama3 debug model, 2 blocks,
one process, float32, batch 2 x 32 tokens:

* what the hooks offload per forward is exactly what the prediction says: the RoPE rows once
  (:func:`attention_input_bytes`) and, with full AC, the blocks' inputs
  (:func:`block_input_bytes`), with no AC everything the blocks keep for backward (the planner's
  activation model, ``tools.planner.activations.layer_bytes``, itself checked against
  the tensors a CPU forward keeps alive in tests/unit/test_planner.py), with selective AC every
  2nd block one of each, and with per-op selective AC each block's input and the outputs the
  policy keeps (the planner's selective figure);
* with a real host copy (``copy=True``: what a GPU run does; on a CPU device the hooks only hold
  references) the gradients are bitwise those without offload (same kernels on the same
  shapes; the copy is exact), under no AC, full AC and per-op selective AC (whose kept outputs
  are really freed, storage resized to 0, and restored before the recomputation);
* negative controls: hooks that restore zeros in place of the saved values change the gradients;
  selective AC's kept outputs are freed (0 bytes) between the forward and the recomputation.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models.parallel.activation_checkpoint import apply_activation_checkpointing
from models.parallel.activation_offload import (
    ActivationOffload,
    apply_activation_offload,
    attention_input_bytes,
    block_input_bytes,
)
from models.registry import build_model
from tools.planner.activations import layer_bytes

B, S = 2, 32


def _model(ac: str, option: str = "op", offload: bool = False, copy: bool | None = None):
    """The model with AC (and, with ``offload``, the offload hooks: ``model.activation_offload``)."""
    torch.manual_seed(0)
    m = build_model("llama3", "debugmodel", device="cpu", max_seq_len=S, n_layers=2)
    m.init_weights(0)
    hooks = ActivationOffload(m, copy) if offload else None
    apply_activation_checkpointing(m, ac, option, hooks)
    if hooks is not None:
        apply_activation_offload(m, offload=hooks)
    return m


def _grads(m, tokens):
    logits = m(tokens)
    F.cross_entropy(logits.flatten(0, 1), tokens.flatten(), reduction="sum").backward()
    return [p.grad.clone() for p in m.parameters()]


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, 2048, (B, S), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("ac,option", [("none", "op"), ("full", "op"), ("selective", "2"), ("selective", "op")])
def test_offloaded_bytes_are_the_prediction(tokens, ac, option):
    m = _model(ac, option, offload=True)
    offload = m.activation_offload
    m(tokens)
    args = m.args
    modes = ("none", "full", "selective")
    held = {a: [layer_bytes(args, i, B, S, 1, 1, 1, False, 4, a) for i in range(2)] for a in modes}
    rope = attention_input_bytes(tuple(m.rope.table.shape[1:]), B, S)  # once per forward: [S, 8, 2] float32
    assert rope == S * (args.head_dim // 2) * 2 * 4
    if ac == "full":
        expected = block_input_bytes(2, B, S, args.dim)
        assert expected == sum(held["full"])
    elif ac == "none":
        expected = sum(held["none"])
    elif option == "2":  # every 2nd block checkpointed: block 0 full, block 1 none
        expected = held["full"][0] + held["none"][1]
    else:  # per-op: each block's input and the outputs the policy keeps, nothing recomputed
        expected = sum(held["selective"])
    assert offload.offloaded_bytes == expected + rope


@pytest.mark.parametrize("ac", ["none", "full", "selective"])
def test_host_copy_round_trip_is_bitwise(tokens, ac):
    ref = _grads(_model(ac), tokens)
    m = _model(ac, offload=True, copy=True)
    offload = m.activation_offload
    got = _grads(m, tokens)
    assert offload.offloaded_bytes > 0
    assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))


def test_negative_control_restoring_zeros_changes_gradients(tokens, monkeypatch):
    ref = _grads(_model("full"), tokens)
    real = ActivationOffload.unpack

    def zeros(packed):
        t = real(packed)
        return torch.zeros_like(t) if t is not packed else t

    monkeypatch.setattr(ActivationOffload, "unpack", staticmethod(zeros))
    got = _grads(_model("full", offload=True, copy=True), tokens)
    assert not all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))


def test_selective_kept_outputs_are_freed_until_restored(tokens, monkeypatch):
    """Per-op selective AC's kept outputs really leave the device storage after the forward
    (resized to 0 bytes) and are back, whole, after the backward's recomputation read them."""
    recorders = []
    real = ActivationOffload.saved_outputs

    def record(self):
        recorders.append(real(self))
        return recorders[-1]

    monkeypatch.setattr(ActivationOffload, "saved_outputs", record)
    m = _model("selective", offload=True, copy=True)
    logits = m(tokens)
    moved = [entry for r in recorders for entry in r.moved]
    assert len(recorders) == 2 and len(moved) > 4
    assert all(storage.nbytes() == 0 for storage, *_ in moved)
    F.cross_entropy(logits.flatten(0, 1), tokens.flatten(), reduction="sum").backward()
    assert all(storage.nbytes() == nbytes for storage, nbytes, *_ in moved)
