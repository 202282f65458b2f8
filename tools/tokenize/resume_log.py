"""``progress.jsonl``, the writer's resume log: a header (what is being tokenized), then one
line per finished shard (its checksums and the input position where it ended), appended and
fsynced after the shard itself is in place. A torn last line (a crash while appending) is
dropped when read; a recorded shard is trusted only if it still has its size and checksums.
"""

from __future__ import annotations

import json
import os

from trainer.data.shard_format import FORMAT, sha256_file


def append_record(path: str, record: dict) -> None:
    """Append one line and fsync it. The one write here that is not a whole-file atomic write
    (``trainer/runtime/files.py``): an append-only log, written whole by ``atomic_write`` at the start
    of a run, whose torn last line :func:`read_progress` drops."""
    with open(path, "a") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_progress(path: str) -> tuple[dict | None, list[dict]]:
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


def shard_ok(out: str, rec: dict, itemsize: int, check_hash: bool) -> bool:
    p, d = os.path.join(out, rec["file"]), os.path.join(out, rec["docs_file"])
    if not (os.path.isfile(p) and os.path.isfile(d)) or os.path.getsize(p) != rec["n_tokens"] * itemsize:
        return False
    return not check_hash or (sha256_file(p) == rec["sha256"] and sha256_file(d) == rec["docs_sha256"])
