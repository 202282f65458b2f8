"""Tied input/output embeddings (``tie_word_embeddings``, models/common/decoder.py)."""

from __future__ import annotations

import pytest
import torch

from models.registry import build_model

pytestmark = pytest.mark.unit

_TINY = dict(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16, max_seq_len=16)


def _tiny(tied: bool, device: str = "cpu"):
    m = build_model("llama3", "debugmodel", device=device, tie_word_embeddings=tied, **_TINY)
    return m


def test_one_parameter_for_both_uses_survives_materialization():
    """Tied, the head's weight is the embedding's Parameter, listed once by named_parameters,
    and stays one object through ``to_empty`` and ``to(dtype)`` (nn.Module._apply converts each
    slot separately) and init; its gradient is the sum of both uses. One layer of width 32
    suffices: the tie is structural."""
    m = _tiny(True, "meta")
    assert m.output.weight is m.tok_embeddings.weight
    m.to_empty(device="cpu")
    m.init_weights(0)
    assert m.output.weight is m.tok_embeddings.weight
    names = [n for n, _ in m.named_parameters()]
    assert "tok_embeddings.weight" in names and "output.weight" not in names
    untied = _tiny(False)
    assert sum(p.numel() for p in untied.parameters()) - sum(p.numel() for p in m.parameters()) == 64 * 32
    tokens = torch.randint(0, 64, (2, 8))
    m(tokens).float().square().mean().backward()
    grad_tied = m.tok_embeddings.weight.grad.clone()
    # the same computation with two separate copies of the weight: the tied grad is the sum
    untied.load_state_dict({k: v for k, v in m.state_dict().items()})
    untied.zero_grad()
    untied(tokens).float().square().mean().backward()
    want = untied.tok_embeddings.weight.grad + untied.output.weight.grad
    torch.testing.assert_close(grad_tied, want, rtol=1e-6, atol=1e-7)
    # negative control: the head's grad alone is not the tied grad
    assert not torch.allclose(grad_tied, untied.output.weight.grad, rtol=1e-3, atol=1e-6)
    m.to(torch.bfloat16)
    assert m.output.weight is m.tok_embeddings.weight and m.output.weight.dtype == torch.bfloat16


def test_untied_by_default():
    m = _tiny(False, "meta")
    assert m.output.weight is not m.tok_embeddings.weight


def test_bad_tie_value_is_refused():
    with pytest.raises(ValueError, match="tie_word_embeddings must be true or false"):
        build_model("llama3", "debugmodel", tie_word_embeddings="yes", **_TINY)
