"""Document sources: streams of documents addressed by JSON-able cursors, so a position can be
checkpointed. ``training.dataset = "synthetic"`` reads :class:`SyntheticSource`, ``"text"`` and
``"jsonl"`` read :class:`FileSource`.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Protocol

from trainer.config import ConfigError
from trainer.data.synthetic import synthetic_document

logger = logging.getLogger(__name__)


class DocumentSource(Protocol):
    """A document stream addressed by JSON-able cursors, so a position can be checkpointed.

    ``read(cursor)`` returns (text, ends_document, next_cursor); a long document may be
    returned as several pieces, only the last of which ends it.
    """

    name: str

    def start(self) -> list[int]: ...

    def read(self, cursor: list[int]) -> tuple[str, bool, list[int]]: ...


class SyntheticSource:
    name = "synthetic"

    def __init__(self, seed: int):
        self.seed = seed

    def start(self) -> list[int]:
        return [0]

    def read(self, cursor: list[int]) -> tuple[str, bool, list[int]]:
        return synthetic_document(self.seed, cursor[0]), True, [cursor[0] + 1]


class FileSource:
    """``.txt`` files (one document per file, streamed in ~1 MiB line-aligned pieces) or
    ``.jsonl`` files (one document per line, field ``text``). Files are visited in sorted
    path order and the stream wraps around (next epoch) when they are exhausted.

    Cursor: [epoch, file_index, byte_offset].
    """

    CHUNK_BYTES = 1 << 20

    def __init__(self, path: str, kind: str, *, option: str = "training.dataset_path"):
        if kind not in ("text", "jsonl"):
            raise ValueError(f"FileSource kind must be 'text' or 'jsonl', got {kind!r}")
        self.name, self.kind, self.path = kind, kind, path
        suffix = ".txt" if kind == "text" else ".jsonl"
        if not os.path.exists(path):
            raise ConfigError(f"{option} '{path}' does not exist; point it at a {suffix} file or a folder of them")

        def unreadable(err: OSError):
            raise ConfigError(
                f"{option}: cannot read '{err.filename}' ({err.strerror}); fix its permissions or point {option} elsewhere"
            )

        if os.path.isdir(path):
            files = sorted(
                os.path.join(root, f)
                for root, _, names in os.walk(path, onerror=unreadable)
                for f in names
                if f.endswith(suffix)
            )
        else:
            files = [path]
        for f in files:
            if not os.access(f, os.R_OK):
                unreadable(PermissionError(13, "Permission denied", f))
        self.files = [f for f in files if os.path.getsize(f) > 0]
        if not self.files:
            raise ConfigError(f"{option} '{path}' has no non-empty {suffix} files for dataset '{kind}'")
        self._fh = None
        self._fh_index = -1

    def start(self) -> list[int]:
        return [0, 0, 0]

    def _open(self, index: int):
        if self._fh_index != index:
            if self._fh is not None:
                self._fh.close()
            self._fh = open(self.files[index], "rb")
            self._fh_index = index
        return self._fh

    def _advance_file(self, epoch: int, index: int) -> list[int]:
        if index + 1 < len(self.files):
            return [epoch, index + 1, 0]
        logger.warning("dataset '%s' exhausted after epoch %d; starting over", self.path, epoch)
        return [epoch + 1, 0, 0]

    def read(self, cursor: list[int]) -> tuple[str, bool, list[int]]:
        epoch, index, offset = cursor
        while True:
            fh = self._open(index)
            fh.seek(offset)
            if self.kind == "jsonl":
                line = fh.readline()
                end = fh.tell()
                if not line:
                    epoch, index, offset = self._advance_file(epoch, index)
                    continue
                nxt = [epoch, index, end]
                if not line.strip():
                    offset = end
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{self.files[index]} (byte {offset}): invalid JSON line: {e}") from None
                text = record.get("text") if isinstance(record, dict) else None
                if not isinstance(text, str):
                    raise ValueError(
                        f"{self.files[index]} (byte {offset}): each jsonl line needs a string field "
                        f"'text'; got keys {sorted(record) if isinstance(record, dict) else type(record).__name__}"
                    )
                return text, True, nxt
            data = fh.read(self.CHUNK_BYTES)
            if not data:  # offset at EOF: only reachable from a cursor saved at a file end
                epoch, index, offset = self._advance_file(epoch, index)
                continue
            if not data.endswith(b"\n"):
                data += fh.readline(self.CHUNK_BYTES)
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError as e:
                if e.start < len(data) - 3:
                    raise ValueError(f"{self.files[index]} (byte {offset + e.start}): not valid UTF-8") from None
                data = data[: e.start]  # a multi-byte character cut by the chunk limit
                text = data.decode("utf-8")
            end = offset + len(data)
            at_eof = end >= os.path.getsize(self.files[index])
            return text, at_eof, (self._advance_file(epoch, index) if at_eof else [epoch, index, end])
