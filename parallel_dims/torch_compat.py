"""Every place meshtrain overrides or works around a torch-private API, in one module.

The lowest layer that needs one is ``parallel_dims`` (its portable mesh builder), so they all
live here; ``models/parallel/pipeline/stage.py`` mixes :class:`PipelineStageFixes` into its
stage class. :data:`OVERRIDES` is the table (checked by ``tests/unit/test_torch_compat.py``:
each override is applied exactly where it says, the torch API it touches exists on the
installed torch, and the version column agrees with what the installed torch does). Version
column: ``needed``; ``not needed`` (the torch code path is fixed or absent); ``not reached``
(torch no longer calls the overridden method for our stages); ``n/a`` (the feature needs a
newer torch, e.g. ``comm.mode = "fake_backend"`` needs >= 2.13); ``not checked`` (no torch
source of that version was read; 2.13.0 and 2.14.1 were read).

==========================  ===========================================  =====  =====  =====  =====  =====
override                    where applied                                2.11   2.12   2.13   2.14   2.15
==========================  ===========================================  =====  =====  =====  =====  =====
fsdp_submodule_reduce       models.parallel.pipeline.stage.CheckedStage  ?      ?      need   need   ?
p2p_warmup_self_send        models.parallel.pipeline.stage.CheckedStage  need*  ?      nr     nr     ?
fake_backend_vote           models.parallel.pipeline.stage.CheckedStage  n/a    n/a    need   nr     ?
fake_backend_recv_buffers   models.parallel.pipeline.stage.CheckedStage  n/a    n/a    need   need   ?
unflatten_without_groups    parallel_dims.parallel_dims                  ?      ?      need   need   ?
sliced_mesh_flat_layout     parallel_dims.parallel_dims                  need*  need*  no     no     ?
schedule_compute_order      tools.planner.schedule_order                 ?      ?      need   need   ?
local_tensor_fsdp_storage   trainer.simulation.local_tensor              n/a    ?      need   ?      need*
constant_result_marker      models.common.attention                      need   ?      need   ?      need
cpu_scaled_mm_emulation     models.parallel.float8                       ?      ?      need   ?      ?
cpu_flash_attention_pack    models.common.attention                      ?      ?      need   ?      ?
==========================  ===========================================  =====  =====  =====  =====  =====

(need = needed, nr = not reached, no = not needed, ? = not checked, * = from the project's runs
on that torch, not from its source.) What each one fixes is in its row of :data:`OVERRIDES` (the table itself: parallel_dims/torch_overrides.py).
One row's implementation has a module of its own for length, re-exported here:
``cpu_flash_attention_pack`` (parallel_dims/torch_compat_flash.py).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from .builders import MESH_BUILDER_ENV
from .torch_compat_flash import flash_attention_pack_fails, guard_cpu_flash_attention
from .torch_overrides import OVERRIDES, TORCH_VERSIONS, Override, render_table

__all__ = [
    "OVERRIDES",
    "TORCH_VERSIONS",
    "Override",
    "PipelineStageFixes",
    "as_flattened",
    "compute_order_only",
    "emulate_cpu_scaled_mm",
    "emulated_scaled_mm",
    "flash_attention_pack_fails",
    "guard_cpu_flash_attention",
    "host_side",
    "install_local_tensor_fsdp_storage",
    "mark_constant_result",
    "on_fake_backend",
    "per_rank",
    "per_rank_autograd",
    "per_rank_int",
    "render_table",
    "simulating_ranks",
    "unflatten_without_groups",
]


def mark_constant_result(fn):
    """What ``torch.compiler.assume_constant_result`` does to ``fn`` (under ``torch.compile``
    its result is a constant of the graph), without importing ``torch._dynamo``."""
    fn._dynamo_marked_constant = True
    return fn


# ------------------------------------------------------------------ the pipeline stage


def on_fake_backend(group) -> bool:
    return group is not None and dist.get_backend(group) == "fake"


def _inner_fsdp_modules(module: nn.Module) -> list[FSDPModule]:
    """The outermost FSDP2-wrapped submodules of a stage module that is not itself wrapped
    (e.g. the routed experts, wrapped on the expert mesh while the dense params have no FSDP:
    a MoE model under tp > 1 without dp_shard). Empty when ``module`` is wrapped."""
    if isinstance(module, FSDPModule):
        return []
    found: list[FSDPModule] = []

    def visit(m: nn.Module) -> None:
        for child in m.children():
            if isinstance(child, FSDPModule):
                found.append(child)
            else:
                visit(child)

    visit(module)
    return found


def _param_groups(state) -> list:
    """An FSDP2 state's parameter groups: a list since torch 2.13, one optional group before."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [group] if group is not None else []


