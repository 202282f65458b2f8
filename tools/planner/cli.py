"""``python -m tools.planner``: rank every valid layout of a model on a cluster by estimated
tokens/s per GPU within the GPU's memory (``python -m parallel_dims plan``, its old name, still
runs it after a note: parallel_dims/moved_commands.py).

    python -m tools.planner --model llama3 --flavor 70B --world-size 256 \\
        --gpus-per-node 8 --gpu h100 --seq-len 8192 --global-batch 512 [--top 10] [--json] [--toml PATH]
        [--float8 [RECIPE] [--float8-all-gather]] [--float8-experts] [--lora RANK [--lora-experts]]
        [--node-failures-per-day RATE | --node-mtbf-hours H --save-seconds C --restart-seconds R
         [--save-write-seconds W]]

Exit codes: 0 a plan was printed; 1 no layout fits (the output names the smallest world size
that would); 2 bad input (unknown model, flavor or GPU: the valid choices are listed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from models.parallel.float8 import FLOAT8_RECIPES
from trainer.runtime.cli_errors import report_user_error
from trainer.runtime.files import atomic_write

from .estimate import Estimate, Job
from .failures import describe, parse_failure_args, plan_checkpoints
from .hardware import GIB, STEP_BYTES_PER_PARAM, load_hardware, step_bytes_per_param
from .search import plan_layouts, smallest_world_size, summarize_losers

__all__ = ["main", "toml_snippet"]

_ASSUMPTIONS = [
    "memory: the peak of the step's phases (loss backward, blocks' backward, optimizer step), each counting "
    "what is alive then: fp32 master params, grads (none at the first micro-batch's loss backward) and AdamW "
    "(2 fp32 states), FSDP2 padding included; gathered compute-dtype params and unsharded grads in flight; "
    "activations per micro-batch from the model code x the micro-batches the schedule keeps in flight; logits "
    "+ fp32 loss buffers and the loss backward's two fp32 gradients",
    "compute: the matmul FLOPs of the busiest rank (its pipeline stage, its TP/CP/EP share; the "
    "trainer's FLOPs accounting) / (peak x efficiency); full AC adds one forward of the blocks but "
    "their last projection; selective AC recomputes no matmul",
    "communication: ring all-gather / reduce-scatter / all-reduce at published nccl-tests bus bandwidths "
    "per GPU kind and NCCL's own latencies (tools/planner/hardware.py LINKS, docs/planner.md); an axis "
    "whose groups cross nodes gets the per-GPU NIC figure x its members per node (at most the NVLink figure)",
    "overlap: FSDP all-gathers, reduce-scatters and HSDP all-reduces hide behind compute except "
    "the first and the last (none hide on a profile with comm_overlap false); TP, CP, EP, PP and "
    "loss collectives are exposed",
    "float8 (--float8): the converted linears' GEMMs at the float8 peak x efficiency (the converter's own "
    "choice of linears; router, output and attention at the parameter dtype's); --float8-experts: the routed "
    "experts' GEMMs too (forward and all of the backward; the converter's choice at each etp degree); "
    "--float8-all-gather: the converted linears' FSDP all-gather bytes at 1 per element (never the experts')",
    "bubble: the schedule's textbook idle fraction (models/parallel/pipeline/plan.py bubble_fraction)",
    "optimizer: the per-parameter work over the rank's local parameter shards, memory-bound, not overlapped: "
    + " + ".join(f"{k} {v}" for k, v in STEP_BYTES_PER_PARAM.items())
    + f" = {step_bytes_per_param()} bytes per parameter over the GPU's memory bandwidth "
    f"({step_bytes_per_param('float32')} with float32 compute: no casts)",
    "elementwise: norms, RoPE, SwiGLU's gate, residual adds, MoE dispatch and combine and the loss's "
    "log-softmax at their minimum traffic (inputs read once, outputs written once; backward 2x; AC "
    "recomputes them) over the memory bandwidth (tools/planner/elementwise.py)",
]


def _registered() -> dict[str, list[str]]:
    """Each registered model's flavors, for --help."""
    from models.registry import flavor_names, model_names

    return {name: flavor_names(name) for name in model_names()}


