"""Activation offload (``activation_checkpoint.offload = true``): what the transformer blocks save
for backward is moved to host memory in the forward and back to the device in the backward.

Each block's ``forward`` runs under one ``torch.autograd.graph.saved_tensors_hooks`` pair (the
wrapper goes around the activation-checkpoint wrapper, models/parallel/activation_checkpoint.py):

* no AC: every tensor the block's ops save for backward;
* full AC (and the blocks that selective AC with an integer option checkpoints): torch's
  non-reentrant checkpoint saves the block's inputs (``_NoopSaveInputs``) under the hooks that
  are active where it is called, so those are offloaded, and what the ops inside save goes to the
  checkpoint's own hooks (discarded and recomputed in backward);
* per-op selective AC (``selective_ac_option = 'op'``): the block inputs as under full AC, and
  the outputs the policy keeps (matmuls, attention, collectives), which live in torch's
  selective-checkpoint cache where no saved-tensor hook sees them: :class:`SavedOutputs` (handed
  to models/parallel/activation_checkpoint.py) records them from the policy (``ctx.op_output``),
  moves their storages to the host once the block's forward has returned (device storage
  resized to 0) and brings them back when the backward recomputes the block, before the
  recomputation reads the cache. What is recomputed is never offloaded. Compiled blocks do not use the recorder (dynamo cannot
  trace its policy closure as a ``context_fn``; models/parallelize.py): what the compiled graph
  saves passes through the hooks.

What is not offloaded: parameters and views of them (FSDP2's gathered weights, re-gathered in
backward anyway), and the model's buffers and views of them (the RoPE table, which every block
shares and which stays on the device). A tensor saved several times (the norm output that wq,
wk and wv each save) moves once: saves of the same view of the same live tensor share one host
copy.

On a CPU compute device the "host copy" is the tensor itself (nothing to move): the hooks still
count every storage they would offload and its bytes (:attr:`ActivationOffload.offloaded_bytes`),
which is what the tests check against :func:`block_input_bytes`, :func:`attention_input_bytes`
and the planner's activation model. ``copy=True`` makes a real copy on any device (the unit test proves the round trip with it).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

__all__ = [
    "ActivationOffload",
    "activation_offload_line",
    "apply_activation_offload",
    "attention_input_bytes",
    "block_input_bytes",
    "model_offloads",
]


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what owns device memory), or the tensor itself."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


class _Storage:
    """One offloaded storage: its host copy (on a CPU device, the storage itself) and, once the
    backward asked for it, the device copy every view saved from it shares."""

    __slots__ = ("__weakref__", "device", "host", "restored", "source")

    def __init__(self, t: torch.Tensor, copy: bool):
        storage = t.untyped_storage()
        self.device = t.device
        # the tensor that owns the storage: while it lives, the address is this storage's
        self.source = weakref.ref(t._base if t._base is not None else t)
        self.restored = None
        if copy:
            pin = t.device.type != "cpu"
            raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
            self.host = torch.empty(raw.shape, dtype=torch.uint8, pin_memory=pin)
            self.host.copy_(raw, non_blocking=pin)
        else:
            self.host = None if t.device.type != "cpu" else torch.empty(0, dtype=torch.uint8).set_(storage)

    def get(self) -> torch.Tensor:
        if self.restored is None:
            self.restored = (
                self.host if self.host.device == self.device else self.host.to(self.device, non_blocking=True)
            )
        return self.restored


class _View:
    """A saved tensor as a view (dtype, size, stride, offset) of an offloaded storage; ``then``:
    the kept outputs of the selective-AC block whose input it is (restored when it is unpacked,
    which is when the backward recomputes that block)."""

    __slots__ = ("dtype", "offset", "shape", "storage", "stride", "then")

    def __init__(self, t: torch.Tensor, storage: _Storage, then=None):
        self.storage, self.dtype, self.then = storage, t.dtype, then
        self.shape, self.stride, self.offset = t.shape, t.stride(), t.storage_offset()

    def get(self) -> torch.Tensor:
        if self.then is not None:
            self.then.restore()
        raw = self.storage.get()
        return torch.empty(0, dtype=self.dtype, device=raw.device).set_(
            raw.untyped_storage(), self.offset, self.shape, self.stride
        )


class _Local:
    """A saved DTensor: its local tensor moved (per view) and the DTensor rebuilt around it."""

    __slots__ = ("device", "host", "meta", "then")

    def __init__(self, t, copy: bool, then=None):
        local, self.then = t._local_tensor, then
        self.device, self.meta = local.device, (t.device_mesh, t.placements, t.shape, t.stride())
        self.host = local.to("cpu", copy=True) if copy else local

    def get(self):
        from torch.distributed.tensor import DTensor

        if self.then is not None:
            self.then.restore()
        mesh, placements, shape, stride = self.meta
        local = self.host.to(self.device, non_blocking=True)
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


class ActivationOffload:
    """The hooks of one model (or pipeline stage): offloads, and counts what it offloads."""

    def __init__(self, model: nn.Module, copy: bool | None = None):
        self.model = model
        self.copy = copy  # None: copy where the tensor is not on the CPU
        self.offloaded_bytes = 0  # since reset(): bytes of the storages moved to host, each once
        self.offloaded_tensors = 0  # saved tensors offloaded (views of one storage each count)
        self._live: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self.restoring: SavedOutputs | None = None  # set while a selective-AC block saves its inputs

    def reset(self) -> None:
        self.offloaded_bytes = self.offloaded_tensors = 0

    def saved_outputs(self) -> SavedOutputs:
        """A recorder for one forward of a per-op selective-AC block."""
        return SavedOutputs(self)

    def _kept(self, t: torch.Tensor) -> bool:
        """Parameters, buffers and views of either stay where they are."""
        base = t._base if t._base is not None else t
        if isinstance(t, nn.Parameter) or isinstance(base, nn.Parameter):
            return True
        ptr = _local(t).untyped_storage().data_ptr()
        return any(b.untyped_storage().data_ptr() == ptr for b in self.model.buffers())

    def pack(self, t: torch.Tensor):
        if self._kept(t):
            return t
        copy = self.copy if self.copy is not None else t.device.type != "cpu"
        self.offloaded_tensors += 1
        if hasattr(t, "_local_tensor"):  # a DTensor (TP): its local shard, per saved view
            self.offloaded_bytes += t._local_tensor.numel() * t._local_tensor.element_size()
            return _Local(t, copy, self.restoring)
        storage = t.untyped_storage()
        saved = self._live.get(storage.data_ptr())
        if saved is None or saved.source() is None:
            saved = _Storage(t, copy)  # a storage seen first: one host copy for all its views
            self._live[storage.data_ptr()] = saved
            self.offloaded_bytes += storage.nbytes()
        return _View(t, saved, self.restoring)

    @staticmethod
    def unpack(packed):
        return packed.get() if isinstance(packed, (_View, _Local)) else packed

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class SavedOutputs:
    """The outputs per-op selective AC keeps for one forward of one block (see the module
    docstring): recorded by the policy, moved to the host after the forward, back before the
    recomputation."""

    def __init__(self, owner: ActivationOffload):
        self.owner = owner
        self.outputs: list[torch.Tensor] = []
        self.moved: list[tuple] = []  # (storage, nbytes, host copy or None)

    def keep(self, out) -> None:
        if torch.compiler.is_compiling():
            return
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if not isinstance(t, torch.Tensor) or t.numel() == 0:
                continue
            t = _local(t)  # under TP the policy sees DTensors: their local shards hold the memory
            try:
                t.untyped_storage().data_ptr()
            except RuntimeError:  # a wrapper without a storage of its own: left on the device
                continue
            self.outputs.append(t)

    def forward_done(self, result) -> None:
        owner, outputs, self.outputs = self.owner, self.outputs, []
        results = result if isinstance(result, (tuple, list)) else (result,)
        escaped = {_local(r).untyped_storage().data_ptr() for r in results if isinstance(r, torch.Tensor)}
        seen: set[int] = set()
        for t in outputs:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr in seen or ptr in escaped or owner._kept(t):
                continue  # once per storage; never what the block returns (the next block reads it)
            seen.add(ptr)
            nbytes = storage.nbytes()
            owner.offloaded_bytes += nbytes
            owner.offloaded_tensors += 1
            copy = owner.copy if owner.copy is not None else t.device.type != "cpu"
            host = None
            if copy:
                pin = t.device.type != "cpu"
                raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
                host = torch.empty(raw.shape, dtype=torch.uint8, pin_memory=pin)
                host.copy_(raw, non_blocking=pin)
                if pin:  # the copy must be done before the device memory is reused
                    torch.accelerator.current_stream().synchronize()
                storage.resize_(0)
            self.moved.append((storage, nbytes, host, t.device))

    def restore(self) -> None:
        for storage, nbytes, host, device in self.moved:
            if host is not None:
                storage.resize_(nbytes)
                torch.empty(0, dtype=torch.uint8, device=device).set_(storage).copy_(host, non_blocking=True)
        self.moved = []


def apply_activation_offload(
    model: nn.Module, copy: bool | None = None, offload: ActivationOffload | None = None
) -> ActivationOffload:
    """Wrap every block's forward of ``model`` (after activation checkpointing) in the offload
    hooks; the :class:`ActivationOffload` (``offload``, the one per-op selective AC was given,
    or a new one) is also ``model.activation_offload``."""
    offload = offload if offload is not None else ActivationOffload(model, copy)
    blocks = model.blocks() if hasattr(model, "blocks") else list(model.layers.values())
    for block in blocks:
        inner = block.forward

        def forward(*args, _inner=inner, **kw):
            with offload.hooks():
                return _inner(*args, **kw)

        block.forward = forward
    model.activation_offload = offload
    return offload


def model_offloads(model_parts: list[nn.Module]) -> list[ActivationOffload]:
    """The offload hooks of this rank's model parts (none without activation offload)."""
    return [m.activation_offload for m in model_parts if getattr(m, "activation_offload", None) is not None]


