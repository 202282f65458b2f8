"""Bytes moved per parameter per training step on one rank: the trainer against a mixed-precision loop.

A census, not a timing: a ``TorchDispatchMode`` sees every ATen op of one training step (forward,
backward, clipping, the optimizer, zeroing the gradients) and adds up the bytes each one reads and
writes: its tensor inputs are read (an in-place op's mutated input is read and written, an
overwrite such as ``copy_`` or an ``out=`` argument only written), its outputs that are not views
are written; views, allocations and metadata ops move nothing. On a GPU these ops are memory-bound
kernels (or GEMMs, the same on both sides), so the bytes stand for what the step costs beyond its
matmuls, measured on CPU.

The model is a debug model with a few tokens per step (1 x 16), so its parameters' traffic
dominates the total, which is divided by the parameter count. bf16 compute, fp32 master weights,
fused AdamW (the GPU default), clipping on, no activation checkpointing, one micro-batch.

Rows:

* ``reference``: a mixed-precision loop written out by hand on the same model code: one
  ``torch._foreach_copy_`` of the fp32 masters into bf16 copies, forward/backward in bf16, the
  gradients cast to fp32 masters, one ``torch._foreach_norm``, ``torch._foreach_mul_`` to clip,
  fused AdamW, ``zero_grad``;
* ``trainer``: ``Trainer.train_step`` as train.py runs it on one rank (compute copies,
  models/parallel/mixed_precision.py);
* ``trainer_fsdp_size1``: the same with FSDP2's policy on the size-1 mesh instead (what the
  one-rank path used before), gradient divide factor unset;
* ``trainer_fsdp_size1_divide``: that with the gradient divide factor 1.0 set as the trainer used
  to (a ``copy_(grad / 1.0)`` per gradient).

Goal (issue 39): trainer / reference <= 1.1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS = ("llama3", "deepseek_v3")
ROWS = ("reference", "trainer", "trainer_fsdp_size1", "trainer_fsdp_size1_divide")
GOAL = 1.1
# overwrites: their mutated argument is written, not read
_OVERWRITE = {
    "copy_",
    "_foreach_copy_",
    "fill_",
    "zero_",
    "_foreach_zero_",
    "normal_",
    "uniform_",
    "split_with_sizes_copy",
}
_FREE = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "resize_", "set_", "lift_fresh"}


class ByteCensus:
    """A dispatch mode adding up the bytes read and written by every ATen op (see the module
    docstring); ``by_op`` keeps them per op name."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        census = self
        self.read = self.written = 0
        self.by_op: dict[str, int] = {}

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                census.count(func, args, kwargs, out)
                return out

        self._mode = _Mode()

    def __enter__(self):
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)

    @staticmethod
    def _tensors(value):
        import torch

        if isinstance(value, torch.Tensor):
            return [value]
        if isinstance(value, (list, tuple)):
            return [t for v in value for t in ByteCensus._tensors(v)]
        return []

    @staticmethod
    def _nbytes(t) -> int:
        return t.numel() * t.element_size()

    def count(self, func, args, kwargs, out) -> None:
        name = func.overloadpacket.__name__
        schema = func._schema
        if name in _FREE or (
            schema.returns and all(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)
        ):
            return  # views and allocations
        read = written = 0
        values = {a.name: v for a, v in zip(schema.arguments, args)}
        values.update(kwargs)
        for arg in schema.arguments:
            if arg.name not in values:
                continue
            mutated = arg.alias_info is not None and arg.alias_info.is_write
            for t in self._tensors(values[arg.name]):
                b = self._nbytes(t)
                if mutated:
                    written += b
                    if name not in _OVERWRITE and arg.name != "out":
                        read += b
                else:
                    read += b
        if not any(r.alias_info is not None for r in schema.returns):
            written += sum(self._nbytes(t) for t in self._tensors(out))
        self.read += read
        self.written += written
        self.by_op[name] = self.by_op.get(name, 0) + read + written

    @property
    def total(self) -> int:
        return self.read + self.written


def _config(model: str, folder: str, param_dtype: str = "bfloat16"):
    from trainer.config import load_config

    return load_config(
        [
            "--config", f"{model}.toml", "--job.dump_folder", folder,
            "--training.seq_len", "16", "--training.local_batch_size", "1", "--training.global_batch_size", "-1",
            "--training.steps", "4", "--checkpoint.enable", "false", "--metrics.enable_tensorboard", "false",
            "--parallelism.mixed_precision_param", param_dtype, "--optimizer.implementation", "fused",
            "--training.max_norm", "1.0", "--activation_checkpoint.mode", "none",
        ]
    )  # fmt: skip


