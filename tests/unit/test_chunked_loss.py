"""Chunked cross-entropy (``training.loss_chunk_tokens``, models/common/chunked_loss.py) on one
process: the per-token losses the head returns, summed by the trainer's loss function, equal the
plain logits + ``cross_entropy_sum`` loss and gradients of every parameter, with masked targets
(assistant-only style: whole spans IGNORE, one chunk with no target at all), tied embeddings,
DeepSeek-V3 MTP (main and depths' parts, ``mtp_sum``), a partial last chunk and chunks of 1 and
of more than the tokens; evaluation (no_grad) too. A mishandled chunk boundary (the last partial
chunk dropped, or an off-by-one start) fails the same comparison. And the memory claim: for a
151,936-token vocabulary the census of live tensor bytes (tools/tensor_census.py) shows the
step's peak lowered by at least the float32 logits' share, as ``chunked_loss_saving_bytes``
predicts (within 10%).

Tolerance: both sides run the same float32 kernels on the same rows (the chunk is a row slice
of the same matmul), but not bitwise the same reductions: the plain loss is torch's fused
log-softmax + NLL, the chunked one ``log(sum(exp(z - max))) - (z_target - max)`` and a weight
gradient summed over chunks. Measured: loss equal to 0 or 1 ulp, gradients within 8e-8 absolute
(values ~1e-2). ``rtol = 1e-5, atol = 1e-6`` is over 10x that margin; a dropped or shifted
boundary changes whole tokens' losses and gradients, far outside it.
"""

from __future__ import annotations

import pytest
import torch

import models.common.chunked_loss as chunked_loss
from models.common.chunked_loss import chunked_loss_saving_bytes
from models.registry import build_model
from tools.tensor_census import TensorCensus
from trainer.data.packing import IGNORE_INDEX
from trainer.forward import cross_entropy_sum, token_loss_sum
from trainer.mtp import MTPLoss, mtp_batch

pytestmark = pytest.mark.unit

RTOL, ATOL = 1e-5, 1e-6
SEQ = 19  # 2 x 19 = 38 tokens: chunks of 5 leave a partial last chunk of 3


def _labels(inputs: torch.Tensor) -> torch.Tensor:
    """Next-token targets with assistant-style masks: the prompt span of row 0 and all of row 1's
    first 12 tokens ignored (with chunk 5, whole chunks carry no target), the row ends IGNORE."""
    labels = torch.roll(inputs, -1, dims=1)
    labels[:, -1] = IGNORE_INDEX
    labels[0, :4] = IGNORE_INDEX
    labels[1, :12] = IGNORE_INDEX
    return labels


def _llama(tied: bool):
    torch.manual_seed(0)
    model = build_model("llama3", "debugmodel_tied" if tied else "debugmodel", device="cpu", n_layers=1, vocab_size=251)
    model.init_weights(0)
    return model


