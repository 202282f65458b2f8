"""GPUs and networks the planner prices layouts on, and the ring cost model of a collective.

Peak FLOP/s come from the trainer's own table (``trainer/reporting/metrics.py`` ``GPU_PEAKS``: dense, no
sparsity, per matmul precision: "float32" is IEEE fp32, "tf32" a float32 run with
``training.enable_tf32``, "bfloat16"/"float16" mixed precision). Memory sizes and bandwidths are the
parts' datasheet HBM figures.

Links (:data:`LINKS`, per GPU kind): the bus bandwidth NCCL reaches in published nccl-tests runs
(``busbw`` of all_gather_perf / reduce_scatter_perf / all_reduce_perf at large sizes), each figure
with its source in a comment here and in docs/planner.md:

* inside a node: the ring figure of the node's NVLink / NVSwitch generation (H100 and H200 NVLink4
  370 GB/s, A100 NVLink3 230 GB/s, B200 NVLink5 695 GB/s); NVLink SHARP all-reduce reaches more
  (480 GB/s on H100 / H200), which the planner does not count: most of a step's traffic in a node
  is all-gather and reduce-scatter (FSDP, sequence parallelism), which run as rings;
* across nodes: per GPU, the bus bandwidth of its own NIC (one 400 Gb/s ConnectX-7 per GPU on
  DGX/HGX H100, H200 and B200: 48 GB/s; 200 Gb/s HDR on DGX A100: 24 GB/s). NCCL's rings and trees
  cross nodes on every NIC of the node at once (rail by rail), so a group with ``g`` members in
  each node reaches ``g`` x that figure, at most the NVLink ring's (8 x 48 = 384 GB/s against the
  ~396 GB/s NVIDIA quotes for 8 NICs); an all-to-all sends each member's off-node share through
  its own NIC;
* latency: NCCL's own cost model (``src/graph/tuning.cc``, ``baseLat`` / ``hwLat`` of the Ring
  algorithm, Simple protocol, which NCCL runs for bulk transfers): 8.4 us per collective, 3.4 us
  per ring step over NVLink, 14 us per step over the network; a ring over ``n`` ranks in ``m``
  nodes takes ``n - m`` NVLink steps and ``m`` network steps per pass.

These replace torch's DTensor cost-model constants (``torch/distributed/tensor/_collective_utils.py``
``MeshTopoInfo.build_from_mesh``: 87.7 GB/s in a node -- NCCL's cap on the low-latency protocol
for Ampere, ``llMaxBws``, not a bulk bandwidth -- x0.22 across nodes, 0.6 / 2.7 / 6.6 us, the LL
protocol's latencies), which priced NVLink at a quarter of what NCCL reaches and steered the
search away from tensor parallelism inside a node. Parts without an NVSwitch (PCIe cards, NVL
pairs) get a third party's PCIe figure, the A100 PCIe a labelled estimate (:data:`LINKS`);
measure yours and give a ``--profile``.

Ring algorithms: all-gather and reduce-scatter move ``bytes * (n-1)/n`` per rank, all-reduce
twice that (reduce-scatter + all-gather), where ``bytes`` is the full buffer (all-gather output,
reduce-scatter input, all-reduce tensor); a measured profile may scale one kind
(``collective_bw_scale``: its bandwidth term; ``collective_latency_us``: added latency) -- gloo on
a CPU host, for one, runs a reduce-scatter at an all-reduce's cost or more.

Per-parameter work (:data:`STEP_BYTES_PER_PARAM`): the memory-bound passes over every local
parameter element in a mixed-precision step (float32 masters, compute-dtype copies), priced at
the memory bandwidth ``memory_gbps`` (:func:`optimizer_seconds`; a CPU profile measures an
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
from functools import lru_cache

__all__ = [
    "GPUS",
    "LINKS",
    "STEP_BYTES_PER_PARAM",
    "Hardware",
    "collective_seconds",
    "elementwise_seconds",
    "hardware_for_device",
    "load_hardware",
    "optimizer_seconds",
    "step_bytes_per_param",
]

GIB = 2**30
COLLECTIVE_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send_recv")

# torch's DTensor cost model (torch/distributed/tensor/_collective_utils.py, MeshTopoInfo):
# what the planner used before the published NCCL figures; kept for comparison (tests, docs)
TORCH_INTRA_NODE_GBPS = 87.7
TORCH_INTRA_NODE_HOP_US = 0.6
TORCH_INTER_NODE_BW_FACTOR = 0.22
TORCH_INTER_NODE_HOP_US = 2.7
TORCH_BASE_LATENCY_US = 6.6

# NCCL's cost model, src/graph/tuning.cc (NVIDIA/nccl, 2.19-2.27): Ring algorithm, Simple
# protocol (bulk transfers): baseLat 8.4 us; hwLat NVLINK 3.4 us, NET 14.0 us per ring step
NCCL_BASE_LATENCY_US = 8.4
NCCL_NVLINK_HOP_US = 3.4
NCCL_NET_HOP_US = 14.0

# Published nccl-tests bus bandwidths (GB/s) per GPU kind: (in a node, per GPU across nodes).
# Sources (also in docs/planner.md):
# [nvl4]  H100 / H200 NVLink4 + NVSwitch, 8 GPUs: 370 GB/s ring busbw for all_gather,
#         reduce_scatter and all_reduce with NCCL_ALGO=RING ("450GB/s is the line rate. With
#         the protocol overhead (~20%) NCCL can get an effective NVLink bandwidth of 370GB/s";
#         NVLS all_reduce peaks at ~480 GB/s busbw): S. Jeaugey (NVIDIA), NVIDIA/nccl-tests
#         issue 212 "H100 all reduce performance is poor"; H200 8 GPUs: 475 GB/s all_reduce
#         (NVLS), NVIDIA/nccl-tests issue 272; 370 -> 480 GB/s NVLS off / on, NVIDIA/nccl issue 2140.
# [nvl3]  A100 NVLink3 + NVSwitch, 8 GPUs: ~230 GB/s busbw (12 links x ~20 GB/s effective, other
#         bottlenecks): S. Jeaugey (NVIDIA), NVIDIA/nccl-tests issue 149 "Expected bandwidth
#         results? A100 GPUs over NVLink".
# [nvl5]  B200 NVLink5: ring busbw 695 GB/s (NVLS 845) measured on 8 x B300, the same NVLink5 /
#         NVSwitch generation, NVIDIA/nccl issue 2140 (no B200 figure found; B300 used).
# [ib400] one 400 Gb/s ConnectX-7 per GPU (DGX/HGX H100, H200, B200: 8 x 400 Gb/s per node):
#         ~48 GB/s busbw per NIC, up to ~396 GB/s per 8-NIC node with the ring: A. Ladd (NVIDIA),
#         NVIDIA/nccl-tests issue 319.
# [ib200] one 200 Gb/s HDR NIC per GPU (DGX A100: 8 x 200 Gb/s): 24 GB/s per NIC, S. Jeaugey
#         (NVIDIA), NVIDIA/nccl-tests issue 119.
# [pcie]  PCIe Gen5 parts without an NVSwitch (H100 PCIe, H100 NVL, H200 NVL), 8 GPUs: 35-45
#         GB/s all_reduce busbw, Alaya New, "NCCL-tests in practice -- the mandatory pre-launch
#         health check" (docs.alayanew.com/en/docs/tech-blog/2026-05-06-nccl-tests): 40 used; NVL
#         pairs' bridges reach more between the two GPUs of a pair only.
# [pcie4] ESTIMATE, no published figure found for 8 x A100 PCIe: PCIe Gen4 has half Gen5's line
#         rate (16 against 32 GT/s per lane), so half the [pcie] figure: 20 GB/s.
# Measure a PCIe machine and give a --profile.
LINKS: dict[str, tuple[float, float]] = {
    "h100": (370.0, 48.0),  # [nvl4], [ib400]
    "h200": (370.0, 48.0),  # [nvl4], [ib400]
    "a100": (230.0, 24.0),  # [nvl3], [ib200]
    "b200": (695.0, 48.0),  # [nvl5], [ib400]
    "h100-pcie": (40.0, 48.0),  # [pcie], [ib400]
    "h100-nvl": (40.0, 48.0),  # [pcie], [ib400]
    "h200-nvl": (40.0, 48.0),  # [pcie], [ib400]
    "a100-pcie": (20.0, 24.0),  # [pcie4] estimate, [ib200]
}

# Bytes one mixed-precision step moves per local parameter element (float32 master, bfloat16
# compute copy), outside the matmuls: the recipe of a mixed-precision training loop, one place.
STEP_BYTES_PER_PARAM = {
    # float32 master -> compute-dtype copy: read 4, write 2 (FSDP2's cast, or a foreach cast)
    "param_cast": 6,
    # compute-dtype gradient -> float32 gradient: read 2, write 4
    "grad_cast": 6,
    # gradient norm: one read of every float32 gradient
    "grad_norm": 4,
    # clipping: read and write every float32 gradient
    "clip": 8,
    # fused AdamW: read param, grad, m, v (16), write param, m, v (12)
    "adamw": 28,
}
# the casts happen only when the compute dtype differs from the float32 master
CAST_KEYS = ("param_cast", "grad_cast")


@lru_cache(maxsize=64)
def step_bytes_per_param(param_dtype: str = "bfloat16", reduce_dtype: str = "float32") -> int:
    """Bytes per local parameter element of the step's per-parameter work: the whole
    :data:`STEP_BYTES_PER_PARAM` recipe, without the casts when parameters compute in float32
    (52 with bfloat16 compute, 40 in float32). ``reduce_dtype`` is accepted for symmetry: the
    gradient reaches the optimizer in float32 either way."""
    del reduce_dtype
    skip = CAST_KEYS if param_dtype == "float32" else ()
    return sum(v for k, v in STEP_BYTES_PER_PARAM.items() if k not in skip)


# the float32 optimizer step alone (norm, clip, AdamW): what a float32 run moves per parameter
OPTIMIZER_BYTES_PER_PARAM = step_bytes_per_param("float32")


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
    # ring bus bandwidth in a node; across nodes per GPU (its own NIC); latencies (LINKS)
    intra_node_gbps: float = LINKS["h100"][0]
    intra_node_hop_us: float = NCCL_NVLINK_HOP_US
    inter_node_gbps: float = LINKS["h100"][1]
    inter_node_hop_us: float = NCCL_NET_HOP_US
    base_latency_us: float = NCCL_BASE_LATENCY_US
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
    # The host link (GPU <-> host memory) one GPU gets, effective GB/s per direction: what the
    # planner's --fit prices CPU offload (training.cpu_offload) and activation offload
    # (activation_checkpoint.offload) over. H100 SXM hosts: PCIe Gen5 x16 per GPU, 64 GB/s raw
    # per direction (PCI-SIG, PCIe 5.0 base spec: 32 GT/s x 16 lanes, 128b/130b) and about 55
    # GB/s measured host-to-device on pinned memory (NVIDIA's nvbandwidth / bandwidthTest on
    # DGX H100; the same figure torchtitan's and DeepSpeed's offload notes assume): 55.
    host_link_gbps: float = 55.0
    # Host memory bandwidth one GPU's share of the host gets, GB/s: where CPU offload runs the
    # optimizer step. DGX H100: 2 x Xeon Platinum 8480C, 8 channels of DDR5-4800 each (Intel ARK:
    # 307 GB/s per socket), 614 GB/s for 8 GPUs: 76.
    host_memory_gbps: float = 76.0
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
                    f"{self.name} has no float8 tensor cores (no float8 peak in trainer/reporting/metrics.py GPU_PEAKS): "
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
    from trainer.reporting.metrics import PEAK_FLOPS

    def entry(name: str, part: str, memory_gib: float, memory_gbps: float) -> Hardware:
        peak = PEAK_FLOPS[part]
        return Hardware(
            name, peak["bfloat16"], peak["float32"], memory_gib, peak_flops_tf32=peak["tf32"],
            peak_flops_fp8=peak.get("float8"), memory_gbps=memory_gbps,
            intra_node_gbps=LINKS[name][0], inter_node_gbps=LINKS[name][1],
        )  # fmt: skip

    # planner name -> trainer/reporting/metrics.py part, HBM capacity and bandwidth from NVIDIA's datasheets
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


# trainer/reporting/metrics.py part -> planner name (parts without one, e.g. L40S with no NVLink, GH200: None)
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
    trainer's MFU table (``trainer.reporting.metrics.find_gpu``: "NVIDIA H100 80GB HBM3" -> h100, "NVIDIA H100
    PCIe" -> h100-pcie, "NVIDIA H200 NVL" -> h200-nvl; a 40 GB A100 gets its memory); None for a GPU
    the planner lacks."""
    from trainer.reporting.metrics import find_gpu

    row = find_gpu(device_name)
    if row is None or row.part not in _PLANNER_NAME:
        return None
    hw = dataclasses.replace(load_hardware(_PLANNER_NAME[row.part]), name=device_name)
    if row.part.startswith("A100") and "40gb" in device_name.lower().replace("-", " ").split():
        hw = dataclasses.replace(hw, **_A100_40GB)
    return hw


