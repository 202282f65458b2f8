"""The table of meshtrain's torch-private overrides: what each one touches, where it is applied,
what it fixes and on which torch versions it is needed. The implementations are in
``parallel_dims/torch_compat.py``, whose docstring shows this table (:func:`render_table`);
``tests/unit/test_torch_compat.py`` checks the two against each other and against the installed
torch."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["OVERRIDES", "TORCH_VERSIONS", "Override", "render_table"]

TORCH_VERSIONS = ("2.11", "2.12", "2.13", "2.14", "2.15")
_SHORT = {"needed": "need", "not needed": "no", "not reached": "nr", "n/a": "n/a", "not checked": "?"}


@dataclass(frozen=True)
class Override:
    """One override of a torch-private API."""

    name: str
    torch_api: str  # what of torch's it overrides or works around
    members: tuple[str, ...]  # the names in this module that implement it
    applied_in: str  # "module.Class" (mixed in there) or "module" (called from there only)
    fixes: str
    versions: dict[str, str]  # torch version -> needed / not needed / not reached / n/a / not checked
    from_runs: tuple[str, ...] = ()  # versions whose entry comes from the project's runs, not the source


_STAGE = "models.parallel.pipeline.stage.CheckedStage"
_BUILDER = "parallel_dims.parallel_dims"
_PLANNER = "tools.planner.schedule_order"
_LOCAL_TENSOR = "trainer.simulation.local_tensor"
_ATTENTION = "models.common.attention"
_FLOAT8 = "models.parallel.float8"

OVERRIDES: tuple[Override, ...] = (
    Override(
        "fsdp_submodule_reduce",
        "PipelineStage.backward_maybe_with_nosync / perform_reduce_grad, FSDPState._fsdp_param_groups",
        ("backward_maybe_with_nosync", "perform_reduce_grad"),
        _STAGE,
        "torch defers FSDP's reduce-scatter and resharding to the end of the step only when the "
        "stage module itself is an FSDPModule; with only submodules wrapped (experts on the "
        "expert mesh, dense params without FSDP) a zero-bubble schedule's weight half fails "
        "(KeyError in stage_backward_weight). Gives those submodules the same treatment.",
        {"2.11": "not checked", "2.12": "not checked", "2.13": "needed", "2.14": "needed", "2.15": "not checked"},
    ),
    Override(
        "p2p_warmup_self_send",
        "PipelineStage._get_init_p2p_neighbors_ops",
        ("_get_init_p2p_neighbors_ops",),
        _STAGE,
        "torch's communicator warm-up sends a dummy tensor to each neighbouring stage; under a "
        "V-shaped schedule two neighbours share a rank and the send to oneself fails on gloo "
        "('Pair is not connected'). Drops those ops.",
        {"2.11": "needed", "2.12": "not checked", "2.13": "not reached", "2.14": "not reached", "2.15": "not checked"},
        from_runs=("2.11",),
    ),
    Override(
        "fake_backend_vote",
        "PipelineStage._warmup_forward_vote / _warmup_backward_result",
        ("_warmup_forward_vote", "_warmup_backward_result"),
        _STAGE,
        "on the fake backend a receive leaves its buffer unchanged, so torch's static-or-dynamic "
        "metadata vote reads 0 ('dynamic') and then exchanges garbage shapes; our stages are "
        "always static, so the vote's outcome is returned directly.",
        {"2.11": "n/a", "2.12": "n/a", "2.13": "needed", "2.14": "not reached", "2.15": "not checked"},
    ),
    Override(
        "fake_backend_recv_buffers",
        "PipelineStage._prepare_forward_infra / _prepare_backward_infra",
        ("_prepare_forward_infra", "_prepare_backward_infra"),
        _STAGE,
        "on the fake backend the receive buffers (allocated uninitialized) are never written, and "
        "NaN garbage spreads through a step; they are zeroed once when torch allocates them.",
        {"2.11": "n/a", "2.12": "n/a", "2.13": "needed", "2.14": "needed", "2.15": "not checked"},
    ),
    Override(
        "unflatten_without_groups",
        "DeviceMesh._unflatten (creates a process group per dimension when _dim_group_names is set)",
        ("unflatten_without_groups",),
        _BUILDER,
        "the portable builder's views must carry our deduplicated groups, created only by their "
        "members; the parent's _dim_group_names is hidden for the one call so torch creates none.",
        {"2.11": "not checked", "2.12": "not checked", "2.13": "needed", "2.14": "needed", "2.15": "not checked"},
    ),
    Override(
        "sliced_mesh_flat_layout",
        "DeviceMesh._layout (a pycute Layout with coalesce on 2.11/2.12)",
        ("as_flattened",),
        _BUILDER,
        "a 1-D mesh sliced from a view keeps a nested (size,):(stride,) layout where _flatten "
        "makes size:stride, so torch's flattened-mesh lookups by layout miss it; rewritten flat.",
        {"2.11": "needed", "2.12": "needed", "2.13": "not needed", "2.14": "not needed", "2.15": "not checked"},
        from_runs=("2.11", "2.12"),
    ),
    Override(
        "schedule_compute_order",
        "_PipelineScheduleRuntime._prepare_schedule_with_comms (multi-stage schedule constructors)",
        ("compute_order_only",),
        _PLANNER,
        "the layout planner builds torch's schedules on stand-in stages only to read each rank's "
        "compute order; the pass that inserts communication (seconds per schedule at pp 8 x 128 "
        "micro-batches) is skipped, which leaves the compute order as it is.",
        {"2.11": "not checked", "2.12": "not checked", "2.13": "needed", "2.14": "needed", "2.15": "not checked"},
    ),
    Override(
        "local_tensor_fsdp_storage",
        "torch.distributed.fsdp._fully_shard._fsdp_param.alloc_storage / free_storage",
        ("install_local_tensor_fsdp_storage",),
        _LOCAL_TENSOR,
        "comm.mode = 'local_tensor': FSDP2 frees and re-allocates the unsharded parameters' storage "
        "with resize_(), which a LocalTensor (a wrapper holding every simulated rank's tensor, no "
        "storage of its own) rejects ('invalid python storage'); the resize is applied to each "
        "rank's tensor instead. Plain tensors take torch's path unchanged.",
        {"2.11": "n/a", "2.12": "not checked", "2.13": "needed", "2.14": "not checked", "2.15": "needed"},
        from_runs=("2.15",),
    ),
    Override(
        "constant_result_marker",
        "torch.compiler.assume_constant_result (sets fn._dynamo_marked_constant after importing torch._dynamo)",
        ("mark_constant_result",),
        _ATTENTION,
        "the public decorator imports torch._dynamo when it is applied, at module import: every "
        "train.py process (the launcher's too) then imports dynamo and, where triton is installed, "
        "triton, whose bindings print a 'nanobind: leaked ...' report at interpreter exit under a "
        "one-line error. The marker dynamo reads is set directly; dynamo is imported only by a "
        "run that compiles.",
        {"2.11": "needed", "2.12": "not checked", "2.13": "needed", "2.14": "not checked", "2.15": "needed"},
    ),
    Override(
        "cpu_scaled_mm_emulation",
        "aten::_scaled_mm's CPU kernel (a Python kernel registered at the CPU dispatch key)",
        ("emulate_cpu_scaled_mm",),
        _FLOAT8,
        "torch's CPU _scaled_mm hands tensorwise-scaled GEMMs to oneDNN on hosts with AMX-INT8 "
        "(Intel Xeon since Sapphire Rapids), whose float8 kernel there takes 0.6-2 s for one "
        "256x256x256 GEMM (a bf16 one: 0.1 ms); every other CPU, and rowwise scales everywhere, "
        "get torch's own float32 emulation. float8 on a CPU (float8.cpu_gemm = 'emulated', the "
        "default) registers that emulation as the CPU kernel: the same arithmetic on every host, "
        "bitwise torch's where torch emulates.",
        {"2.11": "not checked", "2.12": "not checked", "2.13": "needed", "2.14": "not checked", "2.15": "not checked"},
    ),
    Override(
        "cpu_flash_attention_pack",
        "aten::_scaled_dot_product_flash_attention_for_cpu's CPU kernel (a Python kernel registered "
        "at the CPU dispatch key around torch's own)",
        ("guard_cpu_flash_attention",),
        _ATTENTION,
        "torch's CPU flash attention packs bfloat16 (float16: AMX-FP16) inputs for oneDNN's AMX "
        "GEMMs whenever oneDNN may use AMX on the host (Intel Xeon since Sapphire Rapids), with a "
        "helper (pack_vnni2) that only ATen's AVX-512 build has: under ATEN_CPU_CAPABILITY=default "
        "or avx2 (the test suite's second-kernel lane) bfloat16 attention of 64 or more "
        "queries and keys (torch 2.13's packing heuristic) raises 'pack_vnni2 is only supported when avx512 is supported' (training, the "
        "planner's measurements, the benchmarks, torchtitan's model too). Where it fails, those "
        "dtypes run the same kernel with oneDNN disabled for the call (no packing); elsewhere "
        "nothing is registered.",
        {"2.11": "not checked", "2.12": "not checked", "2.13": "needed", "2.14": "not checked", "2.15": "not checked"},
    ),
)


def render_table() -> str:
    """The table of the module docstring, from :data:`OVERRIDES`."""
    widths = (26, 43) + (5,) * len(TORCH_VERSIONS)
    rule = "  ".join("=" * w for w in widths)
    rows = [rule, _row(("override", "where applied", *TORCH_VERSIONS), widths), rule]
    for o in OVERRIDES:
        cells = [_SHORT[o.versions[v]] + ("*" if v in o.from_runs else "") for v in TORCH_VERSIONS]
        rows.append(_row((o.name, o.applied_in, *cells), widths))
    rows.append(rule)
    return "\n".join(rows)


def _row(cells, widths) -> str:
    return "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()
