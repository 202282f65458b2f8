"""One parallelize plan for every model: each applier gets the mesh ParallelDims hands it and
reads what the model declares (``models/common/decoder.py``: the decoder structure, the
attention's and feed-forward's TP projections, ``moe_layers()``), so a new model needs no
change here.

Order matters: the float8 converter swaps linears for torchao's ``Float8Linear`` first (so every
applier below sees the float8 modules), the LoRA converter adds adapters to them and freezes the
base (models/parallel/lora.py; after TP and EP it shards the adapters like their base), TP and EP turn parameters into DTensors on their meshes, CP swaps the attention
cores, activation checkpointing and compile wrap block forwards, and FSDP goes last so it
shards whatever the others produced over the data-parallel meshes.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from models.parallel.activation_checkpoint import apply_activation_checkpointing
from models.parallel.activation_offload import ActivationOffload, apply_activation_offload
from models.parallel.context_parallel import apply_context_parallel
from models.parallel.expert_parallel import apply_expert_parallel
from models.parallel.float8 import Float8Options, convert_to_float8
from models.parallel.fsdp import apply_fsdp
from models.parallel.lora import LoRAOptions, convert_to_lora, shard_adapters_like_base
from models.parallel.mixed_precision import apply_compute_copies
from models.parallel.tensor_parallel import apply_tensor_parallel
from parallel_dims import ParallelDims

__all__ = ["ParallelizeOptions", "apply_converters", "parallelize_model"]

# How mixed precision runs where no parameter is sharded over data-parallel ranks and there is
# no pipeline: "compute_copies" (models/parallel/mixed_precision.py) or "fsdp" (FSDP2 on the
# size-1 mesh, the way before; benchmarks/param_traffic.py and the tests that prove the two
# equal set it).
ONE_RANK_MIXED_PRECISION = "compute_copies"


@dataclass
class ParallelizeOptions:
    sequence_parallel: bool = True
    loss_parallel: bool = True
    chunked_head: bool = False  # training.loss_chunk_tokens > 0 (models/common/chunked_loss.py)
    param_dtype: str = "float32"
    reduce_dtype: str = "float32"
    reshard_after_forward: str = "default"
    ac_mode: str = "none"
    ac_selective_option: str = "op"
    compile: bool = False
    float8: Float8Options | None = None  # model.converters = ["float8"] and/or ["float8_experts"]
    lora: LoRAOptions | None = None  # model.converters = ["lora"] (models/parallel/lora.py)
    cpu_offload: bool = False  # training.cpu_offload: FSDP2's CPUOffloadPolicy on every unit
    ac_offload: bool = False  # activation_checkpoint.offload (models/parallel/activation_offload.py)


def apply_converters(model: nn.Module, parallel_dims: ParallelDims, opts: ParallelizeOptions) -> nn.Module:
    """The converters of ``model.converters`` (float8, then LoRA) applied to ``model`` in place,
    before any parallelism: what decides which parameters exist and which train. The trainer
    also runs them on a meta copy of the whole model, so the optimizer's groups are checked and
    summarised over the parameters that really train (trainer/build.py ``trainable_params``)."""
    pd = parallel_dims
    if opts.float8 is not None:
        # float8 all-gather only where FSDP really shards the dense weights (not on the size-1
        # mesh that only casts, nor across replicas alone)
        dense = pd.fsdp_mesh_for("dense")
        sharded = dense is not None and dense.size(dense.ndim - 1) > 1
        all_gather = opts.float8.fsdp_float8_all_gather and sharded
        convert_to_float8(model, opts.float8, fsdp_all_gather=all_gather, etp=pd.etp)
    if opts.lora is not None:  # adapters on the (float8 or plain) linears; the base frozen
        convert_to_lora(model, opts.lora)
    return model


def parallelize_model(model: nn.Module, parallel_dims: ParallelDims, opts: ParallelizeOptions) -> nn.Module:
    """Apply every enabled parallelism to ``model`` (a :class:`~models.common.decoder.Decoder`,
    whole or one pipeline stage) in place and return it. Works on meta-device models:
    initialize weights afterwards."""
    pd = parallel_dims
    apply_converters(model, pd, opts)
    if pd.tp > 1:
        apply_tensor_parallel(
            model,
            pd.get_mesh("tp"),
            sequence_parallel=opts.sequence_parallel,
            loss_parallel=opts.loss_parallel,
            chunked_head=opts.chunked_head,
        )
    moes = model.moe_layers()
    if moes and (pd.ep > 1 or pd.etp > 1):
        ep_mesh, etp_mesh = pd.expert_parallel_meshes
        for moe in moes:
            apply_expert_parallel(moe.experts, ep_mesh, etp_mesh)
    if opts.lora is not None:  # adapters sharded like their base layers; base frozen again
        shard_adapters_like_base(model)
    if pd.cp > 1:
        apply_context_parallel(model, pd.get_mesh("cp"))
    offload = ActivationOffload(model) if opts.ac_offload else None
    # compiled blocks: what the compiled graph saves goes through the outer hooks; the per-op
    # selective-AC recorder (a policy closure dynamo cannot trace as a context_fn) stays out
    apply_activation_checkpointing(model, opts.ac_mode, opts.ac_selective_option, None if opts.compile else offload)
    if offload is not None:  # outside the checkpoint wrappers: their saved block inputs are offloaded too
        apply_activation_offload(model, offload=offload)
    if opts.compile:
        for block in model.blocks():
            block.compile()
    # Experts get their own FSDP wrapping whenever their rank sets differ from the dense
    # params': as DTensors over ep/etp, or replicated over tp ranks that see different tokens.
    separate = bool(moes) and (pd.ep > 1 or pd.etp > 1 or pd.tp > 1)
    mixed = opts.param_dtype != "float32" or opts.reduce_dtype != "float32"
    dense_mesh = pd.fsdp_mesh_for("dense")
    expert_mesh = pd.fsdp_mesh_for("expert") if separate else None
    one_rank = dense_mesh is None and expert_mesh is None and pd.pp == 1
    if (
        mixed
        and one_rank
        and not opts.cpu_offload
        and opts.param_dtype != "float32"
        and ONE_RANK_MIXED_PRECISION == "compute_copies"
    ):
        # No parameter is sharded over data-parallel ranks and there is no pipeline (one GPU,
        # pure TP): fp32 masters with compute copies, the work of a mixed-precision loop and
        # no more (see models/parallel/mixed_precision.py; FSDP2 on a size-1 mesh computes the
        # same values but copies every gradient once more).
        apply_compute_copies(model, opts.param_dtype)
        return model
    # Otherwise mixed precision is FSDP2's: without data parallelism (a pipeline stage, EP
    # without data parallelism) FSDP2 wraps on the size-1 shard mesh, where it only casts (see
    # models/parallel/fsdp.py). CPU offload is FSDP2's too, so with it FSDP2 wraps every layout,
    # on the size-1 mesh where nothing is sharded (one GPU, pure TP, PP, EP without dp).
    trivial = mixed or opts.cpu_offload
    apply_fsdp(
        model,
        pd.fsdp_mesh_for("dense", allow_trivial=trivial),
        pd.fsdp_mesh_for("expert", allow_trivial=trivial) if separate else None,
        param_dtype=opts.param_dtype,
        reduce_dtype=opts.reduce_dtype,
        reshard_after_forward=opts.reshard_after_forward,
        pp_enabled=pd.pp > 1,
        separate_experts=separate,
        cpu_offload=opts.cpu_offload,
    )
    return model
