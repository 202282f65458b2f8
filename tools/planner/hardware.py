"""GPUs and networks the planner prices layouts on, and the ring cost model of a collective.

Peak FLOP/s come from the trainer's own table (``trainer/metrics.py`` ``GPU_PEAKS``: dense, no
sparsity, per matmul precision: "float32" is IEEE fp32, "tf32" a float32 run with
``training.enable_tf32``, "bfloat16"/"float16" mixed precision). Memory sizes and bandwidths are the
parts' datasheet HBM figures. Every part gets the same network defaults below (an NVSwitch node's
NVLink); a PCIe or NVL card whose GPUs talk over PCIe or 2-GPU bridges needs a ``--profile``.

The network defaults are PyTorch's collective cost model for DTensor redistribution,
``torch/distributed/tensor/_collective_utils.py`` (``MeshTopoInfo.build_from_mesh`` and
``allgather_cost`` / ``reduce_scatter_cost`` / ``allreduce_cost``, torch 2.13):

* inside a node: bus bandwidth 87.7 GB/s and 0.6 us per ring hop (NVLink);
* a group that crosses nodes: bandwidth x 0.22 (19.3 GB/s) and 2.7 us per hop;
* every collective: a 6.6 us base latency (NCCL's ring base latency, ``baseLat`` in
  ``torch/_inductor/comm_analysis.py``);
* ring algorithms: all-gather and reduce-scatter move ``bytes * (n-1)/n`` per rank over
  ``n-1`` hops, all-reduce twice that (reduce-scatter + all-gather), where ``bytes`` is the
  full buffer (all-gather output, reduce-scatter input, all-reduce tensor); a measured profile
  may scale one kind (``collective_bw_scale``: its bandwidth term; ``collective_latency_us``:
  added latency) -- gloo on a CPU host, for one, runs a reduce-scatter at an all-reduce's cost
  or more.

The optimizer step (gradient-norm, clipping and AdamW over the rank's local parameter shards) is
memory-bound: :data:`OPTIMIZER_BYTES_PER_PARAM` bytes per fp32 parameter element over the
memory bandwidth ``memory_gbps`` (the parts' HBM bandwidths; a CPU profile measures an
effective figure, its foreach kernels making several passes).

A GPU entry may override them, and ``--profile FILE`` (JSON with any of the keys of
:class:`Hardware`) overrides everything, e.g. a measured CPU profile for the ranking check
(``benchmarks/planner.py`` measures one: matmul rate, gloo links and per-kind scales, no
overlap, recompute cost, TP's and CP's per-block host overheads, the optimizer's memory
bandwidth).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

__all__ = ["GPUS", "Hardware", "collective_seconds", "hardware_for_device", "load_hardware", "optimizer_seconds"]

GIB = 2**30
COLLECTIVE_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send_recv")

# torch/distributed/tensor/_collective_utils.py, MeshTopoInfo.build_from_mesh
TORCH_INTRA_NODE_GBPS = 87.7
TORCH_INTRA_NODE_HOP_US = 0.6
TORCH_INTER_NODE_BW_FACTOR = 0.22
TORCH_INTER_NODE_HOP_US = 2.7
TORCH_BASE_LATENCY_US = 6.6

# What the optimizer step reads and writes per fp32 parameter element: the gradient-norm reads
# the gradient (4), clipping scales it in place (4 + 4), AdamW reads the parameter, gradient and
# both moments (16) and writes the parameter and both moments (12).
OPTIMIZER_BYTES_PER_PARAM = 40


@dataclass(frozen=True)
class Hardware:
    """One GPU kind and its network. Bandwidths in GB/s (1e9 bytes/s), latencies in us."""

    name: str
    peak_flops_bf16: float
    # IEEE fp32 (CUDA cores): what a float32 run without training.enable_tf32 gets
    peak_flops_fp32: float
    memory_gib: float
    # float32 on TF32 tensor cores (training.enable_tf32); None = peak_flops_fp32 (a CPU profile)
    peak_flops_tf32: float | None = None
    # float8 GEMMs (torch._scaled_mm, model.converters = ["float8"]); None: no float8 tensor cores
    peak_flops_fp8: float | None = None
    # memory the planner keeps free: CUDA context, NCCL buffers, allocator fragmentation
    reserve_gib: float = 6.0
    intra_node_gbps: float = TORCH_INTRA_NODE_GBPS
    intra_node_hop_us: float = TORCH_INTRA_NODE_HOP_US
    inter_node_gbps: float = TORCH_INTRA_NODE_GBPS * TORCH_INTER_NODE_BW_FACTOR
    inter_node_hop_us: float = TORCH_INTER_NODE_HOP_US
    base_latency_us: float = TORCH_BASE_LATENCY_US
    # Whether data-parallel collectives (FSDP all-gathers / reduce-scatters, HSDP all-reduces)
    # run concurrently with compute. GPUs: yes (NCCL on its own streams). A CPU host whose
    # cores all compute (one rank per core): no, every collective waits for the wire and
    # competes with the ranks for cores; the planner then exposes all of them.
    comm_overlap: bool = True
    # Time of a matmul FLOP of full AC's recomputed forward, relative to the FLOP/s the step
    # as a whole achieves (peak x efficiency). 1 on GPUs (matmuls dominate every pass); a CPU
    # profile measures it: there the forward carries a larger share of non-matmul work.
    recompute_cost: float = 1.0
    # Host time a tensor-parallel transformer block adds per micro-batch (forward + backward)
    # beyond its matmul FLOPs: DTensor dispatch, sharding propagation, redistribution
    # bookkeeping, and narrower GEMMs. 0 on GPUs, where the host runs ahead of the kernels; a CPU
    # profile measures it (benchmarks/planner.py: per-block step time of a tp=2 fake-backend
    # rank against a 1-process run).
    tp_block_overhead_s: float = 0.0
    # The same for a context-parallel block (load-balanced causal attention: two masked SDPA
    # calls per block instead of one causal one, the gathered K/V reordered, FSDP's per-group
    # work on the cp mesh): 0 on GPUs; a CPU profile measures it the same way.
    cp_block_overhead_s: float = 0.0
    # Memory bandwidth the optimizer step streams the rank's parameter shards, gradients and
    # AdamW states at (GB/s). GPUs: the HBM bandwidth; a CPU profile measures it.
    memory_gbps: float = 3350.0
    # Per collective kind (all_gather, reduce_scatter, all_reduce, all_to_all, send_recv): a
    # factor on the ring model's bandwidth term and a latency added to each call, for a backend
    # whose kinds do not follow the ring figures of one link (a measured profile's; empty on GPUs).
    collective_bw_scale: dict = field(default_factory=dict, hash=False)
    collective_latency_us: dict = field(default_factory=dict, hash=False)

    def peak_flops(self, dtype: str) -> float:
        """Peak FLOP/s at a matmul precision: "bfloat16"/"float16", "tf32", "float32" (IEEE) or
        "float8" (raises ValueError on a part without float8 tensor cores)."""
        if dtype == "float8":
            if self.peak_flops_fp8 is None:
                raise ValueError(
                    f"{self.name} has no float8 tensor cores (no float8 peak in trainer/metrics.py GPU_PEAKS): "
                    "plan without float8, or give peak_flops_fp8 in a --profile"
                )
            return self.peak_flops_fp8
        if dtype in ("bfloat16", "float16"):
            return self.peak_flops_bf16
        if dtype == "tf32" and self.peak_flops_tf32 is not None:
            return self.peak_flops_tf32
        return self.peak_flops_fp32

    @property
    def usable_gib(self) -> float:
        return self.memory_gib - self.reserve_gib


def _gpu_table() -> dict[str, Hardware]:
    from trainer.metrics import PEAK_FLOPS

    def entry(name: str, part: str, memory_gib: float, memory_gbps: float) -> Hardware:
        peak = PEAK_FLOPS[part]
        return Hardware(
            name, peak["bfloat16"], peak["float32"], memory_gib, peak_flops_tf32=peak["tf32"],
            peak_flops_fp8=peak.get("float8"), memory_gbps=memory_gbps,
        )  # fmt: skip

    # planner name -> trainer/metrics.py part, HBM capacity and bandwidth from NVIDIA's datasheets
    return {
        "h100": entry("h100", "H100 SXM", 80.0, 3350.0),  # 80 GB HBM3, 3.35 TB/s
        "h100-pcie": entry("h100-pcie", "H100 PCIe", 80.0, 2000.0),  # 80 GB HBM2e, 2 TB/s
        "h100-nvl": entry("h100-nvl", "H100 NVL", 94.0, 3900.0),  # 94 GB HBM3, 3.9 TB/s
        "h200": entry("h200", "H200 SXM", 141.0, 4800.0),  # 141 GB HBM3e, 4.8 TB/s
        "h200-nvl": entry("h200-nvl", "H200 NVL", 141.0, 4800.0),  # 141 GB HBM3e, 4.8 TB/s
        "a100": entry("a100", "A100 SXM", 80.0, 2039.0),  # the 80 GB SXM4 part, 2,039 GB/s
        "a100-pcie": entry("a100-pcie", "A100 PCIe", 80.0, 1935.0),  # the 80 GB PCIe part, 1,935 GB/s
        "b200": entry("b200", "B200", 180.0, 8000.0),  # HGX B200: 180 GB HBM3e, 8 TB/s
    }


# trainer/metrics.py part -> planner name (parts without one, e.g. L40S with no NVLink, GH200: None)
_PLANNER_NAME = {
    "H100 SXM": "h100",
    "H100 PCIe": "h100-pcie",
    "H100 NVL": "h100-nvl",
    "H200 SXM": "h200",
    "H200 NVL": "h200-nvl",
    "A100 SXM": "a100",
    "A100 PCIe": "a100-pcie",
    "B200": "b200",
}
# the 40 GB A100s (SXM4 and PCIe): 40 GB HBM2, 1,555 GB/s
_A100_40GB = {"memory_gib": 40.0, "memory_gbps": 1555.0}


GPUS: dict[str, Hardware] = {}


def gpu_names() -> list[str]:
    if not GPUS:
        GPUS.update(_gpu_table())
    return sorted(GPUS)


def load_hardware(gpu: str, profile: str | None = None, **overrides) -> Hardware:
    """The named GPU (:func:`gpu_names`: ``h100``, ``h100-pcie``, ``h200``, ...), then the keys of the JSON
    ``profile`` file, then ``overrides`` (None values ignored). Raises ValueError for an
    unknown GPU or profile key, naming the legal ones."""
    names = gpu_names()
    key = gpu.lower()
    if key not in GPUS:
        raise ValueError(f"unknown gpu {gpu!r}; valid gpus: {', '.join(names)} (or --profile FILE)")
    hw = GPUS[key]
    changes = {}
    if profile:
        with open(profile) as f:
            changes.update(json.load(f))
    changes.update({k: v for k, v in overrides.items() if v is not None})
    fields = {f.name for f in dataclasses.fields(Hardware)}
    unknown = sorted(set(changes) - fields)
    if unknown:
        raise ValueError(f"unknown hardware key(s) {unknown} in the profile; valid keys: {', '.join(sorted(fields))}")
    for key in ("collective_bw_scale", "collective_latency_us"):
        if key in changes:
            value = changes[key]
            if (
                not isinstance(value, dict)
                or not set(value) <= set(COLLECTIVE_KINDS)
                or not all(isinstance(v, (int, float)) and v >= 0 for v in value.values())
            ):
                raise ValueError(
                    f"hardware key {key!r} must map collective kinds ({', '.join(COLLECTIVE_KINDS)}) to numbers >= 0, "
                    f"got {value!r}"
                )
    return dataclasses.replace(hw, **changes)


def hardware_for_device(device_name: str) -> Hardware | None:
    """The table entry of a CUDA device name (``torch.cuda.get_device_name()``), matched like the
    trainer's MFU table (``trainer.metrics.find_gpu``: "NVIDIA H100 80GB HBM3" -> h100, "NVIDIA H100
    PCIe" -> h100-pcie, "NVIDIA H200 NVL" -> h200-nvl; a 40 GB A100 gets its memory); None for a GPU
    the planner lacks."""
    from trainer.metrics import find_gpu

    row = find_gpu(device_name)
    if row is None or row.part not in _PLANNER_NAME:
        return None
    hw = dataclasses.replace(load_hardware(_PLANNER_NAME[row.part]), name=device_name)
    if row.part.startswith("A100") and "40gb" in device_name.lower().replace("-", " ").split():
        hw = dataclasses.replace(hw, **_A100_40GB)
    return hw


def optimizer_seconds(local_params: float, hw: Hardware) -> float:
    """Time of one optimizer step over ``local_params`` fp32 parameter elements (the rank's
    unpadded shards): memory-bound, :data:`OPTIMIZER_BYTES_PER_PARAM` per element."""
    return local_params * OPTIMIZER_BYTES_PER_PARAM / (hw.memory_gbps * 1e9)


def collective_seconds(kind: str, nbytes: float, group_size: int, crosses_nodes: bool, hw: Hardware) -> float:
    """Ring cost of one collective over ``group_size`` ranks (torch's formulas, see the module
    docstring). ``nbytes``: the full buffer (all-gather output, reduce-scatter input,
    all-reduce tensor, all-to-all input, send/recv message)."""
    if group_size <= 1 and kind != "send_recv":
        return 0.0
    bw = (hw.inter_node_gbps if crosses_nodes else hw.intra_node_gbps) * 1e9
    hop = hw.inter_node_hop_us if crosses_nodes else hw.intra_node_hop_us
    n = group_size
    if kind in ("all_gather", "reduce_scatter"):
        hops, moved = n - 1, nbytes * (n - 1) / n
    elif kind == "all_reduce":
        hops, moved = 2 * (n - 1), 2 * nbytes * (n - 1) / n
    elif kind == "all_to_all":
        # pairwise exchange: each rank sends (n-1)/n of its buffer, n-1 steps
        hops, moved = n - 1, nbytes * (n - 1) / n
    elif kind == "send_recv":
        hops, moved = 1, nbytes
    else:
        raise ValueError(f"unknown collective kind {kind!r}")
    latency = hw.base_latency_us + hops * hop + hw.collective_latency_us.get(kind, 0.0)
    return latency * 1e-6 + moved / bw * hw.collective_bw_scale.get(kind, 1.0)
