"""`make bench`: every benchmark section, one JSON file. Figures are ratios against a reference
measured in the same run, so they compare across machines."""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

SECTIONS = [
    "mesh_build",
    "memory",
    "chunked_loss",
    "memory_options",
    "param_traffic",
    "throughput",
    "pipeline",
    "moe",
    "attention",
    "data_loading",
    "planner",
    "planner_search",
    "checkpoint",
    "local_tensor",
    "optimizer",
    "first_step",
    "muon_lr",
    "bf16_state",
    "lora",
    "float8_cpu",
]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default="bench_results/bench.json")
    p.add_argument("--only", nargs="*", choices=SECTIONS, help="run only these sections")
    args = p.parse_args(argv)
    import importlib

    import torch

    from models.common.cpu_info import describe_cpu

    results = {
        "host": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cpus": __import__("os").cpu_count(),
            "cpu": describe_cpu(),
        },
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    for name in args.only or SECTIONS:
        print(f"== {name}", file=sys.stderr)
        results[name] = importlib.import_module(f"benchmarks.{name}").run()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
