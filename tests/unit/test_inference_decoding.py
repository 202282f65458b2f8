"""trainer/inference/decoding.py: next-token choice and stop rules, without a model."""

from __future__ import annotations

import pytest
import torch

from trainer.inference.decoding import StopRules, check_sampling, next_token, prompt_generator

pytestmark = pytest.mark.unit

WORDS = ["a", "b", "STOP", "c", "ST", "OP", "d"]


def _decode(ids):
    return "".join(WORDS[i] for i in ids)


def test_greedy_is_the_argmax_and_sampling_follows_the_seed():
    logits = torch.tensor([0.0, 3.0, 1.0, 3.0, -1.0])
    assert next_token(logits, 0.0, 1.0, None) == 1  # the lowest id among equal maxima
    draws = [next_token(logits, 1.0, 1.0, prompt_generator(5, 0)) for _ in range(3)]
    assert len(set(draws)) == 1  # the same seed, the same draw
    many = {next_token(logits, 1.0, 1.0, g) for g in [prompt_generator(5, 0)] for _ in range(50)}
    assert many >= {1, 3}  # one generator drawing on: both likely tokens come up
    # top_p keeps the smallest most likely set reaching p: here the two tied maxima only
    kept = {next_token(logits, 1.0, 0.8, g) for g in [prompt_generator(1, 2)] for _ in range(100)}
    assert kept == {1, 3}
    assert {next_token(logits, 1.0, 1e-6, prompt_generator(s, 0)) for s in range(20)} == {1}


def test_prompt_generators_differ_by_seed_and_index():
    firsts = {torch.rand(1, generator=prompt_generator(s, i)).item() for s in range(3) for i in range(3)}
    assert len(firsts) == 9


def test_stop_ids_and_stop_strings_are_cut():
    rules = StopRules([6], ["STOP"], _decode)
    assert not rules.finished([0, 1])
    assert rules.finished([0, 6]) and rules.trim([0, 6]) == [0]  # the ending id is left out
    assert rules.finished([0, 2]) and rules.trim([0, 2, 3]) == [0]
    assert rules.finished([0, 4, 5]) and rules.trim([0, 4, 5]) == [0]  # a stop string across tokens
    assert StopRules([], [], _decode).trim([0, 6]) == [0, 6]
    # uncut (lm-eval cuts the text itself): the ending id still goes, the stop string stays
    assert rules.trim([0, 4, 5], cut=False) == [0, 4, 5] and rules.trim([0, 6], cut=False) == [0]
    with pytest.raises(ValueError, match="top_p"):
        check_sampling(1.0, 0.0)
    with pytest.raises(ValueError, match="temperature"):
        check_sampling(-1.0, 1.0)
