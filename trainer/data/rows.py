"""Row datasets read by the trainer itself: ``.jsonl`` files, ``.parquet`` files (a file or a
folder of them) or a folder written by ``datasets.Dataset.save_to_disk``, addressed by JSON-able
cursors so a position can be checkpointed.

Nothing is fetched: parquet files are read with ``pyarrow`` one row group at a time (only the
needed column), a ``save_to_disk`` folder with ``datasets.load_from_disk`` (memory-mapped Arrow
files) in blocks of rows. Files are visited in sorted path order and the rows wrap around (the
next epoch) after the last one.

Cursor: ``[epoch, file_index, position]``, the position a byte offset in a ``.jsonl`` file and
a row index in a parquet file or the ``save_to_disk`` dataset (one "file").
"""

from __future__ import annotations

import bisect
import json
import logging
import os
from typing import Any

from trainer.config import ConfigError

__all__ = ["FileCycle", "RowFiles", "RowStripe", "row_format"]

_BLOCK = 256  # rows read at once from a save_to_disk dataset


def row_format(path: str) -> str:
    """'arrow' (a save_to_disk folder), 'parquet' or 'jsonl' for a dataset path."""
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "state.json")) and os.path.isfile(os.path.join(path, "dataset_info.json")):
            return "arrow"
        names = [f for _root, _dirs, files in os.walk(path) for f in files]
        return "parquet" if any(f.endswith(".parquet") for f in names) else "jsonl"
    return "parquet" if path.endswith(".parquet") else "jsonl"


class FileCycle:
    """A source that reads its ``files`` in order and starts over (a new epoch) after the last:
    :meth:`_next_file` is the position ``[epoch, file index, 0]`` after file ``index``. Needs
    ``files``, ``path``, ``log_epochs`` and ``_epoch_said`` (shared by :class:`RowFiles` and
    ``trainer.data.sources.FileSource``)."""

    files: list[str]
    path: str
    log_epochs: bool
    _epoch_said: int

    def no_rows_error(self) -> ConfigError:
        """The error for files that hold nothing to read (every line blank)."""
        raise NotImplementedError

    def passes(self, cursor: list[int]) -> int:
        """Complete passes over the files before ``cursor`` (a position of the next unread
        byte): its epoch, plus one where nothing but whitespace is left after it in the pass (a
        read from there starts the next pass)."""
        epoch, index, pos = cursor
        end = getattr(self, "_content_end", None)
        if end is None:  # (file index, byte offset) just after the last non-whitespace byte
            end = self._content_end = _content_end(self.files)
        return epoch + ((index, pos) >= end)

    def _after_empty_file(self, epoch: int, index: int, empty_files: int) -> list[int]:
        """:meth:`_next_file` after file ``index`` gave nothing, where ``empty_files`` whole files
        (each read from its start, in this one read) gave nothing: once that is every file, the
        data holds nothing and a read would start over forever, so :meth:`no_rows_error`."""
        if empty_files >= len(self.files):
            raise self.no_rows_error()
        return self._next_file(epoch, index)

    def _next_file(self, epoch: int, index: int) -> list[int]:
        if index + 1 < len(self.files):
            return [epoch, index + 1, 0]
        # said once per epoch: a loader may read the same stretch again (a resumed step), and
        # every rank reads the same stream
        if self.log_epochs and epoch > self._epoch_said:
            self._epoch_said = epoch
            # under the source's own module's logger (trainer.data.sources for FileSource)
            logging.getLogger(type(self).__module__).warning(
                "dataset '%s' exhausted after epoch %d; starting over", self.path, epoch
            )
        return [epoch + 1, 0, 0]


def _content_end(files: list[str]) -> tuple[int, int]:
    """(file index, offset after its last non-whitespace byte) of the last file with any."""
    for index in range(len(files) - 1, -1, -1):
        with open(files[index], "rb") as fh:
            end = fh.seek(0, os.SEEK_END)
            while end > 0:
                start = max(0, end - (1 << 16))
                fh.seek(start)
                chunk = fh.read(end - start).rstrip()
                if chunk:
                    return index, start + len(chunk)
                end = start
    return len(files), 0