def _zero_buffers(recv_infos: dict) -> None:
    with torch.no_grad():
        for infos in recv_infos.values():
            for info in infos:
                buffer = getattr(info, "buffer", None)
                if isinstance(buffer, torch.Tensor):
                    buffer.zero_()


class PipelineStageFixes:
    """Mixed in before torch's ``PipelineStage`` (``class CheckedStage(PipelineStageFixes,
    PipelineStage)``): the rows of :data:`OVERRIDES` applied there."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._inner_fsdp = _inner_fsdp_modules(self.submod)

    # fsdp_submodule_reduce.
    # torch's stage defers FSDP's gradient reduce-scatter and resharding to the end of the step
    # (perform_reduce_grad) only when the stage module itself is an FSDPModule. Where only
    # submodules are wrapped (the experts on the expert mesh, dense params without FSDP),
    # FSDP's post-backward hook would run after every micro-batch's backward instead. With a
    # zero-bubble schedule that is after the input-gradient half: FSDP reduce-scatters
    # gradients the weight half has not computed yet and reshards, swapping the module's
    # unsharded parameters for the sharded DTensors, so torch's weight half no longer finds
    # the parameters whose AccumulateGrad nodes it recorded (KeyError in
    # stage_backward_weight). Give those submodules the treatment torch gives a wrapped stage.
    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs, last_backward=False):
        for module in self._inner_fsdp:
            module.set_is_last_backward(False)
            module.set_reshard_after_backward(False)
            module.set_requires_gradient_sync(False)
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)

    def perform_reduce_grad(self, grad_scale_factor: int):
        roots: dict[int, object] = {}
        for module in self._inner_fsdp:
            module.set_is_last_backward(True)
            module.set_reshard_after_backward(True)
            module.set_requires_gradient_sync(True)
            state = fully_shard.state(module)
            roots.setdefault(id(state._state_ctx), state)
        for state in roots.values():
            states = state._state_ctx.all_states
            root = next((s for s in states if s._is_root), None)
            if root is None:  # never ran forward: nothing to reduce
                continue
            for s in states:
                for group in _param_groups(s):
                    group.post_backward()
            root._root_post_backward_final_callback()
        super().perform_reduce_grad(grad_scale_factor)

    # p2p_warmup_self_send.
    # torch 2.11 warms the pipeline's communicators up by sending a dummy tensor to each
    # neighbouring stage and receiving one from it. A V-shaped schedule (ZBVZeroBubble) puts two
    # neighbouring stages on one rank, which hand activations over in memory, never over the
    # wire; the warm-up's send to oneself fails on gloo ("Pair is not connected"). Leave those
    # out. (torch 2.13 warms up by a vote instead and does not call this.)
    def _get_init_p2p_neighbors_ops(self):
        return [op for op in super()._get_init_p2p_neighbors_ops() if op.group_peer != self.group_rank]

    # fake_backend_vote.
    # On torch's fake backend (comm.mode = "fake_backend": one rank of a larger job in one
    # process) a receive leaves its buffer as it was, so torch's warm-up vote, in which every
    # stage says whether its metadata is static, would read 0 ("dynamic") and go on to exchange
    # shapes as objects, reading garbage sizes. Every CheckedStage has static metadata, so the
    # vote's outcome is known: static.
    def _warmup_forward_vote(self, has_backward, received_acc=None):
        if on_fake_backend(self.group):
            return torch.ones(1, dtype=torch.int32, device=self.device)
        return super()._warmup_forward_vote(has_backward, received_acc=received_acc)

    def _warmup_backward_result(self, received_result=None):
        if on_fake_backend(self.group):
            return torch.ones(1, dtype=torch.int32, device=self.device)
        return super()._warmup_backward_result(received_result=received_result)

    # fake_backend_recv_buffers.
    # On the fake backend the receive buffers (torch.empty) would hand the stages uninitialized memory,
    # which can be NaN and turns every value NaN within a step; on the fake backend they are
    # zeroed once, when torch allocates them.
    def _prepare_forward_infra(self, *args, **kwargs):
        out = super()._prepare_forward_infra(*args, **kwargs)
        if on_fake_backend(self.group):
            _zero_buffers(getattr(self, "args_recv_info", {}))
        return out

    def _prepare_backward_infra(self, *args, **kwargs):
        out = super()._prepare_backward_infra(*args, **kwargs)
        if on_fake_backend(self.group):
            _zero_buffers(getattr(self, "grad_recv_info", {}))
        return out


# ------------------------------------------------------------------ the layout planner


def _no_comms(self, *args, **kwargs) -> None:
    """Stands in for torch's ``_prepare_schedule_with_comms``: keep the compute order only."""


