"""``python -m trainer.checkpoint STEP_DIR OUT [--dtype D]``: consolidate a DCP checkpoint's
model weights into one ``.pt`` or ``.safetensors`` file (:func:`trainer.checkpoint.export.export_checkpoint`)."""

from __future__ import annotations

import argparse
import sys

from trainer.checkpoint.errors import CheckpointError
from trainer.checkpoint.export import export_checkpoint
from trainer.checkpoint.state import EXPORT_DTYPES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.checkpoint", description="Consolidate a DCP checkpoint's model weights into one file."
    )
    parser.add_argument("checkpoint_dir", help="e.g. outputs/checkpoint/step-50")
    parser.add_argument("output", help="output .pt or .safetensors path")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=sorted(EXPORT_DTYPES),
        help="dtype of the written weights (default float32)",
    )
    args = parser.parse_args(argv)
    try:
        print(export_checkpoint(args.checkpoint_dir, args.output, args.dtype))
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
