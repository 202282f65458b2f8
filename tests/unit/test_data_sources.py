"""Document sources (trainer/data/sources.py): .txt folders and long files in pieces, .jsonl
lines, and the errors, read through the packed loader."""

import json
import random

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


def _documents(path, documents: str) -> list[str]:
    """Every document of one epoch, its pieces joined, through FileSource.read and its cursors
    (each read from a new source: a cursor alone says where to go on)."""
    out, text, cursor = [], "", [0, 0, 0]
    while True:
        piece, ends, nxt = FileSource(str(path), "text", documents=documents, log_epochs=False).read(cursor)
        if nxt[0] > cursor[0] and documents != "file":
            return out  # a read past the last file: the next epoch's first document
        text += piece
        if ends:
            out.append(text)
            text = ""
        if nxt[0] > cursor[0]:
            return out
        cursor = nxt


def _reference(body: str, documents: str) -> list[str]:
    """What the three choices mean, on a whole string (``\\n`` line ends)."""
    lines = body.split("\n")
    if documents == "line":
        return [line for line in lines if line.strip()]
    paragraphs, run = [], []
    for line in lines + [""]:
        if line.strip():
            run.append(line)
        elif run:
            paragraphs.append("\n".join(run))
            run = []
    return paragraphs


@pytest.mark.parametrize("chunk", [1 << 20, 3, 5, 8])
def test_text_documents_by_line_and_by_blank_line(tmp_path, monkeypatch, chunk):
    """training.text_documents = line / blank_line: random files (blank and whitespace-only
    lines, multi-byte characters, with and without a final newline) give exactly the lines /
    paragraphs a plain split gives, also when pieces are cut at a few bytes (inside lines,
    characters and runs of spaces) and every read starts from its cursor alone."""
    monkeypatch.setattr(FileSource, "CHUNK_BYTES", chunk)
    rng = random.Random(chunk)
    words = ["a", "bb", "é", "中文", "  ", "x" * 7, "\t"]
    f = tmp_path / "t.txt"
    checked = 0
    while checked < 150:
        lines = []
        for _ in range(rng.randint(1, 10)):
            r = rng.random()
            blank = "" if r < 0.25 else "   " if r < 0.3 else None
            lines.append(blank if blank is not None else " ".join(rng.choice(words) for _ in range(rng.randint(1, 6))))
        body = "\n".join(lines) + ("\n" if rng.random() < 0.5 else "")
        if not body.strip():
            continue
        f.write_text(body)
        for documents in ("line", "blank_line"):
            assert _documents(f, documents) == _reference(body, documents), (repr(body), documents)
        checked += 1
    # the whole-file choice (the default) is unchanged: one document per file
    assert _documents(f, "file") == [body]


def test_paragraphs_are_packed_with_an_eos_each_and_the_mode_is_part_of_the_resume_state(tmp_path, caplog):
    """The loader puts the tokenizer's EOS after every paragraph (not only at the file's end);
    a loader state of one way of cutting documents is refused by another (its cursors point
    into other documents), with the fix; the epoch message is said once per epoch, by the
    source that logs (the trainer's rank 0), never by the others."""
    (tmp_path / "a.txt").write_text("one\ntwo\n\n\nthree\n")
    bt = ByteTokenizer()
    paragraphs = FileSource(str(tmp_path), "text", documents="blank_line")
    ld = loader(global_bs=1, local_bs=1, source=paragraphs, tok=bt, seq=13)  # one epoch: 14 tokens
    with caplog.at_level("WARNING", logger="trainer.data.sources"):
        x, y = next(ld)
        for _ in range(3):
            next(ld)  # three more epochs
    assert x[0].tolist() + y[0, -1:].tolist() == list(b"one\ntwo") + [bt.eos_id] + list(b"three") + [bt.eos_id]
    said = [r.getMessage() for r in caplog.records if "exhausted" in r.getMessage()]
    assert said == [f"dataset '{tmp_path}' exhausted after epoch {e}; starting over" for e in range(len(said))]
    assert len(said) >= 3
    assert paragraphs.name == "text:blank_line"
    assert "documents separated by blank lines" in paragraphs.description
    caplog.clear()
    quiet = FileSource(str(tmp_path), "text", documents="line", log_epochs=False)
    lines = loader(global_bs=1, local_bs=1, source=quiet, tok=bt, seq=8)
    with caplog.at_level("WARNING", logger="trainer.data.sources"):
        for _ in range(4):
            next(lines)
    assert not caplog.records
    whole = loader(global_bs=1, local_bs=1, source=FileSource(str(tmp_path), "text"), tok=bt, seq=8)
    with pytest.raises(ValueError, match=r"dataset 'text:blank_line' but this run uses 'text'.*exclude_from_loading"):
        whole.load_state_dict(ld.state_dict())
