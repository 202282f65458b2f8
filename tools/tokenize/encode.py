"""Tokenizing units into token arrays (eos appended where a document ends), in input order, in
a pool of worker processes with one tokenizer thread each.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
from collections import deque
from collections.abc import Iterator
from typing import Any

import numpy as np

from trainer.data.shard_format import DTYPES
from trainer.data.tokenizer import load_tokenizer

CHUNK_BYTES = 1 << 22  # text per worker task
PARALLELISM_ENV = "TOKENIZERS_PARALLELISM"


@contextlib.contextmanager
def one_thread_per_process() -> Iterator[None]:
    """``TOKENIZERS_PARALLELISM=false`` (unless the caller set it) while tokenizing: each worker
    process, and the tokenizing process itself with one worker, uses one core; set before the
    pool forks so the workers inherit it. The caller's environment is restored afterwards."""
    if PARALLELISM_ENV in os.environ:
        yield
        return
    os.environ[PARALLELISM_ENV] = "false"
    try:
        yield
    finally:
        os.environ.pop(PARALLELISM_ENV, None)


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
    with one_thread_per_process():
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
