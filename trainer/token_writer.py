"""Offline tokenization into token shards (:mod:`trainer.token_dataset`); the command line is
``scripts/tokenize_dataset.py``.

Inputs, each turned into a sequence of *units* (a piece of text, whether it ends a document,
and a cursor from which the enumeration can restart):

- ``.txt`` / ``.jsonl`` files or folders: read by :class:`trainer.data.FileSource` itself, so
  the documents, their order and the ~1 MiB pieces of long text files (each tokenized on its
  own) are exactly the streaming path's, and the tokens equal its first epoch;
- local Hugging Face ``datasets`` (a ``save_to_disk`` folder, or ``.parquet`` / ``.arrow`` /
  ``.json`` files or folders of them), one document per row (``--text-field``), no network;
- ``synthetic:SEED:DOCS``: the first DOCS documents of the built-in synthetic corpus, the
  stream ``training.dataset = "synthetic"`` with ``training.seed = SEED`` trains on.

Units are grouped into chunks, tokenized by a pool of worker processes, and written in order.
Shard i holds stream tokens ``[i*S, (i+1)*S)``; each is written to a temporary name, fsynced,
renamed, and then recorded (with the unit and token offset where it ended) in
``progress.jsonl``. A rerun checks the recorded shards (size and sha256), keeps the good
prefix, and goes on from the recorded position; the index is written last, atomically.
"""

from __future__ import annotations

import glob
import hashlib
import io
import json
import logging
import multiprocessing as mp
import os
import re
import shlex
import sys
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one core per worker process

import numpy as np

from trainer.config import ConfigError
from trainer.files import atomic_write, fsync_dir
from trainer.token_dataset import (
    DTYPES,
    FORMAT,
    FORMAT_VERSION,
    INDEX_NAME,
    PROGRESS_NAME,
    describe_fingerprint,
    docs_file,
    same_tokenizer,
    sha256_file,
    shard_file,
    token_dtype_name,
    tokenizer_fingerprint,
)
from trainer.tokenizer import load_tokenizer

DEFAULT_SHARD_TOKENS = 1 << 27  # 134M tokens: 256 MiB as uint16
CHUNK_BYTES = 1 << 22  # text per worker task
CRASH_ENV = "MESHTRAIN_TOKENIZE_CRASH_AFTER_SHARDS"  # tests: die (os._exit) after recording N shards
HF_SUFFIXES = {".parquet": "parquet", ".arrow": "arrow", ".json": "json"}
_SYNTHETIC = re.compile(r"^synthetic:(\d+):(\d+)$")


class BadInput(ValueError):
    """An input, option or output folder the tokenizer cannot work with (one line, exit 2)."""


# ---------------------------------------------------------------------------- inputs


@dataclass
class InputSpec:
    spec: str  # as given
    kind: str  # text | jsonl | hf | synthetic
    path: str = ""
    files: list[str] = field(default_factory=list)
    builder: str = ""  # hf: parquet | arrow | json | "" (save_to_disk folder)
    seed: int = 0
    n_docs: int = 0

    def identity(self) -> dict[str, Any]:
        """What a resumed run must find unchanged."""
        if self.kind == "synthetic":
            return {"kind": "synthetic", "seed": self.seed, "docs": self.n_docs}
        return {
            "kind": self.kind,
            "path": os.path.abspath(self.path),
            "files": [
                [os.path.relpath(f, self.path) if f != self.path else "", os.path.getsize(f)] for f in self.files
            ],
        }


def _walk(path: str) -> list[str]:
    def unreadable(err: OSError):
        raise BadInput(f"input '{path}': cannot read '{err.filename}' ({err.strerror})")

    return sorted(os.path.join(root, f) for root, _, names in os.walk(path, onerror=unreadable) for f in names)


