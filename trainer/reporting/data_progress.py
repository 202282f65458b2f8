"""What a run has read of its data beside the step count: the global epoch (complete passes over
the data, and ``training.epochs``, which stops the run after N of them) and the global count of
target tokens per source. Both are reported in ``metrics.jsonl`` (``epoch``, ``targets``,
``targets_<source>``), on the step line and in the end-of-run summary.

**Epoch** = complete passes over the data after a step, from the data position the checkpoint
holds (so it survives a resume, on any batch degree):

- one source read as one stream (``.txt``, ``.jsonl``, ``tokens``, ``sequential`` rows): the
  passes its cursor has made (a pass is complete once its last token, or row, is in a consumed
  window; the rest of that step's windows already come from the next pass);
- one source read in stripes: the fewest passes among its stripes (every stripe wraps at its
  own pace; a pass is complete once every row has been read);
- a mixture: the most passes among its finite sources (synthetic data never ends), so with
  ``training.epochs = N`` no source is read more than N times in full; a source with fewer rows
  per weight is the one that ends the epoch;
- synthetic data only: no epoch (the config refuses ``training.epochs``).

With striped reading a rank knows only its own stripes: the ranks agree on each source's fewest
passes on the all-reduce that already agrees on a stop at every step (trainer/runtime/stop.py: a max
over the ranks, each pass count sent negated), so no collective of its own runs per step (one
more runs at the last step of ``training.steps`` and one at the start, where the epoch is needed
and the stop agreement does not run). Sequential reading: every rank reads every window of the
stream, its own count is the global one.

**Targets**: the labels that count in the loss (not ``IGNORE_INDEX``): with masked (chat) data
the step's global target count is already one all-reduce over the batch mesh, read on the host
with the loss (trainer/step.py); in a mixture it is a vector with one entry per source (each
sample's source carried with the step's micro-batches), summed by the same all-reduce. Running
totals since step 0 are kept with the data position in the checkpoint (trainer/data/prefetch.py).
Pre-training windows have no ignored label: their targets are their window positions
(``tokens_<source>``), nothing is counted on the device.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DataProgress", "epoch_of"]

_NO_END = 1  # a source without end on the agreement's wire (a pass count p travels as -p <= 0)


def epoch_of(passes: list[int | None]) -> int | None:
    """The data's epoch from each source's complete passes (None: a source without end)."""
    finite = [p for p in passes if p is not None]
    return max(finite) if finite else None


def _times(n: int) -> str:
    return {1: "once", 2: "twice"}.get(n, f"{n} times")


class DataProgress:
    """The trainer's view of the data's progress. ``data``: the trainer's loader (its
    ``passes``, ``state_dict``, ``targets`` totals); ``epochs``: ``training.epochs`` (0: off);
    ``peers``: whether other ranks exist (then striped passes are agreed on)."""

    def __init__(self, data: Any, *, epochs: int, peers: bool):
        self.data, self.limit = data, epochs
        self.agree = peers and bool(getattr(data, "passes_agree", False))
        self.names: list[str] = list(data.source_names or [data.source_name])
        self.masked = bool(data.masked)
        self.epoch: int | None = None
        self.passes: list[int | None] = []
        self.done_at: int | None = None  # the step after which training.epochs was reached

    # ------------------------------------------------------------------ epoch
    def local_values(self) -> list[int]:
        """This rank's passes per source, as the stop agreement carries them (max over ranks)."""
        return [_NO_END if p is None else -p for p in self.data.passes(self.data.state_dict())]

    def update(self, agreed: list[int] | None, step: int = 0) -> list[str]:
        """After step ``step`` (or before the first): the epoch from the data position, ``agreed``
        the stop agreement's values where the ranks agree (else this rank's own passes are the
        global ones). Returns the notice line of an epoch that has just completed."""
        if self.agree:
            if not agreed:
                return []  # no agreement ran: the epoch is the last agreed one
            passes = [None if v > 0 else -v for v in agreed]
        else:
            passes = self.data.passes(self.data.state_dict())
        before, self.passes, self.epoch = self.epoch, passes, epoch_of(passes)
        if before is None or self.epoch is None or self.epoch <= before:
            return []
        return [self._notice(step)]

    def _notice(self, step: int) -> str:
        read = (
            f"all of '{self.names[0]}' read {_times(self.epoch)}"
            if len(self.names) == 1
            else "complete passes per source: "
            + ", ".join(f"{n} {'-' if p is None else p}" for n, p in zip(self.names, self.passes))
            + " (the epoch: the most among the finite sources)"
        )
        done = self.reached
        what = f"training.epochs = {self.limit} reached: the run stops" if done else "the data starts over"
        return f"epoch {self.epoch} complete after step {step} ({read}); {what}"

    @property
    def reached(self) -> bool:
        """``training.epochs`` complete passes have been made."""
        return bool(self.limit) and self.epoch is not None and self.epoch >= self.limit

    # ---------------------------------------------------------------- targets
    def add_targets(self, counts: list[int]) -> None:
        """A step's global target counts (one per source; masked data only) into the totals."""
        totals = self.data.targets
        for name, c in zip(self.names, counts):
            totals[name] = totals.get(name, 0) + int(c)

    def targets_total(self) -> int | None:
        """Target tokens since step 0 (masked data; None for pre-training data)."""
        return sum(self.data.targets.values()) if self.masked else None

    def metrics(self, tokens: dict[str, int]) -> dict[str, int]:
        """The metrics row's fields: ``epoch``, and with masked data ``targets`` (target tokens
        since step 0) and, in a mixture, ``targets_<source>`` beside ``tokens_<source>``
        (``tokens``: the row's window positions per source; a pre-training mixture's targets are
        its window positions)."""
        out: dict[str, int] = {} if self.epoch is None else {"epoch": self.epoch}
        if self.masked:
            out["targets"] = self.targets_total() or 0
        if len(self.names) > 1:
            for name in self.names:
                if self.masked:
                    out[f"targets_{name}"] = int(self.data.targets.get(name, 0))
                elif f"tokens_{name}" in tokens:
                    out[f"targets_{name}"] = int(tokens[f"tokens_{name}"])
        return out
