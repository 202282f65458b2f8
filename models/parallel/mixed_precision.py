"""Mixed precision where no rank shares a parameter shard: fp32 master weights, compute copies.

Where a layout shards parameters over data-parallel ranks, FSDP2's ``MixedPrecisionPolicy`` casts
them (models/parallel/fsdp.py). Where nothing is sharded over data-parallel ranks and there is no
pipeline (one GPU, pure tensor parallelism), FSDP2 on its size-1 mesh does the same casts but also
copies every gradient through its reduce-scatter buffer: per parameter per step a second
parameter copy (``tensor.copy_`` of the cast parameter into the all-gather buffer, +4 bytes) and
two gradient copies (copy-in to the reduce buffer is the cast, then ``copy_`` of the buffer into
the output, +8 bytes, +8 more when a gradient divide factor is set). :class:`ComputeCopies` does
only the work a mixed-precision loop does:

* before a forward of the model (a forward pre-hook of the root), every floating-point parameter
  (the fp32 master) is cast into a persistent compute copy of ``dtype`` with one
  ``torch._foreach_copy_`` per device (4 bytes read, 2 written per parameter), and the copies
  are put in the modules' parameter slots, so every layer, activation-checkpoint recomputation
  and compiled block computes with them;
* each copy's gradient goes to its master's ``.grad`` in a post-accumulate-grad hook: cast to
  the master's dtype on the first micro-batch of a step (2 read, 4 written), added in place on the
  next ones, and the copy's own gradient is dropped;
* the floating-point inputs of the root, the blocks, the embedding, the final norm and the head
  are cast to ``dtype`` as FSDP2's policy casts those of the modules it wraps (the blocks' RoPE
  tables), so the model computes the same way as on data-parallel layouts;
* at the end of the backward pass (an autograd engine callback queued by a hook on the model's
  output), or right after a forward without gradients (evaluation), the masters go back in the
  slots. ``state_dict`` / ``load_state_dict`` of the model restore them first too.

The values are those of FSDP2's policy on the size-1 mesh, bit for bit (the same
round-to-nearest casts of the same parameters, fp32 gradient accumulation in the same order):
``tests/distributed/test_one_gpu_path.py``. The copies stay allocated between steps (2 bytes
per parameter, outside the backward pass's activation peak) so that compiled blocks see the same
parameter objects every step.

A model whose forward runs twice with gradients before one backward keeps the copies until
every such output has been backpropagated through (a count of pending backwards); an output that
is never backpropagated keeps them installed until the next ``state_dict`` or evaluation.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map

__all__ = ["ComputeCopies", "apply_compute_copies"]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


class ComputeCopies:
    """Compute-dtype copies of ``model``'s floating-point parameters (see the module docstring)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        self.model, self.dtype = model, dtype
        self.installed = False
        self._pending_backwards = 0
        # (module, slot name, master) for every parameter slot (a tied parameter has several)
        self._slots: list[tuple[nn.Module, str, nn.Parameter]] = []
        self._copies: dict[int, nn.Parameter] = {}  # id(master) -> its compute copy
        model.register_forward_pre_hook(self._pre_forward)
        model.register_forward_hook(self._post_forward)
        # FSDP2's policy also casts the floating-point inputs of every module it wraps (its
        # ``cast_forward_inputs``): the blocks' RoPE tables reach attention in the compute
        # dtype on every data-parallel layout, and so they do here
        units = model.blocks() if hasattr(model, "blocks") else [*getattr(model, "layers", {}).values()]
        units += [getattr(model, name, None) for name in ("tok_embeddings", "norm", "output")]
        for unit in [model, *units]:
            if unit is not None:
                unit.register_forward_pre_hook(self._cast_inputs, with_kwargs=True)
        model.register_state_dict_pre_hook(lambda *_: self.release())
        model.register_load_state_dict_pre_hook(lambda *_: self.release())

    # ------------------------------------------------------------------ lifecycle
    def _pre_forward(self, module: nn.Module, args) -> None:
        if not self.installed:
            self.install()

    def _cast_inputs(self, module: nn.Module, args, kwargs):
        def cast(t):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != self.dtype:
                return t.to(self.dtype)
            return t

        return tree_map(cast, args), tree_map(cast, kwargs)

    def _post_forward(self, module: nn.Module, args, output):
        if not torch.is_grad_enabled():
            if self._pending_backwards == 0:
                self.release()
            return output
        outputs = [
            t for t in (output if isinstance(output, (tuple, list)) else (output,)) if isinstance(t, torch.Tensor)
        ]
        grad_outputs = [t for t in outputs if t.requires_grad]
        if not grad_outputs:
            if self._pending_backwards == 0:
                self.release()
            return output
        self._pending_backwards += 1
        fired = [False]

        def on_output_grad(grad: torch.Tensor) -> None:
            if not fired[0]:  # one callback per forward, whichever output's gradient comes first
                fired[0] = True
                torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)

        for t in grad_outputs:
            t.register_hook(on_output_grad)
        return output

    def _backward_done(self) -> None:
        self._pending_backwards = max(0, self._pending_backwards - 1)
        if self._pending_backwards == 0:
            self.release()

    # ------------------------------------------------------------------ swapping
    def _masters(self) -> list[tuple[nn.Module, str, nn.Parameter]]:
        slots = []
        for module in self.model.modules():
            for name, p in module._parameters.items():
                if p is not None and p.is_floating_point() and p.dtype != self.dtype:
                    slots.append((module, name, p))
        return slots

    def _copy_of(self, master: nn.Parameter) -> nn.Parameter:
        copy = self._copies.get(id(master))
        if copy is not None and copy.shape == master.shape and copy.device == master.device:
            return copy
        # (re)made for a new master, or one that moved (a meta model materialised by to_empty)
        with torch.no_grad():
            copy = nn.Parameter(torch.empty_like(master, dtype=self.dtype), requires_grad=master.requires_grad)
        if master.requires_grad:
            copy.register_post_accumulate_grad_hook(_GradToMaster(master))
        self._copies[id(master)] = copy
        return copy

    @torch.no_grad()
    def install(self) -> None:
        """Cast every master into its compute copy and put the copies in the parameter slots."""
        self._slots = self._masters()
        by_device: dict = defaultdict(lambda: ([], []))
        seen: set[int] = set()
        for _, _, master in self._slots:
            if id(master) in seen:
                continue
            seen.add(id(master))
            copy = self._copy_of(master)
            dst, src = by_device[_local(master).device]
            dst.append(_local(copy))
            src.append(_local(master))
        for dst, src in by_device.values():
            torch._foreach_copy_(dst, src)
        for module, name, master in self._slots:
            module._parameters[name] = self._copies[id(master)]
        self.installed = True

    def release(self) -> None:
        """Put the fp32 masters back in the parameter slots (a no-op when they are there)."""
        if not self.installed:
            return
        for module, name, master in self._slots:
            module._parameters[name] = master
        self._slots = []
        self._pending_backwards = 0
        self.installed = False


class _GradToMaster:
    """Post-accumulate-grad hook of a compute copy: its gradient, in the master's dtype, into
    the master's ``.grad`` (assigned on the first micro-batch, added on the next)."""

    def __init__(self, master: nn.Parameter) -> None:
        self.master = master

    def __call__(self, copy: torch.Tensor) -> None:
        grad, copy.grad = copy.grad, None
        if grad is None:
            return
        master = self.master
        if master.grad is None:
            master.grad = grad.to(master.dtype)
        else:
            master.grad.add_(grad)


def apply_compute_copies(model: nn.Module, param_dtype: str) -> ComputeCopies:
    """Give ``model`` (whole, not a pipeline stage) compute copies in ``param_dtype``."""
    dtypes = {"bfloat16": torch.bfloat16, "float16": torch.float16}
    if param_dtype not in dtypes:
        raise ValueError(
            f"compute copies need a 16-bit param_dtype, got {param_dtype!r}; legal values: {', '.join(dtypes)}"
        )
    handle = ComputeCopies(model, dtypes[param_dtype])
    model.compute_copies = handle  # what the trainer and tests inspect
    return handle