def _parse(argv):
    models = _registered()
    p = argparse.ArgumentParser(
        prog="python -m tools.planner",
        description="Rank every valid layout of a model on a cluster by estimated tokens/s per GPU.",
    )
    p.add_argument("--model", required=True, help=f"one of {', '.join(models)}")
    p.add_argument(
        "--flavor",
        required=True,
        help="the model's size: " + "; ".join(f"{name}: {', '.join(flavors)}" for name, flavors in models.items()),
    )
    p.add_argument(
        "--mtp-layers", type=int, default=0,
        help="DeepSeek-V3 multi-token prediction depths (model.mtp_layers; default 0: none)",
    )  # fmt: skip
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument(
        "--gpu",
        default="h100",
        help="h100, h100-pcie, h100-nvl, h200, h200-nvl, a100, a100-pcie, b200 (SXM unless named)",
    )
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--toml", metavar="PATH", help="write the winner as a config snippet")
    p.add_argument(
        "--efficiency", "--mfu", type=float, default=0.5, dest="efficiency",
        help="achieved fraction of the GPU's peak FLOP/s for the compute (default 0.5)",
    )  # fmt: skip
    p.add_argument("--param-dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="FSDP compute dtype (mixed_precision_param; default bfloat16, as the shipped real-size configs)")  # fmt: skip
    p.add_argument("--reduce-dtype", default="float32", choices=("bfloat16", "float32"))
    p.add_argument(
        "--float8", nargs="?", const="tensorwise", default=None, choices=FLOAT8_RECIPES, metavar="RECIPE",
        help="float8 training of the linears (model.converters = ['float8']): their GEMMs at the GPU's float8 "
        f"peak; RECIPE one of {', '.join(FLOAT8_RECIPES)} (default tensorwise)",
    )  # fmt: skip
    p.add_argument(
        "--float8-all-gather", action="store_true",
        help="with --float8 tensorwise: FSDP all-gathers the converted weights in float8 "
        "(float8.enable_fsdp_float8_all_gather)",
    )  # fmt: skip
    p.add_argument(
        "--float8-experts", action="store_true",
        help="float8 grouped GEMMs for the MoE routed experts (model.converters = ['float8_experts'], "
        "float8.moe_fqns = ['experts'], rowwise); alone: the linears stay in the parameter dtype",
    )  # fmt: skip
    p.add_argument(
        "--lora", type=int, default=None, metavar="RANK",
        help="LoRA fine-tuning (model.converters = ['lora'], default targets): gradients and AdamW state of "
        "the rank-RANK adapters only, the frozen base in the parameter dtype's storage (lora.frozen_dtype)",
    )  # fmt: skip
    p.add_argument("--lora-experts", action="store_true", help="with --lora: adapters on the routed experts too")
    p.add_argument("--reserve-gib", type=float, default=None, help="GPU memory kept free (default 6 GiB)")
    p.add_argument("--memory-gib", type=float, default=None, help="override the GPU's memory")
    p.add_argument("--profile", metavar="FILE", help="JSON with hardware keys overriding the GPU table")
    p.add_argument(
        "--fit", action="store_true",
        help="rank the cheapest combination of layout + the memory options (chunked loss, bf16 optimizer state, "
        "activation offload, CPU offload) that fits the GPU, and print the config fields that turn them on",
    )  # fmt: skip
    p.add_argument(
        "--loss-chunk-tokens", type=int, default=None, metavar="C",
        help="with --fit: the chunk of training.loss_chunk_tokens it prices (default 1024)",
    )  # fmt: skip
    p.add_argument("--ac", nargs="*", choices=("none", "selective", "full"), help="AC modes to consider (default all)")
    f = p.add_argument_group("failures: the checkpoint interval that loses the least time (docs/long_runs.md)")
    f.add_argument(
        "--node-failures-per-day",
        metavar="RATE",
        help="failures per node per day (Llama 3's 16k-GPU run: 0.0038 per 8-GPU node; no default)",
    )
    f.add_argument("--node-mtbf-hours", metavar="H", help="or a node's mean time between failures, in hours")
    f.add_argument(
        "--save-seconds",
        metavar="C",
        help="seconds a save holds training: checkpoint_stall_s in metrics.jsonl (no default)",
    )
    f.add_argument(
        "--restart-seconds",
        metavar="R",
        help="a failure's detection plus a resumed run's start to its first step (no default)",
    )
    f.add_argument(
        "--save-write-seconds",
        metavar="W",
        help="async saves: the save's start to its last byte, checkpoint_write_s (default 0: synchronous)",
    )
    return p.parse_args(argv)


def _job(args) -> Job:
    import dataclasses

    from models.registry import flavor_names, get_model_spec, model_names

    if args.model not in model_names():
        raise ValueError(f"unknown model {args.model!r}; valid models: {', '.join(model_names())}")
    if args.flavor not in flavor_names(args.model):
        raise ValueError(
            f"unknown flavor {args.flavor!r} for model {args.model!r}; valid flavors: "
            f"{', '.join(flavor_names(args.model))}"
        )
    for name in ("world_size", "gpus_per_node", "seq_len", "global_batch", "top"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.mtp_layers < 0:
        raise ValueError(f"--mtp-layers must be >= 0, got {args.mtp_layers}")
    if args.mtp_layers and "mtp_layers" not in {
        f.name for f in dataclasses.fields(get_model_spec(args.model, args.flavor).args)
    }:
        raise ValueError(
            f"--mtp-layers {args.mtp_layers}: multi-token prediction is a DeepSeek-V3 feature, and --model {args.model} "
            "has none; drop --mtp-layers or use --model deepseek_v3"
        )
    if args.loss_chunk_tokens is not None and not args.fit:
        raise ValueError("--loss-chunk-tokens prices chunked loss for --fit: add --fit, or drop --loss-chunk-tokens")
    if args.loss_chunk_tokens is not None and args.loss_chunk_tokens < 1:
        raise ValueError(f"--loss-chunk-tokens must be >= 1, got {args.loss_chunk_tokens}")
    if not 0 < args.efficiency <= 1:
        raise ValueError(f"--efficiency must be in (0, 1], got {args.efficiency}")
    if args.profile and not os.path.isfile(args.profile):
        raise ValueError(f"--profile {args.profile} is not a file: pass a JSON file of hardware keys")
    try:
        hw = load_hardware(args.gpu, args.profile, reserve_gib=args.reserve_gib, memory_gib=args.memory_gib)
    except json.JSONDecodeError as exc:  # only the profile is JSON
        raise ValueError(f"--profile {args.profile} is not valid JSON ({exc}): fix the file") from None
    if args.toml:
        _check_writable(args.toml)
    float8 = None
    if args.float8_all_gather and args.float8 != "tensorwise":
        raise ValueError(
            "--float8-all-gather needs --float8 tensorwise (FSDP float8 all-gather works with tensorwise scaling only)"
        )
    if args.float8 or args.float8_experts:
        from models.parallel.float8 import Float8Options

        hw.peak_flops("float8")  # a part without float8 tensor cores: one line naming the fix
        float8 = Float8Options(
            recipe=args.float8 or "tensorwise", fsdp_float8_all_gather=args.float8_all_gather,
            linears=bool(args.float8), moe_fqns=("experts",) if args.float8_experts else (),
        )  # fmt: skip
    lora = None
    if args.lora is not None:
        from models.parallel.lora import LoRAOptions

        if args.lora < 1:
            raise ValueError(f"--lora RANK must be >= 1, got {args.lora}")
        lora = LoRAOptions(rank=args.lora, experts=args.lora_experts, frozen_dtype=args.param_dtype)
    elif args.lora_experts:
        raise ValueError("--lora-experts needs --lora RANK")
    job = Job(
        args.model, args.flavor, args.world_size, args.gpus_per_node, args.seq_len, args.global_batch, hw,
        args.efficiency, args.param_dtype, args.reduce_dtype, float8=float8, lora=lora,
        model_overrides=(("mtp_layers", args.mtp_layers),) if args.mtp_layers else (),
    )  # fmt: skip
    if args.float8_experts:
        _check_float8_experts(job)
    return job


def _check_float8_experts(job: Job) -> None:
    """``--float8-experts`` on a model whose routed experts convert without expert TP (the
    search then drops the etp degrees at which they would not, as the trainer refuses them)."""
    from .float8 import float8_experts_refusal

    key = tuple(sorted(job.overrides.items()))
    why = float8_experts_refusal(job.model, job.flavor, key, tuple(job.float8.moe_fqns), 1)
    if why:
        raise ValueError(f"--float8-experts: {why}; plan without it (--float8 converts the linear layers)")


def _check_writable(path: str) -> None:
    """``--toml PATH`` can be written: checked before the search, so a bad path costs nothing."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"--toml {path} is a folder: pass a file path, e.g. {os.path.join(path, 'layout.toml')}")
    if not os.path.isdir(folder):
        raise ValueError(f"--toml {path}: folder {folder} does not exist; create it or choose another path")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"--toml {path}: folder {folder} is not writable; choose another path")


def toml_snippet(e: Estimate, job: Job) -> str:
    """The layout as the trainer's config sections (merge into a config, or pass with
    ``--config``): degrees, FSDP and pipeline settings, AC, and the batch split."""
    from parallel_dims.axes import AXES

    d, c = e.degrees, e.choice
    lines = [
        f"# layout planner: {job.model}/{job.flavor} on {job.world_size} x {job.hardware.name} "
        f"({job.gpus_per_node} per node), seq_len {job.seq_len}, global batch {job.global_batch}",
        f"# estimate: {e.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, {e.memory['total'] / GIB:.1f} GiB per GPU",
    ]
    depth = dict(job.model_overrides).get("mtp_layers", 0)
    if depth:
        lines.append(f"# with [model] mtp_layers = {depth}")
    lines += [
        "[parallelism]",
    ]
    lines += [f"{a.config_key} = {getattr(d, a.name)}" for a in AXES]
    lines += [
        f'fsdp_reshard_after_forward = "{c.reshard}"',
        f'mixed_precision_param = "{c.param_dtype}"',
        f'mixed_precision_reduce = "{c.reduce_dtype}"',
        "enable_sequence_parallel = true",
        "enable_loss_parallel = true",
    ]
    if d.pp > 1:
        lines += [
            f'pipeline_parallel_schedule = "{c.schedule}"',
            f"pipeline_parallel_microbatches = {c.n_microbatches}",
        ]
    lines += [
        "",
        "[activation_checkpoint]",
        f'mode = "{c.ac}"',
        *([f'selective_ac_option = "{c.selective_ac_option}"'] if c.ac == "selective" else []),
        "",
        "[training]",
        f"global_batch_size = {c.global_batch}",
        f"local_batch_size = {c.local_batch}",
        f"seq_len = {c.seq_len}",
    ]
    if c.float8 is not None:
        f8 = c.float8
        converters = ['"float8"'] * bool(f8.linears) + ['"float8_experts"'] * bool(f8.moe_fqns)
        lines += ["", f"# with [model] converters = [{', '.join(converters)}]", "[float8]"]
        if f8.linears:
            lines += [
                f'recipe_name = "{f8.recipe}"',
                f"enable_fsdp_float8_all_gather = {str(f8.fsdp_float8_all_gather).lower()}",
            ]
        if f8.moe_fqns:
            lines.append("moe_fqns = [" + ", ".join(f'"{f}"' for f in f8.moe_fqns) + "]")
    return "\n".join(lines) + "\n"


def _row(i: int, e: Estimate) -> str:
    d, c = e.degrees, e.choice
    sched = f"{c.schedule}/{c.n_microbatches}" if d.pp > 1 else "-"
    return (
        f"{i:>3} {e.tokens_per_s_per_gpu:>9,.0f} {e.time['total']:>8.2f}  {d.dp_replicate:>3} {d.dp_shard:>4} "
        f"{d.cp:>3} {d.tp:>3} {d.pp:>3} {d.ep:>3} {d.etp:>3}  {sched:<24}{c.local_batch:>4} x {e.grad_accum:<3}"
        f"{c.ac:<10}{c.reshard:<8}{e.memory['total'] / GIB:>7.1f}  {','.join(e.crosses_nodes) or '-'}"
    )


def _breakdown(e: Estimate) -> list[str]:
    from .phases import PHASE_WORDS, PHASES, peak_phase_name

    m = {k: v / GIB for k, v in e.memory.items()}
    t = e.time
    comm = ", ".join(f"{k} {v:.3f}" for k, v in sorted(t["comm"].items(), key=lambda kv: -kv[1]))
    top = peak_phase_name(e.memory)
    others = ", ".join(f"{PHASE_WORDS[p]} {m[f'phase_{p}']:.2f}" for p in PHASES if p != top)
    return [
        f"      memory GiB: params {m['params']:.2f} + grads {m['grads']:.2f} + optimizer {m['optimizer']:.2f} + "
        f"gathered params {m['gathered_params']:.2f} + unsharded grads {m['unsharded_grads']:.2f} + activations "
        f"{m['activations']:.2f} + loss grads {m['loss_grads']:.2f} = {m['total']:.2f} at the peak, the "
        f"{PHASE_WORDS[top]}; {others}",
        f"      time s: compute {t['compute']:.3f} + recompute {t['recompute']:.3f}"
        + (f" + tp host overhead {t['tp_overhead']:.3f}" if t["tp_overhead"] else "")
        + (f" + cp host overhead {t['cp_overhead']:.3f}" if t["cp_overhead"] else "")
        + f" + elementwise {t['elementwise']:.3f}"
        + f" + exposed comm {t['comm_exposed_fsdp'] + t['comm_exposed_other']:.3f} + bubble {t['bubble']:.3f}"
        f" + optimizer {t['optimizer']:.3f} = {t['total']:.3f}; comm per axis (before overlap): {comm or 'none'}",
    ]


def main(argv=None) -> int:
    args = _parse(argv)
    try:
        job = _job(args)
        failures = parse_failure_args(args)
    except (ValueError, OSError) as exc:  # bad input, an unreadable --profile: before the search
        return report_user_error(exc)
    ac = tuple(args.ac) if args.ac else ("none", "selective", "full")
    if args.fit:
        from .fit_cli import main_fit

        return main_fit(args, job, ac, toml_snippet)
    start = time.perf_counter()
    result = plan_layouts(job, ac_modes=ac)
    elapsed = time.perf_counter() - start
    ests = result.estimates
    fitting = [e for e in ests if e.fits]
    hw = job.hardware
    if not fitting:
        smallest = smallest_world_size(job)
        where = (
            f"the smallest world size that fits is {smallest} ({smallest // job.gpus_per_node} nodes of "
            f"{job.gpus_per_node})"
            if smallest
            else f"nothing fits up to {64 * job.world_size} GPUs"
        )
        msg = (
            f"no layout of {job.model}/{job.flavor} fits {job.world_size} x {hw.name} "
            f"({hw.memory_gib:g} GiB - {hw.reserve_gib:g} GiB reserve) at seq_len {job.seq_len}, global batch "
            f"{job.global_batch}: {result.layouts:,} valid layouts, all out of memory; {where}"
        )
        if args.json:
            print(json.dumps({"fits": False, "layouts": result.layouts, "smallest_world_size": smallest,
                              "message": msg}, indent=1))  # fmt: skip
        else:
            print(msg)
        return 1
    top = fitting[: args.top]
    reasons = summarize_losers(result, job, len(top))
    nodes = -(-job.world_size // job.gpus_per_node)
    ckpt = plan_checkpoints(failures, nodes, top[0].time["total"]) if failures else None
    if args.toml:
        try:
            atomic_write(args.toml, toml_snippet(top[0], job))
        except OSError as exc:
            return report_user_error(
                ValueError(f"--toml {args.toml} cannot be written ({exc.strerror or exc}); choose another path")
            )
    if args.json:
        print(json.dumps({
            "model": job.model, "flavor": job.flavor, "world_size": job.world_size,
            "gpus_per_node": job.gpus_per_node, "gpu": hw.name, "seq_len": job.seq_len,
            "global_batch": job.global_batch, "efficiency": job.efficiency,
            "float8": job.float8.describe() if job.float8 else None,
            "lora": job.lora.describe() if job.lora else None,
            "mtp_layers": dict(job.model_overrides).get("mtp_layers", 0), "layouts": result.layouts,
            "fitting": len(fitting), "assumptions": _ASSUMPTIONS,
            "top": [e.as_json() for e in top], "losing_reasons": dict(reasons.most_common()),
            "checkpoint": ckpt,
        }, indent=1))  # fmt: skip
        return 0
    tokens = job.global_batch * job.seq_len
    print(
        f"layout plan: {job.model}/{job.flavor} on {job.world_size} x {hw.name} ({job.gpus_per_node} per node), "
        f"seq_len {job.seq_len}, global batch {job.global_batch} ({tokens:,} tokens/step)"
    )
    print(
        f"hardware: {hw.peak_flops(job.param_dtype) / 1e12:.0f} TFLOP/s peak ({job.param_dtype}) x efficiency "
        f"{job.efficiency:.2f}"
        + (
            f", float8 ({job.float8.describe()}) at {hw.peak_flops('float8') / 1e12:.0f} TFLOP/s peak"
            if job.float8
            else ""
        )
        + f"; {hw.memory_gib:g} GiB - {hw.reserve_gib:g} GiB reserve; links {hw.intra_node_gbps:g} GB/s, "
        f"{hw.intra_node_hop_us:g} us/hop in a node, {hw.inter_node_gbps:.1f} GB/s, {hw.inter_node_hop_us:g} us/hop across; "
        f"memory {hw.memory_gbps:g} GB/s"
    )
    print(
        f"{result.layouts:,} valid layouts ({len(fitting):,} fit), searched in {elapsed:.1f} s; top {len(top)} by "
        f"estimated tokens/s per GPU:\n"
    )
    print(
        f"{'#':>3} {'tok/s/GPU':>9} {'step s':>8}  {'dpr':>3} {'dps':>4} {'cp':>3} {'tp':>3} {'pp':>3} {'ep':>3} "
        f"{'etp':>3}  {'schedule/microbatches':<24}{'lbs x acc':<10}{'ac':<10}{'reshard':<8}{'GiB':>6}  crosses nodes"
    )
    for i, e in enumerate(top, 1):
        print(_row(i, e))
        for line in _breakdown(e):
            print(line)
    print("\nwhy the other layouts lost: " + "; ".join(f"{r} {n:,}" for r, n in reasons.most_common()))
    if ckpt:
        print("\n".join(describe(ckpt)))
    print("assumptions:\n" + "\n".join(f"  - {a}" for a in _ASSUMPTIONS))
    if args.toml:
        print(f"\nwrote the winner to {args.toml}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
