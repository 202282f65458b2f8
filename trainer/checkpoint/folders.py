"""Publishing a folder written under a temporary name (``<final>.tmp``): a step checkpoint
(``step-N``) or a Hugging Face export (``step-N-hf``, a ``convert_hf.py`` output).

The folder is renamed into place only once it is complete, and an existing ``<final>`` is kept
as ``<final>.old`` until the new one is in place, so a crash at any point leaves either the
previous folder or the new one under the final name, never a partial one. Files inside the
folder are written by their writers (DCP, :mod:`trainer.runtime.files`); this module only renames.
"""

from __future__ import annotations

import os
import shutil

from trainer.runtime.files import fsync_dir

__all__ = ["publish_folder"]


def publish_folder(tmp: str, final: str) -> str:
    """Rename the complete folder ``tmp`` to ``final`` (replacing an existing ``final`` only
    then) and make the rename durable; returns ``final``."""
    old = final + ".old"
    if os.path.exists(old):  # left by a crash between the two renames below
        shutil.rmtree(old)
    if os.path.exists(final):  # re-saving: keep the previous folder until the new one is in place
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(os.path.dirname(os.path.abspath(final)))
    if os.path.exists(old):
        shutil.rmtree(old)
    return final
