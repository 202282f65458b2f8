"""Record every collective a piece of code issues on this rank: kind, mesh, count and bytes.

    with record_comms(parallel_dims) as rec:
        trainer.train_step(batch)
    rec.summary()  # {("all_gather", "fsdp"): {"count": 24, "bytes": 1572864}, ...}
    rec.calls()  # [{"kind": "all_gather", "mesh": "fsdp", "bytes": 65536, "count": 4}, ...]

Why it lives here: the layout layer owns the process groups, so it is the one place that can
say which named mesh (``fsdp``, ``tp``, ``loss``...) a process group stands for. It imports
nothing from the models or the trainer.

How it sees the collectives. Everything the framework issues goes through the dispatcher as
one of two op families, which a :class:`~torch.utils._python_dispatch.TorchDispatchMode` sees
(forward and backward; autograd carries the mode to its backward pass):

* ``c10d.*`` -- what ``torch.distributed``'s eager functions become (FSDP2's all-gather and
  reduce-scatter, HSDP's all-reduce, our loss / grad-norm / MoE-statistics all-reduces,
  pipeline send/recv);
* ``_c10d_functional.*`` -- the functional collectives (DTensor redistribution for TP/SP and
  loss parallel, CP's K/V all-gather, EP's token-count exchange and token all-to-all).

A functional collective runs its ``c10d`` work below the mode, so nothing is counted twice.
DTensor ops are let through (``NotImplemented``) so that DTensor desugars them into the
collectives the mode then sees. A collective on a size-1 group moves nothing and is skipped.

Bytes are what the call carries on this rank (the planner uses the same convention):
all-gather = output bytes; reduce-scatter = input bytes; all-reduce and broadcast = tensor
bytes; all-to-all = input bytes (``out_bytes`` holds the output's); send and recv
(``send_recv``, with ``direction``) = tensor bytes; gather / scatter / reduce = tensor bytes.

Which mesh. A group is mapped to the ParallelDims names that share it (one process group per
distinct rank set: with cp == 1, ``fsdp``, ``dp_shard`` and -- without replication -- ``batch``
and ``loss`` are one group). When several names share the group, the record names the role the
call played: an all-to-all is ``ep`` (or ``etp``), the only parallelism that exchanges tokens
that way; otherwise the innermost caller decides, by the module it belongs to (expert-parallel
-> ``ep``/``etp``, context-parallel -> ``cp``, pipelining -> ``pp``, tensor-parallel -> ``tp``)
or by a mesh it holds (FSDP2's parameter group carries its mesh, a DTensor its mesh, the
trainer's loss reduction its ``loss_mesh``); failing those, a fixed preference order (tp, cp,
ep, etp, fsdp, efsdp, dp_replicate, pp, loss, ...). ``aliases`` lists every name of the group.
The tests record eager models; a ``torch.compile``d fake-backend run recorded the same kinds by hand.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "CommRecord",
    "CommRecorder",
    "calls_by_size",
    "group_mesh_names",
    "record_comms",
    "summarize",
]

# preference when nothing on the call stack says which role a shared group played
_PREFERENCE = (
    "tp",
    "cp",
    "ep",
    "etp",
    "fsdp",
    "efsdp",
    "dp_replicate",
    "pp",
    "loss",
    "batch",
    "dp_shard",
    "world",
)

# the module that issued a collective, by file path suffix -> preferred names
_MODULE_ROLES = (
    (os.path.join("models", "parallel", "expert_parallel.py"), ("ep", "etp")),
    (os.path.join("models", "parallel", "context_parallel.py"), ("cp",)),
    (os.path.join("models", "parallel", "tensor_parallel.py"), ("tp",)),
    (os.path.join("distributed", "pipelining", ""), ("pp",)),
    (os.path.join("models", "parallel", "pipeline", ""), ("pp",)),
)


@dataclass
class CommRecord:
    kind: str  # all_gather, reduce_scatter, all_reduce, all_to_all, broadcast, send_recv, ...
    mesh: str  # the ParallelDims name of the role (see the module docstring)
    group_size: int
    bytes: int  # the convention of the module docstring
    dtype: str
    op: str  # the dispatcher op, e.g. "c10d._allgather_base_"
    out_bytes: int | None = None  # all_to_all: output bytes
    direction: str | None = None  # send_recv: "send" or "recv"
    aliases: list[str] = field(default_factory=list)  # every ParallelDims name of the group


def _nbytes(t: Any) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return 0


def _first_tensor(t: Any) -> torch.Tensor | None:
    if isinstance(t, torch.Tensor):
        return t
    if isinstance(t, (list, tuple)):
        for x in t:
            found = _first_tensor(x)
            if found is not None:
                return found
    return None


# op name -> (kind, argument carrying the bytes, "in"/"out"/"both"); c10d ops name their
# process group "process_group", functional ones "group_name"
_C10D = {
    "_allgather_base_": ("all_gather", "output_tensor"),
    "allgather_": ("all_gather", "output_tensors"),
    "allgather_into_tensor_coalesced_": ("all_gather", "outputs"),
    "_reduce_scatter_base_": ("reduce_scatter", "input_tensor"),
    "reduce_scatter_": ("reduce_scatter", "input_tensors"),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", "inputs"),
    "allreduce_": ("all_reduce", "tensors"),
    "allreduce_coalesced_": ("all_reduce", "tensors"),
    "alltoall_base_": ("all_to_all", "input"),
    "alltoall_": ("all_to_all", "input_tensors"),
    "broadcast_": ("broadcast", "tensors"),
    "send": ("send_recv", "tensors"),
    "recv_": ("send_recv", "tensors"),
    "recv_any_source_": ("send_recv", "tensors"),
    "gather_": ("gather", "input_tensors"),
    "scatter_": ("scatter", "output_tensors"),
    "reduce_": ("reduce", "tensors"),
}
_FUNCTIONAL = {
    "all_gather_into_tensor": ("all_gather", "@out"),
    "all_gather_into_tensor_out": ("all_gather", "@out"),
    "all_gather_into_tensor_coalesced": ("all_gather", "@out"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "reduce_scatter_tensor_out": ("reduce_scatter", "input"),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", "inputs"),
    "all_reduce": ("all_reduce", "input"),
    "all_reduce_": ("all_reduce", "input"),
    "all_reduce_coalesced": ("all_reduce", "inputs"),
    "all_reduce_coalesced_": ("all_reduce", "inputs"),
    "all_to_all_single": ("all_to_all", "input"),
    "broadcast": ("broadcast", "input"),
    "broadcast_": ("broadcast", "input"),
}


def _op_spec(func) -> tuple[str, str, str] | None:
    """(family, kind, byte argument) of a collective op overload, or None."""
    packet = getattr(func, "_overloadpacket", None)
    if packet is None:
        return None
    ns, _, name = str(packet).rpartition(".")  # e.g. "c10d.allreduce_"
    if ns == "c10d" and name in _C10D:
        return ("c10d", *_C10D[name])
    if ns == "_c10d_functional" and name in _FUNCTIONAL:
        return ("_c10d_functional", *_FUNCTIONAL[name])
    return None


def _group_name(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, torch.ScriptObject):  # a c10d op's process group argument
        try:
            value = dist.ProcessGroup.unbox(value)
        except Exception:
            return None
    name = getattr(value, "group_name", None)
    return name if isinstance(name, str) else None


def group_mesh_names(parallel_dims) -> dict[str, list[str]]:
    """Process-group name -> the ParallelDims mesh names (built 1-D meshes, flattened ones
    included) whose group it is, in the layout's order."""
    out: dict[str, list[str]] = {}
    meshes = getattr(parallel_dims, "_meshes", {})
    for name, mesh in meshes.items():
        if "/" in name or mesh.ndim != 1:
            continue
        names = getattr(mesh, "_dim_group_names", None)
        if not names:
            continue
        out.setdefault(names[0], [])
        if name not in out[names[0]]:
            out[names[0]].append(name)
    return out


