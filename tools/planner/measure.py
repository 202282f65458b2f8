"""Measurements the planner's estimates are checked against (tests and ``benchmarks/planner.py``).

* :func:`measure_training_state`: one rank of a layout, built with the real code (meta model,
  ``split_model`` for pp, the model's parallelize function, materialized on CPU) on torch's
  ``fake`` backend (collectives move no data, so values are garbage but every tensor training
  keeps exists with its real shape, dtype and storage); one forward/backward and one AdamW
  step (``foreach=False``; ``cpu_offload``: FSDP2's CPU offload policy), or with ``optimizer`` (keys of the config's ``[optimizer]``
  section: name, param_groups, ...) one step of the trainer's own optimizer
  (``trainer.optim.optimizers.build_optimizer``, for-loop AdamW beside Muon). Reports, in bytes, the
  distinct storages behind the parameters (FSDP2's padded chunks), behind the gradients
  (FSDP2's padded reduce-scatter output buffers) and behind the optimizer state (AdamW's two
  moments, Muon's momentum buffer), and the local elements of Muon's parameters. Run it in a fresh interpreter per layout
  (:func:`measure_in_subprocess`): DTensor caches keyed by equal-looking meshes would leak
  shard shapes from one fake world into the next.
* :func:`measure_activations`: one process, no parallelism: the bytes of the tensors created
  during a forward pass (model + loss) that are still alive when the forward returns, i.e.
  what autograd and activation checkpointing hold for the backward (saved tensors, checkpoint
  inputs, selective-AC caches, the logits and the loss buffers). Deterministic: tracked with a
  ``TorchDispatchMode`` that keeps weak references to every op output, counting each storage
  once and nothing that existed before the forward (parameters, inputs).
"""

from __future__ import annotations

import json
import subprocess
import sys
import weakref

__all__ = [
    "census_of_runs",
    "forget_sharding_caches",
    "measure_activations",
    "measure_in_subprocess",
    "measure_training_state",
]


def _storage_bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    storages = {}
    for t in tensors:
        local = t._local_tensor if isinstance(t, DTensor) else t
        s = local.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())


def measure_training_state(
    model: str, flavor: str, degrees: dict, rank: int, param_dtype: str = "float32", reduce_dtype: str = "float32",
    schedule: str = "1F1B", seq_len: int = 64, lora: dict | None = None, optimizer: dict | None = None,
    cpu_offload: bool = False,
) -> dict:  # fmt: skip
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from models.parallel.offload import cpu_offload_bytes
    from models.parallel.pipeline import plan_stages, split_model
    from models.parallelize import ParallelizeOptions
    from models.registry import build_model, get_model_spec
    from parallel_dims import ParallelDims
    from parallel_dims.process_groups import register_fake_backend

    register_fake_backend()
    pd = ParallelDims(**degrees)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=pd.world_size)
    try:
        pd.build_mesh("cpu")
        spec = get_model_spec(model, flavor)
        full = build_model(model, flavor, device="meta")
        parts = (
            list(split_model(full, plan_stages(spec.args.n_layers, pd.pp, schedule), pd).modules)
            if pd.pp > 1
            else [full]
        )
        from models.parallel.lora import LoRAOptions

        opts = ParallelizeOptions(
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            lora=LoRAOptions(**lora) if lora else None,
            cpu_offload=cpu_offload,
        )
        params = []
        cp_seq = seq_len // pd.cp
        for part in parts:
            spec.parallelize_fn(part, pd, opts)
            part.to_empty(device="cpu")
            with torch.no_grad():
                for p in part.parameters():
                    p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
                for b in part.buffers():
                    b.zero_()
            part.rope.reset_table()
            if part.tok_embeddings is not None:
                x = torch.randint(0, spec.args.vocab_size, (1, cp_seq))
            else:
                # a later stage receives its tp rank's sequence shard under sequence parallel
                x = torch.randn(1, cp_seq // part.boundary_seq_shards, spec.args.dim)
            out = part(x)
            out = out.full_tensor() if hasattr(out, "full_tensor") else out
            out.float().sum().backward()
            params += list(part.parameters())
        # FSDP2's own bookkeeping: [all-gather output / reduce-scatter input numel, shard-mesh
        # size] of every FSDP group (padded sharded size x shard-mesh size)
        from torch.distributed.fsdp import FSDPModule

        groups = []
        for part in parts:
            for module in part.modules():
                if isinstance(module, FSDPModule):
                    pg = module._get_fsdp_state()._fsdp_param_group
                    if pg is not None:
                        size = pg.mesh_info.shard_mesh_size
                        groups.append([sum(fp._sharded_param_data.numel() for fp in pg.fsdp_params) * size, size])
        if optimizer is None:
            optimizers = [torch.optim.AdamW(params, lr=1e-3, foreach=False)]
        else:
            from trainer.config import Optimizer
            from trainer.optim.optimizers import build_optimizer

            optimizers = build_optimizer(parts, Optimizer(**{"implementation": "for-loop", **optimizer})).optimizers
        for opt in optimizers:
            opt.step()
        keys = ("exp_avg", "exp_avg_sq", "momentum_buffer")
        states = [s[k] for opt in optimizers for s in opt.state.values() for k in keys if k in s]
        from torch.distributed.tensor import DTensor

        muon = [p for opt in optimizers if type(opt).__name__ == "Muon" for g in opt.param_groups for p in g["params"]]
        return {
            "rank": rank,
            "params_bytes": _storage_bytes(params),
            "grads_bytes": _storage_bytes([p.grad for p in params if p.grad is not None]),
            "optimizer_bytes": _storage_bytes(states),
            "muon_local_numel": sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in muon),
            "fsdp_group_unsharded_numels": sorted(groups),
            # what CPU offload's prediction says these three are (models/parallel/offload.py)
            "cpu_offload_bytes": cpu_offload_bytes(parts),
        }
    finally:
        dist.destroy_process_group()


