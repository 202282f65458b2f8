"""A forked rank's output lines reach the job's shared pipe whole (tools/forkserver.py
``whole_lines``), also when the server runs unbuffered (``PYTHONUNBUFFERED=1``, as in CI).

Seen before: tests/e2e/test_compare_loss.py's fork-launcher test got a line ``"\\n"`` and a
``"rank 0 on stderr"`` without its newline, rank 1's line between them: under
``PYTHONUNBUFFERED`` a stream writes through to an unbuffered file and ``print`` writes the
text and the newline in two ``write`` calls."""

from __future__ import annotations

import io
import os

import pytest

from tools.forkserver import whole_lines

pytestmark = pytest.mark.unit


class _CountingFile(io.FileIO):
    """An unbuffered file that records every write, as the file descriptor sees them."""

    def __init__(self, fd: int):
        super().__init__(fd, "w", closefd=True)
        self.writes: list[bytes] = []

    def write(self, b) -> int:
        self.writes.append(bytes(b))
        return super().write(b)


def _unbuffered_stream():
    """What an interpreter started with PYTHONUNBUFFERED=1 has as sys.stdout / sys.stderr."""
    read_fd, write_fd = os.pipe()
    raw = _CountingFile(write_fd)
    return io.TextIOWrapper(raw, encoding="utf-8", line_buffering=True, write_through=True), raw, read_fd


def test_each_line_is_one_write():
    stream, raw, read_fd = _unbuffered_stream()
    whole_lines(stream)
    print("rank 0 on stderr", file=stream)
    print("step 1/2  loss 8.0", "(rank 0)", file=stream)
    stream.write("no newline yet")
    assert raw.writes == [b"rank 0 on stderr\n", b"step 1/2  loss 8.0 (rank 0)\n"]  # the rest waits
    stream.write(" and now\n")
    assert raw.writes[-1] == b"no newline yet and now\n"
    stream.close()
    with os.fdopen(read_fd, "rb") as pipe:
        assert pipe.read().count(b"\n") == 3


def test_control_unbuffered_print_writes_the_newline_apart():
    stream, raw, read_fd = _unbuffered_stream()
    print("rank 0 on stderr", file=stream)
    assert raw.writes == [b"rank 0 on stderr", b"\n"]  # what could tear a line between ranks
    stream.close()
    os.close(read_fd)
