"""Striped reading (``training.row_reading``): each rank reads only its own rows of a parquet or
``save_to_disk`` dataset, and the samples do not depend on the layout.

A packed window's first token depends on the lengths of every row before it, so one stream of
windows over the whole dataset must be read in full by every rank (``sequential``). Instead, the
rows are cut into G contiguous stripes, G = the global batch size in samples, and slot i of every
optimizer step (global sample ``s * G + i``) is the next window of stripe i, packed on its own
(documents + EOS, or conversations), wrapping to the stripe's first row after its last. Batch
rank b of D owns the slots ``[b * G / D, (b + 1) * G / D)`` (trainer/data/batching.py), so it
reads only those stripes: 1/D of the rows. Every layout of the same global batch reads the same
windows in the same places, and a resume on another layout continues them.

In a mixture (``[[training.sources]]``) the seeded schedule still picks the source of every
global sample; a parquet / save_to_disk source of kind ``hf`` or ``chat`` gives slot i the next
window of its own stripe i, any other source (``.jsonl``, ``.txt``, tokens, synthetic) keeps its
one stream, walked by every rank as before.

Preference rows give two windows each (chosen, rejected: trainer/data/preference.py): such a
source is cut into G / 2 stripes, and slots 2j and 2j + 1 (which one batch rank owns together,
G / D being even) read pair after pair of stripe j.

The resume state: the sample index, G, and per striped source the position of every stripe. A
rank knows only its own stripes' positions; :func:`complete_state` (collective, called by the
checkpoint save on every rank) gathers them, so the checkpoint holds all G.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from trainer.data.mixture import MixtureSchedule, check_mixture_state, mixture_notes, mixture_tokens
from trainer.data.preference import preference_notes

__all__ = ["StripedStream", "Stripes", "complete_state", "merge_states"]


class Stripes:
    """One source read in stripes: ``make(i)`` builds the window stream of stripe i (a
    :class:`~trainer.data.packing.PackedStream` or :class:`~trainer.data.chat.ChatStream` over
    ``RowFiles.stripe(i, G)``), built when its slot first reads it. ``unit``: the slots each
    stripe serves (2 for preference pairs: slots 2j, 2j + 1 read stripe j)."""

    def __init__(self, make: Callable[[int], Any], description: str, rows: Any = None, count: int = 0, unit: int = 1):
        self.make, self.description, self.unit = make, description, unit
        self.rows, self.count = rows, count  # the RowFiles cut into ``count`` stripes (their passes)
        self._geometry: dict[int, Any] = {}
        self.streams: dict[int, Any] = {}
        self.saved: dict[int, dict[str, Any]] = {}  # restored positions of stripes not built yet

    def stream(self, i: int):
        s = self.streams.get(i)
        if s is None:
            s = self.streams[i] = self.make(i)
            if i in self.saved:
                s.restore(self.saved.pop(i))
        return s

    def passes(self, i: int, state: dict[str, Any] | None) -> int:
        """Complete passes over stripe i's rows before its position ``state`` (None: not read yet)."""
        if state is None:
            return 0
        geometry = self._geometry.get(i)
        if geometry is None:
            geometry = self._geometry[i] = self.rows.stripe(i, self.count)
        return geometry.passes(state["cursor"])


