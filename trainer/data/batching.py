"""Global batches that do not depend on the parallel layout, and exact resumption.

Optimizer step s consumes global samples ``[s*G, (s+1)*G)``; the rank with batch coordinate b
of batch degree D owns the contiguous slice ``[s*G + b*G/D, s*G + (b+1)*G/D)`` and yields it as
micro-batches of local_batch_size. Consequently every parallel layout (any D, any local batch
size) trains on exactly the same global batch at every step, which is what makes loss curves
comparable across layouts and lets a run resume on a different number of GPUs.

The resume state is the position of the next unconsumed step in the stream, identical on all
ranks and independent of D.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from trainer.config import ConfigError, gradient_accumulation_steps, resolve_global_batch_size
from trainer.data.packing import IGNORE_INDEX, PackedStream
from trainer.data.sources import DocumentSource
from trainer.data.striped import StripedStream
from trainer.data.token_shards import TokenDataset

logger = logging.getLogger(__name__)


class PackedDataLoader:
    """Infinite iterator of (inputs, labels) micro-batches, each a CPU LongTensor of shape
    [local_batch_size, seq_len]; ``grad_accum_steps`` consecutive micro-batches form one
    rank's share of a global step."""

    def __init__(
        self,
        source: DocumentSource | TokenDataset,
        tokenizer,
        *,
        seq_len: int,
        global_batch_size: int,
        local_batch_size: int,
        batch_rank: int,
        batch_degree: int,
        stream=None,
    ):
        if seq_len <= 0 or local_batch_size <= 0:
            raise ConfigError(f"seq_len ({seq_len}) and local_batch_size ({local_batch_size}) must be > 0")
        if not 0 <= batch_rank < batch_degree:
            raise ConfigError(f"batch rank {batch_rank} must be in [0, batch degree {batch_degree})")
        self.grad_accum_steps = gradient_accumulation_steps(global_batch_size, local_batch_size, batch_degree)
        self.global_batch_size = resolve_global_batch_size(global_batch_size, local_batch_size, batch_degree)
        self.local_batch_size, self.seq_len = local_batch_size, seq_len
        self.batch_rank, self.batch_degree = batch_rank, batch_degree
        self.rank_samples = self.global_batch_size // batch_degree
        self.tokens_per_step = self.global_batch_size * seq_len  # global, for throughput
        self.source_name = source.name
        self.description = getattr(source, "description", source.name)  # the start-up line's words
        # masked: labels may hold IGNORE_INDEX (chat data), so the step's loss is divided by the
        # count of target tokens (trainer/loss_count.py) instead of tokens_per_step
        self.masked = bool(getattr(source, "masked", False))
        if stream is not None:  # a stream built by the caller (chat windows, a mixture)
            self._stream = stream
        elif isinstance(source, TokenDataset):  # pre-tokenized: read by address
            source.check_tokenizer(tokenizer)
            self._stream = source.stream(seq_len)
        else:
            self._stream = PackedStream(source, tokenizer, seq_len)
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._step_start: dict[str, Any] | None = None
        # a mixture's source names; per step, the source index of each of this rank's samples
        # (``step_sources``, in micro-batch order), which the step's per-source target counts read
        names = getattr(self._stream, "names", None)
        self.source_names: list[str] | None = list(names) if names is not None and len(names) > 1 else None
        self.step_sources: torch.Tensor | None = None
        self._pending_sources: torch.Tensor | None = None
        # rows read in stripes: a rank knows only its own stripes' passes (the ranks agree on them)
        self.passes_agree = isinstance(self._stream, StripedStream)
        # global sample ranges [start, end) never trained on (training.skip_samples, a rollback's:
        # trainer/bad_steps.py): a step whose first sample lies in one reads on from its end
        self.skip_ranges: list[tuple[int, int]] = []

    def add_skip(self, start: int, end: int) -> None:
        self.skip_ranges.append((int(start), int(end)))

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._pending:
            self._prepare_step()
        return self._pending.pop(0)

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """All grad_accum_steps micro-batches of the next step (must be at a step boundary)."""
        if self._pending:
            raise RuntimeError("next_step() called with micro-batches of the current step still unconsumed")
        self._prepare_step()
        batches, self._pending = self._pending, []
        self.step_sources = self._pending_sources
        return batches

    def _prepare_step(self) -> None:
        s = self._stream
        while hit := [end for start, end in self.skip_ranges if start <= s.sample_index < end]:
            s.skip(max(hit) - s.sample_index)
        self._step_start = s.state()
        s.skip(self.batch_rank * self.rank_samples)
        windows = s.take(self.rank_samples)
        if self.source_names is not None:
            self._pending_sources = torch.from_numpy(np.asarray(s.taken_sources, dtype=np.int64))
        s.skip((self.batch_degree - 1 - self.batch_rank) * self.rank_samples)
        if isinstance(windows, tuple):  # (tokens, is-target): only targets are labels
            windows, targets = windows
            inputs = windows[:, :-1]
            labels = torch.where(targets[:, 1:], windows[:, 1:], torch.full_like(windows[:, 1:], IGNORE_INDEX))
        else:
            inputs, labels = windows[:, :-1], windows[:, 1:]
        b = self.local_batch_size
        self._pending = [
            (inputs[i : i + b].contiguous(), labels[i : i + b].contiguous()) for i in range(0, self.rank_samples, b)
        ]

    def notes(self) -> str:
        """What the first step's data line adds for this data ('' for plain token streams)."""
        notes = getattr(self._stream, "notes", None)
        return "; " + notes() if notes is not None else ""

    def source_metrics(self, state: dict[str, Any]) -> dict[str, int]:
        """A mixture's tokens per source up to the position ``state`` (a :meth:`state_dict`),
        for the metrics rows; {} for one source."""
        metrics = getattr(self._stream, "source_metrics", None)
        return metrics(int(state["sample_index"])) if metrics is not None else {}

    def passes(self, state: dict[str, Any]) -> list[int | None]:
        """Complete passes over each source before the position ``state`` (a :meth:`state_dict`),
        one entry per source (None: a source without end, synthetic data); with rows read in
        stripes, as far as this rank's stripes tell (:attr:`passes_agree`)."""
        got = self._stream.passes(state) if hasattr(self._stream, "passes") else None
        return got if isinstance(got, list) else [got]

    def state_dict(self) -> dict[str, Any]:
        """Position of the first step not fully consumed (a half-consumed step is replayed
        on resume, matching a model that has not taken that optimizer step)."""
        state = dict(self._step_start) if self._pending else self._stream.state()
        state.update(dataset=self.source_name, seq_len=self.seq_len)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("dataset") != self.source_name:
            raise ValueError(
                f"data loader state is for dataset '{state.get('dataset')}' but this run uses "
                f"'{self.source_name}'; to start the new dataset from its beginning set "
                f'checkpoint.exclude_from_loading = ["dataloader"]'
            )
        striped = isinstance(self._stream, StripedStream)
        if striped != ("stripes" in state):
            how = (
                ("in stripes of rows", "as one stream")
                if "stripes" in state
                else ("as one stream", "in stripes of rows")
            )
            setting = "'striped'" if "stripes" in state else "'sequential'"
            raise ValueError(
                f"data loader state was written reading the rows {how[0]}, but this run reads them {how[1]} "
                f"(training.row_reading); set training.row_reading = {setting} to continue the same samples, or "
                'start the data from its beginning with checkpoint.exclude_from_loading = ["dataloader"]'
            )
        if state.get("seq_len") != self.seq_len:
            logger.warning(
                "resuming data with seq_len %s (checkpoint had %s): the token position is kept, "
                "sample indices continue from %s",
                self.seq_len,
                state.get("seq_len"),
                state["sample_index"],
            )
        self._stream.restore(state)
        self._pending = []
        self._step_start = None
