"""Peak bytes of live tensor storage while a piece of code runs, on any device (CPU included,
where torch tracks no allocations): a ``TorchDispatchMode`` sees every tensor an op creates
(forward and backward: the CPU autograd engine runs the backward on the calling thread, with the
mode active), counts each new storage's bytes when it first appears and uncounts them when the
last tensor over that storage seen by the census is freed (a ``weakref.finalize`` per tensor;
torch keeps a tensor's Python object alive as long as the C++ side holds it, e.g. when autograd
saved it). Tensors that existed before the census (parameters, inputs) are not counted: the
figure is what the code allocates on top of them. Deterministic: pure bookkeeping, no sampling
and no allocator state, so a test can assert on it.

    with TensorCensus() as census:
        loss = model(x).sum(); loss.backward()
    census.peak_bytes
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["TensorCensus"]


class TensorCensus(TorchDispatchMode):
    """``peak_bytes``: the most bytes of census-seen storage alive at once; ``live_bytes``: now."""

    def __init__(self) -> None:
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self._refs: dict[int, list[int]] = {}  # storage data_ptr -> [tensors alive, bytes]

    def _release(self, key: int) -> None:
        entry = self._refs.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.live_bytes -= entry[1]
            del self._refs[key]

    def _track(self, t: torch.Tensor) -> None:
        if t.device.type == "meta":
            return
        storage = t.untyped_storage()
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0:
            return
        entry = self._refs.get(key)
        if entry is None:
            entry = self._refs[key] = [0, nbytes]
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        entry[0] += 1
        weakref.finalize(t, self._release, key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out
