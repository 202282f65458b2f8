"""Document sources: streams of documents addressed by JSON-able cursors, so a position can be
checkpointed. ``training.dataset = "synthetic"`` reads :class:`SyntheticSource`, ``"text"`` and
``"jsonl"`` read :class:`FileSource`.
"""

from __future__ import annotations

import copy
import json
import os
from typing import Protocol

from trainer.config import ConfigError
from trainer.config.schema import TEXT_DOCUMENTS
from trainer.data.rows import FileCycle
from trainer.data.synthetic import synthetic_document


class DocumentSource(Protocol):
    """A document stream addressed by JSON-able cursors, so a position can be checkpointed.

    ``read(cursor)`` returns (text, ends_document, next_cursor); a long document may be
    returned as several pieces, only the last of which ends it.
    """

    name: str

    def start(self) -> list[int]: ...

    def read(self, cursor: list[int]) -> tuple[str, bool, list[int]]: ...


class RowTextSource:
    """``training.dataset = "hf"``: the ``text`` column of parquet files or a ``save_to_disk``
    folder (:class:`~trainer.data.rows.RowFiles`), one document per row."""

    name = "hf"

    def __init__(self, path: str, *, option: str = "training.dataset_path", log_epochs: bool = True):
        from trainer.data.rows import RowFiles

        self.rows = RowFiles(path, "text", option=option, log_epochs=log_epochs)

    @property
    def description(self) -> str:
        return f"{self.rows.description}, one document per row (column 'text')"

    def with_rows(self, rows) -> RowTextSource:
        """This source over other rows (a :class:`~trainer.data.rows.RowStripe` of its own)."""
        clone = copy.copy(self)
        clone.rows = rows
        return clone

    def start(self) -> list[int]:
        return self.rows.start()

    def passes(self, cursor: list[int]) -> int:
        """Complete passes over the rows before ``cursor`` (trainer/data/epochs.py)."""
        return self.rows.passes(cursor)

    def read(self, cursor: list[int]) -> tuple[str, bool, list[int]]:
        text, where, nxt = self.rows.read(cursor)
        if not isinstance(text, str):
            raise ValueError(f"{where}: column 'text' must hold strings, got {type(text).__name__}")
        return text, True, nxt


class SyntheticSource:
    name = "synthetic"

    def __init__(self, seed: int):
        self.seed = seed

    def start(self) -> list[int]:
        return [0]

    @property
    def description(self) -> str:
        """The start-up line's words for this data."""
        return f"synthetic documents (seed {self.seed})"

    def passes(self, cursor: list[int]) -> None:
        """None: the corpus never ends, so it has no passes (trainer/data/epochs.py)."""
        return None

    def read(self, cursor: list[int]) -> tuple[str, bool, list[int]]:
        return synthetic_document(self.seed, cursor[0]), True, [cursor[0] + 1]


def describe_text_documents(documents: str) -> str:
    """What one document of a ``.txt`` file is, in words (the start-up "dataset:" line)."""
    return {
        "file": "one document per file",
        "blank_line": "documents separated by blank lines",
        "line": "one document per line",
    }[documents]


