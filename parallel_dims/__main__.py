"""Describe a layout, or dry-run building it, for any world size, on a laptop.

    python -m parallel_dims --world-size 4096 --dp-shard -1 --cp 2 --tp 8 --pp 4 --ep 64 \
        --rank 17 --gpus-per-node 8 [--json]

The layout planner is ``python -m tools.planner`` and a training config's job plan is
``python -m trainer.plan_report --config X``; the old forms ``python -m parallel_dims plan ...``
and ``python -m parallel_dims --config X ...`` still work: they print a one-line note and run
those (parallel_dims/moved_commands.py, the one place this package reaches above itself).

The meshes are really built, for the chosen rank, on torch's ``fake`` backend (no GPU, no other
processes), and checked against the layout layer. The output names the mesh builder used
(``layout`` or ``portable``; ``MESHTRAIN_MESH_BUILDER`` forces one). Invalid degrees print the
validation message on stderr and exit with code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from . import moved_commands
from .axes import AXES, DEGREE_NAMES
from .layout import COMPOSITE_MESHES, ONE_D_AXES, validate_degrees

_ROLES = {
    "world": "all ranks",
    "pp": "pipeline stages",
    "dp_replicate": "HSDP replicate / DDP",
    "dp_shard": "data-parallel shard",
    "cp": "context-parallel attention",
    "tp": "tensor/sequence/loss parallel",
    "efsdp": "FSDP shard axis for experts",
    "ep": "expert-parallel all-to-all",
    "etp": "expert tensor parallel",
    "fsdp": "FSDP shard axis for dense params (dp_shard x cp)",
    "batch": "data loading (dp_replicate x dp_shard)",
    "loss": "loss/metric reduction (dp_replicate x dp_shard x cp)",
    "dense": "dense layers",
    "sparse": "routed experts",
}


_BUILDER_NOTE = {
    "layout": "every mesh a layout view of the world mesh",
    "portable": "every mesh a dimension of an unflattened world mesh",
}


def _parse(argv):
    p = argparse.ArgumentParser(
        prog="python -m parallel_dims",
        description="Describe the device meshes of a parallelism layout (dry run, no GPU).",
        epilog=f"Choose a layout: {moved_commands.LAYOUT_PLANNER}. A config's job plan: "
        f"{moved_commands.JOB_PLAN} --config X.",
    )
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument(
        "--config",
        help="moved: python -m trainer.plan_report --config X prints a training config's job plan "
        "(this flag still runs it, after a note)",
    )
    for axis in AXES:
        p.add_argument(axis.cli_flag, type=int, default=None, help=f"{axis.help} (default {axis.default})")
    p.add_argument("--rank", type=int, default=0, help="the rank whose groups are shown")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    return p.parse_args(argv)


def _short(ranks: list[int], limit: int = 8) -> str:
    if len(ranks) <= limit:
        return "[" + ", ".join(map(str, ranks)) + "]"
    return "[" + ", ".join(map(str, ranks[: limit - 2])) + f", ... , {ranks[-1]}] ({len(ranks)} ranks)"


def describe(args) -> dict:
    import torch
    import torch.distributed as dist

    from .parallel_dims import ParallelDims
    from .process_groups import register_fake_backend

    given = {n: getattr(args, n) for n in DEGREE_NAMES if getattr(args, n) is not None}
    degrees = validate_degrees(world_size=args.world_size, **given)
    if not 0 <= args.rank < degrees.world_size:
        raise ValueError(
            f"--rank {args.rank} is outside world_size={degrees.world_size}; legal ranks: 0 .. {degrees.world_size - 1}"
        )
    if args.gpus_per_node < 1:
        raise ValueError(f"--gpus-per-node {args.gpus_per_node} must be >= 1")
    register_fake_backend()
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=args.rank, world_size=degrees.world_size)
    try:
        start = time.perf_counter()
        pd = ParallelDims(**degrees.as_dict())
        pd.build_mesh("cpu")
        build_s = time.perf_counter() - start
        layout = pd.layout
        meshes = {}
        for name in ONE_D_AXES:
            group = layout.group(name, args.rank)
            meshes[name] = {
                "size": layout.size(name),
                "strides": list(layout.strides(name)),
                "enabled": pd.get_optional_mesh(name) is not None,
                "coordinate": layout.coordinate(name, args.rank),
                "group": group,
                "shares_group_with": layout.distinct_rank_sets[name],
                "crosses_nodes": layout.crosses_nodes(name, args.gpus_per_node),
                "role": _ROLES[name],
            }
        for name, axes in COMPOSITE_MESHES.items():
            mesh = pd.get_mesh(name)
            meshes[name] = {
                "axes": list(axes),
                "shape": list(mesh.shape),
                "strides": [layout.strides(a)[0] if layout.size(a) > 1 else None for a in axes],
                "coordinate": list(mesh.get_coordinate()),
                "role": _ROLES[name],
            }
        return {
            "degrees": degrees.as_dict() | {"efsdp": degrees.efsdp},
            "builder": pd.mesh_builder,
            "torch": str(torch.__version__),
            "rank": args.rank,
            "gpus_per_node": args.gpus_per_node,
            "meshes": meshes,
            "process_groups_per_rank": pd.process_group_count(),
            "build_seconds": round(build_s, 4),
        }
    finally:
        dist.destroy_process_group()


def _print_text(info: dict) -> None:
    d = info["degrees"]
    print(
        "degrees: "
        + ", ".join(
            f"{k}={d[k]}" for k in ("world_size", "pp", "dp_replicate", "dp_shard", "cp", "tp", "ep", "etp", "efsdp")
        )
    )
    rank, gpn = info["rank"], info["gpus_per_node"]
    print(f"rank {rank} (node {rank // gpn}, {gpn} GPUs per node)")
    print(f"mesh builder: {info['builder']} (torch {info['torch']}; {_BUILDER_NOTE[info['builder']]})\n")
    for name in ("dense", "sparse"):
        m = info["meshes"][name]
        dims = ", ".join(f"{a}={s}" for a, s in zip(m["axes"], m["shape"]))
        strides = ", ".join("-" if s is None else str(s) for s in m["strides"])
        print(f"{name:<7} mesh ({dims})  strides ({strides})  coordinate {tuple(m['coordinate'])}  [{m['role']}]")
    print()
    header = (
        f"{'mesh':<13}{'size':>7}  {'strides':<14}{'coord':>6}  {'crosses nodes':<14}{'group of rank ' + str(rank)}"
    )
    print(header)
    print("-" * len(header))
    for name in ONE_D_AXES:
        m = info["meshes"][name]
        if not m["enabled"] and name != "world":
            status = "off"
        else:
            status = "yes" if m["crosses_nodes"] else "no"
        shared = (
            "" if m["shares_group_with"] == name or m["size"] == 1 else f"  (same group as {m['shares_group_with']})"
        )
        strides = "x".join(map(str, m["strides"]))
        print(f"{name:<13}{m['size']:>7}  {strides:<14}{m['coordinate']:>6}  {status:<14}{_short(m['group'])}{shared}")
    c = info["process_groups_per_rank"]
    print(
        f"\nprocess groups on this rank: {c['distinct_real_rank_sets']} distinct real rank sets "
        f"({c['created']} created, the rest reuse the default group), {c['placeholder']} "
        f"placeholder (size-1 axes, fake backend, no communicator); built in {info['build_seconds']} s"
    )


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "plan":  # moved: python -m tools.planner
        return moved_commands.layout_planner(argv[1:])
    args = _parse(argv)
    if args.config:  # moved: python -m trainer.plan_report
        return moved_commands.job_plan(args)
    try:
        info = describe(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(info, indent=1))
    else:
        _print_text(info)
    return 0


if __name__ == "__main__":
    sys.exit(main())
