"""The two mesh builders: which one runs, and the mesh objects each makes.

Both make the same mesh objects from the same process groups (:mod:`parallel_dims.parallel_dims`
creates the groups and registers the meshes):

* ``layout`` (torch >= 2.13): each named 1-D mesh is a view of the world mesh made directly from
  its (size, stride) modes with torch's ``_FlatLayout`` and the layout-based DeviceMesh
  constructor (:func:`layout_view`).
* ``portable`` (torch 2.11 .. 2.15): the world mesh from ``init_device_mesh`` is unflattened
  (``DeviceMesh._unflatten``, as torchtitan 0.2.2 does) into row-major views in which every
  named axis is one dimension (:data:`PORTABLE_VIEWS`) -- dense, sparse and (pp, loss, tp) from
  the world mesh, (dp_replicate, fsdp) and (batch, cp) from the loss mesh -- and each 1-D mesh
  is sliced out of its view (``mesh[name]``), so all of them share the world mesh as root. The
  views are made while the mesh being unflattened does not expose its process groups, so torch
  creates none: every group is still ours (deduplicated, placeholders for size-1 axes, created
  only by its members; :func:`parallel_dims.torch_compat.unflatten_without_groups`).

n-D meshes come from ``DeviceMesh._concatenate`` under both builders (the dense and sparse views
are those meshes under the portable one).

``auto`` (the default) picks ``layout`` where torch has it, else ``portable``; the environment
variable ``MESHTRAIN_MESH_BUILDER`` (or the ``mesh_builder`` argument) forces one. Supported
torch: see :mod:`parallel_dims._torch_support`.
"""

from __future__ import annotations

import functools
import inspect
import os

import torch
from torch.distributed.device_mesh import DeviceMesh

from .layout import DENSE_AXES, SPARSE_AXES

__all__ = [
    "MESH_BUILDERS",
    "MESH_BUILDER_ENV",
    "PORTABLE_VIEWS",
    "coalesce_modes",
    "flat_group",
    "layout_builder_available",
    "layout_view",
    "resolve_mesh_builder",
]

MESH_BUILDER_ENV = "MESHTRAIN_MESH_BUILDER"
MESH_BUILDERS = ("auto", "layout", "portable")

# The portable builder's views, (parent mesh, dimensions outer -> inner): each named 1-D axis is
# one dimension of the first view that lists it. fsdp, batch and loss have one stride each in
# rank space, so a row-major unflatten has them as single dimensions; fsdp and batch come from
# the (small) loss mesh, so only three views span the world (torch 2.11 checks every mesh it
# constructs by enumerating its ranks in Python).
PORTABLE_VIEWS = (
    ("world", DENSE_AXES),
    ("world", SPARSE_AXES),
    ("world", ("pp", "loss", "tp")),
    ("loss", ("dp_replicate", "fsdp")),
    ("loss", ("batch", "cp")),
)


@functools.cache
def layout_builder_available() -> bool:
    """Whether this torch has what the ``layout`` builder uses: ``_FlatLayout`` and the
    layout-based DeviceMesh constructor (torch >= 2.13)."""
    try:
        from torch.distributed._mesh_layout import _FlatLayout, _MeshLayout  # noqa: F401
    except ImportError:
        return False
    try:
        params = inspect.signature(DeviceMesh.__init__).parameters
    except (TypeError, ValueError):
        return False
    needed = ("_layout", "_rank_map", "_root_mesh", "_init_backend")
    return all(p in params for p in needed) and hasattr(DeviceMesh, "_concatenate")


def resolve_mesh_builder(requested: str | None = None) -> str:
    """``"layout"`` or ``"portable"``: ``requested`` if given, else ``$MESHTRAIN_MESH_BUILDER``;
    ``auto`` (the default, also for an empty value) picks ``layout`` where this torch has it.
    Raises ``ValueError`` for an unknown value, or for ``layout`` on a torch without it."""
    if requested is None:
        raw = os.environ.get(MESH_BUILDER_ENV, "")
        source = f"{MESH_BUILDER_ENV}={raw!r}"
    else:
        raw = requested
        source = f"mesh_builder={raw!r}"
    value = raw.strip().lower() if isinstance(raw, str) else None
    value = "auto" if value == "" else value
    if value not in MESH_BUILDERS:
        raise ValueError(
            f"{source} is not a mesh builder; legal values: auto (the default: layout where "
            f"this torch supports it, else portable), layout, portable"
        )
    if value == "auto":
        return "layout" if layout_builder_available() else "portable"
    if value == "layout" and not layout_builder_available():
        raise ValueError(
            f"{source} needs torch's layout-based DeviceMesh (torch.distributed._mesh_layout."
            f"_FlatLayout, torch >= 2.13), which torch {torch.__version__} lacks; use "
            f"{MESH_BUILDER_ENV}=portable or auto"
        )
    return value


def layout_view(world: DeviceMesh, name: str, group_name: str, modes) -> DeviceMesh:
    """The ``layout`` builder's 1-D mesh ``name``: a view of ``world`` with the (size, stride)
    ``modes`` in rank space, whose process group is ``group_name``."""
    from torch.distributed._mesh_layout import _FlatLayout, _MeshLayout

    layout = _MeshLayout([_FlatLayout(tuple(s for s, _ in modes), tuple(st for _, st in modes))])
    mesh = DeviceMesh(
        world.device_type,
        _layout=layout,
        _rank_map=world._rank_map,
        mesh_dim_names=(name,),
        _root_mesh=world,
        _init_backend=False,
    )
    mesh._dim_group_names = [group_name]
    return mesh


def flat_group(modes, rank: int) -> list[int]:
    """The ranks of ``rank``'s group on a 1-D mesh with the (size, stride) ``modes``."""
    base = rank - sum(((rank // st) % s) * st for s, st in modes)
    offsets = [0]
    for size, stride in modes:
        offsets = [o + i * stride for o in offsets for i in range(size)]
    return [base + o for o in offsets]


def coalesce_modes(modes) -> list[tuple[int, int]]:
    """Merge (size, stride) modes, outer first, that are contiguous in rank space; drop size 1."""
    out: list[tuple[int, int]] = []
    for size, stride in reversed([m for m in modes if m[0] > 1]):
        if out and stride == out[-1][0] * out[-1][1]:
            inner_size, inner_stride = out.pop()
            out.append((size * inner_size, inner_stride))
        else:
            out.append((size, stride))
    return out[::-1] or [(1, 1)]
