"""Rank layout as plain data: which ranks form each group of each named mesh.

This module knows nothing about torch.distributed. Given the degrees, it answers "which ranks
share my tp group?" or "what are all the ep groups?" for any world size, as integers. The
runtime (:mod:`parallel_dims.parallel_dims`), the describe CLI, the dry run and the tests all read
the same answers from here, and after the real DeviceMeshes exist their groups are checked
against it.

Every named 1-D axis is a list of *modes* ``(size, stride)`` in world-rank space, outer mode
first. A rank's group on that axis is ``base + sum(i_k * stride_k)`` over all index tuples, where
``base`` is the rank with its coordinates on those modes set to zero. Rank order, innermost
first: tp, cp, dp_shard, dp_replicate, pp. The sparse (MoE) view re-factors the same
``dp_shard * cp * tp`` block as ``efsdp * ep * etp``.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import make_dataclass
from functools import cached_property

import numpy as np

from .axes import DEFAULT_DEGREES, DEGREE_NAMES

DENSE_AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
SPARSE_AXES = ("pp", "dp_replicate", "efsdp", "ep", "etp")
# Flattened meshes, each the product of dense axes (outer -> inner).
DERIVED_AXES = {
    "fsdp": ("dp_shard", "cp"),
    "batch": ("dp_replicate", "dp_shard"),
    "loss": ("dp_replicate", "dp_shard", "cp"),
}
# Multi-dimensional meshes that have a name of their own.
COMPOSITE_MESHES = {"dense": DENSE_AXES, "sparse": SPARSE_AXES}
ONE_D_AXES = ("world",) + DENSE_AXES + ("efsdp", "ep", "etp") + tuple(DERIVED_AXES)
ALL_NAMES = ONE_D_AXES + tuple(COMPOSITE_MESHES)


Mode = tuple[int, int]  # (size, stride) in world-rank space


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _fmt_values(values: list[int], limit: int = 24) -> str:
    if len(values) <= limit:
        return ", ".join(map(str, values))
    head = ", ".join(map(str, values[: limit - 3]))
    return f"{head}, ... , {values[-1]} ({len(values)} values)"


def _check_int(name: str, value, allow_infer: bool = False) -> int:
    hint = " (dp_shard may also be -1 to infer it)" if allow_infer else ""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise ValueError(f"{name}={value!r} is not an integer; parallelism degrees are integers >= 1{hint}")
    value = int(value)
    if allow_infer and value == -1:
        return value
    if value < 1:
        if value < 0 and not allow_infer:
            raise ValueError(
                f"{name}={value} is invalid: degrees must be integers >= 1; only dp_shard may be "
                f"-1 (inferred), so at most one axis is inferred"
            )
        raise ValueError(f"{name}={value} is invalid: degrees must be integers >= 1{hint}")
    return value


def _efsdp(self) -> int:
    return self.dp_shard * self.cp * self.tp // (self.ep * self.etp)


def _as_dict(self) -> dict[str, int]:
    return {n: getattr(self, n) for n in DEGREE_NAMES + ("world_size",)}


# Validated degrees, one field per axis of parallel_dims/axes.py plus world_size; ``dp_shard`` is
# always resolved (never -1 here).
Degrees = make_dataclass(
    "Degrees",
    [(name, int) for name in DEGREE_NAMES] + [("world_size", int)],
    frozen=True,
    namespace={
        "__doc__": "Validated degrees (one field per axis in parallel_dims/axes.py, and world_size).",
        "__module__": __name__,
        "efsdp": property(_efsdp, doc="The experts' FSDP degree: dp_shard*cp*tp / (ep*etp)."),
        "as_dict": _as_dict,
    },
)


def validate_degrees(*, world_size: int, **degrees: int) -> Degrees:
    """Check the degrees against every layout rule and resolve ``dp_shard=-1``.

    Raises ``ValueError`` naming the degrees, the rule and the legal values, and ending with a
    change of degrees that makes the whole layout valid (``a valid choice: change tp 3 -> 2``).
    Runs before any process group exists, so a bad config fails in milliseconds, not in a
    collective.
    """
    unknown = sorted(set(degrees) - set(DEGREE_NAMES))
    if unknown:
        raise ValueError(f"unknown degree(s) {unknown}; the degrees are: {', '.join(DEGREE_NAMES)}")
    given = {**DEFAULT_DEGREES, **degrees}
    try:
        return _validate_degrees(world_size=world_size, **given)
    except ValueError as exc:
        raise ValueError(f"{exc}; {_repair_message(given, world_size)}") from None


def _as_degree(value, allow_infer: bool = False) -> int | None:
    """``value`` as a usable degree (an integer written as a string counts), or None."""
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    try:
        value = _check_int("degree", value, allow_infer=allow_infer)
    except ValueError:
        return None
    return value


def _repair_message(given: dict, world_size) -> str:
    """A small change of degrees that makes the layout valid for ``world_size``: each degree
    becomes the largest legal value not above the one given (tp first, then cp, pp,
    dp_replicate, each dividing what the previous left of the world; dp_shard takes the rest
    unless inferred; etp 1 unless it equals tp; then ep). Unusable values count as 1."""
    ws = _as_degree(world_size)
    if ws is None:
        return "world_size must be the number of processes launched (an integer >= 1)"
    new = {n: _as_degree(v) or 1 for n, v in given.items() if n != "dp_shard"}
    remaining = ws
    for name in ("tp", "cp", "pp", "dp_replicate"):
        new[name] = max(d for d in _divisors(remaining) if d <= new[name])
        remaining //= new[name]
    shard = _as_degree(given["dp_shard"], allow_infer=True)
    new["dp_shard"] = -1 if shard == -1 else remaining
    if new["etp"] not in (1, new["tp"]):
        new["etp"] = 1
    block = remaining * new["cp"] * new["tp"]
    new["ep"] = max(d for d in _divisors(block) if d <= new["ep"] and block % (d * new["etp"]) == 0)
    changes = [
        f"{name} {given[name]!r} -> {new[name]}"
        for name in DEGREE_NAMES
        if not (isinstance(given[name], int) and not isinstance(given[name], bool) and given[name] == new[name])
    ]
    return f"a valid choice for world_size={ws}: change {', '.join(changes)}"


def _validate_degrees(*, dp_replicate, dp_shard, cp, tp, pp, ep, etp, world_size) -> Degrees:
    world_size = _check_int("world_size", world_size)
    fixed = {
        "dp_replicate": _check_int("dp_replicate", dp_replicate),
        "cp": _check_int("cp", cp),
        "tp": _check_int("tp", tp),
        "pp": _check_int("pp", pp),
    }
    dp_shard = _check_int("dp_shard", dp_shard, allow_infer=True)
    ep = _check_int("ep", ep)
    etp = _check_int("etp", etp)

    legal = _fmt_values(_divisors(world_size))
    for name, value in fixed.items():
        if world_size % value:
            raise ValueError(f"{name}={value} does not divide world_size={world_size}; legal {name} values: {legal}")
    others = math.prod(fixed.values())
    product_str = "*".join(f"{n}" for n in ("dp_replicate", "cp", "tp", "pp"))
    values_str = "*".join(str(fixed[n]) for n in ("dp_replicate", "cp", "tp", "pp"))
    if world_size % others:
        raise ValueError(
            f"{product_str} = {values_str} = {others} does not divide world_size={world_size}; "
            f"the degrees dp_replicate*dp_shard*cp*tp*pp must multiply to world_size"
        )
    if dp_shard == -1:
        dp_shard = world_size // others
    elif world_size % dp_shard:
        raise ValueError(
            f"dp_shard={dp_shard} does not divide world_size={world_size}; legal dp_shard "
            f"values: {legal}, or -1 to infer it"
        )
    if others * dp_shard != world_size:
        inferred = world_size // others
        raise ValueError(
            f"dp_replicate*dp_shard*cp*tp*pp = {fixed['dp_replicate']}*{dp_shard}*{fixed['cp']}*"
            f"{fixed['tp']}*{fixed['pp']} = {others * dp_shard} != world_size={world_size}; "
            f"the degrees must multiply to world_size: use dp_shard={inferred} or dp_shard=-1"
        )
    tp = fixed["tp"]
    if etp not in (1, tp):
        raise ValueError(
            f"etp={etp} is not supported with tp={tp}: expert tensor parallelism reuses the tp "
            f"groups, so etp must be 1 or tp; legal etp values: {_fmt_values(sorted({1, tp}))}"
        )
    block = dp_shard * fixed["cp"] * tp
    if block % (ep * etp):
        legal_ep = [d for d in _divisors(block) if (block // d) % etp == 0]
        raise ValueError(
            f"ep*etp = {ep}*{etp} = {ep * etp} does not divide dp_shard*cp*tp = {dp_shard}*"
            f"{fixed['cp']}*{tp} = {block}: experts fold over the dp_shard, cp and tp ranks; "
            f"legal ep values with etp={etp}: {_fmt_values(legal_ep)}"
        )
    return Degrees(
        dp_replicate=fixed["dp_replicate"],
        dp_shard=dp_shard,
        cp=fixed["cp"],
        tp=tp,
        pp=fixed["pp"],
        ep=ep,
        etp=etp,
        world_size=world_size,
    )


def _view_modes(sizes: tuple[int, ...]) -> list[Mode]:
    """Row-major (size, stride) modes of a view over the whole world."""
    modes, stride = [], 1
    for size in reversed(sizes):
        modes.append((size, stride))
        stride *= size
    return modes[::-1]


class RankLayout:
    """All rank groups of every named mesh, for one set of degrees. Pure integers."""

    def __init__(self, degrees: Degrees):
        self.degrees = degrees
        d = degrees
        dense = dict(zip(DENSE_AXES, _view_modes((d.pp, d.dp_replicate, d.dp_shard, d.cp, d.tp))))
        sparse = dict(zip(SPARSE_AXES, _view_modes((d.pp, d.dp_replicate, d.efsdp, d.ep, d.etp))))
        modes: dict[str, list[Mode]] = {"world": [(d.world_size, 1)]}
        modes.update({name: [mode] for name, mode in dense.items()})
        modes.update({name: [sparse[name]] for name in ("efsdp", "ep", "etp")})
        for name, parts in DERIVED_AXES.items():
            modes[name] = [dense[p] for p in parts]
        self._modes = modes

    # -- per-axis facts -------------------------------------------------------------------
    def modes(self, name: str) -> list[Mode]:
        """(size, stride) modes of a 1-D axis, outer first."""
        self._check_name(name, one_d=True)
        return list(self._modes[name])

    def size(self, name: str) -> int:
        if name in COMPOSITE_MESHES:
            return self.degrees.world_size
        return math.prod(s for s, _ in self.modes(name))

    def strides(self, name: str) -> tuple[int, ...]:
        """Rank strides of the axis' modes (one per mode, size-1 modes dropped)."""
        return tuple(st for s, st in self.modes(name) if s > 1) or (1,)

    def _offsets(self, name: str) -> np.ndarray:
        offsets = np.zeros(1, dtype=np.int64)
        for size, stride in self._modes[name]:
            offsets = (offsets[:, None] + np.arange(size, dtype=np.int64)[None, :] * stride).ravel()
        return offsets

    def _coord(self, name: str, ranks):
        """Index of ``ranks`` within their group on ``name`` (row-major over the modes)."""
        coord = 0
        for size, stride in self._modes[name]:
            coord = coord * size + (ranks // stride) % size
        return coord

    def coordinate(self, name: str, rank: int) -> int:
        self._check_rank(rank)
        self._check_name(name, one_d=True)
        return int(self._coord(name, rank))

    def group(self, name: str, rank: int) -> list[int]:
        """Ranks of ``rank``'s group on the 1-D axis ``name``, in mesh order."""
        self._check_rank(rank)
        self._check_name(name, one_d=True)
        base = rank - sum(((rank // st) % s) * st for s, st in self._modes[name])
        return (base + self._offsets(name)).tolist()

    def groups(self, name: str) -> np.ndarray:
        """All groups of a 1-D axis: int64 array ``[num_groups, group_size]``."""
        self._check_name(name, one_d=True)
        ranks = np.arange(self.degrees.world_size, dtype=np.int64)
        at_origin = np.ones_like(ranks, dtype=bool)
        for size, stride in self._modes[name]:
            at_origin &= (ranks // stride) % size == 0
        return ranks[at_origin][:, None] + self._offsets(name)[None, :]

    def mesh_of(self, names: tuple[str, ...] | list[str], rank: int) -> np.ndarray:
        """The n-D rank array (shape = sizes of ``names``) of the mesh through ``rank``."""
        self._check_rank(rank)
        names = self.expand(names)
        used = [m for n in names for m in self._modes[n]]
        base = rank - sum(((rank // st) % s) * st for s, st in used)
        grid = np.full((), base, dtype=np.int64)
        for n in names:
            axis = self._offsets(n)
            grid = grid[..., None] + axis.reshape((1,) * grid.ndim + (-1,))
        return grid

    def expand(self, names) -> tuple[str, ...]:
        """Resolve composite names ('dense', 'sparse') to their axes; check the names."""
        if isinstance(names, str):
            names = (names,)
        out: list[str] = []
        for n in names:
            self._check_name(n)
            out.extend(COMPOSITE_MESHES.get(n, (n,)))
        return tuple(out)

    def check_composable(self, names: tuple[str, ...]) -> None:
        """Raise unless ``names`` are distinct axes whose ranks do not overlap, outer to inner."""
        names = self.expand(names)
        if len(set(names)) != len(names):
            raise ValueError(f"mesh names {list(names)} repeat an axis")
        in_order = [st for n in names for s, st in self._modes[n] if s > 1]
        if any(a < b for a, b in zip(in_order, in_order[1:])):
            raise ValueError(
                f"axes {list(names)} must be listed outer to inner (rank order: pp, "
                f"dp_replicate, dp_shard/efsdp, cp/ep, tp/etp)"
            )
        used = sorted((st, s) for n in names for s, st in self._modes[n] if s > 1)
        # Modes of one mixed-radix rank numbering are disjoint iff, ordered by stride, each
        # starts at or beyond the span of the previous one.
        for (st0, s0), (st1, _) in zip(used, used[1:]):
            if st1 < st0 * s0:
                raise ValueError(f"axes {list(names)} overlap (share ranks) and cannot form one mesh")

    # -- whole-layout facts ----------------------------------------------------------------
    @cached_property
    def distinct_rank_sets(self) -> dict[str, str]:
        """For each 1-D axis, the first axis (in ONE_D_AXES order) with the same groups, or itself.

        Two axes with equal group partitions share one process group per rank set.
        """
        canonical: dict[str, str] = {}
        seen: dict[tuple, str] = {}
        for name in ONE_D_AXES:
            key = self._partition_key(name)
            canonical[name] = seen.setdefault(key, name)
        return canonical

    def _partition_key(self, name: str) -> tuple:
        # Two axes have the same groups iff their non-trivial modes generate the same offset set.
        size = self.size(name)
        if size == 1:
            return ("singleton",)
        return (size, tuple(sorted(self._offsets(name).tolist())))

    def rank_sets_per_rank(self) -> int:
        """Process groups with a real communicator that each rank joins (size > 1, distinct)."""
        return len({self.distinct_rank_sets[n] for n in ONE_D_AXES if self.size(n) > 1})

    def crosses_nodes(self, name: str, gpus_per_node: int) -> bool:
        """Whether any group of ``name`` spans more than one node of ``gpus_per_node`` ranks."""
        groups = self.groups(name)
        nodes = groups // gpus_per_node
        return bool((nodes.min(axis=1) != nodes.max(axis=1)).any())

    # -- checks -----------------------------------------------------------------------------
    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.degrees.world_size:
            raise ValueError(
                f"rank={rank} is outside world_size={self.degrees.world_size}; legal ranks: "
                f"0 .. {self.degrees.world_size - 1}"
            )

    def _check_name(self, name: str, one_d: bool = False) -> None:
        valid = ONE_D_AXES if one_d else ALL_NAMES
        if name not in valid:
            raise ValueError(f"unknown mesh name {name!r}; valid names: {', '.join(valid)}")