def compute_order_only(schedule_cls: type) -> type:
    """A subclass of torch's pipeline schedule class ``schedule_cls`` whose constructor builds
    the compute actions of ``pipeline_order`` without inserting the communication."""
    return type(f"_ComputeOrder{schedule_cls.__name__}", (schedule_cls,), {"_prepare_schedule_with_comms": _no_comms})


# ------------------------------------------------------------------ the portable mesh builder


def unflatten_without_groups(parent: DeviceMesh, sizes, names, group_names) -> DeviceMesh:
    """``parent._unflatten(0, sizes, names)`` (a 1-D mesh) with ``group_names`` as the groups of
    its dimensions.

    torch's ``_unflatten`` creates a process group per dimension (for every subgroup, on every
    rank) only when the mesh it unflattens exposes ``_dim_group_names``; the parent's is hidden
    for that one call, so torch creates none and the view gets ours."""
    hidden = parent.__dict__.pop("_dim_group_names", None)
    try:
        view = parent._unflatten(0, tuple(sizes), tuple(names))
    finally:
        if hidden is not None:
            parent._dim_group_names = hidden
    if "_dim_group_names" in view.__dict__:
        raise RuntimeError(
            f"torch {torch.__version__} created process groups while unflattening a mesh "
            f"into {tuple(names)}; the portable mesh builder cannot keep one group per "
            f"rank set on it (use {MESH_BUILDER_ENV}=layout)"
        )
    view._dim_group_names = list(group_names)
    return view


def as_flattened(mesh: DeviceMesh) -> DeviceMesh:
    """Give a 1-D mesh sliced from a view the layout torch's own ``_flatten`` gives a 1-D mesh,
    so that torch finds it in the root's flatten namespace by layout (DTensor's flattened-mesh
    lookup, ``root[name]``, a ``_flatten`` to the same name and ranks). Only torch 2.11/2.12,
    whose ``_MeshLayout`` is a pycute Layout, need this: a sliced dimension keeps a nested
    ``(size,):(stride,)`` there where ``_flatten`` makes ``size:stride``. From torch 2.13 on
    both are the same ``_FlatLayout``. The stride of a size-1 mesh is kept (torch's coalesce
    would make it 1): concatenated meshes must keep their strides in descending order."""
    layout = mesh._layout
    if not hasattr(layout, "coalesce") or mesh.__dict__.get("_hash"):
        return mesh
    shape, stride = layout.shape, layout.stride
    if isinstance(shape, tuple) and len(shape) == 1 and isinstance(shape[0], int):
        mesh._layout = type(layout)(shape[0], stride[0])
    return mesh


# ------------------------------------------------------------------ comm.mode = "local_tensor"


def host_side():
    """A context in which tensors are plain host tensors even while ``comm.mode =
    'local_tensor'`` simulates every rank (trainer/simulation/local_tensor.py): what is computed in it is
    the same on every rank (a full parameter drawn from its FQN seed, a checkpoint read). A
    no-op otherwise."""
    import contextlib

    try:
        from torch.distributed._local_tensor import maybe_disable_local_tensor_mode
    except ImportError:  # a torch without LocalTensor: nothing to disable
        return contextlib.nullcontext()
    return maybe_disable_local_tensor_mode()


_SIMULATING = [False]  # a plain flag: torch.compile reads it without tracing into _local_tensor


def simulating_ranks(start: bool = False) -> bool:
    """Whether this process simulates every rank (set by trainer/simulation/local_tensor.py: ``start=True``)."""
    _SIMULATING[0] = _SIMULATING[0] or start
    return _SIMULATING[0]


def _enabled_mode():
    if not _SIMULATING[0]:
        return None
    from torch.distributed._local_tensor import enabled_local_tensor_mode as mode

    return mode()


def per_rank(fn):
    """``fn``, or while ranks are simulated, ``fn`` run once per rank with the mode off, LocalTensor
    and per-rank int arguments replaced by that rank's value, results combined per rank (torch's
    ``maybe_run_for_local_tensor``): for pure rank-dependent code, no collectives, no autograd."""
    if not _SIMULATING[0]:  # a real run (also under torch.compile) calls fn itself
        return fn
    from torch.distributed._local_tensor import maybe_run_for_local_tensor

    return maybe_run_for_local_tensor(fn)


