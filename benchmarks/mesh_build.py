"""Mesh build time and process groups: ours vs torchtitan 0.2.2, fake backend, one process per
(implementation, world size) so neither inherits the other's groups or caches."""

from __future__ import annotations

import json
import subprocess
import sys
import time

CONFIGS = [
    dict(world_size=8, pp=1, dp_replicate=1, dp_shard=2, cp=2, tp=2, ep=4, etp=1),
    dict(world_size=64, pp=2, dp_replicate=2, dp_shard=2, cp=2, tp=4, ep=8, etp=1),
    dict(world_size=512, pp=2, dp_replicate=2, dp_shard=8, cp=2, tp=8, ep=16, etp=1),
    dict(world_size=4096, pp=4, dp_replicate=2, dp_shard=32, cp=2, tp=8, ep=64, etp=1),
    dict(world_size=32768, pp=8, dp_replicate=4, dp_shard=64, cp=2, tp=8, ep=64, etp=1),
    dict(world_size=131072, pp=8, dp_replicate=4, dp_shard=256, cp=2, tp=8, ep=64, etp=1),
]


def _measure(impl: str, cfg: dict, rank: int) -> dict:
    """Runs inside a fresh interpreter."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=cfg["world_size"])
    before = set(c10d._world.pg_map)
    if impl == "ours":
        from parallel_dims import ParallelDims
    else:
        from torchtitan.distributed.parallel_dims import ParallelDims
    start = time.perf_counter()
    pd = ParallelDims(**cfg)
    pd.build_mesh()
    seconds = time.perf_counter() - start
    new = [pg for pg in c10d._world.pg_map if pg not in before]
    rank_sets = [frozenset(c10d._world.pg_group_ranks[pg]) for pg in new]
    multi = [s for s in rank_sets if len(s) > 1]
    return {
        "seconds": seconds,
        "groups_created": len(new),
        "groups_size_gt1": len(multi),
        "duplicate_rank_sets": len(multi) - len(set(multi)),
    }


def run(rank: int = 0) -> list[dict]:
    rows = []
    for cfg in CONFIGS:
        row = {"config": cfg, "rank": rank}
        for impl in ("ours", "torchtitan"):
            code = (
                "import json,sys; from benchmarks.mesh_build import _measure; "
                f"print(json.dumps(_measure({impl!r}, {cfg!r}, {rank})))"
            )
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
            if out.returncode != 0:
                row[impl] = {"error": out.stderr.strip().splitlines()[-1]}
                continue
            row[impl] = json.loads(out.stdout.strip().splitlines()[-1])
        if "seconds" in row.get("ours", {}) and "seconds" in row.get("torchtitan", {}):
            row["time_ratio_ours_over_torchtitan"] = round(row["ours"]["seconds"] / row["torchtitan"]["seconds"], 3)
        rows.append(row)
        print(
            f"mesh build world={cfg['world_size']:>6}: ours {row['ours'].get('seconds', float('nan')):.3f} s "
            f"({row['ours'].get('groups_size_gt1')} groups, {row['ours'].get('duplicate_rank_sets')} dup) | "
            f"torchtitan {row['torchtitan'].get('seconds', float('nan')):.3f} s "
            f"({row['torchtitan'].get('groups_size_gt1')} groups, {row['torchtitan'].get('duplicate_rank_sets')} dup)",
            file=sys.stderr,
        )
    return rows


if __name__ == "__main__":
    print(json.dumps(run(), indent=1))
