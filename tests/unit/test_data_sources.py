"""Document sources (trainer/data/sources.py): .txt folders and long files in pieces, .jsonl
lines, and the errors, read through the packed loader."""

import json

import pytest
import torch

from tests.unit.test_data_loader import loader
from trainer.config import ConfigError
from trainer.data.sources import FileSource
from trainer.data.tokenizer import ByteTokenizer


def test_text_folder_packing(tmp_path):
    (tmp_path / "b.txt").write_text("second file\nline two\n")
    (tmp_path / "a.txt").write_text("first file\n")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "skip.md").write_text("not a txt\n")
    bt = ByteTokenizer()
    ld = loader(global_bs=1, local_bs=1, source=FileSource(str(tmp_path), "text"), tok=bt, seq=40)
    x, y = next(ld)
    expected = list(b"first file\n") + [bt.eos_id] + list(b"second file\nline two\n") + [bt.eos_id]
    expected = (expected * 2)[:41]  # the stream wraps around into the next epoch
    assert x[0].tolist() == expected[:40] and y[0].tolist() == expected[1:41]


def test_text_chunking_resumes_inside_a_long_file(tmp_path, monkeypatch):
    monkeypatch.setattr(FileSource, "CHUNK_BYTES", 16)
    (tmp_path / "long.txt").write_text("".join(f"line {i:03d} é\n" for i in range(40)))
    bt = ByteTokenizer()
    src = lambda: FileSource(str(tmp_path / "long.txt"), "text")  # noqa: E731
    full = loader(global_bs=2, local_bs=2, source=src(), tok=bt, seq=20)
    batches = [next(full)[0] for _ in range(4)]
    data = (tmp_path / "long.txt").read_bytes()
    assert batches[0][0].tolist() == list(data[:20])
    part = loader(global_bs=2, local_bs=2, source=src(), tok=bt, seq=20)
    next(part)
    resumed = loader(global_bs=2, local_bs=2, source=src(), tok=bt, seq=20)
    resumed.load_state_dict(part.state_dict())
    assert all(torch.equal(next(resumed)[0], b) for b in batches[1:])


def test_jsonl_packing_and_bad_lines(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"text": "alpha"}) + "\n\n" + json.dumps({"text": "beta", "id": 2}) + "\n")
    bt = ByteTokenizer()
    ld = loader(global_bs=1, local_bs=1, source=FileSource(str(f), "jsonl"), tok=bt, seq=11)
    x, _ = next(ld)
    assert x[0].tolist() == list(b"alpha") + [bt.eos_id] + list(b"beta") + [bt.eos_id]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"content": "x"}) + "\n")
    with pytest.raises(ValueError, match="needs a string field 'text'"):
        next(loader(global_bs=1, local_bs=1, source=FileSource(str(bad), "jsonl"), tok=bt, seq=4))


def test_missing_dataset_path_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        FileSource(str(tmp_path / "missing"), "jsonl")
    with pytest.raises(ConfigError, match="no non-empty .jsonl files"):
        FileSource(str(tmp_path), "jsonl")
