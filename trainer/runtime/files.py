"""The one way meshtrain writes a file that someone else reads: atomically.

Every file the project writes for a reader (checkpoint metadata, metrics summaries, comm and
matmul records, fake-backend reports, token shards, HF exports, flight-recorder dumps) goes
through :func:`atomic_write` or :func:`atomic_file`: the bytes go to a temporary name next to
the target, are flushed and fsynced, then renamed over the target, and the folder is fsynced so
the rename survives a power loss. A reader sees the old file or the whole new one, never a
partial file; a failed write leaves no temporary file behind.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from typing import Any


def fsync_dir(path: str) -> None:
    """Make renames inside folder ``path`` durable (best effort: some file systems refuse to
    open or fsync a folder, which is not an error)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _tmp_name(path: str) -> str:
    # pid-unique: two processes writing the same target never share a temporary file
    return f"{path}.tmp.{os.getpid()}"


@contextlib.contextmanager
def atomic_path(path: str) -> Iterator[str]:
    """Yield a temporary path next to ``path`` for a writer that takes a file name (e.g.
    ``safetensors.torch.save_file``); renamed over ``path`` when the block succeeds."""
    tmp = _tmp_name(path)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise
    fsync_dir(os.path.dirname(os.path.abspath(path)))


@contextlib.contextmanager
def atomic_file(path: str, mode: str = "wb") -> Iterator[Any]:
    """Open a temporary file next to ``path`` for writing (``mode`` "wb" or "w"); when the block
    ends without an exception the file is fsynced and renamed over ``path``, else removed."""
    if mode not in ("wb", "w"):
        raise ValueError(f"atomic_file writes a whole file: mode must be 'wb' or 'w', not {mode!r}")
    with atomic_path(path) as tmp, open(tmp, mode) as f:
        yield f


def atomic_write(path: str, data: bytes | str) -> None:
    """Write ``data`` (str is UTF-8 encoded) to ``path`` atomically."""
    with atomic_file(path, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)


def atomic_write_json(path: str, obj: Any, indent: int | None = 1) -> None:
    """Write ``obj`` as JSON to ``path`` atomically."""
    atomic_write(path, json.dumps(obj, indent=indent))
