"""Process groups: the device and backend a job defaults to, the placeholder (``fake``) backend,
group creation with the job's timeout, and reading a group's timeout back."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

__all__ = [
    "default_backend",
    "default_device_type",
    "new_group",
    "process_group_timeout",
    "register_fake_backend",
]


def default_device_type() -> str:
    """``cuda`` when a GPU is present, else ``cpu``: the device never comes from model code."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_backend(device_type: str | None = None) -> str:
    return "nccl" if (device_type or default_device_type()) == "cuda" else "gloo"


def register_fake_backend() -> None:
    # The "fake" backend's factory lives in torch's testing package; importing it registers the
    # backend. We use it only for placeholder groups of size-1 axes and for dry runs.
    import torch.testing._internal.distributed.fake_pg  # noqa: F401


def process_group_timeout(group: dist.ProcessGroup | None = None) -> datetime.timedelta | None:
    """The collective timeout ``group``'s backend runs with (default: WORLD), as set at creation
    or by ``_set_pg_timeout``; None for a backend that has none (the ``fake`` placeholders).
    Read from the backend's options (``Backend.options._timeout``, torch 2.11 .. 2.15)."""
    group = group if group is not None else dist.group.WORLD
    if dist.get_backend(group) == "fake":
        return None
    for device in group._device_types:
        options = getattr(group._get_backend(device), "options", None)
        timeout = getattr(options, "_timeout", None)
        if timeout is not None:
            return timeout
    return None


def new_group(ranks: list[int], backend: str | None, desc: str, timeout: datetime.timedelta | None = None):
    if backend == "fake":
        register_fake_backend()
        timeout = None  # a placeholder has no communicator to time out
    return dist.new_group(
        ranks, backend=backend, timeout=timeout, use_local_synchronization=True, group_desc=f"mesh_{desc}"
    )


def host_group(desc: str, timeout: datetime.timedelta) -> dist.ProcessGroup:
    """A new gloo group over every rank of the job, for host-side work that runs beside training
    and whose collectives must never interleave with training's (a background checkpoint write
    and its completion checks, trainer/checkpoint/async_save.py; the ranks' agreement to stop
    on an NCCL job, trainer/runtime/stop.py). Collective: every rank calls it
    in the same order. Not one of the mesh's groups: never shared, not counted by ParallelDims."""
    return dist.new_group(backend="gloo", timeout=timeout, group_desc=desc)