def activation_offload_line(model_parts: list[nn.Module], step: int) -> str | None:
    """What the hooks of this rank's model parts moved to host memory in the first step of a
    launch (``step``), counted: None without activation offload."""
    offloads = model_offloads(model_parts)
    if not offloads:
        return None
    moved = sum(o.offloaded_bytes for o in offloads)
    tensors = sum(o.offloaded_tensors for o in offloads)
    for o in offloads:
        o.reset()
    return (
        f"activation offload: step {step} moved {moved:,} bytes ({moved / 2**20:.1f} MiB, {tensors} saved tensors) "
        "to host memory on this rank, all micro-batches together"
    )


def block_input_bytes(
    n_blocks: int, local_batch: int, seq_len: int, dim: int, *, cp: int = 1, tp: int = 1, sp: bool = False, a: int = 4
) -> int:
    """Bytes of the inputs of ``n_blocks`` fully checkpointed blocks on one rank, per micro-batch:
    each block's input ``[b, seq_len / cp (/ tp under sequence parallelism), dim]`` in the
    compute dtype (``a`` bytes: 4 float32, 2 bfloat16). What full AC's blocks offload (with
    :func:`attention_input_bytes`); a block without AC offloads what it keeps for backward, the
    planner's ``tools.planner.activations.layer_bytes``."""
    tokens = local_batch * (seq_len // cp)
    if sp and tp > 1:
        tokens //= tp
    return n_blocks * tokens * dim * a


def attention_input_bytes(rope_rows: tuple[int, ...], local_batch: int, seq_len: int, *, cp: int = 1) -> int:
    """Bytes of the RoPE rows the decoder builds once per micro-batch and hands to every block
    (models/common/decoder.py ``attention_inputs``: ``[seq_len / cp, *rope_rows]`` float32, where
    ``rope_rows`` is the RoPE table's row shape, ``model.rope.table.shape[1:]``), which the blocks
    save (full AC: as a checkpoint input); offloaded once per forward. With
    ``model.document_positions`` the rows are per sequence (x ``local_batch``); a block-causal
    mask, where the attention kernel builds one, adds its tensor once more."""
    n = seq_len // cp
    for d in rope_rows:
        n *= d
    return 4 * n
