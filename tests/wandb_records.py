"""Read what an offline W&B run wrote: its ``run-<id>.wandb`` transaction log.

wandb 0.31 dropped its Python reader (``wandb.sdk.internal.datastore``; the Go core reads and
writes the file now), so this is the file format, as the Go core writes it: a 7-byte header
(``:W&B``, magic 0xBEE1, version 0), then LevelDB log framing (32 KiB blocks of records, each a
crc32 (IEEE) of its type byte and data, a 2-byte length and a type: FULL, or FIRST, MIDDLE...,
LAST pieces of one record), each record one ``wandb.proto.wandb_internal_pb2.Record``: wandb's
own protobuf decodes it. Every record's checksum is checked, so a misread frame fails loudly.
"""

from __future__ import annotations

import glob
import json
import os
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: str) -> list[Any]:
    """Every ``Record`` of a .wandb file, in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    ident, magic, _version = struct.unpack("<4sHB", data[:HEADER])
    assert ident == b":W&B" and magic == 0xBEE1, f"{path}: not a W&B transaction log ({ident!r}, {magic:#x})"
    out, pos, pieces = [], HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # a block's trailer: zero bytes
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        if kind == 0 and length == 0:  # zero padding at the end of a block
            pos += left
            continue
        chunk = data[pos + HEADER : pos + HEADER + length]
        assert len(chunk) == length, f"{path}: record cut short at byte {pos}"
        assert zlib.crc32(bytes([kind]) + chunk) == crc, f"{path}: bad checksum at byte {pos}"
        pos += HEADER + length
        if kind == FULL:
            out.append(pb.Record.FromString(chunk))
        elif kind == FIRST:
            pieces = chunk
        elif kind == MIDDLE:
            pieces += chunk
        elif kind == LAST:
            out.append(pb.Record.FromString(pieces + chunk))
            pieces = b""
    return out


def _key(item: Any) -> str:
    return item.key or "/".join(item.nested_key)


@dataclass
class OfflineRun:
    """One offline run directory's contents: its run record, config, history rows by step
    (``_``-prefixed W&B fields dropped) and exit code (None: no exit record)."""

    path: str
    run_id: str = ""
    project: str = ""
    name: str = ""
    resume: bool = False
    config: dict[str, Any] = field(default_factory=dict)
    history: dict[int, dict[str, Any]] = field(default_factory=dict)
    exit_code: int | None = None


def read_run(path: str) -> OfflineRun:
    """The run of one ``run-<id>.wandb`` file."""
    run = OfflineRun(path)
    for rec in records(path):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            run.run_id, run.project = rec.run.run_id, rec.run.project
            run.name, run.resume = rec.run.display_name, rec.run.resume
            for item in rec.run.config.update:
                run.config[_key(item)] = json.loads(item.value_json)
        elif kind == "config":
            for item in rec.config.update:
                run.config[_key(item)] = json.loads(item.value_json)
        elif kind == "history":
            row = {_key(i): json.loads(i.value_json) for i in rec.history.item}
            run.history[rec.history.step.num] = {k: v for k, v in row.items() if not k.startswith("_")}
        elif kind == "exit":
            run.exit_code = rec.exit.exit_code
    return run


def offline_runs(wandb_dir: str) -> list[OfflineRun]:
    """Every offline run under ``<wandb_dir>/wandb``, oldest first (W&B names the folders
    ``offline-run-<date>_<time>-<id>``; a resumed run is a new folder with the same id)."""
    files = glob.glob(os.path.join(wandb_dir, "wandb", "offline-run-*", "run-*.wandb"))
    return [read_run(f) for f in sorted(files, key=lambda f: os.path.basename(os.path.dirname(f)))]


def rows_by_step(jsonl_records: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """metrics.jsonl records as W&B keeps them: one row per step, the step's records merged in
    order, without ``step`` and ``time`` (trainer/reporting/wandb_log.py)."""
    out: dict[int, dict[str, Any]] = {}
    for rec in jsonl_records:
        row = out.setdefault(rec["step"], {})
        row.update({k: v for k, v in rec.items() if k not in ("step", "time")})
    return out
