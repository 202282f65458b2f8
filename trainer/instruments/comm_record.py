"""``comm.record_step``: every collective of one training step, per rank, in
``<dump_folder>/comm_rank<R>.json`` (parallel_dims/comm_record.py records; this hook decides
when and writes the file)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from parallel_dims.comm_record import CommRecorder
from trainer.instruments.base import HookBase
from trainer.runtime.files import atomic_write_json

__all__ = ["CommRecordHook", "write_records"]


def write_records(recorder: CommRecorder, path: str, **meta: Any) -> None:
    """``meta`` (step, rank, world_size, ...) with the recorder's records, summary and calls as
    one JSON object at ``path`` (atomically)."""
    atomic_write_json(path, {**meta, **recorder.to_json()})


class CommRecordHook(HookBase):
    """Records the collectives of step ``step`` (a dispatch mode around the step) and writes them."""

    def __init__(self, step: int, parallel_dims, folder: str, meta: dict[str, Any], log: Callable[[str], None]):
        super().__init__()
        self.step, self.pd, self.folder, self.meta, self.log = step, parallel_dims, folder, meta, log
        self._recorder: CommRecorder | None = None

    def on_step_start(self, step: int) -> None:
        if step == self.step:
            self._recorder = CommRecorder(self.pd)
            self._recorder.__enter__()

    def on_step_end(self, step: int, result: Any) -> None:
        recorder = self._stop()
        if recorder is None:
            return
        path = os.path.join(self.folder, f"comm_rank{self.meta['rank']}.json")
        write_records(recorder, path, step=step, **self.meta)
        self.log(f"recorded the collectives of step {step}: {self.folder}/comm_rank<R>.json")

    def _stop(self) -> CommRecorder | None:
        recorder, self._recorder = self._recorder, None
        if recorder is not None:
            recorder.__exit__(None, None, None)
        return recorder

    def close(self, exc: BaseException | None = None) -> None:
        self._stop()  # a step that failed while recording leaves the dispatch mode