class FileSource(FileCycle):
    """``.txt`` files or ``.jsonl`` files (one document per line, field ``text``). Files are
    visited in sorted path order and the stream wraps around (next epoch) when they are
    exhausted.

    What a ``.txt`` document is (``documents``, the config's ``training.text_documents``):
    ``file`` (the whole file), ``blank_line`` (paragraphs: runs of lines between blank or
    whitespace-only lines) or ``line`` (each line that is not blank). A document is streamed in
    ~1 MiB line-aligned pieces; in ``blank_line`` and ``line`` modes the newline that ends a
    document is not part of its text (the tokenizer's EOS marks the end), and blank lines are
    never a document. A read in those modes that runs past the last file returns the next
    epoch's first document (its cursor's epoch is the next), as ``.jsonl`` reads do.

    Cursor: [epoch, file_index, byte_offset]. ``log_epochs``: whether this source says when it
    starts over (one rank's does: every rank reads the same stream).
    """

    CHUNK_BYTES = 1 << 20

    def __init__(
        self,
        path: str,
        kind: str,
        *,
        option: str = "training.dataset_path",
        documents: str = "file",
        log_epochs: bool = True,
    ):
        if kind not in ("text", "jsonl"):
            raise ValueError(f"FileSource kind must be 'text' or 'jsonl', got {kind!r}")
        if documents not in TEXT_DOCUMENTS:
            raise ValueError(f"text documents must be one of {', '.join(TEXT_DOCUMENTS)}, got {documents!r}")
        self.kind, self.path, self.log_epochs, self.option = kind, path, log_epochs, option
        self.documents = documents
        # the loader's resume check compares names: a cursor into paragraphs is not one into files
        self.name = kind if kind == "jsonl" or documents == "file" else f"text:{documents}"
        self._epoch_said = -1
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

    @property
    def description(self) -> str:
        """The start-up line's words for this data: the files and what one document is."""
        suffix = ".txt" if self.kind == "text" else ".jsonl"
        n = len(self.files)
        files = f"{self.path}: {n} {suffix} file{'s' if n != 1 else ''}"
        if self.kind == "jsonl":
            return f"{files}, one document per line (field 'text')"
        return f"{files}, {describe_text_documents(self.documents)} (text_documents = {self.documents})"

    def start(self) -> list[int]:
        return [0, 0, 0]

    def no_rows_error(self) -> ConfigError:
        """Files that hold only blank lines (``jsonl``, or ``line`` / ``blank_line`` text)."""
        n, suffix = len(self.files), ".txt" if self.kind == "text" else ".jsonl"
        files = "only blank lines" if n == 1 else f"its {n} {suffix} files hold only blank lines"
        if self.kind == "jsonl":
            return ConfigError(
                f"{self.option} '{self.path}' has no rows ({files}); write one JSON object per line with a field "
                "'text', or point it at other data"
            )
        return ConfigError(
            f"{self.option} '{self.path}' has no documents ({files}; text_documents = {self.documents}); "
            "point it at files with text"
        )

    def _open(self, index: int):
        if self._fh_index != index:
            if self._fh is not None:
                self._fh.close()
            self._fh = open(self.files[index], "rb")
            self._fh_index = index
        return self._fh

    def _decode(self, data: bytes, index: int, offset: int, *, cut_ok: bool) -> tuple[str, bytes]:
        """``data`` as text, and the bytes that make it: a multi-byte character cut at the end of
        a size-limited read (``cut_ok``) is left for the next piece."""
        try:
            return data.decode("utf-8"), data
        except UnicodeDecodeError as e:
            if not cut_ok or e.start < len(data) - 3:
                raise ValueError(f"{self.files[index]} (byte {offset + e.start}): not valid UTF-8") from None
            data = data[: e.start]
            return data.decode("utf-8"), data

    def _rest_of_line(self, fh) -> tuple[bool, bytes]:
        """Read on to the end of the current line, in pieces: whether it holds only whitespace,
        and the bytes read (for a line with text, up to its first piece with text)."""
        read = b""
        while True:
            piece = fh.readline(self.CHUNK_BYTES)
            read += piece
            if not piece or piece.endswith(b"\n"):
                return not read.strip(), read
            if piece.strip():
                return False, read

    def _ends_after(self, fh, data: bytes) -> tuple[bool, bytes]:
        """After a size-limited read of ``data``: whether its document ends there (the line
        ends in nothing but whitespace and, for ``blank_line``, the file ends or a blank line
        follows), and that whitespace (part of the document)."""
        tail = b""
        if not data.endswith(b"\n"):
            at = fh.tell()
            blank, read = self._rest_of_line(fh)
            if not blank:
                fh.seek(at)
                return False, b""  # the line goes on
            tail = read
            if self.documents == "line" or not read.endswith(b"\n"):
                return True, tail
        blank, _ = self._rest_of_line(fh)
        return blank, tail

    def _read_split(self, fh, epoch: int, index: int, offset: int) -> tuple[str, bool, list[int]] | None:
        """The next document (or piece of one) in ``line`` / ``blank_line`` mode from
        ``offset``, or None at the end of the file (nothing but blank lines left)."""
        fh.seek(offset)
        while True:  # blank lines before a document are skipped
            blank, read = self._rest_of_line(fh)
            if not read:
                return None
            if not blank:
                fh.seek(offset)
                break
            offset += len(read)
        data = fh.readline(self.CHUNK_BYTES)
        ends = self.documents == "line" and data.endswith(b"\n")
        if self.documents == "blank_line":
            while len(data) < self.CHUNK_BYTES and data.endswith(b"\n"):
                line_start = fh.tell()
                if self._rest_of_line(fh)[0]:  # a blank line, or the end of the file
                    ends = True
                    break
                fh.seek(line_start)
                data += fh.readline(self.CHUNK_BYTES - len(data))
        if not ends:  # the read stopped at the size limit, perhaps inside a line
            ends, tail = self._ends_after(fh, data)
            data += tail
        text, data = self._decode(data, index, offset, cut_ok=not ends)
        if ends and text.endswith("\n"):
            text = text[:-2] if text.endswith("\r\n") else text[:-1]
        return text, ends, [epoch, index, offset + len(data)]

    def _read_jsonl(self, fh, epoch: int, index: int, offset: int) -> tuple[str, bool, list[int]] | None:
        """The next ``.jsonl`` document from ``offset``, or None at the end of the file."""
        fh.seek(offset)
        while True:
            line = fh.readline()
            if not line:
                return None
            if line.strip():
                break
            offset += len(line)
        end = offset + len(line)
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
        return text, True, [epoch, index, end]

    def read(self, cursor: list[int]) -> tuple[str, bool, list[int]]:
        epoch, index, offset = cursor
        empty_files = 0  # whole files read from their start without a document (blank lines only)
        while True:
            fh = self._open(index)
            if self.kind == "jsonl" or self.documents != "file":
                read = self._read_jsonl if self.kind == "jsonl" else self._read_split
                unit = read(fh, epoch, index, offset)
                if unit is not None:
                    return unit
                empty_files += offset == 0
                epoch, index, offset = self._after_empty_file(epoch, index, empty_files)
                continue
            fh.seek(offset)
            data = fh.read(self.CHUNK_BYTES)
            if not data:  # offset at EOF: only reachable from a cursor saved at a file end
                epoch, index, offset = self._next_file(epoch, index)
                continue
            if not data.endswith(b"\n"):
                data += fh.readline(self.CHUNK_BYTES)
            text, data = self._decode(data, index, offset, cut_ok=True)
            end = offset + len(data)
            at_eof = end >= os.path.getsize(self.files[index])
            return text, at_eof, (self._next_file(epoch, index) if at_eof else [epoch, index, end])
