"""ParallelDims: degrees -> one world DeviceMesh -> named dense and sparse meshes.

The names, ``get_mesh`` / ``get_optional_mesh`` and the ``*_enabled`` properties follow
torchtitan's ParallelDims, and every name both define gets the same rank groups. What differs is
how the meshes come to be:

* Every named axis is a view of ONE world mesh ``("world",)``. Its layout comes from the pure
  :class:`~parallel_dims.layout.RankLayout`, so the groups are known before any process group
  exists and are checked against it after building.
* One process group per distinct rank set. pp and dp_replicate are the same groups in the dense
  and sparse views, etp is the tp group when ``etp == tp``, a derived mesh equal to an axis (e.g.
  ``fsdp`` when cp == 1 equals ``dp_shard``) reuses that axis' group, and an axis that spans the
  whole world reuses the default group. Each rank only creates the groups it belongs to
  (``use_local_synchronization``), so building is O(axes) per rank, not O(world).
* A size-1 axis gets a placeholder group on the ``fake`` backend: no communicator, no memory.
* One name registry. Our meshes are registered in the root mesh's flatten namespace, so a later
  ``_flatten`` that reuses a name with other ranks fails loudly instead of shadowing a group,
  and :meth:`ParallelDims.flatten` refuses clashes with a clear error.

Two mesh builders (``layout``, ``portable``: :mod:`parallel_dims.builders`) make the same mesh
objects from the same process groups (:mod:`parallel_dims.process_groups`); the torch-private
workarounds the portable one needs are in :mod:`parallel_dims.torch_compat`.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .axes import DEGREE_NAMES
from .builders import (
    PORTABLE_VIEWS,
    coalesce_modes,
    flat_group,
    layout_view,
    resolve_mesh_builder,
)
from .layout import (
    ALL_NAMES,
    COMPOSITE_MESHES,
    DENSE_AXES,
    ONE_D_AXES,
    SPARSE_AXES,
    Degrees,
    RankLayout,
    validate_degrees,
)
from .process_groups import default_device_type, new_group, process_group_timeout, register_fake_backend
from .torch_compat import as_flattened, unflatten_without_groups
from .torchtitan_compat import TorchtitanCompat

__all__ = ["ParallelDims"]


class ParallelDims(TorchtitanCompat):
    """Parallelism degrees and, once built, the meshes for each role.

    ``ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=2, pp=1, ep=1, etp=1, world_size=8)``:
    one keyword per axis of :data:`parallel_dims.axes.AXES` (omitted ones take the table's
    default: 1, and -1 for dp_shard), or positionally in that order followed by ``world_size``
    (torchtitan's order). ``dp_shard=-1`` infers the degree from the world size. Validation
    happens on construction, before any process group exists. ``mesh_builder`` (``"auto"``,
    ``"layout"`` or ``"portable"``; None reads ``$MESHTRAIN_MESH_BUILDER``, default auto) is
    resolved on construction too: afterwards it names the builder that :meth:`build_mesh` uses.
    """

    def __init__(self, *positional: int, mesh_builder: str | None = None, **named: int) -> None:
        names = DEGREE_NAMES + ("world_size",)
        if len(positional) > len(names):
            raise TypeError(f"ParallelDims takes at most {len(names)} positional degrees: {', '.join(names)}")
        given = dict(zip(names, positional))
        twice = sorted(given.keys() & named.keys())
        if twice:
            raise TypeError(f"ParallelDims got {twice} both positionally and by name")
        given.update(named)
        if "world_size" not in given:
            raise TypeError("ParallelDims needs world_size (the number of processes)")
        degrees = validate_degrees(**given)
        for name, value in degrees.as_dict().items():
            setattr(self, name, value)
        self.mesh_builder = resolve_mesh_builder(mesh_builder)
        self.degrees: Degrees = degrees
        self.layout = RankLayout(degrees)
        self._meshes: dict[str, DeviceMesh] = {}
        self._world_mesh: DeviceMesh | None = None
        self._group_by_rank_set: dict[tuple[int, ...], str] = {}
        self._flat_names: dict[str, tuple[str, ...]] = {}
        self.groups_created = 0  # real communicators this object created on this rank
        self._group_timeout: datetime.timedelta | None = None  # set by build_mesh
        self._embedding_mesh: DeviceMesh | None = None  # pp > 2 with tied embeddings, on first use
        self.placeholder_groups_created = 0  # size-1 axes: fake-backend groups, no communicator

    def __repr__(self) -> str:
        degrees = ", ".join(f"{k}={v}" for k, v in self.degrees.as_dict().items())
        return f"ParallelDims({degrees}, mesh_builder={self.mesh_builder!r})"

    # ------------------------------------------------------------------ building
    def build_mesh(
        self,
        device_type: str | None = None,
        backend_override: dict[str, str] | None = None,
        timeout: datetime.timedelta | None = None,
    ) -> DeviceMesh:
        """Build the world mesh and every named mesh; return the world mesh.

        ``backend_override`` maps axis names to a backend for their groups (e.g. ``"fake"`` for
        a dry run of one axis). Needs an initialized default process group of ``world_size``.
        ``timeout``: the collective timeout of every group this creates (and of later
        :meth:`flatten` groups); None = the default group's, so the whole mesh runs with the
        timeout the job gave ``init_process_group`` (torch's ``new_group`` would otherwise give
        each subgroup the backend's default, 10 min on NCCL, 30 min on gloo).
        """
        if self._world_mesh is not None:
            return self._world_mesh
        if not dist.is_initialized():
            raise RuntimeError(
                "ParallelDims.build_mesh needs torch.distributed to be initialized: launch with "
                "torchrun (or call torch.distributed.init_process_group) first"
            )
        if dist.get_world_size() != self.world_size:
            raise ValueError(
                f"ParallelDims was configured for world_size={self.world_size} but the process "
                f"group has {dist.get_world_size()} ranks; launch with "
                f"--nproc_per_node/--nnodes that multiply to {self.world_size}"
            )
        overrides = dict(backend_override or {})
        unknown = set(overrides) - set(ONE_D_AXES)
        if unknown:
            raise ValueError(f"backend_override names unknown axes {sorted(unknown)}; valid: {ONE_D_AXES}")
        device_type = device_type or default_device_type()
        self._group_timeout = timeout if timeout is not None else process_group_timeout(dist.group.WORLD)
        world = init_device_mesh(device_type, (self.world_size,), mesh_dim_names=("world",))
        self._world_mesh = world
        self._meshes["world"] = world
        rank = dist.get_rank()
        group_names = {}
        for name in ONE_D_AXES[1:]:
            ranks = tuple(self.layout.group(name, rank))
            group_names[name] = self._group_for(ranks, overrides.get(name), name)
        if self.mesh_builder == "layout":
            for name in ONE_D_AXES[1:]:
                self._register(name, layout_view(world, name, group_names[name], self.layout.modes(name)))
        else:
            self._build_portable(group_names)
        self._verify()
        return world

    def _build_portable(self, group_names: dict[str, str]) -> None:
        """Every named 1-D mesh as a dimension of an unflattened view of the world mesh
        (``PORTABLE_VIEWS``), with our process groups; API present in torch 2.11 .. 2.15."""
        for parent, names in PORTABLE_VIEWS:
            view = unflatten_without_groups(
                self._meshes[parent],
                tuple(self.layout.size(n) for n in names),
                names,
                [group_names[n] for n in names],
            )
            if names in (DENSE_AXES, SPARSE_AXES):
                # the view is that composite mesh: get_mesh("dense") needs no _concatenate
                self._meshes["/".join(names)] = view
            for name in names:
                if name not in self._meshes:
                    self._register(name, as_flattened(view[name]))

    def _register(self, name: str, mesh: DeviceMesh) -> DeviceMesh:
        """Keep ``mesh`` under ``name`` and put it in the root mesh's flatten namespace."""
        from torch.distributed.distributed_c10d import _resolve_process_group

        world = self._world_mesh
        group_name = mesh._dim_group_names[0]
        world._pg_registry.setdefault(group_name, _resolve_process_group(group_name))
        world._flatten_mapping[name] = mesh  # one namespace with torch's own flattens
        self._meshes[name] = mesh
        return mesh

    def _group_for(self, ranks: tuple[int, ...], backend: str | None, name: str) -> str:
        """The process group name for a rank set, creating it only the first time it is seen."""
        key = ranks if len(ranks) > 1 else ("singleton",) + ranks
        existing = self._group_by_rank_set.get(key)
        if existing is not None:
            return existing
        if len(ranks) == self.world_size and backend is None:
            group = dist.group.WORLD
        elif len(ranks) == 1:
            group = new_group(list(ranks), "fake", name)
            self.placeholder_groups_created += 1
        else:
            group = new_group(list(ranks), backend, name, self._group_timeout)
            self.groups_created += 1
        self._group_by_rank_set[key] = group.group_name
        return group.group_name

    def _verify(self) -> None:
        """Every built group must have exactly the ranks the layout layer says."""
        rank = dist.get_rank()
        for name in ONE_D_AXES:
            got = self._meshes[name].mesh.tolist()
            want = self.layout.group(name, rank)
            if got != want:
                raise AssertionError(f"mesh {name!r} on rank {rank} has ranks {got}, layout says {want}")
        for name in COMPOSITE_MESHES:
            got = self._mesh_nd(COMPOSITE_MESHES[name]).mesh
            want = torch.as_tensor(self.layout.mesh_of(name, rank), dtype=got.dtype)
            if not torch.equal(got, want):
                raise AssertionError(f"mesh {name!r} on rank {rank} disagrees with the layout")

    def _mesh_nd(self, names: tuple[str, ...]) -> DeviceMesh:
        key = "/".join(names)
        mesh = self._meshes.get(key)
        if mesh is None:
            self.layout.check_composable(names)
            mesh = DeviceMesh._concatenate([self._meshes[n] for n in names])
            self._meshes[key] = mesh
        return mesh

    def flatten(self, names: Iterable[str], new_name: str) -> DeviceMesh:
        """A 1-D mesh over the product of ``names`` (e.g. a user's ``dp_cp``), registered under
        ``new_name``. Reuses the group of an existing axis with the same ranks. Refuses a name
        that already means something else."""
        names = tuple(names)
        self._require_built()
        if new_name in ALL_NAMES or new_name in self._meshes:
            if self._flat_names.get(new_name) == names:
                return self._meshes[new_name]
            raise ValueError(
                f"cannot name a flattened mesh {new_name!r}: that name already denotes another "
                f"mesh; names in use: {sorted(set(ALL_NAMES) | set(self._flat_names))}"
            )
        self.layout.check_composable(names)
        axes = self.layout.expand(names)
        modes = [m for n in axes for m in self.layout.modes(n)]
        ranks = tuple(flat_group(modes, dist.get_rank()))
        group_name = self._group_for(ranks, None, new_name)
        if self.mesh_builder == "layout":
            mesh = self._register(new_name, layout_view(self._world_mesh, new_name, group_name, modes))
        else:
            mesh = self._portable_flat_mesh(new_name, axes, modes, group_name)
        self._flat_names[new_name] = names
        return mesh

    def _portable_flat_mesh(self, new_name, axes, modes, group_name: str) -> DeviceMesh:
        merged = coalesce_modes(modes)
        if len(merged) == 1:
            # one stride in rank space: a dimension of a row-major view, like fsdp or loss
            ((size, stride),) = merged
            view = unflatten_without_groups(
                self._world_mesh,
                (self.world_size // (size * stride), size, stride),
                (f"{new_name}.outer", new_name, f"{new_name}.inner"),
                [group_name] * 3,  # the view is dropped; only its middle dimension is kept
            )
            return self._register(new_name, as_flattened(view[new_name]))
        # Several strides (e.g. dp_replicate x cp with dp_shard > 1): without the layout
        # constructor only torch's _flatten makes such a 1-D mesh, and it always creates a
        # group per subgroup. Ask it for placeholders (fake backend, no communicator), then
        # give the mesh our group.
        register_fake_backend()
        mesh = self._mesh_nd(axes)._flatten(new_name, backend_override="fake")
        self.placeholder_groups_created += 1
        mesh._dim_group_names = [group_name]
        return self._register(new_name, mesh)

    # ------------------------------------------------------------------ lookup
    def _require_built(self) -> None:
        if self._world_mesh is None:
            self.build_mesh()

    def _exists(self, name: str) -> bool:
        if name in ("world",) or name in COMPOSITE_MESHES:
            return True
        if name == "efsdp":
            # As in torchtitan: efsdp is the experts' FSDP axis only when EP is on, and then
            # even at size 1 (experts are always FSDP-wrapped for mixed precision). Without
            # EP, experts are ordinary parameters on the dense fsdp mesh.
            return self.ep > 1
        if name in self._flat_names:
            return self._meshes[name].size() > 1
        return self.layout.size(name) > 1

    def get_optional_mesh(self, dims: str | list[str] | tuple[str, ...]) -> DeviceMesh | None:
        """The mesh over ``dims`` (one name or several, outer to inner), or None when any of
        them is disabled (size 1)."""
        names = (dims,) if isinstance(dims, str) else tuple(dims)
        valid = set(ALL_NAMES) | set(self._flat_names)
        for n in names:
            if n not in valid:
                raise ValueError(f"Invalid mesh dim: {n!r}. Valid names are: {sorted(valid)}")
        self._require_built()
        if not all(self._exists(n) for n in names):
            return None
        if len(names) == 1 and names[0] not in COMPOSITE_MESHES:
            return self._meshes[names[0]]
        axes = tuple(a for n in names for a in (COMPOSITE_MESHES.get(n, (n,))))
        return self._mesh_nd(axes)

    def embedding_mesh(self) -> DeviceMesh | None:
        """Megatron's embedding group: the ranks holding the first and the last pipeline stage
        at the same other coordinates, over which the two copies of a tied embedding/head weight
        sum their gradients (models/parallel/pipeline/tied.py). None without pipelining, and on
        a pp rank that is neither end. Every schedule puts stage 0 on pp rank 0 and the last
        stage on pp rank pp-1 (looped schedules: stage s on rank s % pp) or on rank 0 (V
        schedules, where rank 0 holds both ends and needs no group): the group is pp ranks
        {0, pp-1}. With pp=2 it is the pp mesh; with pp > 2 a 2-rank group made on first use by
        its two members only (collective over them)."""
        if self.pp < 2:
            return None
        if self.pp == 2:
            return self.get_mesh("pp")
        self._require_built()
        coordinate = self.coordinate("pp")
        if coordinate not in (0, self.pp - 1):
            return None
        if self._embedding_mesh is None:
            from torch.distributed.distributed_c10d import _resolve_process_group

            pp_ranks = self.layout.group("pp", dist.get_rank())
            ends = (pp_ranks[0], pp_ranks[-1])
            group_name = self._group_for(ends, None, "embedding")
            self._embedding_mesh = DeviceMesh.from_group(
                _resolve_process_group(group_name),
                self._world_mesh.device_type,
                mesh=list(ends),
                mesh_dim_names=("embedding",),
            )
        return self._embedding_mesh

    def get_mesh(self, dims: str | list[str] | tuple[str, ...]) -> DeviceMesh:
        """Like :meth:`get_optional_mesh`, but a disabled axis is an error."""
        mesh = self.get_optional_mesh(dims)
        if mesh is None:
            names = [dims] if isinstance(dims, str) else list(dims)
            off = [f"{n} (size {self.layout.size(n)})" for n in names if not self._exists(n)]
            raise ValueError(
                f"Mesh {dims!r} is not available: {', '.join(off)} disabled. Enable the axis "
                f"(degree > 1) or use get_optional_mesh, which returns None for it."
            )
        return mesh

    def get_all_one_dimensional_meshes(self) -> dict[str, DeviceMesh]:
        """Enabled (size > 1) 1-D meshes by name, world excluded."""
        self._require_built()
        return {n: self._meshes[n] for n in ONE_D_AXES[1:] if self.layout.size(n) > 1}

    # -- meshes by role (docs/design.md section 3): each consumer asks for its mesh, never ranks --
    @property
    def dense_fsdp_mesh(self) -> DeviceMesh | None:
        """FSDP2 mesh for dense params: ``[dp_replicate, fsdp]`` (HSDP; also DDP-like when
        fsdp is 1), ``fsdp``, or None without data parallelism."""
        return self._dp_mesh("fsdp")

    @property
    def expert_fsdp_mesh(self) -> DeviceMesh | None:
        """FSDP2 mesh for routed-expert params: ``[dp_replicate, efsdp]`` or ``efsdp``. efsdp
        folds tp in when etp == 1, so expert grads are summed over every rank that holds the
        same expert shard."""
        return self._dp_mesh("efsdp")

    def fsdp_mesh_for(self, params: str = "dense", *, allow_trivial: bool = False) -> DeviceMesh | None:
        """The FSDP2 mesh for ``params`` (``"dense"`` or ``"expert"``): what
        :attr:`dense_fsdp_mesh` / :attr:`expert_fsdp_mesh` return, except that with
        ``allow_trivial`` a layout without data parallelism for those params gets the size-1
        shard mesh instead of None. On a size-1 mesh FSDP2 never communicates (its group is a
        placeholder); it only casts parameters to the compute dtype and gradients back, which
        is how mixed precision takes effect on pipeline stages and EP without data parallelism (one
        GPU and pure TP use compute copies, models/parallel/mixed_precision.py)."""
        if params not in ("dense", "expert"):
            raise ValueError(f"fsdp_mesh_for(params={params!r}); legal values: 'dense', 'expert'")
        shard_axis = "fsdp" if params == "dense" else "efsdp"
        mesh = self._dp_mesh(shard_axis)
        if mesh is None and allow_trivial:
            mesh = self._meshes[shard_axis]
        return mesh

    def _dp_mesh(self, shard_axis: str) -> DeviceMesh | None:
        self._require_built()
        if self.dp_replicate > 1:
            return self._mesh_nd(("dp_replicate", shard_axis))
        if self.layout.size(shard_axis) > 1 or (shard_axis == "efsdp" and self.ep > 1):
            # experts under EP are FSDP-wrapped even on a size-1 efsdp (as in torchtitan):
            # their parameters must not fall into the dense wrapping of their block
            return self._meshes[shard_axis]
        return None

    @property
    def expert_parallel_meshes(self) -> tuple[DeviceMesh, DeviceMesh | None]:
        """(ep mesh, etp mesh or None) for token dispatch; the ep mesh may have size 1 when
        only expert TP is on."""
        self._require_built()
        return self._meshes["ep"], (self._meshes["etp"] if self.etp > 1 else None)

    def coordinate(self, name: str, rank: int | None = None) -> int:
        """This rank's index on the 1-D mesh ``name`` (e.g. ``batch``: which slice of the
        global batch it reads; ``cp``: which sequence chunks it holds)."""
        return self.layout.coordinate(name, dist.get_rank() if rank is None else rank)

    def size(self, name: str) -> int:
        """Degree of the 1-D mesh ``name`` (1 when disabled)."""
        return self.layout.size(name)

    @property
    def world_mesh(self) -> DeviceMesh:
        self._require_built()
        return self._world_mesh

    def process_group_count(self) -> dict[str, int]:
        """Groups this rank holds: real communicators created, placeholders, and the total of
        distinct real rank sets (the default group included when an axis spans the world)."""
        return {
            "created": self.groups_created,
            "placeholder": self.placeholder_groups_created,
            "distinct_real_rank_sets": self.layout.rank_sets_per_rank(),
        }