class StripedStream:
    """The :class:`~trainer.data.packing.PackedStream` interface (``take``, ``skip``, ``state``,
    ``restore``) over sources of which at least one is :class:`Stripes`; ``sources[j]`` is a
    :class:`Stripes` or a plain stream (read in full by every rank). ``schedule``: the mixture's
    (None: one source). ``owned``: this rank's slots (for its state)."""

    def __init__(
        self,
        sources: list[Any],
        names: list[str],
        *,
        slots: int,
        owned: range,
        window: int,
        masked: bool,
        name: str,
        description: str,
        schedule: MixtureSchedule | None = None,
    ):
        self.sources, self.names, self.slots, self.owned = sources, names, slots, owned
        self.window, self.masked, self.name, self.schedule = window, masked, name, schedule
        self.description = description
        self.sample_index = 0

    def _walk(self, n: int, keep: bool):
        start = self.sample_index
        picks = self.schedule.choices(start, n) if self.schedule is not None else np.zeros(n, dtype=np.int64)
        toks = np.empty((n, self.window), dtype=np.int64) if keep else None
        tgt = np.ones((n, self.window), dtype=bool) if keep else None
        if keep:
            self.taken_sources = picks  # the source of each sample taken
        for m, j in enumerate(picks.tolist()):
            src = self.sources[j]
            if isinstance(src, Stripes):
                if not keep:
                    continue  # another rank's slot: its stripe is not read here
                slot = (start + m) % self.slots
                if slot not in self.owned:
                    raise RuntimeError(f"slot {slot} taken by the rank that owns slots {self.owned}")
                got = src.stream(slot // src.unit).take(1)
            else:
                got = src.take(1) if keep else src.skip(1)
            if keep:
                if isinstance(got, tuple):
                    toks[m], tgt[m] = got[0][0].numpy(), got[1][0].numpy()
                else:
                    toks[m] = got[0].numpy()
        self.sample_index += n
        if keep:
            toks_t = torch.from_numpy(toks)
            return (toks_t, torch.from_numpy(tgt)) if self.masked else toks_t
        return None

    def take(self, n_samples: int):
        return self._walk(n_samples, keep=True)

    def skip(self, n_samples: int) -> None:
        self._walk(n_samples, keep=False)

    def state(self) -> dict[str, Any]:
        """This rank's part of the position (its own stripes'); :func:`complete_state` merges
        every rank's."""
        sources: dict[str, Any] = {}
        for name, src in zip(self.names, self.sources):
            if isinstance(src, Stripes):
                slots = {str(i): s for i, s in src.saved.items() if i * src.unit in self.owned}
                slots.update({str(i): s.state() for i, s in src.streams.items()})
                sources[name] = {"stripes": slots}
            else:
                sources[name] = src.state()
        state = {
            "sample_index": self.sample_index,
            "stripes": self.slots,
            "slot_range": [self.owned.start, self.owned.stop],
            "sources": sources,
        }
        if self.schedule is not None:
            state["mixture"] = [[n, w] for n, w in zip(self.names, self.schedule.weights)]
        return state

    def restore(self, state: dict[str, Any]) -> None:
        if state.get("stripes") != self.slots:
            raise ValueError(
                f"data loader state is for a global batch of {state.get('stripes')} samples read in as many "
                f"stripes, but this run's global batch is {self.slots} (training.row_reading: one stripe per "
                f"sample); resume with training.global_batch_size = {state.get('stripes')}, or start the data "
                'from its beginning with checkpoint.exclude_from_loading = ["dataloader"]'
            )
        if self.schedule is not None:
            check_mixture_state(state, self.names, self.schedule.weights)
        for name, src in zip(self.names, self.sources):
            saved = state["sources"][name]
            if isinstance(src, Stripes):
                src.streams = {}
                src.saved = {int(i): s for i, s in saved["stripes"].items()}
            else:
                src.restore(saved)
        self.sample_index = int(state["sample_index"])

    def passes(self, state: dict[str, Any]) -> list[int | None]:
        """Each source's complete passes before the position ``state`` as far as this rank knows:
        a striped source's the fewest among this rank's own stripes (the global figure is the
        fewest over the ranks: trainer/data/epochs.py agrees on it), another source's its own."""
        out: list[int | None] = []
        slots = self.owned if "slot_range" in state else range(self.slots)  # merged: every rank's
        for name, src in zip(self.names, self.sources):
            saved = state["sources"][name]
            if isinstance(src, Stripes):
                stripes = sorted({i // src.unit for i in slots})
                out.append(min(src.passes(i, saved["stripes"].get(str(i))) for i in stripes))
            else:
                out.append(src.passes(saved))
        return out

    def notes(self) -> str:
        """The first step's data line: this rank's stripes, and the chat counts of its streams."""
        unit = max((src.unit for src in self.sources if isinstance(src, Stripes)), default=1)  # 2: preference pairs
        lo, hi, count = self.owned.start // unit, (self.owned.stop - 1) // unit, self.slots // unit
        chats = []
        for src in self.sources:
            streams = list(src.streams.values()) if isinstance(src, Stripes) else [src]
            if any(hasattr(s, "conversations") for s in streams):
                chats.append(_chat_sum([s for s in streams if hasattr(s, "conversations")]))
            elif any(hasattr(s, "pairs") for s in streams):
                chats.append(preference_notes([s for s in streams if hasattr(s, "pairs")], "this rank's "))
        own = f"this rank reads stripes {lo}-{hi} of {count}" if lo != hi else f"this rank reads stripe {lo} of {count}"
        if self.schedule is not None:
            return own + "; " + mixture_notes(self.names, self.schedule, self.sample_index, chats)
        return "; ".join([own, *chats])

    def source_metrics(self, sample_index: int) -> dict[str, int]:
        if self.schedule is None:
            return {}
        return mixture_tokens(self.names, self.schedule, sample_index, self.window - 1)


def _chat_sum(streams: list[Any]) -> str:
    """The chat counts of several window streams (this rank's stripes of one source), in the
    words of :meth:`~trainer.data.chat.ChatStream.notes`."""
    s0 = streams[0]
    conv, trunc, drop = (sum(getattr(s, k) for s in streams) for k in ("conversations", "truncated", "dropped"))
    windows = sum(s.sample_index for s in streams)
    return (
        f"chat: this rank's {conv} conversations in {windows} windows ({s0.packing}), {trunc} truncated and "
        f"{drop} dropped as longer than {s0.window} tokens (training.chat_too_long = {s0.too_long})"
    )


def merge_states(states: list[dict[str, Any]]) -> dict[str, Any]:
    """Every rank's part of a striped position as one: the stripes of all (the ranks that share
    a batch slice, e.g. TP peers, hold the same)."""
    first = states[0]
    if any(s["sample_index"] != first["sample_index"] for s in states):
        raise RuntimeError(f"ranks disagree on the data position: {[s['sample_index'] for s in states]}")
    merged = {k: v for k, v in first.items() if k not in ("slot_range", "sources")}
    merged["sources"] = {}
    for name, saved in first["sources"].items():
        if isinstance(saved, dict) and set(saved) == {"stripes"}:
            slots: dict[str, Any] = {}
            for s in states:
                slots.update(s["sources"][name]["stripes"])
            merged["sources"][name] = {"stripes": dict(sorted(slots.items(), key=lambda kv: int(kv[0])))}
        else:
            merged["sources"][name] = saved
    return merged


def complete_state(state: Any, group: dist.ProcessGroup | None = None) -> Any:
    """A loader's state as a checkpoint holds it: a striped one (which holds only this rank's
    stripes) merged with every other rank's. Collective over ``group`` (every rank calls it,
    with whatever its loader's state is); other states are returned as they are."""
    if not isinstance(state, dict) or "slot_range" not in state:
        return state
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return merge_states([state])
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, state, group=group)
    return merge_states(gathered)