def measure_in_subprocess(*args, **kwargs) -> dict:
    """:func:`measure_training_state` in a fresh interpreter (see the module docstring)."""
    code = (
        "import json, sys; from tools.planner.measure import measure_training_state as m; "
        "a, k = json.loads(sys.argv[1]); print(json.dumps(m(*a, **k)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps([args, kwargs])], capture_output=True, text=True, timeout=300
    )
    if out.returncode != 0:
        raise RuntimeError(f"measurement failed: {out.stderr.strip()[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure_activations(
    model: str, flavor: str, seq_len: int, batch: int = 1, ac_mode: str = "none", dtype: str = "float32",
    ac_option: str = "op", **overrides,
) -> dict:  # fmt: skip
    """Bytes held for the backward at the end of one forward + loss (see the module docstring),
    on CPU, one process. ``dtype``: the parameters' (and so the activations') dtype;
    ``ac_option``: selective AC's option ("op" or every N-th block)."""
    import torch
    import torch.nn.functional as F
    from torch.utils._python_dispatch import TorchDispatchMode

    from models.parallel.activation_checkpoint import apply_activation_checkpointing
    from models.registry import build_model

    m = build_model(model, flavor, device="cpu", max_seq_len=max(seq_len, 16), **overrides)
    m.init_weights(0)
    m.to(getattr(torch, dtype))
    apply_activation_checkpointing(m, ac_mode, ac_option)
    tokens = torch.randint(0, m.args.vocab_size, (batch, seq_len))
    # DeepSeek-V3's MTP depths: their token ids, and labels for the main and every depth's logits
    depth = getattr(m.args, "mtp_layers", 0)
    mtp_tokens = torch.randint(0, m.args.vocab_size, (batch, seq_len, depth)) if depth else None
    labels = torch.randint(0, m.args.vocab_size, (batch, (1 + depth) * seq_len))
    inputs = [tokens, labels] + ([mtp_tokens] if depth else [])
    before = {t.untyped_storage().data_ptr() for t in [*m.parameters(), *m.buffers(), *inputs]}

    class Track(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.refs = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.refs.append(weakref.ref(t))
            return out

    track = Track()
    with track:
        logits = m(tokens, mtp_tokens=mtp_tokens) if depth else m(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum")
    alive = {}
    for ref in track.refs:
        t = ref()
        if t is None:
            continue
        s = t.untyped_storage()
        if s.data_ptr() not in before and s.nbytes() > 0:
            alive[s.data_ptr()] = s.nbytes()
    result = {"bytes": sum(alive.values()), "tensors": len(alive)}
    del loss, logits
    return result


def forget_sharding_caches() -> None:
    """Drop DTensor's sharding-propagation and redistribution caches: their keys compare
    meshes by value, so a later job's equal-looking mesh in the same process would get back
    specs that hold an earlier job's mesh object (and process groups)."""
    import torch
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._redistribute import _gen_transform_infos

    from trainer.optim import foreach_strategy

    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    propagator._propagate_tensor_meta_cached.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()
    _gen_transform_infos.cache_clear()
    foreach_strategy.forget()


def census_of_runs(argvs: list[list[str]]) -> list[dict]:
    """Run ``train.py`` with each argument list in turn in this process (each a fake-backend run
    of one rank with ``--profiling.matmul_census_step``), forgetting DTensor's caches between
    them, and return each run's census (``matmul_census_rank<R>.json``)."""
    import glob
    import os

    from trainer.lifecycle.rank import run_rank as main

    out = []
    for argv in argvs:
        forget_sharding_caches()
        if main(argv) != 0:
            raise RuntimeError(f"train.py {' '.join(argv)} failed")
        folder = argv[argv.index("--job.dump_folder") + 1]
        (path,) = glob.glob(os.path.join(folder, "**", "matmul_census_rank*.json"), recursive=True)
        with open(path) as f:
            out.append(json.load(f))
    return out