class RowFiles(FileCycle):
    """The rows of a dataset path; ``read(cursor)`` returns (the row's ``column`` value, where
    the row is in words, the next cursor). ``column``: the field each row must have; or a tuple
    of fields, when a read returns a dict of them, those in ``optional`` None where a row (or a
    file) lacks them (preference rows: trainer/data/preference.py)."""

    def __init__(
        self,
        path: str,
        column: str | tuple[str, ...],
        *,
        option: str = "training.dataset_path",
        log_epochs: bool = True,
        optional: tuple[str, ...] = (),
    ):
        self.path, self.option, self.log_epochs = path, option, log_epochs
        self.single = isinstance(column, str)
        self.names: tuple[str, ...] = (column,) if isinstance(column, str) else tuple(column)
        self.required = tuple(n for n in self.names if n not in optional)
        self.column = column if isinstance(column, str) else "', '".join(self.names)  # for messages
        if not os.path.exists(path):
            raise ConfigError(
                f"{option} '{path}' does not exist; point it at a .jsonl or .parquet file, a folder of them, "
                "or a datasets save_to_disk folder"
            )
        self.format = row_format(path)
        self._epoch_said = -1
        self._cache: tuple[int, int, list[Any]] | None = None  # (file, first row, values)
        self.rows_read = 0  # instrumentation: rows read by read()
        if self.format == "arrow":
            self._open_arrow()
            return
        suffix = "." + self.format
        if os.path.isdir(path):
            files = sorted(os.path.join(r, f) for r, _d, names in os.walk(path) for f in names if f.endswith(suffix))
        else:
            files = [path]
        self.files = [f for f in files if os.path.getsize(f) > 0]
        if not self.files:
            raise ConfigError(f"{option} '{path}' has no non-empty {suffix} files")
        if self.format == "parquet":
            self._open_parquet()

    # ------------------------------------------------------------------ formats
    def _open_arrow(self) -> None:
        import datasets

        try:
            ds = datasets.load_from_disk(self.path)
        except Exception as exc:  # datasets raises several kinds for a broken folder
            raise ConfigError(f"{self.option} '{self.path}': not a readable save_to_disk dataset ({exc})") from None
        if isinstance(ds, datasets.DatasetDict):
            raise ConfigError(
                f"{self.option} '{self.path}' holds a DatasetDict (splits {', '.join(ds)}); point it at one "
                f"split's folder, e.g. {os.path.join(self.path, next(iter(ds)))}"
            )
        for name in self.required:
            if name not in ds.column_names:
                raise ConfigError(
                    f"{self.option} '{self.path}' has no column '{name}' (columns: {', '.join(ds.column_names)})"
                )
        self._ds = ds.select_columns([n for n in self.names if n in ds.column_names])
        self.files = [self.path]
        self.rows = [len(ds)]
        if not len(ds):
            raise ConfigError(f"{self.option} '{self.path}' has no rows")

    def _open_parquet(self) -> None:
        import pyarrow.parquet as pq

        self._pq, self.rows, self._groups = [], [], []
        self._present: list[list[str]] = []  # per file: the columns of ``names`` it has
        for f in self.files:
            try:
                pf = pq.ParquetFile(f)
            except Exception as exc:  # pyarrow's ArrowInvalid and friends
                raise ConfigError(f"{self.option}: {f} is not a readable parquet file ({exc})") from None
            names = pf.schema_arrow.names
            for name in self.required:
                if name not in names:
                    raise ConfigError(f"{f} has no column '{name}' (columns: {', '.join(names)}); fix the file")
            self._pq.append(pf)
            self._present.append([n for n in self.names if n in names])
            self.rows.append(pf.metadata.num_rows)
            starts, n = [], 0
            for g in range(pf.num_row_groups):
                starts.append(n)
                n += pf.metadata.row_group(g).num_rows
            self._groups.append(starts)
        if not sum(self.rows):
            raise ConfigError(f"{self.option} '{self.path}' has no rows")

    @property
    def n_rows(self) -> int | None:
        """Rows in the dataset (None for .jsonl, which is not counted ahead)."""
        return None if self.format == "jsonl" else sum(self.rows)

    @property
    def description(self) -> str:
        n = len(self.files)
        if self.format == "arrow":
            return f"{self.path}: a save_to_disk dataset, {self.rows[0]:,} rows"
        what = f"{n} .{self.format} file{'s' if n != 1 else ''}"
        return f"{self.path}: {what}" + (f", {sum(self.rows):,} rows" if self.format == "parquet" else "")

    def start(self) -> list[int]:
        return [0, 0, 0]

    def _block(self, index: int, row: int) -> tuple[int, list[Any]]:
        """The rows read together with row ``row`` of file ``index``: (the first one's row
        number, their values): a parquet row group, or :data:`_BLOCK` rows of a save_to_disk
        dataset."""
        if self.format == "arrow":
            first = row - row % _BLOCK
            try:
                return first, self._values(self._ds[first : first + _BLOCK])
            except Exception as exc:  # pyarrow's errors for a damaged file (ArrowInvalid, OSError...)
                raise self._unreadable(f"{self.path} (rows {first}-{first + _BLOCK - 1})", exc) from None
        starts = self._groups[index]
        g = max(i for i, s in enumerate(starts) if s <= row)
        try:
            table = self._pq[index].read_row_group(g, columns=self._present[index])
            return starts[g], self._values(table.to_pydict())
        except Exception as exc:  # only opening (the footer) was checked; a data page can be damaged
            n = self._pq[index].metadata.row_group(g).num_rows
            where = f"{self.files[index]} (row group {g}, rows {starts[g]}-{starts[g] + n - 1})"
            raise self._unreadable(where, exc) from None

    def _values(self, columns: dict[str, list[Any]]) -> list[Any]:
        """A block's rows from its columns: the values of ``column``, or one dict per row."""
        if self.single:
            return columns[self.column]
        n = len(next(iter(columns.values()))) if columns else 0
        return [{name: columns[name][i] if name in columns else None for name in self.names} for i in range(n)]

    def _unreadable(self, where: str, exc: Exception) -> ValueError:
        detail = " ".join(str(exc).split()) or type(exc).__name__
        return ValueError(
            f"{where}: column '{self.column}' cannot be read ({detail.rstrip('.')}); the file is damaged: write it "
            f"again, or point {self.option} at data without it"
        )

    def _value(self, index: int, row: int) -> Any:
        cached = self._cache
        if cached is None or cached[0] != index or not cached[1] <= row < cached[1] + len(cached[2]):
            self._cache = cached = (index, *self._block(index, row))
        return cached[2][row - cached[1]]

    def stripe(self, index: int, count: int, *, log_epochs: bool = False) -> RowStripe:
        """Stripe ``index`` of ``count``: a contiguous ``count``-th of the rows, read as a
        dataset of its own (trainer/data/striped.py); parquet and save_to_disk data only."""
        return RowStripe(self, index, count, log_epochs=log_epochs)

    @property
    def addressable(self) -> bool:
        """Whether :meth:`advance` can move a cursor without reading (parquet, save_to_disk)."""
        return self.format != "jsonl"

    def advance(self, cursor: list[int], n: int) -> list[int]:
        """The cursor ``n`` rows after ``cursor``, computed from the row counts (nothing read);
        the rows wrap into the next epoch as :meth:`read` does."""
        epoch, index, pos = cursor
        total = sum(self.rows)
        flat = sum(self.rows[:index]) + pos + n
        epoch, flat = epoch + flat // total, flat % total
        index = 0
        while flat >= self.rows[index]:
            flat -= self.rows[index]
            index += 1
        return [epoch, index, flat]

    def passes(self, cursor: list[int]) -> int:
        """Complete passes over the rows before ``cursor`` (the next unread row): its epoch, plus
        one where it is just past the last row."""
        if self.format == "jsonl":
            return super().passes(cursor)
        epoch, index, pos = cursor
        return epoch + (sum(self.rows[:index]) + pos >= sum(self.rows))

    def no_rows_error(self) -> ConfigError:
        n = len(self.files)
        files = "only blank lines" if n == 1 else f"its {n} .jsonl files hold only blank lines"
        return ConfigError(
            f"{self.option} '{self.path}' has no rows ({files}); write one JSON object per line with a field "
            f"'{self.column}', or point {self.option} at another dataset"
        )

    def read(self, cursor: list[int]) -> tuple[Any, str, list[int]]:
        epoch, index, pos = cursor
        empty_files = 0  # whole files read from their start without a row (jsonl: blank lines only)
        while True:
            if self.format == "jsonl":
                empty_files += pos == 0
                with open(self.files[index], "rb") as fh:
                    fh.seek(pos)
                    line = fh.readline()
                    while line and not line.strip():
                        pos += len(line)
                        line = fh.readline()
                if not line:
                    epoch, index, pos = self._after_empty_file(epoch, index, empty_files)
                    continue
                where = f"{self.files[index]} (byte {pos})"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{where}: invalid JSON line: {exc}") from None
                missing = [n for n in self.required if not isinstance(record, dict) or n not in record]
                if missing:
                    keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                    raise ValueError(f"{where}: each row needs a field '{missing[0]}'; got keys {keys}")
                value = record[self.column] if self.single else {n: record.get(n) for n in self.names}
                return value, where, [epoch, index, pos + len(line)]
            if pos >= self.rows[index]:
                epoch, index, pos = self._next_file(epoch, index)
                continue
            where = f"{self.files[index]} (row {pos})"
            self.rows_read += 1
            return self._value(index, pos), where, [epoch, index, pos + 1]