def per_rank_int(value_on_rank):
    """``value_on_rank(dist.get_rank())``, or while ranks are simulated, ``value_on_rank(r)`` for
    every simulated rank ``r`` as torch's per-rank SymInt (which :func:`per_rank` maps)."""
    mode = _enabled_mode()
    if mode is None:
        return value_on_rank(dist.get_rank())
    from torch.distributed._local_tensor import LocalIntNode

    return torch.SymInt(LocalIntNode({r: value_on_rank(r) for r in sorted(mode.ranks)}))


def _on_rank(x, r: int):
    from torch.distributed._local_tensor import LocalIntNode, LocalTensor

    if isinstance(x, LocalTensor):
        return x._local_tensors[r]
    if isinstance(x, torch.SymInt) and isinstance(x.node, LocalIntNode):
        return x.node._local_ints[r]
    return x


class _PerRankAutograd(torch.autograd.Function):
    """``fn`` per simulated rank on plain tensors, each rank's graph kept for its own backward."""

    @staticmethod
    def forward(ctx, fn, mode, rest, *tensors):
        from torch.distributed._local_tensor import LocalTensor
        from torch.utils._pytree import tree_map

        ctx.ins, ctx.outs, ctx.mode, needs = {}, {}, mode, ctx.needs_input_grad[3:]
        with mode.disable():
            for r in sorted(mode.ranks):
                ins = [_on_rank(t, r).detach().requires_grad_(need) for t, need in zip(tensors, needs)]
                args, kwargs = tree_map(lambda x, r=r: _on_rank(x, r), rest)
                with torch.enable_grad():
                    ctx.ins[r], ctx.outs[r] = ins, fn(*ins, *args, **kwargs)
            return LocalTensor({r: out.detach() for r, out in ctx.outs.items()})

    @staticmethod
    def backward(ctx, grad):
        from torch.distributed._local_tensor import LocalTensor

        grads = [{} for _ in ctx.needs_input_grad[3:]]
        with ctx.mode.disable():
            for r, ins in ctx.ins.items():
                need = [i for i, t in enumerate(ins) if t.requires_grad]
                got = torch.autograd.grad(ctx.outs[r], [ins[i] for i in need], _on_rank(grad, r)) if need else ()
                for i, g in zip(need, got):
                    grads[i][r] = g
        ctx.ins = ctx.outs = ctx.mode = None
        return (None, None, None, *(LocalTensor(g) if g else None for g in grads))


def per_rank_autograd(fn, tensors: tuple, *args, **kwargs):
    """``fn(*tensors, *args, **kwargs)``, or while ranks are simulated, that call once per rank (each
    running its own kernels) with gradients to ``tensors``: :func:`per_rank` with autograd."""
    mode = _enabled_mode()
    if mode is None:
        return fn(*tensors, *args, **kwargs)
    return _PerRankAutograd.apply(fn, mode, (args, kwargs), *tensors)


def install_local_tensor_fsdp_storage() -> None:
    """FSDP2's ``alloc_storage`` / ``free_storage`` resize each simulated rank's tensor of a
    LocalTensor (see the ``local_tensor_fsdp_storage`` row). Idempotent."""
    from torch.distributed._local_tensor import LocalTensor
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    if getattr(_fsdp_param.alloc_storage, "_meshtrain_local_tensor", False):
        return

    def per_rank(fn):
        def apply(tensor: torch.Tensor) -> None:
            if isinstance(tensor, LocalTensor):
                for local in tensor._local_tensors.values():
                    fn(local)
            else:
                fn(tensor)

        apply._meshtrain_local_tensor = True
        return apply

    alloc, free = per_rank(_fsdp_param.alloc_storage), per_rank(_fsdp_param.free_storage)
    _fsdp_param.alloc_storage = alloc
    _fsdp_param.free_storage = free
    _fsdp_param_group.alloc_storage = alloc


# cpu_scaled_mm_emulation: torch._scaled_mm's own CPU arithmetic, on every CPU
_FLOAT8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
_scaled_mm_library: torch.library.Library | None = None  # the registration, while installed
_WIDEN: dict[torch.dtype, torch.Tensor] = {}  # float8 dtype -> float32 value of each of its 256 bytes


def _widened(t: torch.Tensor) -> torch.Tensor:
    """A CPU float8 tensor as float32, contiguous: each byte looked up in a table of torch's own
    cast of all 256 (the same bits as ``t.contiguous().to(torch.float32)``, 2-3x faster on CPU,
    where the elementwise cast from float8 is not vectorized)."""
    table = _WIDEN.get(t.dtype)
    if table is None:
        table = _WIDEN[t.dtype] = torch.arange(256, dtype=torch.uint8).view(t.dtype).to(torch.float32)
    return table.take(t.contiguous().view(torch.uint8).long())