def resolve_input(spec: str, kind: str = "auto") -> InputSpec:
    m = _SYNTHETIC.match(spec)
    if m and not os.path.exists(spec):
        if kind not in ("auto", "synthetic"):
            raise BadInput(f"input '{spec}' is the synthetic corpus but --kind is {kind}")
        return InputSpec(spec, "synthetic", seed=int(m.group(1)), n_docs=int(m.group(2)))
    if not os.path.exists(spec):
        raise BadInput(
            f"input '{spec}' does not exist (expected a .txt/.jsonl/.parquet/.arrow/.json file, a folder of "
            f"them, a Hugging Face save_to_disk folder, or synthetic:SEED:DOCS)"
        )
    if os.path.isdir(spec):
        if any(os.path.isfile(os.path.join(spec, n)) for n in ("state.json", "dataset_dict.json")) and kind in (
            "auto",
            "hf",
        ):
            return InputSpec(spec, "hf", spec, files=[f for f in _walk(spec) if os.path.isfile(f)])
        files = _walk(spec)
        by_kind: dict[str, list[str]] = {"text": [], "jsonl": [], "hf": []}
        for f in files:
            ext = os.path.splitext(f)[1]
            k = {".txt": "text", ".jsonl": "jsonl"}.get(ext) or ("hf" if ext in HF_SUFFIXES else None)
            if k:
                by_kind[k].append(f)
        if kind == "auto":
            found = [k for k, fs in by_kind.items() if fs]
            if not found:
                raise BadInput(f"input folder '{spec}' has no .txt, .jsonl, .parquet, .arrow or .json files")
            if len(found) > 1:
                raise BadInput(
                    f"input folder '{spec}' holds {' and '.join(found)} files; choose which with --kind {'|'.join(found)}"
                )
            kind = found[0]
        chosen = by_kind.get(kind)
        if not chosen:
            raise BadInput(f"input folder '{spec}' has no files for --kind {kind}")
    else:
        ext = os.path.splitext(spec)[1]
        if kind == "auto":
            kind = {".txt": "text", ".jsonl": "jsonl"}.get(ext) or ("hf" if ext in HF_SUFFIXES else "")
            if not kind:
                raise BadInput(
                    f"input '{spec}': unknown file type '{ext}' (expected .txt, .jsonl, .parquet, .arrow, .json); "
                    f"or name the reader with --kind text|jsonl|hf"
                )
        chosen = [spec]
    for f in chosen:
        if not os.access(f, os.R_OK):
            raise BadInput(f"input '{spec}': cannot read '{f}' (permission denied)")
    out = InputSpec(spec, kind, spec, files=chosen)
    if kind == "hf":
        builders = {HF_SUFFIXES.get(os.path.splitext(f)[1]) for f in chosen} - {None}
        if len(builders) != 1:
            raise BadInput(f"input '{spec}': mixes {', '.join(sorted(builders))} files; give them as separate inputs")
        out.builder = builders.pop()
    elif kind not in ("text", "jsonl"):
        raise BadInput(f"--kind must be auto, text, jsonl, hf or synthetic, got {kind!r}")
    return out


def _units_filesource(spec: InputSpec, start: list[int] | None) -> Iterator[tuple[str, bool, Any]]:
    """The streaming path's own reader, for one epoch."""
    from trainer.data import FileSource

    logging.getLogger("trainer.data").setLevel(logging.ERROR)  # its "starting over" warning
    try:
        src = FileSource(spec.path, spec.kind)
    except ConfigError as exc:  # e.g. every file empty
        raise BadInput(f"input '{spec.spec}': {str(exc).replace('training.dataset_path ', '')}") from None
    cursor = list(start) if start else src.start()
    while True:
        text, ends_doc, nxt = src.read(cursor)
        # a jsonl read that ran past the last file returns a document of the next epoch
        if spec.kind == "jsonl" and nxt[0] > cursor[0]:
            return
        yield text, ends_doc, cursor
        if nxt[0] > 0:
            return
        cursor = nxt


