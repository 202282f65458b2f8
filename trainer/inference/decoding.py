"""Choosing the next token and deciding where a completion ends.

* :func:`next_token`: greedy (``temperature`` 0: the arg-max, the lowest id among equal
  maxima) or sampled (softmax of ``logits / temperature``, cut to the smallest set of most
  likely tokens whose probability reaches ``top_p``, one draw from a ``torch.Generator``).
  Every rank holds the same float32 logits and a generator seeded the same way, so every rank
  draws the same token: nothing here reads the rank.
* :func:`prompt_generator`: prompt ``i``'s generator from the user's ``seed``: one generator
  per prompt, so a prompt's completion does not depend on which prompts run beside it (nor on
  the layout).
* :class:`StopRules`: the end-of-sequence ids (the model's and the caller's ``stop_ids``; the
  id that ends a completion is not part of it) and stop strings (the completion is cut before
  the first occurrence of any of them in its decoded text).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

__all__ = ["StopRules", "check_sampling", "next_token", "prompt_generator"]

_SEED_MIX = 1_000_003  # prompt i of seed s draws from seed s * _SEED_MIX + i


def check_sampling(temperature: float, top_p: float) -> None:
    """The sampling options' ranges, as one-line ValueErrors."""
    if not temperature >= 0.0:
        raise ValueError(f"temperature must be >= 0 (0: greedy), got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def prompt_generator(seed: int, index: int) -> torch.Generator:
    """The CPU generator prompt ``index`` samples from under ``seed``."""
    return torch.Generator(device="cpu").manual_seed((seed * _SEED_MIX + index) % (2**63))


def next_token(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> int:
    """The next token of one row from its ``logits`` [vocab] (float32, on any device)."""
    if temperature == 0.0:
        return int(torch.argmax(logits).item())
    probs = torch.softmax(logits.detach().to("cpu", torch.float32) / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True, stable=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # the mass of the tokens ahead
        sorted_probs = torch.where(before < top_p, sorted_probs, torch.zeros_like(sorted_probs))
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator).item())


class StopRules:
    """Where one completion ends: at an id of ``stop_ids`` (left out) or before the first of
    ``stop_strings`` in its text (``decode``: token ids -> text)."""

    def __init__(self, stop_ids: Iterable[int], stop_strings: Sequence[str], decode: Callable[[list[int]], str]):
        self.stop_ids = frozenset(int(i) for i in stop_ids)
        self.stop_strings = tuple(s for s in stop_strings if s)
        self.decode = decode

    def finished(self, tokens: list[int]) -> bool:
        """Whether the completion ``tokens`` (new tokens so far) has ended."""
        if tokens and tokens[-1] in self.stop_ids:
            return True
        return bool(self.stop_strings) and self._cut_at(tokens) is not None

    def _cut_at(self, tokens: list[int]) -> int | None:
        text = self.decode(tokens)
        found = [text.find(s) for s in self.stop_strings]
        found = [i for i in found if i >= 0]
        return min(found) if found else None

    def trim(self, tokens: list[int], cut: bool = True) -> list[int]:
        """The completion as returned: without its ending id, and (``cut``) cut before a stop
        string (to the longest prefix of tokens whose text ends before it; a token that holds
        text on both sides of the cut is left out)."""
        if tokens and tokens[-1] in self.stop_ids:
            tokens = tokens[:-1]
        if not cut or not self.stop_strings:
            return tokens
        at = self._cut_at(tokens)
        if at is None:
            return tokens
        keep = 0
        for n in range(1, len(tokens) + 1):
            if len(self.decode(tokens[:n])) > at:
                break
            keep = n
        return tokens[:keep]