def _trainer_row(model: str, folder: str, row: str) -> dict:
    import models.parallelize as parallelize
    from trainer.trainer import Trainer

    parallelize.ONE_RANK_MIXED_PRECISION = "compute_copies" if row == "trainer" else "fsdp"
    try:
        trainer = Trainer(_config(model, folder))
    finally:
        parallelize.ONE_RANK_MIXED_PRECISION = "compute_copies"
    if row == "trainer_fsdp_size1_divide":
        from torch.distributed.fsdp import FSDPModule

        for m in trainer.model_parts[0].modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)
    trainer.train_step(trainer.data.next_step())  # first-use work (optimizer state, DTensor caches) out of the way
    trainer.step += 1
    batch = trainer.data.next_step()
    with ByteCensus() as census:
        trainer.train_step(batch)
    params = sum(p.numel() for p in trainer.model_parts[0].parameters())
    return {"bytes": census.total, "params": params, "by_op": census.by_op}


def _reference_row(model: str, folder: str) -> dict:
    """The hand-written mixed-precision loop on the trainer's model (built by the trainer in
    float32, where it applies no mixed precision of its own) and data."""
    import torch

    from trainer.forward import cross_entropy_sum
    from trainer.trainer import Trainer

    trainer = Trainer(_config(model, folder, param_dtype="float32"))
    net = trainer.model_parts[0]
    slots = [(m, n, p) for m in net.modules() for n, p in m._parameters.items() if p is not None]
    masters = [p for _, _, p in slots]
    if len({id(p) for p in masters}) != len(masters):
        raise RuntimeError("the reference loop needs untied parameters")
    copies = [torch.empty_like(p, dtype=torch.bfloat16) for p in masters]
    opt = torch.optim.AdamW(masters, lr=1e-4, weight_decay=0.1, fused=True)

    def step(inputs, labels):
        with torch.no_grad():
            torch._foreach_copy_(copies, masters)
        leaves = [torch.nn.Parameter(c) for c in copies]
        for (module, name, _), leaf in zip(slots, leaves):
            module._parameters[name] = leaf
        logits = net(inputs)
        loss = cross_entropy_sum(logits, labels) / labels.numel()
        loss.backward()
        for (module, name, master), leaf in zip(slots, leaves):
            module._parameters[name] = master
            master.grad = leaf.grad.to(torch.float32)
        grads = [m.grad for m in masters]
        norm = torch.stack(torch._foreach_norm(grads)).square().sum().sqrt()
        torch._foreach_mul_(grads, torch.clamp(1.0 / (norm + 1e-6), max=1.0))
        opt.step()
        opt.zero_grad(set_to_none=True)

    ((inputs, labels),) = trainer.data.next_step()
    step(inputs, labels)
    ((inputs, labels),) = trainer.data.next_step()
    with ByteCensus() as census:
        step(inputs, labels)
    return {"bytes": census.total, "params": sum(p.numel() for p in masters), "by_op": census.by_op}


def census(model: str, folder: str) -> dict:
    """Every row's bytes per parameter for ``model`` and their ratios to the reference (in a
    process whose environment makes it rank 0 of a world of one)."""
    rows = {"reference": _reference_row(model, folder)}
    for row in ROWS[1:]:
        rows[row] = _trainer_row(model, folder, row)
    ref = rows["reference"]["bytes"] / rows["reference"]["params"]
    return {
        "params": rows["reference"]["params"],
        **{f"{row}_bytes_per_param": rows[row]["bytes"] / rows[row]["params"] for row in ROWS},
        **{f"{row}_over_reference": rows[row]["bytes"] / rows[row]["params"] / ref for row in ROWS[1:]},
        "goal_trainer_over_reference": GOAL,
        "top_ops_trainer": dict(sorted(rows["trainer"]["by_op"].items(), key=lambda kv: -kv[1])[:8]),
        "top_ops_reference": dict(sorted(rows["reference"]["by_op"].items(), key=lambda kv: -kv[1])[:8]),
    }


def _child(folder: str) -> dict:
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(20000 + os.getpid() % 20000))
    return {model: census(model, folder) for model in MODELS}


def run() -> dict:
    """``make bench`` section ``param_traffic``: one fresh process (a world of one rank)."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        proc = subprocess.run(
            [sys.executable, "-m", "benchmarks.param_traffic", "--child", folder],
            cwd=ROOT,
            capture_output=True,
            text=True,
            env=dict(os.environ, OMP_NUM_THREADS="1"),
            timeout=900,
        )
    if proc.returncode != 0:
        raise RuntimeError(f"param_traffic child failed: {proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        print(json.dumps(_child(sys.argv[2])))
    else:
        print(json.dumps(run(), indent=1))
