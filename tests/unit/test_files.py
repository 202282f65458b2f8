"""trainer/runtime/files.py: the one atomic-write helper every written file goes through."""

import json
import os

import pytest

from trainer.runtime.files import atomic_file, atomic_path, atomic_write, atomic_write_json


def _leftovers(folder):
    return [p for p in os.listdir(folder) if ".tmp" in p]


def test_atomic_write_replaces_whole_file(tmp_path):
    p = tmp_path / "a.txt"
    atomic_write(str(p), "old")
    atomic_write(str(p), b"new bytes")
    assert p.read_bytes() == b"new bytes"
    atomic_write_json(str(tmp_path / "b.json"), {"x": [1, 2]})
    assert json.loads((tmp_path / "b.json").read_text()) == {"x": [1, 2]}
    assert _leftovers(tmp_path) == []


def test_failed_write_keeps_old_file_and_leaves_no_temporary(tmp_path):
    p = tmp_path / "a.json"
    atomic_write(str(p), "old")
    with pytest.raises(TypeError):
        atomic_write_json(str(p), {"x": object()})  # not JSON: fails before anything is opened
    with pytest.raises(RuntimeError):
        with atomic_file(str(p), "w") as f:
            f.write("half a fi")
            raise RuntimeError("disk full")
    with pytest.raises(RuntimeError):
        with atomic_path(str(p)) as tmp:
            open(tmp, "w").write("partial")
            raise RuntimeError("writer crashed")
    assert p.read_text() == "old"
    assert _leftovers(tmp_path) == []


def test_atomic_path_for_writers_that_take_a_name(tmp_path):
    p = tmp_path / "t.bin"
    with atomic_path(str(p)) as tmp:
        assert tmp != str(p) and os.path.dirname(tmp) == str(tmp_path)
        with open(tmp, "wb") as f:
            f.write(b"\x00\x01")
        assert not p.exists()  # the target appears only when the block succeeds
    assert p.read_bytes() == b"\x00\x01"


def test_only_whole_file_modes():
    with pytest.raises(ValueError, match="mode must be"):
        with atomic_file("/nonexistent/x", "a"):
            pass
