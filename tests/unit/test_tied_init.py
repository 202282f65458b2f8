"""Initialisation of tied input/output embeddings (models/common/init.py, ``standard_rule``).

The tied weight is drawn at ``TIED_EMBEDDING_STD`` = 0.02 so the first loss of a tied model on
random tokens is about ln(vocab), as it is untied; the untied embedding's std 1 gave ~250.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from models.common.init import TIED_EMBEDDING_STD, ParamInit, full_init_tensor
from models.parallel.pipeline.split import _carve_stage
from models.registry import build_model

pytestmark = pytest.mark.unit

SEED = 0
# Band for the first loss around ln(vocab), derived for dim 256 and std s = 0.02, random labels:
# the logits of tokens other than the input are ~N(0, sigma^2), sigma <= s * sqrt(dim) = 0.32,
# which raises the expected loss by about sigma^2 / 2 = 0.05; the input token's own logit is at
# most s * dim = 5.1 (its embedding alone in the residual), adding at most
# ln(1 + (e^5.1 - 1) / 2048) = 0.08. So the loss is within ln(vocab) + 0.13 in expectation;
# 256 tokens' sampling noise (per-token loss std < 0.4 here: / 16) is < 0.03. Measured:
# +0.08 (llama3 debugmodel_tied), +0.04 (qwen3 debugmodel tied). Below ln(vocab) by more than
# the noise is impossible on random labels. The old std-1 draw is ~245 above, dim**-0.5 ~5-6.5.
BAND_BELOW, BAND_ABOVE = 0.1, 0.25


def _first_loss(model: torch.nn.Module, tied_std: float | None = None) -> float:
    """Loss of ``model`` (initialized) on 4 x 64 seeded random tokens; ``tied_std`` redraws the
    tied weight at that std first (the negative controls)."""
    if tied_std is not None:
        w = model.tok_embeddings.weight
        with torch.no_grad():
            w.copy_(full_init_tensor(ParamInit.normal(tied_std), w.shape, SEED, "tok_embeddings.weight"))
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, model.args.vocab_size, (4, 65), generator=g)
    with torch.no_grad():
        logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).item()


@pytest.mark.parametrize(
    "name,flavor,overrides",
    [("llama3", "debugmodel_tied", {}), ("qwen3", "debugmodel", {"tie_word_embeddings": True})],
)
def test_tied_first_loss_is_near_ln_vocab(name, flavor, overrides):
    model = build_model(name, flavor, device="cpu", **overrides)
    assert model.output.weight is model.tok_embeddings.weight
    model.init_weights(SEED)
    w = model.tok_embeddings.weight
    assert abs(w.std().item() - TIED_EMBEDDING_STD) < 0.05 * TIED_EMBEDDING_STD  # 0.986 * s truncated at 3 s
    ln_v = math.log(model.args.vocab_size)
    loss = _first_loss(model)
    assert ln_v - BAND_BELOW <= loss <= ln_v + BAND_ABOVE, (loss, ln_v)
    # negative controls: the untied embedding's std 1 (the old tied init), and dim**-0.5 (the
    # untied head's std; the input token's own logit is then ~sqrt(dim) = 16)
    assert _first_loss(model, 1.0) > ln_v + 100
    assert _first_loss(model, model.args.dim**-0.5) > ln_v + 3


def test_last_pipeline_stage_copy_is_drawn_as_the_tied_weight():
    """A last pipeline stage (no tok_embeddings, models/parallel/pipeline/split.py) holds its own
    copy of the tied weight as ``output.weight``: it must start equal to the full model's tied
    weight, bit for bit, so the copy is at the tied std and the pp first loss equals pp=1's.
    Negative control: the head's own draw (its name's generator) differs."""
    kw = dict(n_layers=2, vocab_size=256)
    meta = build_model("llama3", "debugmodel_tied", **kw)
    last = _carve_stage(copy.deepcopy(meta), (1, 2), is_first=False, is_last=True)
    last.to_empty(device="cpu")
    last.init_weights(SEED)
    full = build_model("llama3", "debugmodel_tied", device="cpu", **kw)
    full.init_weights(SEED)
    assert torch.equal(last.output.weight, full.tok_embeddings.weight)
    own = full_init_tensor(ParamInit.normal(TIED_EMBEDDING_STD), last.output.weight.shape, SEED, "output.weight")
    assert not torch.allclose(own, full.tok_embeddings.weight)
    # the untied model keeps std 1 / dim**-0.5
    untied = build_model("llama3", "debugmodel", device="cpu", **kw)
    untied.init_weights(SEED)
    assert abs(untied.tok_embeddings.weight.std().item() - 1.0) < 0.05
    assert abs(untied.output.weight.std().item() - untied.args.dim**-0.5) < 0.05 * untied.args.dim**-0.5
