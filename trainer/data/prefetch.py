"""Preparing the next step's data while the current step trains: :class:`BackgroundLoader`
(``training.prefetch = true``) and :class:`SyncLoader`, the same interface without a thread.
"""

from __future__ import annotations

import concurrent.futures
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from trainer.data.batching import PackedDataLoader


class _Totals:
    """What both wrappers keep beside the loader's position: ``targets``, the run's global target
    tokens (labels that count in the loss) per source name since step 0, which the trainer adds
    each step's to; saved with the position (``"targets"`` in :meth:`state_dict`) so the counts
    continue on resume, whatever the batch degree (they are global)."""

    targets: dict[str, int]

    def _with_totals(self, state: dict[str, Any]) -> dict[str, Any]:
        if self.targets:
            state["targets"] = dict(self.targets)
        return state

    def _take_totals(self, state: dict[str, Any]) -> dict[str, Any]:
        state = dict(state)
        self.targets = {k: int(v) for k, v in (state.pop("targets", None) or {}).items()}
        return state


class BackgroundLoader(_Totals):
    """Prepares the next step's micro-batches of a :class:`PackedDataLoader` on one background
    thread while the training thread runs the current step.

    The samples and their order are the wrapped loader's, unchanged: the thread calls its
    ``next_step()`` one step ahead, nothing else. ``state_dict()`` is the position of the next
    step the *trainer* will consume (the wrapped loader is one step further once a step is
    prefetched), so a checkpoint resumes exactly where the trainer stopped, prefetching or not.
    An exception raised while preparing a step (a dataset error) is raised again, unchanged, by
    the ``next_step()`` call that would have returned that step.

    On CUDA the thread also pins the micro-batches and copies them to ``device`` with
    non-blocking copies on a side stream; ``next_step()`` makes the caller's stream wait for
    them. Elsewhere the tensors stay on the CPU (the trainer moves them).

    ``wait_s``: seconds the last ``next_step()`` call blocked waiting for its data.
    """

    def __init__(self, loader: PackedDataLoader, device: torch.device | str | None = None):
        self.loader = loader
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self._copy_stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._executor: ThreadPoolExecutor | None = None  # started by the first next_step()
        self._future: Future | None = None
        self._state: dict[str, Any] | None = None  # the trainer's position while a step is prefetched
        self.wait_s = 0.0
        self.targets = {}
        self.step_sources: torch.Tensor | None = None  # the consumed step's (the loader is one step ahead)

    def __getattr__(self, name: str) -> Any:  # grad_accum_steps, tokens_per_step, ...
        if name == "loader":  # not yet set (e.g. during unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)

    def _produce(self) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], dict[str, Any], Any, Any]:
        batches = self.loader.next_step()
        state = self.loader.state_dict()  # where the step after this one starts
        sources = getattr(self.loader, "step_sources", None)  # a mixture's per-sample source ids
        event = None
        if self._cuda:
            with torch.cuda.device(self.device), torch.cuda.stream(self._copy_stream):
                if sources is not None:
                    sources = sources.pin_memory().to(self.device, non_blocking=True)
                batches = [
                    (
                        x.pin_memory().to(self.device, non_blocking=True),
                        y.pin_memory().to(self.device, non_blocking=True),
                    )
                    for x, y in batches
                ]
                event = torch.cuda.Event()
                event.record(self._copy_stream)
        return batches, state, event, sources

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        start = time.perf_counter()
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="data-prefetch")
        future = self._future if self._future is not None else self._executor.submit(self._produce)
        self._future = None
        batches, state, event, self.step_sources = future.result()  # re-raises the thread's exception, if any
        self._state = state
        self._future = self._executor.submit(self._produce)
        if event is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(event)
            for x, y in batches:  # allocated on the copy stream, used on this one
                x.record_stream(stream)
                y.record_stream(stream)
            if self.step_sources is not None:
                self.step_sources.record_stream(stream)
        self.wait_s = time.perf_counter() - start
        return batches

    def _drop(self) -> None:
        """Wait for the step in flight and discard it (its exception too)."""
        if self._future is not None:
            concurrent.futures.wait([self._future])
            self._future = None

    def state_dict(self) -> dict[str, Any]:
        if self._state is not None:
            return self._with_totals(dict(self._state))
        return self._with_totals(self.loader.state_dict())  # nothing consumed or prefetched yet (or a failed step)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._drop()  # the prefetched step came from the old position
        self._state = None
        self.loader.load_state_dict(self._take_totals(state))

    def close(self) -> None:
        """Stop the thread once the step in flight, if any, is ready; that step is kept for the
        next ``next_step()`` (which starts a new thread), so nothing is skipped."""
        if self._future is not None:
            concurrent.futures.wait([self._future])
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def __enter__(self) -> BackgroundLoader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class SyncLoader(_Totals):
    """The same interface without a thread (``training.prefetch = false``): every step is
    prepared on the training thread; ``wait_s`` is the time that took."""

    def __init__(self, loader: PackedDataLoader):
        self.loader = loader
        self.wait_s = 0.0
        self.targets = {}

    def __getattr__(self, name: str) -> Any:
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        start = time.perf_counter()
        batches = self.loader.next_step()
        self.wait_s = time.perf_counter() - start
        return batches

    def state_dict(self) -> dict[str, Any]:
        return self._with_totals(self.loader.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(self._take_totals(state))

    def close(self) -> None:
        pass

    def __enter__(self) -> SyncLoader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
