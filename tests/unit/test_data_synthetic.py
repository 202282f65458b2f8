"""The synthetic corpus and its entropy bars (trainer/data/synthetic.py)."""

import pytest
import torch

from trainer.data.synthetic import bigram_conditional_entropy, synthetic_document, unigram_entropy
from trainer.data.tokenizer import load_tokenizer

TOK = load_tokenizer()


def test_synthetic_corpus_is_deterministic_and_seeded():
    assert synthetic_document(0, 17) == synthetic_document(0, 17)
    assert [synthetic_document(0, i) for i in range(20)] != [synthetic_document(1, i) for i in range(20)]


def test_synthetic_corpus_has_learnable_structure():
    toks = []
    for i in range(400):
        toks += TOK.encode(synthetic_document(0, i)) + [TOK.eos_id]
    h1, h2 = unigram_entropy(toks), bigram_conditional_entropy(toks)
    assert 3.0 < h1 < 6.0
    assert h2 < 0.6 * h1  # a previous-token model already beats the unigram floor by far


def test_entropy_helpers_on_known_distributions():
    assert unigram_entropy([0, 1, 2, 3] * 10) == pytest.approx(torch.log(torch.tensor(4.0)).item())
    assert bigram_conditional_entropy([0, 1] * 50) == pytest.approx(0.0)