def _hf_dataset(spec: InputSpec, split: str):
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import datasets
    except ImportError:
        raise BadInput(
            f"input '{spec.spec}' is a Hugging Face dataset but the `datasets` package is not installed; "
            f"pip install datasets"
        ) from None
    try:
        if not spec.builder:
            ds = datasets.load_from_disk(spec.path)
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise BadInput(
                        f"input '{spec.spec}' has splits {sorted(ds)}, not '{split}'; choose one with --split"
                    )
                ds = ds[split]
            return ds
        return datasets.load_dataset(spec.builder, data_files=list(spec.files), split="train", streaming=True)
    except BadInput:
        raise
    except Exception as exc:  # datasets raises many types for unreadable input
        raise BadInput(
            f"input '{spec.spec}': the datasets library cannot read it ({type(exc).__name__}: {exc})"
        ) from None


def _units_hf(spec: InputSpec, start: list[int] | None, text_field: str, split: str) -> Iterator[tuple[str, bool, Any]]:
    ds = _hf_dataset(spec, split)
    row = start[0] if start else 0
    names = ds.column_names
    if names is not None and text_field not in names:
        raise BadInput(
            f"input '{spec.spec}' has no column '{text_field}' (columns: {names}); choose one with --text-field"
        )
    if row:
        ds = ds.skip(row)
    for record in ds:
        text = record.get(text_field)
        if not isinstance(text, str):
            raise BadInput(
                f"input '{spec.spec}' row {row}: column '{text_field}' is {type(text).__name__}, not a string"
            )
        yield text, True, [row]
        row += 1


def _units_synthetic(spec: InputSpec, start: list[int] | None) -> Iterator[tuple[str, bool, Any]]:
    from trainer.data import synthetic_document

    for i in range(start[0] if start else 0, spec.n_docs):
        yield synthetic_document(spec.seed, i), True, [i]


def iter_units(
    specs: list[InputSpec], start: list | None = None, *, text_field: str = "text", split: str = "train"
) -> Iterator[tuple[str, bool, list]]:
    """(text, ends_document, cursor) for every unit of every input in order; ``cursor`` =
    [input index, inner cursor] restarts the enumeration at that unit."""
    first = start[0] if start else 0
    for i in range(first, len(specs)):
        spec, inner = specs[i], (start[1] if start and i == first else None)
        if spec.kind in ("text", "jsonl"):
            units = _units_filesource(spec, inner)
        elif spec.kind == "hf":
            units = _units_hf(spec, inner, text_field, split)
        else:
            units = _units_synthetic(spec, inner)
        for text, ends, cursor in units:
            yield text, ends, [i, cursor]


# ---------------------------------------------------------------------- tokenization

_WORKER: dict[str, Any] = {}


def _init_worker(tokenizer_path: str, dtype: str) -> None:
    _WORKER["tok"] = load_tokenizer(tokenizer_path)
    _WORKER["dtype"] = DTYPES[dtype]


def _encode_chunk(texts: list[str], ends: list[bool]) -> list[np.ndarray]:
    tok, dtype = _WORKER["tok"], _WORKER["dtype"]
    out = []
    for ids, end in zip(tok.encode_batch(texts), ends):
        if end:
            ids.append(tok.eos_id)
        out.append(np.asarray(ids, dtype=dtype))
    return out