def emulated_scaled_mm(
    mat_a: torch.Tensor,
    mat_b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    bias: torch.Tensor | None = None,
    scale_result: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    use_fast_accum: bool = False,
) -> torch.Tensor:
    """``torch._scaled_mm`` on CPU tensors, computed as torch's CPU kernel computes it wherever it
    does not hand the GEMM to oneDNN: both float8 operands widened to float32 and multiplied by
    their scale (one per tensor, or one per row of ``mat_a`` and per column of ``mat_b``), one
    float32 GEMM, the bias added in float32, the result divided by ``scale_result`` for a float8
    output, then cast to ``out_dtype`` (``mat_a``'s dtype when None). The same checks as torch's
    (float8 operands, float32 scales of a supported shape); ``use_fast_accum`` is ignored on CPU
    there too."""
    if mat_a.dim() != 2 or mat_b.dim() != 2 or mat_a.shape[1] != mat_b.shape[0]:
        raise RuntimeError(
            f"_scaled_mm: mat_a {tuple(mat_a.shape)} and mat_b {tuple(mat_b.shape)} cannot be multiplied"
        )
    if mat_a.dtype not in _FLOAT8_DTYPES or mat_b.dtype not in _FLOAT8_DTYPES:
        raise RuntimeError(f"_scaled_mm: mat_a and mat_b must be float8, got {mat_a.dtype} and {mat_b.dtype}")
    tensorwise = scale_a.numel() == 1 and scale_b.numel() == 1
    rowwise = tuple(scale_a.shape) == (mat_a.shape[0], 1) and tuple(scale_b.shape) == (1, mat_b.shape[1])
    if scale_a.dtype != torch.float32 or scale_b.dtype != torch.float32 or not (tensorwise or rowwise):
        raise RuntimeError(
            "_scaled_mm: invalid scaling configuration: float32 scales, one per tensor or "
            f"[{mat_a.shape[0]}, 1] and [1, {mat_b.shape[1]}]; got {scale_a.dtype} {tuple(scale_a.shape)} "
            f"and {scale_b.dtype} {tuple(scale_b.shape)}"
        )
    if tensorwise:  # a scalar multiplier, whatever the scales' shapes ([] or [1])
        scale_a, scale_b = scale_a.reshape(()), scale_b.reshape(())
    out_dtype = mat_a.dtype if out_dtype is None else out_dtype
    out = torch.matmul(_widened(mat_a) * scale_a, _widened(mat_b) * scale_b)
    if bias is not None:
        out.add_(bias)
    if scale_result is not None and out_dtype in _FLOAT8_DTYPES:
        out = out * (torch.ones((), dtype=torch.float32) / scale_result.to(torch.float32).reshape(()))
    return out.to(out_dtype)


def _emulated_scaled_mm_out(
    mat_a, mat_b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False, *, out
):
    if out_dtype is not None and out_dtype != out.dtype:
        raise RuntimeError(f"_scaled_mm: out_dtype {out_dtype} must match the output's dtype {out.dtype}")
    result = emulated_scaled_mm(mat_a, mat_b, scale_a, scale_b, bias, scale_result, out.dtype, use_fast_accum)
    out.resize_(result.shape)
    return out.copy_(result)


def emulate_cpu_scaled_mm(enabled: bool) -> bool:
    """Run every CPU ``torch._scaled_mm`` of this process as :func:`emulated_scaled_mm` (``True``)
    or as torch's own kernel (``False``); returns whether it was emulated before. Process-wide (a
    kernel registered for ``aten::_scaled_mm`` and its ``out`` form at the CPU dispatch key, so
    eager calls, autograd's backward threads and compiled graphs, whose CPU lowering calls the
    ``out`` form, all take it); CUDA tensors are not affected. See the
    ``cpu_scaled_mm_emulation`` row for why."""
    global _scaled_mm_library
    before = _scaled_mm_library is not None
    if enabled and not before:
        library = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():  # "Overriding a previously registered kernel": that is the point
            warnings.simplefilter("ignore", UserWarning)
            library.impl("_scaled_mm", emulated_scaled_mm, "CPU")
            library.impl("_scaled_mm.out", _emulated_scaled_mm_out, "CPU")
        _scaled_mm_library = library
    elif not enabled and before:
        _scaled_mm_library._destroy()  # torch's own CPU kernels are the registered ones again
        _scaled_mm_library = None
    return before