def _meshes_of(value: Any) -> Iterator[Any]:
    """DeviceMeshes a local variable stands for: a mesh, a DTensor's or a DTensor spec's mesh,
    an FSDP2 parameter group's mesh."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    if isinstance(value, DeviceMesh):
        yield value
        return
    if isinstance(value, DTensor):
        yield value.device_mesh
        return
    module = type(value).__module__ or ""
    if not module.startswith("torch.distributed"):
        return
    found = []
    try:  # plain attributes of torch's own objects; a property that fails is no mesh
        found = [getattr(value, attr, None) for attr in ("mesh", "device_mesh")]
        found.append(getattr(getattr(value, "mesh_info", None), "mesh", None))  # FSDPParamGroup, FSDPParam
    except Exception:
        pass
    yield from (m for m in found if isinstance(m, DeviceMesh))


def _role_from_stack(candidates: list[str], frame) -> str | None:
    """The innermost caller that tells which of ``candidates`` (names sharing one group) the
    collective was issued for: a mesh among its locals, or the module it belongs to."""
    while frame is not None:
        path = frame.f_code.co_filename
        for suffix, names in _MODULE_ROLES:
            if (os.sep + suffix in path) if suffix.endswith(os.sep) else path.endswith(os.sep + suffix):
                hit = [n for n in names if n in candidates]
                if hit:
                    return hit[0]
        if path != __file__:
            try:
                values = list(frame.f_locals.values())
            except Exception:  # pragma: no cover - exotic frames
                values = []
            for value in values:
                for mesh in _meshes_of(value):
                    dims = mesh.mesh_dim_names or ()
                    hit = [n for n in dims if n in candidates]
                    if hit:
                        return hit[-1]
        frame = frame.f_back
    return None


class CommRecorder(TorchDispatchMode):
    """A dispatch mode that appends a :class:`CommRecord` for every collective it sees.

    ``parallel_dims``: a built :class:`~parallel_dims.ParallelDims`, to name groups by mesh
    (without it: ``world`` for the default group, else the group's description)."""

    def __init__(self, parallel_dims=None) -> None:
        super().__init__()
        self.records: list[CommRecord] = []
        self._names = group_mesh_names(parallel_dims) if parallel_dims is not None else {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor turn it into the collectives we then see
        out = func(*args, **kwargs)
        spec = _op_spec(func)
        if spec is not None:
            self._record(func, spec, args, kwargs, out)
        return out

    def _record(self, func, spec, args, kwargs, out) -> None:
        family, kind, byte_arg = spec
        schema = func._schema
        bound = {a.name: v for a, v in zip(schema.arguments, args)}
        bound.update(kwargs)
        group_value = bound.get("process_group" if family == "c10d" else "group_name")
        group_name = _group_name(group_value)
        group = None
        if group_name is not None:
            try:
                group = dist.distributed_c10d._resolve_process_group(group_name)
            except Exception:
                group = None
        size = dist.get_world_size(group) if group is not None else int(bound.get("group_size", 0) or 0)
        if size == 1:
            return  # a size-1 group moves nothing
        if byte_arg == "@out":
            data = out
        else:
            data = bound[byte_arg]
        nbytes = _nbytes(data)
        first = _first_tensor(data)
        name = str(func._overloadpacket)
        record = CommRecord(
            kind=kind,
            mesh="",
            group_size=size,
            bytes=nbytes,
            dtype=str(first.dtype).replace("torch.", "") if first is not None else "",
            op=name,
        )
        if kind == "all_to_all":
            record.out_bytes = _nbytes(
                out if family == "_c10d_functional" else bound.get("output", bound.get("output_tensors"))
            )
        if kind == "send_recv":
            record.direction = "send" if name.endswith(".send") else "recv"
        candidates = list(self._names.get(group_name, [])) if group_name else []
        record.aliases = candidates
        record.mesh = self._mesh_name(kind, group, group_name, candidates)
        self.records.append(record)

    def _mesh_name(self, kind: str, group, group_name: str | None, candidates: list[str]) -> str:
        if len(candidates) == 1:
            return candidates[0]
        if candidates:
            # only EP (and ETP's uneven all-gather) exchange tokens all-to-all; in backward no
            # Python frame of theirs is on the stack, so the kind decides
            if kind == "all_to_all":
                for name in ("ep", "etp"):
                    if name in candidates:
                        return name
            role = _role_from_stack(candidates, sys._getframe())
            if role is not None:
                return role
            for name in _PREFERENCE:
                if name in candidates:
                    return name
            return candidates[0]
        if group is not None and group is dist.group.WORLD:
            return "world"
        desc = getattr(group, "group_desc", "") or ""
        if desc.startswith("mesh_"):
            return desc[len("mesh_") :]
        return desc or (group_name or "unknown")

    # ------------------------------------------------------------------ results
    def summary(self) -> dict[tuple[str, str], dict[str, int]]:
        """(kind, mesh) -> {"count", "bytes"} over the records so far."""
        return summarize(self.records)

    def calls(self) -> list[dict[str, Any]]:
        """One entry per distinct (kind, mesh, bytes of one call) with its count: the layout
        planner's record convention (tools/planner/collectives.py)."""
        return calls_by_size(self.records)

    def to_json(self) -> dict[str, Any]:
        return {
            "records": [asdict(r) for r in self.records],
            "summary": [{"kind": k, "mesh": m, **v} for (k, m), v in sorted(self.summary().items())],
            "calls": self.calls(),
        }


def summarize(records: list[CommRecord]) -> dict[tuple[str, str], dict[str, int]]:
    out: dict[tuple[str, str], dict[str, int]] = {}
    for r in records:
        entry = out.setdefault((r.kind, r.mesh), {"count": 0, "bytes": 0})
        entry["count"] += 1
        entry["bytes"] += r.bytes
    return out


def calls_by_size(records: list[CommRecord]) -> list[dict[str, Any]]:
    """[{"kind", "mesh", "bytes", "count"}] per distinct (kind, mesh, bytes), sorted."""
    counts: dict[tuple[str, str, int], int] = {}
    for r in records:
        key = (r.kind, r.mesh, r.bytes)
        counts[key] = counts.get(key, 0) + 1
    return [{"kind": k, "mesh": m, "bytes": b, "count": c} for (k, m, b), c in sorted(counts.items())]


@contextlib.contextmanager
def record_comms(parallel_dims=None) -> Iterator[CommRecorder]:
    """Record the collectives issued inside the block (this rank, this thread and the autograd
    work it starts); yields the :class:`CommRecorder` (``.records``, ``.summary()``)."""
    recorder = CommRecorder(parallel_dims)
    with recorder:
        yield recorder