def _chunks(units: Iterator[tuple[str, bool, list]], chunk_bytes: int) -> Iterator[list[tuple[str, bool, list]]]:
    chunk, size = [], 0
    for unit in units:
        chunk.append(unit)
        size += len(unit[0])
        if size >= chunk_bytes:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def encoded_units(
    units: Iterator[tuple[str, bool, list]],
    tokenizer_path: str,
    dtype: str,
    workers: int,
    chunk_bytes: int = CHUNK_BYTES,
) -> Iterator[tuple[np.ndarray, bool, list]]:
    """(tokens incl. eos, ends_document, cursor) per unit, in input order; ``workers`` > 1
    tokenizes chunks in a process pool with a bounded number of chunks in flight."""
    if workers <= 1:
        _init_worker(tokenizer_path, dtype)
        for chunk in _chunks(units, chunk_bytes):
            encoded = _encode_chunk([u[0] for u in chunk], [u[1] for u in chunk])
            for (_, ends, cursor), toks in zip(chunk, encoded):
                yield toks, ends, cursor
        return
    methods = mp.get_all_start_methods()
    ctx = mp.get_context("fork" if "fork" in methods else "spawn")
    with ctx.Pool(workers, initializer=_init_worker, initargs=(tokenizer_path, dtype)) as pool:
        pending: deque = deque()

        def drain(limit: int):
            while len(pending) > limit:
                chunk, result = pending.popleft()
                for (_, ends, cursor), toks in zip(chunk, result.get()):
                    yield toks, ends, cursor

        for chunk in _chunks(units, chunk_bytes):
            texts, ends = [u[0] for u in chunk], [u[1] for u in chunk]
            pending.append(([(None, u[1], u[2]) for u in chunk], pool.apply_async(_encode_chunk, (texts, ends))))
            yield from drain(2 * workers)
        yield from drain(0)


# ------------------------------------------------------------------------- the writer


