"""``python -m tools.planner ... --fit``: the output of :mod:`tools.planner.fit`'s ranking."""

from __future__ import annotations

import json
import time

from trainer.runtime.cli_errors import report_user_error
from trainer.runtime.files import atomic_write

from .fit import DEFAULT_CHUNK_TOKENS, config_lines, fit_layouts, merge_into_toml
from .hardware import GIB
from .search import plan_layouts

__all__ = ["main_fit"]

_NAMES = {
    "loss_chunk_tokens": "chunked loss",
    "state_dtype": "bf16 optimizer state",
    "activation_offload": "activation offload",
    "cpu_offload": "CPU offload",
}


def main_fit(args, job, ac, toml_snippet) -> int:
    """``toml_snippet``: :func:`tools.planner.cli.toml_snippet` (the winner's layout lines)."""
    chunk = args.loss_chunk_tokens or DEFAULT_CHUNK_TOKENS
    start = time.perf_counter()
    result = plan_layouts(job, ac_modes=ac, prune_state=False)
    ranked = fit_layouts(job, result.estimates, chunk)
    elapsed = time.perf_counter() - start
    hw = job.hardware
    if not ranked:
        msg = (
            f"no layout of {job.model}/{job.flavor} fits {job.world_size} x {hw.name} ({hw.memory_gib:g} GiB - "
            f"{hw.reserve_gib:g} GiB reserve) at seq_len {job.seq_len}, global batch {job.global_batch}, "
            f"even with every memory option on: {result.layouts:,} valid layouts; add GPUs or shorten the sequence"
        )
        print(json.dumps({"fits": False, "layouts": result.layouts, "message": msg}) if args.json else msg)
        return 1
    top = ranked[: args.top]
    best = top[0]
    if args.toml:
        try:
            atomic_write(
                args.toml, merge_into_toml(toml_snippet(best.estimate, job), config_lines(best.options, chunk))
            )
        except OSError as exc:
            return report_user_error(
                ValueError(f"--toml {args.toml} cannot be written ({exc.strerror or exc}); choose another path")
            )
    if args.json:
        print(json.dumps({
            "model": job.model, "flavor": job.flavor, "world_size": job.world_size, "gpu": hw.name,
            "layouts": result.layouts, "fitting": len(ranked), "loss_chunk_tokens": chunk,
            "top": [{**r.estimate.as_json(), "options": list(r.options),
                     "saved_gib": {k: round(v / GIB, 3) for k, v in r.saved.items()},
                     "config": config_lines(r.options, chunk)} for r in top],
        }, indent=1))  # fmt: skip
        return 0
    print(
        f"fit plan: {job.model}/{job.flavor} on {job.world_size} x {hw.name} ({job.gpus_per_node} per node), "
        f"seq_len {job.seq_len}, global batch {job.global_batch}; {hw.memory_gib:g} GiB - {hw.reserve_gib:g} GiB "
        f"reserve; host link {hw.host_link_gbps:g} GB/s, host memory {hw.host_memory_gbps:g} GB/s per GPU"
    )
    print(
        f"{result.layouts:,} valid layouts, {len(ranked):,} (layout, options) pairs fit, searched in {elapsed:.1f} s; "
        f"top {len(top)} by estimated tokens/s per GPU:\n"
    )
    print(
        f"{'#':>3} {'tok/s/GPU':>9} {'step s':>8}  {'dpr':>3} {'dps':>4} {'cp':>3} {'tp':>3} {'pp':>3}  "
        f"{'lbs x acc':<10}{'ac':<10}{'reshard':<8}{'GiB':>6}  options"
    )
    for i, r in enumerate(top, 1):
        e = r.estimate
        d, c = e.degrees, e.choice
        print(
            f"{i:>3} {e.tokens_per_s_per_gpu:>9,.0f} {e.time['total']:>8.2f}  {d.dp_replicate:>3} {d.dp_shard:>4} "
            f"{d.cp:>3} {d.tp:>3} {d.pp:>3}  {c.local_batch:>4} x {e.grad_accum:<3}{c.ac:<10}{c.reshard:<8}"
            f"{e.memory['total'] / GIB:>6.1f}  {', '.join(_NAMES[o] for o in r.options) or 'none'}"
        )
        if r.saved:
            print(
                "      saves GiB: "
                + ", ".join(f"{_NAMES[o]} {v / GIB:.2f}" for o, v in r.saved.items())
                + f"; costs s: loss recompute {e.time.get('loss_recompute', 0):.3f}, host link "
                f"{e.time.get('host_link', 0):.3f}"
            )
    lines = config_lines(best.options, chunk)
    print("\nset in the config (with the winner's layout: --toml PATH writes both):")
    print("\n".join(f"  {line}" for line in lines) if lines else "  (no memory option needed)")
    if args.toml:
        print(f"\nwrote the winner to {args.toml}")
    return 0
