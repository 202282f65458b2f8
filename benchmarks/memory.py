"""Per-rank training-state memory (parameters + gradients + AdamW state) under FSDP, measured on
the real sharded model: fake backend, one process per (model, fsdp degree, rank).

Each configuration builds the debug model on the meta device, parallelizes it exactly as
training does, materializes it on CPU and runs one forward/backward/AdamW step (the fake
backend's collectives move no data, so the values are garbage but every tensor that training
keeps exists with its real shape, dtype and storage). Two figures per rank:

* ``logical``: local shard sizes, ``numel * element_size`` of each parameter's, gradient's,
  ``exp_avg``'s and ``exp_avg_sq``'s local tensor (fp32);
* ``allocated``: bytes of the distinct storages behind those tensors. FSDP2 keeps each sharded
  parameter in a buffer padded to ``ceil(dim0 / N)`` rows and reduce-scatters gradients into
  padded group buffers, so this is what the process really holds.

The ideal is the unsharded (fsdp=1) total divided by N; the ratio to it is 1.0 for perfect
sharding and slightly above when dim 0 of some parameter is not divisible by N (rank 0 holds
the largest chunks, the last rank the smallest; both are measured).
"""

from __future__ import annotations

import json
import subprocess
import sys

MODELS = ("llama3", "deepseek_v3")
# 3 does not divide the debug models' dims (2048-row vocab, 8 experts): it shows the padding
FSDP_DEGREES = (1, 2, 3, 4, 8)


def _local(t):
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def _bytes(tensors) -> dict:
    tensors = [_local(t) for t in tensors]
    storages = {}
    for t in tensors:
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
    return {
        "logical": sum(t.numel() * t.element_size() for t in tensors),
        "allocated": sum(storages.values()),
    }


def _measure_rank(model_name: str, fsdp: int, rank: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from models.parallelize import ParallelizeOptions, parallelize_model
    from models.registry import build_model
    from parallel_dims import ParallelDims

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=fsdp)
    try:
        pd = ParallelDims(dp_replicate=1, dp_shard=fsdp, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=fsdp)
        pd.build_mesh("cpu")
        model = build_model(model_name, "debugmodel", device="meta")
        parallelize_model(model, pd, ParallelizeOptions())
        model.to_empty(device="cpu")
        model.init_weights(0)
        tokens = torch.randint(0, model.args.vocab_size, (1, 64))
        model(tokens).float().sum().backward()
        params = list(model.parameters())
        optimizer = torch.optim.AdamW(params, lr=1e-3, foreach=False)
        optimizer.step()
        states = [s[k] for s in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
        parts = {
            "params": _bytes(params),
            "grads": _bytes([p.grad for p in params]),
            "optimizer": _bytes(states),
        }
        return {
            "rank": rank,
            **{f"{part}_bytes": b["logical"] for part, b in parts.items()},
            "total_bytes": sum(b["logical"] for b in parts.values()),
            "allocated_bytes": sum(b["allocated"] for b in parts.values()),
            "param_dtype": str(params[0].dtype),
        }
    finally:
        dist.destroy_process_group()


def _subprocess(model_name: str, fsdp: int, rank: int) -> dict:
    """One fake world per interpreter: DTensor caches keyed by an equal-looking mesh would hand
    a second world in the same process the first world's shard shapes."""
    code = (
        "import json; from benchmarks.memory import _measure_rank; "
        f"print(json.dumps(_measure_rank({model_name!r}, {fsdp}, {rank})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if out.returncode != 0:
        return {"rank": rank, "error": out.stderr.strip().splitlines()[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def run() -> list[dict]:
    rows = []
    for model_name in MODELS:
        unsharded = None
        for fsdp in FSDP_DEGREES:
            ranks = [_subprocess(model_name, fsdp, rank) for rank in sorted({0, fsdp - 1})]
            row = {"model": model_name, "flavor": "debugmodel", "fsdp": fsdp}
            errors = [r["error"] for r in ranks if "error" in r]
            if errors:
                row["error"] = errors[0]
                rows.append(row)
                continue
            worst = max(ranks, key=lambda r: r["allocated_bytes"])
            row.update(
                per_rank=ranks,
                total_bytes=max(r["total_bytes"] for r in ranks),
                allocated_bytes=worst["allocated_bytes"],
            )
            if fsdp == 1:
                unsharded = row["total_bytes"]
            if unsharded is not None:
                row["ideal_bytes"] = unsharded / fsdp
                row["ratio_to_ideal"] = round(row["total_bytes"] / row["ideal_bytes"], 4)
                row["allocated_ratio_to_ideal"] = round(row["allocated_bytes"] / row["ideal_bytes"], 4)
            rows.append(row)
            print(
                f"memory {model_name:11s} fsdp={fsdp}: {row['total_bytes'] / 2**20:8.2f} MiB/rank "
                f"(allocated {row['allocated_bytes'] / 2**20:8.2f}), "
                f"ratio to ideal {row.get('ratio_to_ideal', float('nan')):.4f} "
                f"(allocated {row.get('allocated_ratio_to_ideal', float('nan')):.4f})",
                file=sys.stderr,
            )
    return rows


if __name__ == "__main__":
    print(json.dumps(run(), indent=1))