def _append_line(path: str, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _read_progress(path: str) -> tuple[dict | None, list[dict]]:
    """Header and shard records; a torn last line (crash while appending) is dropped."""
    with open(path) as f:
        lines = f.read().split("\n")
    parsed = []
    for line in lines:
        if not line.strip():
            continue
        try:
            parsed.append(json.loads(line))
        except ValueError:
            break
    if not parsed or parsed[0].get("format") != FORMAT:
        return None, []
    return parsed[0], parsed[1:]


def _shard_ok(out: str, rec: dict, itemsize: int, check_hash: bool) -> bool:
    p, d = os.path.join(out, rec["file"]), os.path.join(out, rec["docs_file"])
    if not (os.path.isfile(p) and os.path.isfile(d)) or os.path.getsize(p) != rec["n_tokens"] * itemsize:
        return False
    return not check_hash or (sha256_file(p) == rec["sha256"] and sha256_file(d) == rec["docs_sha256"])


class _Progress:
    def __init__(self, stream, every: float = 2.0):
        self.stream, self.every = stream, every
        self.start = self.last = time.monotonic()
        self.tokens = 0  # tokenized in this process (for tokens/s)

    def report(self, docs: int, total: int, shards: int, force: bool = False) -> None:
        now = time.monotonic()
        if self.stream is None or (not force and now - self.last < self.every):
            return
        self.last = now
        rate = self.tokens / max(now - self.start, 1e-9)
        print(
            f"tokenize: {docs:,} documents, {total:,} tokens, {shards} shards, {rate:,.0f} tokens/s",
            file=self.stream,
            flush=True,
        )


def tokenize_to_shards(
    inputs: list[str],
    out: str,
    *,
    tokenizer_path: str = "",
    workers: int | None = None,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    kind: str = "auto",
    text_field: str = "text",
    split: str = "train",
    verify: bool = False,
    chunk_bytes: int = CHUNK_BYTES,
    command: str | None = None,
    log: Any = "stderr",
) -> dict[str, Any]:
    """Tokenize ``inputs`` into shards in ``out`` (resuming an interrupted run there);
    returns the index. ``BadInput``/``ConfigError`` for bad inputs or a foreign ``out``.
    ``log``: where progress goes (default: the current stderr; None: nowhere)."""
    log = sys.stderr if log == "stderr" else log
    if not inputs:
        raise BadInput("no inputs: give one or more files, folders or synthetic:SEED:DOCS")
    if shard_tokens <= 0:
        raise BadInput(f"--shard-tokens must be > 0, got {shard_tokens}")
    if not workers:
        workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    tok = load_tokenizer(tokenizer_path)
    fp = tokenizer_fingerprint(tok)
    dtype_name = token_dtype_name(tok.vocab_size)
    itemsize = DTYPES[dtype_name].itemsize
    specs = [resolve_input(s, kind) for s in inputs]
    source = {
        "inputs": [s.identity() for s in specs],
        "shard_tokens": shard_tokens,
        "dtype": dtype_name,
        "text_field": text_field,
        "split": split,
    }
    header = {"format": FORMAT, "version": FORMAT_VERSION, "tokenizer": fp, "source": source}
    if command is None:  # what to re-run to finish or repair this folder (named by the reader's errors)
        parts = ["python", "scripts/tokenize_dataset.py", *inputs, "--out", out]
        for flag, value, default in [
            ("--tokenizer", tokenizer_path, ""),
            ("--shard-tokens", shard_tokens, DEFAULT_SHARD_TOKENS),
            ("--kind", kind, "auto"),
            ("--text-field", text_field, "text"),
            ("--split", split, "train"),
        ]:
            if value != default:
                parts += [flag, str(value)]
        command = shlex.join(parts)
    progress = _Progress(log)

    def say(msg: str) -> None:
        if log is not None:
            print(msg, file=log, flush=True)

    def foreign(what: dict, where: str) -> None:
        if not same_tokenizer(what.get("tokenizer", {}), fp):
            raise BadInput(
                f"--out {out} holds shards of another tokenizer ({describe_fingerprint(what.get('tokenizer', {}))}; "
                f"this run's is {describe_fingerprint(fp)}, per its {where}): choose another --out, or delete {out}"
            )
        if what.get("source") != source:
            raise BadInput(
                f"--out {out} holds shards of other inputs or options (per its {where}): rerun with the same "
                f"inputs and options to resume it, choose another --out, or delete {out}"
            )

    os.makedirs(out, exist_ok=True)
    index_path, progress_path = os.path.join(out, INDEX_NAME), os.path.join(out, PROGRESS_NAME)
    records: list[dict] = []
    if os.path.isfile(index_path):
        try:
            with open(index_path) as f:
                index = json.load(f)
        except (OSError, ValueError):
            index = None
        if index is not None:
            foreign(index, INDEX_NAME)
            if all(_shard_ok(out, rec, itemsize, verify) for rec in index["shards"]):
                say(f"tokenize: {out} is complete ({index['total_tokens']:,} tokens); nothing to do")
                return index
        say(f"tokenize: {out} has a damaged index or shard; checking and redoing from the first bad shard")
        os.remove(index_path)  # the folder is visibly incomplete again
        fsync_dir(out)
    if os.path.isfile(progress_path):
        old_header, old_records = _read_progress(progress_path)
        if old_header is None:
            raise BadInput(f"--out {out} has an unreadable {PROGRESS_NAME}; delete {out} and start over")
        foreign(old_header, PROGRESS_NAME)
        for i, rec in enumerate(old_records):
            if rec.get("shard") != i or not _shard_ok(out, rec, itemsize, True):
                break
            records.append(rec)
        if records:
            say(f"tokenize: resuming after {len(records)} finished shard(s) in {out}")
    else:
        leftovers = [n for n in os.listdir(out) if not n.startswith(".")]
        if leftovers:
            raise BadInput(
                f"--out {out} is not empty and holds no tokenize progress ({', '.join(sorted(leftovers)[:3])}...): "
                f"choose an empty or new folder"
            )
    # progress = header + the good records; rewritten atomically, then appended to
    atomic_write(progress_path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in [header, *records]).encode())
    keep = {INDEX_NAME, PROGRESS_NAME} | {r["file"] for r in records} | {r["docs_file"] for r in records}
    for p in sorted(set(glob.glob(os.path.join(out, "shard_*")) + glob.glob(os.path.join(out, "*.tmp.*")))):
        if os.path.basename(p) not in keep:
            os.remove(p)  # half-written or unrecorded: never trusted, rewritten below

    crash_after = int(os.environ.get(CRASH_ENV, "0") or 0)
    written_here = 0
    if records:
        last = records[-1]
        start, skip = last["resume"]["cursor"], last["resume"]["token_offset"]
        n_docs, total = last["documents_after"], last["tokens_after"]
    else:
        start, skip, n_docs, total = None, 0, 0, 0
    buf: list[np.ndarray] = []
    buf_n = 0
    doc_ends: list[int] = []
    docs_before_shard = n_docs

    def flush(cursor: list, offset: int) -> None:
        nonlocal buf, buf_n, doc_ends, docs_before_shard, written_here
        i = len(records)
        arr = np.concatenate(buf) if len(buf) != 1 else buf[0]
        data = np.ascontiguousarray(arr, dtype=DTYPES[dtype_name]).tobytes()
        ends = np.asarray(doc_ends, dtype=np.int64)
        docs_io = io.BytesIO()
        np.save(docs_io, ends)
        docs_bytes = docs_io.getvalue()
        atomic_write(os.path.join(out, shard_file(i)), data)
        atomic_write(os.path.join(out, docs_file(i)), docs_bytes)
        rec = {
            "shard": i,
            "file": shard_file(i),
            "docs_file": docs_file(i),
            "n_tokens": buf_n,
            "n_documents": len(doc_ends),
            "first_document": docs_before_shard,
            "sha256": hashlib.sha256(data).hexdigest(),
            "docs_sha256": hashlib.sha256(docs_bytes).hexdigest(),
            "documents_after": n_docs,
            "tokens_after": total,
            "resume": {"cursor": cursor, "token_offset": offset},
        }
        _append_line(progress_path, rec)
        records.append(rec)
        buf, buf_n, doc_ends, docs_before_shard = [], 0, [], n_docs
        written_here += 1
        if crash_after and written_here >= crash_after:
            os._exit(17)  # simulated crash (tests): no cleanup, no index

    units = iter_units(specs, start, text_field=text_field, split=split)
    first = True
    for toks, ends_doc, cursor in encoded_units(units, tokenizer_path, dtype_name, workers, chunk_bytes):
        consumed = 0
        if first:
            first = False
            if start is not None:
                consumed = skip  # this unit's first tokens are in the last finished shard
        progress.tokens += len(toks) - consumed
        while consumed < len(toks):
            take = min(len(toks) - consumed, shard_tokens - buf_n)
            buf.append(toks[consumed : consumed + take])
            buf_n += take
            consumed += take
            total += take
            if ends_doc and consumed == len(toks):
                n_docs += 1
                doc_ends.append(buf_n)
            if buf_n == shard_tokens:
                flush(cursor, consumed)
        progress.report(n_docs, total, len(records))
    if buf_n:
        flush([len(specs), None], 0)
    if total == 0:
        raise BadInput(f"the inputs ({', '.join(inputs)}) hold no documents")
    index = {
        **header,
        "dtype": dtype_name,
        "shard_tokens": shard_tokens,
        "total_tokens": total,
        "n_documents": n_docs,
        "command": command,
        "shards": [
            {
                k: r[k]
                for k in ("file", "docs_file", "n_tokens", "n_documents", "first_document", "sha256", "docs_sha256")
            }
            for r in records
        ],
    }
    atomic_write(index_path, (json.dumps(index, indent=1, sort_keys=True) + "\n").encode())
    progress.report(n_docs, total, len(records), force=True)
    say(f"tokenize: wrote {len(records)} shard(s), {total:,} tokens, {n_docs:,} documents ({dtype_name}) to {out}")
    return index


def verify_folder(out: str, log: Any = "stderr") -> dict[str, Any]:
    """Check a finished folder: index, every shard's size and sha256 (ConfigError if bad)."""
    from trainer.token_dataset import TokenDataset

    ds = TokenDataset(out, verify=True, option="--out")
    for s in ds.shards:
        d = os.path.join(out, s["docs_file"])
        if not os.path.isfile(d) or sha256_file(d) != s["docs_sha256"]:
            raise ConfigError(f"document offsets {d} are missing or corrupt; {ds._fix()}")
    log = sys.stderr if log == "stderr" else log
    if log is not None:
        print(f"tokenize: {out} verified: {len(ds.shards)} shard(s), {ds.total_tokens:,} tokens", file=log)
    return ds.index
