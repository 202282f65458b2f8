"""Pre-tokenized datasets: the offline tokenizer (scripts/tokenize_dataset.py -> tools/tokenize/)
and the by-address reader (trainer/data/token_shards.py) against the streaming path
(trainer/data/), resumable tokenization, and the errors."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tools.tokenize.writer import CRASH_ENV, tokenize_to_shards
from trainer.config import ConfigError, load_config
from trainer.data.batching import PackedDataLoader
from trainer.data.loader import build_dataloader
from trainer.data.shard_format import INDEX_NAME
from trainer.data.sources import FileSource, SyntheticSource
from trainer.data.synthetic import synthetic_document
from trainer.data.token_shards import TokenDataset
from trainer.data.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import tokenize_dataset as cli  # noqa: E402

TOK = load_tokenizer()
SEQ = 32
W = SEQ + 1
LAYOUTS = [(1, 8), (1, 2), (2, 2), (4, 1), (8, 1)]  # (batch degree D, local batch), global batch 8


def write_corpus(folder: Path) -> None:
    """The debug corpus as files: jsonl (two files, a blank line) and text (short and long
    files; a long one is read in several pieces once FileSource.CHUNK_BYTES is small)."""
    (folder / "jsonl").mkdir(parents=True)
    docs = [synthetic_document(7, i) for i in range(60)]
    (folder / "jsonl" / "b.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[30:]))
    (folder / "jsonl" / "a.jsonl").write_text(
        "".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs[:30])) + "\n"
    )
    (folder / "text").mkdir()
    (folder / "text" / "one.txt").write_text("\n".join(docs[:5]) + "\n")
    (folder / "text" / "two.txt").write_text("".join(f"line {i}: {d} é\n" for i, d in enumerate(docs[5:40])))
    (folder / "text" / "empty.txt").write_text("")
    (folder / "text" / "three.txt").write_text(docs[40] + "\nno final newline")
    # paragraphs (training.text_documents = blank_line): several blank lines, a whitespace-only
    # line, a paragraph of two lines, CRLF line ends
    paragraphs = "\n\n".join(f"{docs[i]}\n{docs[i + 1]}" for i in range(41, 51, 2))
    (folder / "text" / "four.txt").write_text("\n" + paragraphs + "\n \t\n\n" + docs[52] + "\r\n\r\n" + docs[53])


def tokenize(inputs, out, **kw):
    kw.setdefault("workers", 1)
    kw.setdefault("log", None)
    return tokenize_to_shards([str(i) for i in inputs], str(out), **kw)


def make_loader(source, d, b, local, tok=TOK):
    return PackedDataLoader(
        source, tok, seq_len=SEQ, global_batch_size=8, local_batch_size=local, batch_rank=b, batch_degree=d
    )


def rank_batches(make_source, d, local, steps, tok=TOK):
    """Every rank's micro-batches (inputs and labels) for ``steps`` steps."""
    out = []
    for b in range(d):
        ld = make_loader(make_source(), d, b, local, tok)
        out.append([[(x.clone(), y.clone()) for x, y in ld.next_step()] for _ in range(steps)])
    return out


def assert_same(a, b):
    assert len(a) == len(b)
    for ra, rb in zip(a, b):
        for sa, sb in zip(ra, rb):
            assert len(sa) == len(sb)
            for (xa, ya), (xb, yb) in zip(sa, sb):
                assert xa.dtype == xb.dtype == torch.long
                assert torch.equal(xa, xb) and torch.equal(ya, yb)


def without_command(folder: Path) -> dict:
    """The index, less the command that wrote it (it names the folder)."""
    index = json.loads((folder / INDEX_NAME).read_text())
    del index["command"]
    return index


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    write_corpus(folder)
    return folder


