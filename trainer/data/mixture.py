"""Data mixtures (``[[training.sources]]``): every global sample (window) is drawn from one
source, chosen by a seeded schedule that depends only on (seed, sample index) and the weights,
never on the layout: global sample k comes from source ``choice(k)``, and it is that source's
next window in its own stream (each source is packed as it would be alone: documents + eos for
pre-training kinds, conversations for ``chat``).

Schedule: the samples are cut into blocks of :data:`BLOCK`; block b draws BLOCK uniforms from
``numpy.random.default_rng([seed, b])`` and sample k takes the source whose cumulative weight
share first exceeds its uniform. So each sample is an independent draw with probability
weight / sum(weights): over n samples a source's count is Binomial(n, p) (the mixture proportion
test bounds it by 5 standard deviations).

Preference sources (``kind = "preference"``) fill two windows per row (a pair: chosen, rejected):
a mixture of them draws a source per pair (``unit = 2``: samples 2k and 2k + 1 take pair k's
draw), so a pair never mixes sources; a preference source beside another kind is refused.

Resume state: the sample index and every source's own position, each the same on every rank
(every rank walks the whole schedule; it takes its own samples and skips the others', as for a
single stream). The per-source counts up to a sample index come from the schedule alone, so the
metrics' per-source token counts continue across a resume.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["BLOCK", "MixtureSchedule", "MixtureStream", "mixture_notes"]

BLOCK = 4096


class MixtureSchedule:
    """Which source each global sample comes from: (seed, weights) -> ``choices(start, n)``, the
    same for every rank, layout and resume (the module docstring's schedule)."""

    def __init__(self, weights: list[float], seed: int, unit: int = 1) -> None:
        self.weights, self.seed, self.unit = [float(w) for w in weights], seed, unit
        self._cum = np.cumsum(self.weights) / sum(self.weights)
        self._cum[-1] = 1.0
        self._blocks: dict[int, np.ndarray] = {}

    @property
    def shares(self) -> list[float]:
        return [w / sum(self.weights) for w in self.weights]

    def _block(self, b: int) -> np.ndarray:
        choice = self._blocks.get(b)
        if choice is None:
            u = np.random.default_rng([self.seed, b]).random(BLOCK)
            choice = np.searchsorted(self._cum, u, side="right").astype(np.int64)
            if len(self._blocks) > 64:
                self._blocks.clear()
            self._blocks[b] = choice
        return choice

    def choices(self, start: int, n: int) -> np.ndarray:
        """The source index of global samples ``[start, start + n)`` (with ``unit`` > 1, the draw
        of each run of ``unit`` samples)."""
        if self.unit > 1:
            first = start // self.unit
            runs = -(-(start + n) // self.unit) - first
            return np.repeat(self._draws(first, runs), self.unit)[start - first * self.unit :][:n]
        return self._draws(start, n)

    def _draws(self, start: int, n: int) -> np.ndarray:
        out = np.empty(n, dtype=np.int64)
        k = 0
        while k < n:
            b, off = divmod(start + k, BLOCK)
            m = min(n - k, BLOCK - off)
            out[k : k + m] = self._block(b)[off : off + m]
            k += m
        return out

    def counts(self, end: int) -> list[int]:
        """Samples drawn from each source among global samples ``[0, end)``."""
        if self.unit > 1:
            runs, part = divmod(end, self.unit)
            total = [c * self.unit for c in self._counts(runs)]
            if part:
                total[int(self._draws(runs, 1)[0])] += part
            return total
        return self._counts(end)

    def _counts(self, end: int) -> list[int]:
        full, rest = divmod(end, BLOCK)
        total = np.zeros(len(self.weights), dtype=np.int64)
        for b in range(full):
            total += np.bincount(self._block(b), minlength=len(self.weights))
        if rest:
            total += np.bincount(self._block(full)[:rest], minlength=len(self.weights))
        return total.tolist()


class MixtureStream:
    """The :class:`~trainer.data.packing.PackedStream` interface over several streams.
    ``take`` returns windows, or (windows, targets) when any source is masked (a pre-training
    source's windows are all targets)."""

    def __init__(self, streams: list[Any], names: list[str], weights: list[float], seed: int, *, masked: bool) -> None:
        self.streams, self.names, self.seed, self.masked = streams, names, seed, masked
        self.schedule = MixtureSchedule(weights, seed, unit=getattr(streams[0], "pair_unit", 1))
        self.weights = self.schedule.weights
        self.window = streams[0].window
        self.sample_index = 0
        self.shares, self.choices, self.counts = self.schedule.shares, self.schedule.choices, self.schedule.counts

    def take(self, n_samples: int):
        toks = np.empty((n_samples, self.window), dtype=np.int64)
        tgt = np.ones((n_samples, self.window), dtype=bool)
        self.taken_sources = picks = self.choices(self.sample_index, n_samples)  # the source of each sample
        for i, s in enumerate(picks):
            got = self.streams[s].take(1)
            if isinstance(got, tuple):
                toks[i], tgt[i] = got[0][0].numpy(), got[1][0].numpy()
            else:
                toks[i] = got[0].numpy()
        self.sample_index += n_samples
        toks_t = torch.from_numpy(toks)
        return (toks_t, torch.from_numpy(tgt)) if self.masked else toks_t

    def skip(self, n_samples: int) -> None:
        for s in self.choices(self.sample_index, n_samples):
            self.streams[s].skip(1)
        self.sample_index += n_samples

    def state(self) -> dict[str, Any]:
        return {
            "sample_index": self.sample_index,
            "mixture": [[name, w] for name, w in zip(self.names, self.weights)],
            "sources": {name: s.state() for name, s in zip(self.names, self.streams)},
        }

    def restore(self, state: dict[str, Any]) -> None:
        check_mixture_state(state, self.names, self.weights)
        for name, stream in zip(self.names, self.streams):
            stream.restore(state["sources"][name])
        self.sample_index = int(state["sample_index"])

    def passes(self, state: dict[str, Any]) -> list[int | None]:
        """Each source's complete passes before the position ``state`` (None: no end)."""
        return [s.passes(state["sources"][n]) for n, s in zip(self.names, self.streams)]

    def notes(self) -> str:
        """The first step's data line: each source's share of the windows so far."""
        chats = [s.notes() for s in self.streams if hasattr(s, "notes")]
        return mixture_notes(self.names, self.schedule, self.sample_index, chats)

    def source_metrics(self, sample_index: int) -> dict[str, int]:
        """Tokens (window positions) each source gave up to ``sample_index``: the metrics row."""
        return mixture_tokens(self.names, self.schedule, sample_index, self.window - 1)


def check_mixture_state(state: dict[str, Any], names: list[str], weights: list[float]) -> None:
    """A checkpoint's data position is for this mixture (the same names and weights)."""
    saved = state.get("mixture")
    if saved != [[name, w] for name, w in zip(names, weights)]:
        raise ValueError(
            f"data loader state is for the mixture {saved} but this run's training.sources are "
            f"{[[n, w] for n, w in zip(names, weights)]} (name, weight); to start the new mixture "
            'from its beginning set checkpoint.exclude_from_loading = ["dataloader"]'
        )


def mixture_notes(names: list[str], schedule: MixtureSchedule, sample_index: int, chats: list[str]) -> str:
    """The first step's data line of a mixture: each source's share of the windows so far, and
    what its chat sources say."""
    got = schedule.counts(sample_index)
    shares = ", ".join(
        f"{name} {c / max(sample_index, 1):.1%} (weight share {p:.1%})"
        for name, c, p in zip(names, got, schedule.shares)
    )
    return f"mixture: {shares} of {sample_index} windows" + "".join("; " + c for c in chats)


def mixture_tokens(names: list[str], schedule: MixtureSchedule, sample_index: int, seq_len: int) -> dict[str, int]:
    """Tokens (window positions) each source gave up to ``sample_index``: the metrics row."""
    return {f"tokens_{name}": c * seq_len for name, c in zip(names, schedule.counts(sample_index))}