class RowStripe:
    """Rows ``[lo, hi)`` of a :class:`RowFiles` (row numbers counted over its files in order),
    read like a dataset of their own: :meth:`read` wraps from the last of them to the first (the
    stripe's next epoch). Stripe ``index`` of ``count`` holds rows ``[index * R // count,
    (index + 1) * R // count)`` of the R rows. Cursors are the parent's ``[epoch, file index,
    row]`` (so a row is named as the parent names it); the parent's opened files are shared,
    while each stripe keeps its own block of rows (one parquet row group's column) cached."""

    addressable = True

    def __init__(self, parent: RowFiles, index: int, count: int, *, log_epochs: bool = False):
        if not parent.addressable:
            raise ValueError(f"{parent.path}: .jsonl rows cannot be striped (they are not counted ahead)")
        total = sum(parent.rows)
        self.parent, self.index, self.count, self.log_epochs = parent, index, count, log_epochs
        self.lo, self.hi = index * total // count, (index + 1) * total // count
        if self.hi <= self.lo:
            raise ValueError(f"stripe {index} of {count} of {parent.path} ({total} rows) holds no row")
        self.path, self.format, self.files = parent.path, parent.format, parent.files
        self._starts = [sum(parent.rows[:i]) for i in range(len(parent.rows))]
        self._cache: tuple[int, int, list[Any]] | None = None
        self._epoch_said = -1
        self.rows_read = 0  # instrumentation: rows read by read()

    @property
    def n_rows(self) -> int:
        return self.hi - self.lo

    def _locate(self, epoch: int, flat: int) -> list[int]:
        index = bisect.bisect_right(self._starts, flat) - 1
        return [epoch, index, flat - self._starts[index]]

    def start(self) -> list[int]:
        return self._locate(0, self.lo)

    def passes(self, cursor: list[int]) -> int:
        """Complete passes over the stripe's rows before ``cursor`` (the next unread row)."""
        epoch, index, pos = cursor
        return epoch + (self._starts[index] + pos >= self.hi)

    def advance(self, cursor: list[int], n: int) -> list[int]:
        """The cursor ``n`` rows after ``cursor`` within the stripe (nothing read)."""
        epoch, index, pos = cursor
        flat = self._starts[index] + pos - self.lo + n
        return self._locate(epoch + flat // self.n_rows, self.lo + flat % self.n_rows)

    def read(self, cursor: list[int]) -> tuple[Any, str, list[int]]:
        epoch, index, pos = cursor
        flat = self._starts[index] + pos
        if flat >= self.hi:
            if self.log_epochs and epoch > self._epoch_said:
                self._epoch_said = epoch
                logging.getLogger(__name__).warning(
                    "dataset '%s': stripe %d of %d (rows %d-%d) exhausted after epoch %d; starting over "
                    "(each stripe at its own pace)",
                    self.path, self.index, self.count, self.lo, self.hi - 1, epoch,
                )  # fmt: skip
            epoch, index, pos = self._locate(epoch + 1, self.lo)
            flat = self.lo
        cached = self._cache
        if cached is None or cached[0] != index or not cached[1] <= pos < cached[1] + len(cached[2]):
            self._cache = cached = (index, *self.parent._block(index, pos))
        self.rows_read += 1
        return cached[2][pos - cached[1]], f"{self.files[index]} (row {pos})", self._locate(epoch, flat + 1)