def optimizer_seconds(local_params: float, hw: Hardware, bytes_per_param: float = OPTIMIZER_BYTES_PER_PARAM) -> float:
    """Time of the step's per-parameter work over ``local_params`` parameter elements (the
    rank's unpadded shards): memory-bound, ``bytes_per_param`` per element
    (:func:`step_bytes_per_param`; the default, the float32 optimizer step alone)."""
    return local_params * bytes_per_param / (hw.memory_gbps * 1e9)


def elementwise_seconds(nbytes: float, hw: Hardware) -> float:
    """Time of ``nbytes`` of memory-bound activation traffic (:mod:`tools.planner.elementwise`)."""
    return nbytes / (hw.memory_gbps * 1e9)


def collective_seconds(
    kind: str, nbytes: float, group_size: int, crosses_nodes: bool, hw: Hardware, per_node: int = 1
) -> float:
    """Ring cost of one collective over ``group_size`` ranks (see the module docstring).
    ``nbytes``: the full buffer (all-gather output, reduce-scatter input, all-reduce tensor,
    all-to-all input, send/recv message). A group that crosses nodes has ``per_node`` members in
    each node: its ring crosses the network on that many NICs at once (bandwidth ``per_node`` x
    ``inter_node_gbps``, at most the node's ``intra_node_gbps``) and takes one network step per
    node, NVLink steps for the rest; an all-to-all sends each member's off-node share through its
    own NIC."""
    if group_size <= 1 and kind != "send_recv":
        return 0.0
    n = group_size
    nodes = max(n // max(per_node, 1), 1) if crosses_nodes else 1
    if crosses_nodes:
        bw = min(hw.inter_node_gbps * max(per_node, 1), hw.intra_node_gbps) * 1e9
    else:
        bw = hw.intra_node_gbps * 1e9
    if kind in ("all_gather", "reduce_scatter"):
        passes, moved = 1, nbytes * (n - 1) / n
    elif kind == "all_reduce":
        passes, moved = 2, 2 * nbytes * (n - 1) / n
    elif kind == "all_to_all":
        # pairwise exchange: each rank sends (n-1)/n of its buffer, n-1 steps; across nodes the
        # off-node share goes through the rank's own NIC, the rest over NVLink at the same time
        passes, moved = 1, nbytes * (n - 1) / n
        if crosses_nodes:
            off_node = nbytes * (n - per_node) / n
            on_node = nbytes * (per_node - 1) / n
            seconds = max(off_node / (hw.inter_node_gbps * 1e9), on_node / (hw.intra_node_gbps * 1e9))
            latency = hw.base_latency_us + (n - nodes) * hw.intra_node_hop_us + nodes * hw.inter_node_hop_us
            latency += hw.collective_latency_us.get(kind, 0.0)
            return latency * 1e-6 + seconds * hw.collective_bw_scale.get(kind, 1.0)
    elif kind == "send_recv":
        hop = hw.inter_node_hop_us if crosses_nodes else hw.intra_node_hop_us
        if crosses_nodes:
            bw = hw.inter_node_gbps * 1e9
        latency = hw.base_latency_us + hop + hw.collective_latency_us.get(kind, 0.0)
        return latency * 1e-6 + nbytes / bw * hw.collective_bw_scale.get(kind, 1.0)
    else:
        raise ValueError(f"unknown collective kind {kind!r}")
    # a ring pass over n ranks in `nodes` nodes: n - nodes NVLink steps and `nodes` network steps
    # (n - 1 NVLink steps in one node)
    if crosses_nodes:
        steps = (n - nodes) * hw.intra_node_hop_us + nodes * hw.inter_node_hop_us
    else:
        steps = (n - 1) * hw.intra_node_hop_us
    latency = hw.base_latency_us + passes * steps + hw.collective_latency_us.get(kind, 0.0)
    return latency * 1e-6 + moved / bw * hw.collective_bw_scale.get(kind, 1.0)