def _loss_and_grads(model, inputs, labels, chunk: int, loss_fn=None):
    model.zero_grad(set_to_none=True)
    model.loss_chunk_tokens = chunk
    count = int((labels != IGNORE_INDEX).sum())
    extra = {}
    if getattr(model.args, "mtp_layers", 0):
        extra["mtp_tokens"], labels = mtp_batch(inputs, labels, model.args.mtp_layers)
    if chunk:
        out = model(inputs, labels=labels, **extra)
        loss = (loss_fn or token_loss_sum)(out, labels)
    else:
        out = model(inputs, **extra)
        loss = (loss_fn or cross_entropy_sum)(out, labels)
    (loss / count).backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(a, b):
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    torch.testing.assert_close(loss_a, loss_b, rtol=RTOL, atol=ATOL)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=RTOL, atol=ATOL, msg=name)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_chunked_equals_plain_loss_and_gradients(tied):
    model = _llama(tied)
    inputs = torch.randint(0, 251, (2, SEQ), generator=torch.Generator().manual_seed(1))
    labels = _labels(inputs)
    plain = _loss_and_grads(model, inputs, labels, 0)
    if tied:
        assert "tok_embeddings.weight" in plain[1] and "output.weight" not in plain[1]
    for chunk in (1, 5, 2 * SEQ, 1000):
        _assert_same(_loss_and_grads(model, inputs, labels, chunk), plain)
    # evaluation: forward only, the same per-token losses
    with torch.no_grad():
        model.loss_chunk_tokens = 5
        chunked = token_loss_sum(model(inputs, labels=labels), labels)
        torch.testing.assert_close(chunked, cross_entropy_sum(model(inputs), labels), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize(
    "broken",
    [
        lambda n, c: ((s, min(s + c, n)) for s in range(0, n - n % c, c)),  # the last partial chunk dropped
        lambda n, c: ((s + (s > 0), min(s + c, n)) for s in range(0, n, c)),  # off by one at each boundary
    ],
    ids=["dropped-last-partial", "off-by-one"],
)
def test_mishandled_chunk_boundary_fails(monkeypatch, broken):
    model = _llama(False)
    inputs = torch.randint(0, 251, (2, SEQ), generator=torch.Generator().manual_seed(1))
    labels = _labels(inputs)
    plain = _loss_and_grads(model, inputs, labels, 0)
    monkeypatch.setattr(chunked_loss, "_chunks", broken)
    with pytest.raises(AssertionError):
        _assert_same(_loss_and_grads(model, inputs, labels, 5), plain)


def test_chunked_mtp_matches_plain():
    torch.manual_seed(0)
    model = build_model("deepseek_v3", "debugmodel", device="cpu", n_layers=2, vocab_size=256, mtp_layers=2)
    model.init_weights(0)
    inputs = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(1))
    labels = _labels(inputs)
    plain_fn, chunked_fn = MTPLoss(cross_entropy_sum, 2, 0.3), MTPLoss(token_loss_sum, 2, 0.3)
    plain = _loss_and_grads(model, inputs, labels, 0, plain_fn)
    chunked = _loss_and_grads(model, inputs, labels, 7, chunked_fn)
    _assert_same(chunked, plain)
    assert any(n.startswith("mtp.") for n in chunked[1])
    torch.testing.assert_close(
        chunked_fn.take(torch.device("cpu")), plain_fn.take(torch.device("cpu")), rtol=RTOL, atol=ATOL
    )


def test_peak_memory_saving_as_predicted():
    """A 151,936-token vocabulary (Qwen3's) at width 64, 256 tokens, float32: the float32 logits
    are 148 MiB. Peak of one forward + backward (the trainer's: the logits held until the
    backward returns) in live tensor bytes, plain against chunks of 32."""
    vocab, dim, tokens, chunk = 151_936, 64, 256, 32
    torch.manual_seed(0)
    model = build_model(
        "llama3", "debugmodel", device="cpu", n_layers=1, dim=dim, n_heads=4, n_kv_heads=2, vocab_size=vocab
    )
    model.init_weights(0)
    inputs = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(2))
    peaks = {}
    for c in (0, chunk):
        model.zero_grad(set_to_none=True)
        model.loss_chunk_tokens = c
        with TensorCensus() as census:
            if c:
                logits = model(inputs, labels=labels)  # per-token losses
                loss = token_loss_sum(logits, labels)
            else:
                logits = model(inputs)
                loss = cross_entropy_sum(logits, labels)
            (loss / tokens).backward()
            del logits, loss
        peaks[c] = census.peak_bytes
    saving = peaks[0] - peaks[chunk]
    logits_bytes = tokens * vocab * 4
    predicted = chunked_loss_saving_bytes(tokens, vocab, dim, chunk)
    print(
        f"peak plain {peaks[0] / 2**20:.1f} MiB, chunk {chunk}: {peaks[chunk] / 2**20:.1f} MiB; predicted saving {predicted / 2**20:.1f} MiB"
    )
    assert saving >= logits_bytes, (peaks, logits_bytes)
    assert abs(saving - predicted) <= 0.1 * predicted, (saving, predicted)
    assert chunked_loss_saving_bytes(tokens, vocab, dim, 0) == 0
