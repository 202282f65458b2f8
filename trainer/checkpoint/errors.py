"""The one error a checkpoint the user pointed at raises, and how a read failure is described."""

from __future__ import annotations

import pickle

from torch.distributed.checkpoint.api import CheckpointException

__all__ = ["CheckpointError", "read_failure"]


class CheckpointError(ValueError):
    """A checkpoint the user pointed at (or the run folder holds) that cannot be used:
    missing, incomplete, from another model, unreadable or corrupt. The message names the
    path, the problem and the fix; the trainer prints it as one line and exits with code 2."""


def read_failure(exc: BaseException, reading: str) -> str | None:
    """What an exception raised while reading ``reading`` (".metadata" or "shard file") of a
    checkpoint says about the files, or None when it is not about the files (a bug, which
    keeps its traceback)."""
    if isinstance(exc, CheckpointException):  # DCP wraps each rank's failure
        reasons = [read_failure(inner, reading) for inner, _ in exc.failures.values()]
        return next((r for r in reasons if r), None)
    if isinstance(exc, PermissionError):
        return f"permission denied reading {exc.filename or 'a file'}"
    if isinstance(exc, FileNotFoundError):
        return f"missing file {exc.filename}"
    if isinstance(exc, OSError):
        return f"{exc.strerror or exc} ({exc.filename})"
    if isinstance(exc, (pickle.UnpicklingError, EOFError)) or (
        isinstance(exc, RuntimeError) and ("PytorchStreamReader" in str(exc) or "zip archive" in str(exc))
    ):
        return f"truncated or corrupt {reading}"
    return None
