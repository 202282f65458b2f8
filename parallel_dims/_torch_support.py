"""Which torch versions meshtrain supports, checked once when :mod:`parallel_dims` is imported.

A torch older than :data:`MIN_TORCH` would fail later, deep inside ``torch.distributed``, with a
traceback that names none of the versions involved. Instead the import prints one line that says
which torch is needed and how to install it, and exits with code 2.
"""

from __future__ import annotations

import os
import re
import sys

MIN_TORCH = (2, 11)
MAX_TORCH_EXCLUSIVE = (2, 16)  # as pyproject.toml states it; a newer torch is not refused
SUPPORTED_SPEC = f"torch>={MIN_TORCH[0]}.{MIN_TORCH[1]},<{MAX_TORCH_EXCLUSIVE[0]}.{MAX_TORCH_EXCLUSIVE[1]}"


def parse_torch_version(version: str) -> tuple[int, int] | None:
    """(major, minor) of a torch version string ('2.13.0+cpu', '2.16.0.dev20260101'), or None
    when it does not start with two numbers."""
    m = re.match(r"\s*(\d+)\.(\d+)", str(version))
    return (int(m.group(1)), int(m.group(2))) if m else None


def unsupported_torch_message(version: str | None) -> str | None:
    """The one-line error for ``version`` (None: torch is not installed), or None if supported."""
    need = f"meshtrain needs torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]}"
    fix = f'install a supported torch: pip install "{SUPPORTED_SPEC}"'
    if version is None:
        return f"{need} (torch is not installed); {fix}"
    parsed = parse_torch_version(version)
    if parsed is not None and parsed < MIN_TORCH:
        return f"{need} (found {version}); {fix}"
    return None


def check_torch_version() -> None:
    """Exit with one line on stderr (code 2) when the installed torch is too old or missing.

    Under torchrun every process exits; only local rank 0 prints, so a node shows the line once.
    """
    try:
        import torch
    except ImportError:
        version = None
    else:
        version = str(torch.__version__)
    message = unsupported_torch_message(version)
    if message is not None:
        if os.environ.get("LOCAL_RANK", "0") == "0":
            print(f"error: {message}", file=sys.stderr, flush=True)
        raise SystemExit(2)
