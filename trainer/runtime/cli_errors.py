"""How every user-facing command ends on bad input: one line on stderr starting ``error: ``
that names the problem and the fix, exit code 2, no traceback.

Bad input is a :class:`ValueError`: the config's ``ConfigError``, ``CheckpointError``, each
command's ``UsageError`` / ``BadInput`` are all ValueErrors, and the messages already name the
path, the problem and the fix. A command that also treats ``OSError`` as bad input (an input
file it cannot read, an output folder it cannot create) passes ``kinds=(ValueError, OSError)``.

torch.distributed.checkpoint reports a failure inside ``dcp.save`` / ``dcp.load`` (ours too:
an adapter reading a corrupt safetensors file while DCP writes) as a ``CheckpointException``,
a BaseException holding each rank's exception; :func:`user_error` looks inside it, so the
original message reaches the user. Anything else (a bug) keeps its traceback.

    def main(argv=None) -> int:
        ns = build_parser().parse_args(argv)
        return run_command(lambda: ns.run(ns))
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TextIO

__all__ = [
    "BAD_INPUT",
    "EXIT_BAD_INPUT",
    "dcp_failures",
    "error_line",
    "report_user_error",
    "run_command",
    "unwrap_dcp",
    "user_error",
]

EXIT_BAD_INPUT = 2
BAD_INPUT: tuple[type[BaseException], ...] = (ValueError,)


def _is_dcp_wrapper(exc: BaseException) -> bool:
    # torch.distributed.checkpoint.api is looked up, not imported: a command that never loaded
    # it (the planner, the tokenizer) cannot have one of its exceptions, and pays no import
    api = sys.modules.get("torch.distributed.checkpoint.api")
    wrapper = getattr(api, "CheckpointException", None) if api is not None else None
    return wrapper is not None and isinstance(exc, wrapper)


def dcp_failures(exc: BaseException) -> list[BaseException]:
    """The exceptions a torch.distributed.checkpoint ``CheckpointException`` holds, one per
    failed rank in rank order (nested wrappers flattened); ``[exc]`` for any other exception."""
    if not _is_dcp_wrapper(exc):
        return [exc]
    out: list[BaseException] = []
    for _rank, failure in sorted(exc.failures.items(), key=lambda kv: kv[0]):
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, BaseException):
            out.extend(dcp_failures(inner))
    return out or [exc]


def unwrap_dcp(exc: BaseException) -> BaseException:
    """The first rank's own exception when ``exc`` is DCP's wrapper, else ``exc``: for code that
    calls ``dcp.save`` / ``dcp.load`` in one process and wants to re-raise what actually failed."""
    return dcp_failures(exc)[0]


def user_error(exc: BaseException, kinds: tuple[type[BaseException], ...] = BAD_INPUT) -> BaseException | None:
    """The bad-input exception ``exc`` is or carries, or None (a bug, an interrupt: re-raise).

    ``exc`` itself when it is one of ``kinds``; for DCP's ``CheckpointException`` the first
    rank's exception when every wrapped exception is one of ``kinds`` (a wrapper that also holds
    a bug is not reduced to one line)."""
    failures = dcp_failures(exc)
    if all(isinstance(f, kinds) for f in failures):
        return failures[0]
    return None


def error_line(exc: BaseException) -> str:
    """``error: <message>`` on one line (a message spanning lines is joined with spaces)."""
    message = " ".join(part.strip() for part in str(exc).splitlines() if part.strip())
    return f"error: {message or type(exc).__name__}"


def report_user_error(exc: BaseException, file: TextIO | None = None) -> int:
    """Print :func:`error_line` of ``exc`` to ``file`` (default stderr); returns ``EXIT_BAD_INPUT``."""
    print(error_line(exc), file=file or sys.stderr, flush=True)
    return EXIT_BAD_INPUT


def run_command(fn: Callable[[], int | None], kinds: tuple[type[BaseException], ...] = BAD_INPUT) -> int:
    """``fn()``'s exit code (None: 0); bad input (:func:`user_error` with ``kinds``) ends as
    one ``error:`` line on stderr and ``EXIT_BAD_INPUT``; everything else propagates."""
    try:
        code = fn()
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        err = user_error(exc, kinds)
        if err is None:
            raise
        return report_user_error(err)
    return 0 if code is None else code