@pytest.mark.parametrize("kind", ["jsonl", "text", "text:blank_line", "text:line", "synthetic"])
def test_tokens_path_gives_the_streaming_samples_on_every_layout(corpus, tmp_path, monkeypatch, kind):
    """Every token of every rank's micro-batches, several layouts, across shard boundaries
    and (files) the wrap into the next epoch, equals the streaming path's (text: each way of
    cutting .txt files into documents)."""
    monkeypatch.setattr(FileSource, "CHUNK_BYTES", 256)  # long text files come in several pieces
    kind, _, documents = kind.partition(":")
    documents = documents or "file"
    if kind == "synthetic":
        spec, stream_source = "synthetic:5:40", lambda: SyntheticSource(5)
    else:
        spec = str(corpus / kind)
        stream_source = lambda: FileSource(str(corpus / kind), kind, documents=documents)  # noqa: E731
    out = tmp_path / "tok"
    tokenize([spec], out, shard_tokens=101, workers=2 if kind == "text" else 1, text_documents=documents)
    ds = TokenDataset(str(out))
    # every stream token, through the streaming reader, equals the shards' concatenation
    ref = make_loader(stream_source(), 1, 0, 8)._stream
    assert torch.equal(ref.take(len(ds) // W).flatten(), torch.from_numpy(ds.read(0, (len(ds) // W) * W)))
    assert len(ds.shards) >= 5
    # synthetic: within the 40 documents tokenized; files: past the end (the wrap)
    steps = (len(ds) // (8 * W)) if kind == "synthetic" else (len(ds) // (8 * W)) + 3
    assert steps >= 4
    for d, local in LAYOUTS:
        tokens = rank_batches(lambda: TokenDataset(str(out)), d, local, steps)
        assert_same(tokens, rank_batches(stream_source, d, local, steps))
    if kind != "synthetic":
        assert steps * 8 * W > len(ds), "the test must cross the wrap"
    ends = ds.document_ends()
    assert len(ends) == ds.n_documents and ends[-1] == len(ds)
    if kind == "text":  # 4 files; their 10 paragraphs; their 54 lines that are not blank
        assert ds.n_documents == {"file": 4, "blank_line": 10, "line": 54}[documents]
    assert (ds.read(0, len(ds))[ends - 1] == TOK.eos_id).all()


def test_parallel_tokenization_writes_the_same_bytes(corpus, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    tokenize([corpus / "jsonl", "synthetic:1:30"], a, shard_tokens=300, workers=1)
    tokenize([corpus / "jsonl", "synthetic:1:30"], b, shard_tokens=300, workers=2, chunk_bytes=500)
    names = sorted(os.listdir(a))
    assert names == sorted(os.listdir(b)) and "shard_00003.bin" in names
    for n in names:
        if n != INDEX_NAME:
            assert (a / n).read_bytes() == (b / n).read_bytes(), n
    assert without_command(a) == without_command(b)


def test_rank_reads_only_its_own_samples(tmp_path):
    out = tmp_path / "tok"
    tokenize(["synthetic:0:200"], out, shard_tokens=500)
    read = {}
    for d, b in [(1, 0), (8, 0), (8, 7)]:
        ds = TokenDataset(str(out))
        ld = make_loader(ds, d, b, 1)
        for _ in range(3):
            ld.next_step()
        read[d, b] = ds.tokens_read
    assert read[1, 0] == 3 * 8 * W  # the whole global batch of 3 steps
    assert read[8, 0] == read[8, 7] == read[1, 0] // 8  # its own 1/8, nothing of the other ranks


def test_resume_on_another_layout_is_exact(tmp_path):
    out = tmp_path / "tok"
    tokenize(["synthetic:3:120"], out, shard_tokens=257)
    first = make_loader(TokenDataset(str(out)), 2, 1, 2)
    for _ in range(3):
        first.next_step()
    state = first.state_dict()
    assert state["dataset"] == "tokens" and state["sample_index"] == 24 and state["position"] == 24 * W
    for d, local in [(4, 1), (1, 8)]:
        resumed = [make_loader(TokenDataset(str(out)), d, b, local) for b in range(d)]
        for ld in resumed:
            ld.load_state_dict(state)
        straight = [make_loader(TokenDataset(str(out)), d, b, local) for b in range(d)]
        for ld in straight:
            for _ in range(3):
                ld.next_step()
        for _ in range(4):
            for r, s in zip(resumed, straight):
                assert all(torch.equal(x[0], y[0]) for x, y in zip(r.next_step(), s.next_step()))
    # another dataset's state (streaming, or other shards) is refused with the fix
    with pytest.raises(ValueError, match="exclude_from_loading"):
        make_loader(TokenDataset(str(out)), 1, 0, 8).load_state_dict(
            make_loader(SyntheticSource(3), 1, 0, 8).state_dict()
        )
    other = tmp_path / "other"
    tokenize(["synthetic:4:50"], other, shard_tokens=257)
    with pytest.raises(ValueError, match="another token dataset"):
        make_loader(TokenDataset(str(other)), 1, 0, 8).load_state_dict(state)


def test_hugging_face_inputs_equal_the_jsonl_stream(tmp_path):
    datasets = pytest.importorskip("datasets")
    docs = [synthetic_document(9, i) for i in range(40)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    ref = tokenize([tmp_path / "d.jsonl"], tmp_path / "ref", shard_tokens=200)
    ds = datasets.Dataset.from_dict({"text": docs, "n": list(range(40))})
    ds.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "dict"))
    (tmp_path / "pq").mkdir()
    ds.select(range(25)).to_parquet(str(tmp_path / "pq" / "0.parquet"))
    ds.select(range(25, 40)).to_parquet(str(tmp_path / "pq" / "1.parquet"))
    for name in ("saved", "dict", "pq"):
        got = tokenize([tmp_path / name], tmp_path / f"out_{name}", shard_tokens=200)
        assert [s["sha256"] for s in got["shards"]] == [s["sha256"] for s in ref["shards"]], name
        assert got["n_documents"] == 40
    assert cli.main([str(tmp_path / "saved"), "--out", str(tmp_path / "bad"), "--text-field", "body"]) == 2


def _crashing_run(inputs, out, after):
    os.environ[CRASH_ENV] = str(after)
    tokenize(inputs, out, shard_tokens=211)


def test_interrupted_tokenization_resumes_to_identical_output(corpus, tmp_path):
    inputs = [corpus / "jsonl", "synthetic:2:40"]
    ref = tmp_path / "ref"
    tokenize(inputs, ref, shard_tokens=211)
    out = tmp_path / "out"
    for after in (2, 3):  # crash twice: after 2 shards, then 3 more (mid-input both times)
        child = mp.get_context("fork").Process(target=_crashing_run, args=(inputs, out, after))
        child.start()
        child.join(60)
        assert child.exitcode == 17
        assert not (out / INDEX_NAME).exists()  # visibly incomplete
        with pytest.raises(ConfigError, match="no index.json: its tokenization is unfinished"):
            TokenDataset(str(out))
    # what a crash can leave: a temp file and a renamed but unrecorded shard, half written
    (out / "shard_00005.bin.tmp.999").write_bytes(b"\0" * 10)
    (out / "shard_00005.bin").write_bytes(b"\1" * 10)
    # and a recorded shard damaged since (same size, other bytes): caught by its sha256
    damaged = bytearray((out / "shard_00003.bin").read_bytes())
    damaged[7] ^= 0xFF
    (out / "shard_00003.bin").write_bytes(bytes(damaged))
    index = tokenize(inputs, out, shard_tokens=211)
    assert sorted(os.listdir(out)) == sorted(os.listdir(ref))
    for n in os.listdir(ref):
        if n != INDEX_NAME:
            assert (out / n).read_bytes() == (ref / n).read_bytes(), n
    assert without_command(out) == without_command(ref)
    # a finished folder is left alone; a truncated shard in it is found and rewritten
    assert tokenize(inputs, out, shard_tokens=211) == index
    (out / "shard_00001.bin").write_bytes((out / "shard_00001.bin").read_bytes()[:100])
    with pytest.raises(ConfigError, match=r"shard_00001.bin is truncated .*re-run"):
        TokenDataset(str(out))
    tokenize(inputs, out, shard_tokens=211)
    assert (out / "shard_00001.bin").read_bytes() == (ref / "shard_00001.bin").read_bytes()
    TokenDataset(str(out), verify=True)


def test_reader_errors_name_the_file_and_the_fix(tmp_path, capsys):
    out = tmp_path / "tok"
    argv = ["synthetic:0:60", "--out", str(out), "--shard-tokens", "300", "--workers", "1"]
    assert cli.main(argv) == 0
    (out / "shard_00002.bin").unlink()
    with pytest.raises(ConfigError) as err:
        TokenDataset(str(out))
    assert "shard_00002.bin is missing (600 bytes expected); re-run `python scripts/tokenize_dataset.py " in str(
        err.value
    )
    assert f"synthetic:0:60 --out {out} --shard-tokens 300`" in str(err.value)
    assert cli.main(argv) == 0  # the command it names rewrites the shard
    assert "redoing from the first bad shard" in capsys.readouterr().err
    TokenDataset(str(out), verify=True)
    index = json.loads((out / INDEX_NAME).read_text())
    (out / INDEX_NAME).write_text(json.dumps({**index, "version": 99}))
    with pytest.raises(ConfigError, match="format version 99"):
        TokenDataset(str(out))
    with pytest.raises(ConfigError, match="does not exist"):
        TokenDataset(str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="no index.json: it is not a token folder"):
        TokenDataset(str(tmp_path))


def test_tokenizer_fingerprint_mismatch_is_a_config_error(tmp_path):
    out = tmp_path / "tok"
    tokenize(["synthetic:0:20"], out, tokenizer_path="bytes", shard_tokens=300)
    assert json.loads((out / INDEX_NAME).read_text())["dtype"] == "uint16"
    ds = TokenDataset(str(out))
    with pytest.raises(ConfigError) as err:
        make_loader(ds, 1, 0, 8)
    msg = str(err.value)
    assert "bytes (vocab 259" in msg and "tokenizer/tokenizer.json (vocab 2048" in msg
    assert "set model.tokenizer_path" in msg and "--tokenizer" in msg
    make_loader(ds, 1, 0, 8, tok=load_tokenizer("bytes")).next_step()  # the right tokenizer reads it


def test_cli_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    out = tmp_path / "tok"
    cases = [
        ([str(tmp_path / "missing.jsonl"), "--out", str(out)], "does not exist"),
        ([str(tmp_path / "x.csv"), "--out", str(out)], "unknown file type"),
    ]
    (tmp_path / "x.csv").write_text("a,b\n")
    for argv, expected in cases:
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and expected in err and err.count("\n") == 1, err
    assert cli.main(["synthetic:0:10", "--out", str(out), "--tokenizer", "bytes", "--workers", "1"]) == 0
    capsys.readouterr()
    assert cli.main(["synthetic:0:10", "--out", str(out), "--workers", "1"]) == 2  # other tokenizer
    err = capsys.readouterr().err
    assert "holds shards of another tokenizer (bytes" in err and err.count("\n") == 1, err
    assert cli.main(["synthetic:0:11", "--out", str(out), "--tokenizer", "bytes"]) == 2  # other inputs
    assert "other inputs or options" in capsys.readouterr().err
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.md").write_text("mine")
    assert cli.main(["synthetic:0:10", "--out", str(tmp_path / "busy")]) == 2
    assert "not empty" in capsys.readouterr().err
    assert cli.main(["--verify", "--out", str(out)]) == 0
    data = bytearray((out / "shard_00000.bin").read_bytes())
    data[0] ^= 1
    (out / "shard_00000.bin").write_bytes(bytes(data))
    assert cli.main(["--verify", "--out", str(out)]) == 2
    assert "corrupt (sha256" in capsys.readouterr().err


def test_config_selects_the_tokens_dataset(tmp_path):
    out = tmp_path / "tok"
    tokenize(["synthetic:42:100"], out, shard_tokens=1000)
    argv = ["--config", "llama3.toml", "--training.seq_len", str(SEQ), "--training.dataset", "tokens"]
    cfg = load_config([*argv, "--training.dataset_path", str(out)])
    ld = build_dataloader(cfg, TOK, batch_rank=1, batch_degree=4)
    ref = build_dataloader(load_config(["--config", "llama3.toml", "--training.seq_len", str(SEQ)]), TOK, 1, 4)
    for _ in range(2):
        assert all(torch.equal(a[0], b[0]) for a, b in zip(ld.next_step(), ref.next_step()))
    with pytest.raises(ConfigError, match="needs training.dataset_path"):
        load_config(argv)
    assert np.dtype(TokenDataset(str(out)).dtype) == np.dtype("<u2")
