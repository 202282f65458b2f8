"""Writing token shards: :func:`tokenize_to_shards` (resumable) and :func:`verify_folder`;
the command line is ``scripts/tokenize_dataset.py`` (:mod:`tools.tokenize.cli`).
"""

from __future__ import annotations

import glob
import hashlib
import io
import json
import os
import shlex
import sys
import time
from typing import Any

import numpy as np

from tools.tokenize.encode import CHUNK_BYTES, encoded_units
from tools.tokenize.errors import BadInput
from tools.tokenize.inputs import iter_units, resolve_input
from tools.tokenize.resume_log import append_record, read_progress, shard_ok
from trainer.config import ConfigError
from trainer.data.shard_format import (
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
from trainer.data.token_shards import TokenDataset
from trainer.data.tokenizer import load_tokenizer
from trainer.runtime.files import atomic_write, fsync_dir

DEFAULT_SHARD_TOKENS = 1 << 27  # 134M tokens: 256 MiB as uint16
CRASH_ENV = "MESHTRAIN_TOKENIZE_CRASH_AFTER_SHARDS"  # tests: die (os._exit) after recording N shards


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
    text_documents: str = "file",
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
    specs = [resolve_input(s, kind, text_documents) for s in inputs]
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
            ("--text-documents", text_documents, "file"),
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
            if all(shard_ok(out, rec, itemsize, verify) for rec in index["shards"]):
                say(f"tokenize: {out} is complete ({index['total_tokens']:,} tokens); nothing to do")
                return index
        say(f"tokenize: {out} has a damaged index or shard; checking and redoing from the first bad shard")
        os.remove(index_path)  # the folder is visibly incomplete again
        fsync_dir(out)
    if os.path.isfile(progress_path):
        old_header, old_records = read_progress(progress_path)
        if old_header is None:
            raise BadInput(f"--out {out} has an unreadable {PROGRESS_NAME}; delete {out} and start over")
        foreign(old_header, PROGRESS_NAME)
        for i, rec in enumerate(old_records):
            if rec.get("shard") != i or not shard_ok(out, rec, itemsize, True):
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
        append_record(progress_path, rec)
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
    ds = TokenDataset(out, verify=True, option="--out")
    for s in ds.shards:
        d = os.path.join(out, s["docs_file"])
        if not os.path.isfile(d) or sha256_file(d) != s["docs_sha256"]:
            raise ConfigError(f"document offsets {d} are missing or corrupt; {ds._fix()}")
    log = sys.stderr if log == "stderr" else log
    if log is not None:
        print(f"tokenize: {out} verified: {len(ds.shards)} shard(s), {ds.total_tokens:,} tokens", file=log)
    return ds.index
