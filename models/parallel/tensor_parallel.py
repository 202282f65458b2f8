"""Tensor, sequence and loss parallelism on the ``tp`` mesh, for every model.

What to split comes from the model: the decoder structure (``models/common/decoder.py``), the
projections each attention and feed-forward module declares (``tp_colwise`` / ``tp_rowwise``)
and ``block.moe_enabled``.

Layout between blocks (sequence parallel): activations are sharded along the sequence
(``Shard(1)``), so norms and residual adds run on ``s / tp`` tokens per rank. Each attention and
feed-forward input is all-gathered to the full sequence, projected column-wise (heads / hidden
units split over tp), and the row-wise output projection reduce-scatters back to ``Shard(1)``.
The output projection keeps the vocabulary sharded (``Shard(-1)``) so cross entropy runs under
``loss_parallel`` without gathering the logits. Both the embedding (row-wise) and the head
(column-wise) hold their ``[vocab, dim]`` weight as ``Shard(0)``, so tied embeddings stay one
Parameter (the vocabulary must divide tp).

Pipeline stage boundaries keep that layout: a stage hands the next one its last block's
sequence-sharded output as it is, so each tp rank sends its own ``[b, s / tp, dim]`` shard to
the same tp rank of the next stage (no gather before the send, no re-shard after the receive).
The stage's ``boundary_seq_shards`` records the split, so a stage fed hidden states still
computes RoPE for the whole local sequence its attention gathers
(``models/common/decoder.Decoder.local_seq_len``), and the pipeline sizes its buffers from it.
Without sequence parallelism activations are replicated over tp, boundaries included.

Gradient bookkeeping that plain DTensor styles do not cover is made explicit here:

* MLA's decoupled rope key ``k_pe`` is computed by replicated weights but consumed by this rank's
  heads only, so its gradient is partial; the model calls ``attention.k_pe_grad_sync`` on it
  (declared in ``attention.tp_grad_syncs``), which this module sets to an all-reduce in
  backward.
* Blocks may declare extra modules around the decoder block with a TP role each
  (``block.tp_roles``, e.g. DeepSeek-V3's MTP depths, ``models/deepseek_v3/mtp.py``):
  ``"embedding"`` is sharded like ``tok_embeddings``, ``"norm"`` like the blocks' norms,
  ``"replicated_linear"`` keeps one replicated weight applied to this rank's sequence shard (no
  communication in forward; its gradient is a partial sum over tp that DTensor reduces).
* MoE layers route this rank's own tokens (sequence parallel gives every tp rank different
  tokens). The router gate is a replicated DTensor fed token-sharded inputs, so its gradient
  comes out partial and is summed over tp. Shared experts are an ordinary TP feed-forward over
  the flattened tokens.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from models.parallel.context_parallel import AllReduceCounts

__all__ = ["AllReduceBackward", "apply_tensor_parallel", "loss_parallel_context"]


class AllReduceBackward(torch.autograd.Function):
    """Identity forward; all-reduce (sum) of the gradient over ``group`` in backward.

    Marks a tensor computed identically on every tp rank whose consumers are split over tp:
    each rank's gradient is a partial sum and the true gradient is their sum."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReplicatedOnShards(ParallelStyle):
    """Replicated weights applied to this rank's own activations: local (or DTensor) input in,
    local output out. ``layout`` says what the local input is: ``Shard(0)`` for the MoE router
    gate (token-sharded ``[tokens, dim]``), the blocks' layout for an MTP depth's ``eh_proj``
    (``Shard(1)`` under sequence parallelism, else ``Replicate()``). Inside, the input is a DTensor
    of that layout, so under a ``Shard`` the weight gradient is a partial sum that DTensor (or
    FSDP) reduces over tp."""

    def __init__(self, layout) -> None:
        super().__init__()
        self.layout = layout

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def to_dtensor_input(mod, inputs, mesh):
            x = inputs[0]
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, mesh, (self.layout,), run_check=False)
            return (x, *inputs[1:])

        def to_local_output(mod, outputs, mesh):
            return outputs.to_local()

        def replicate_params(name, mod, mesh):
            for pname, param in list(mod.named_parameters(recurse=False)):
                dist_param = nn.Parameter(distribute_tensor(param, mesh, [Replicate()], src_data_rank=None))
                mod.register_parameter(pname, dist_param)

        return distribute_module(
            module, device_mesh, replicate_params, input_fn=to_dtensor_input, output_fn=to_local_output
        )


def _role_plan(block: nn.Module, sp: bool) -> dict[str, ParallelStyle]:
    """The styles of the modules a block declares in ``tp_roles`` (see the module docstring)."""
    seq = Shard(1) if sp else Replicate()
    plan: dict[str, ParallelStyle] = {}
    for name, role in getattr(block, "tp_roles", {}).items():
        if role == "embedding":
            plan[name] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
        elif role == "norm":
            if sp:
                plan[name] = SequenceParallel()
        elif role == "replicated_linear":
            plan[name] = _ReplicatedOnShards(seq)
        else:
            raise ValueError(
                f"{type(block).__name__}.tp_roles[{name!r}] = {role!r} is not a tensor-parallel role "
                "(use 'embedding', 'norm' or 'replicated_linear')"
            )
    return plan


def _declared_tp(module: nn.Module, role: str) -> tuple[tuple[str, ...], str]:
    """The column-wise and row-wise projections ``module`` declares (``tp_colwise`` /
    ``tp_rowwise``, see ``models/common/decoder.DecoderAttention``)."""
    colwise, rowwise = module.tp_colwise, module.tp_rowwise
    if not colwise:
        raise ValueError(
            f"{type(module).__name__} (the {role}) declares no tp_colwise projections, so tensor "
            "parallelism does not know how to split it; see models/common/decoder.py"
        )
    return tuple(colwise), rowwise


def _input_stays_dtensor(module: nn.Module, colwise: tuple[str, ...], rowwise: str) -> bool:
    """Whether ``module``'s input can stay a Replicate DTensor: true when every parameter it
    holds belongs to a column-wise or the row-wise projection (then every consumer of the
    input is a DTensor-aware projection). Its column-wise projections' input gradients are
    then Partial DTensors that autograd sums, and the input's redistribution turns that sum
    into one reduce-scatter (sequence parallel) or one all-reduce, instead of one all-reduce
    per projection, which a local input costs. Modules with replicated plain weights fed the
    input (MLA's low-rank parts) need it as a local tensor."""
    owners = set(colwise) | {rowwise}
    return all(name.split(".", 1)[0] in owners for name, _ in module.named_parameters())


def _attention_plan(attention: nn.Module, sp: bool) -> dict[str, ParallelStyle]:
    """The projections that produce heads (``attention.tp_colwise``) are split column-wise,
    the output projection (``attention.tp_rowwise``) row-wise; everything else (e.g. MLA's
    low-rank parts) stays replicated."""
    colwise, rowwise = _declared_tp(attention, "attention")
    seq = Shard(1) if sp else Replicate()
    plan: dict[str, ParallelStyle] = {
        # x -> full sequence, replicated: every projection below sees all tokens. The RoPE rows
        # and the attention mask are plain tensors of the full local sequence (the decoder
        # builds them once per micro-batch before the blocks).
        "": PrepareModuleInput(
            input_layouts=(seq, None, None),
            desired_input_layouts=(Replicate(), None, None),
            use_local_output=not _input_stays_dtensor(attention, colwise, rowwise),
        ),
        rowwise: RowwiseParallel(output_layouts=seq),
    }
    plan.update({name: ColwiseParallel() for name in colwise})
    return plan


def _feed_forward_plan(ffn: nn.Module, token_dim: int, sp: bool) -> dict[str, ParallelStyle]:
    colwise, rowwise = _declared_tp(ffn, "feed-forward")
    seq = Shard(token_dim) if sp else Replicate()
    plan: dict[str, ParallelStyle] = {
        "": PrepareModuleInput(
            input_layouts=(seq,),
            desired_input_layouts=(Replicate(),),
            use_local_output=not _input_stays_dtensor(ffn, colwise, rowwise),
        )
    }
    plan.update({name: ColwiseParallel() for name in colwise})
    plan[rowwise] = RowwiseParallel(output_layouts=seq)
    return plan


def _prefixed(prefix: str, plan: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    return {(f"{prefix}.{k}" if k else prefix): v for k, v in plan.items()}


def _own_storage(module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
    """The sharded embedding's output in storage of its own: the reduce-scatter onto the
    sequence dimension (Partial -> Shard(1)) runs on dim 0 and hands back ``movedim(0, 1)`` of
    its buffer, a non-contiguous view. FSDP2 (its post-forward hook runs after this one) warns
    of every view it wraps, because an in-place op on a view drops its pre-backward hook. The
    model adds to the embedding out of place, so that drop cannot happen here; the copy (one
    activation of this rank's sequence shard per micro-batch) removes the view rather than
    the warning, and hands the first block contiguous memory."""
    if output._base is None:
        return output
    return output.clone(memory_format=torch.contiguous_format)


def apply_tensor_parallel(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    *,
    sequence_parallel: bool = True,
    loss_parallel: bool = True,
    chunked_head: bool = False,
) -> None:
    """Shard ``model`` (a :class:`~models.common.decoder.Decoder`, possibly one pipeline
    stage) over ``tp_mesh`` in place. ``chunked_head``: the head computes the chunked loss
    (models/common/chunked_loss.py) on its vocabulary shard and returns each token's loss,
    already reduced over tp, replicated: its output layout is then ``Replicate``, handed back
    as the local tensor."""
    sp = sequence_parallel
    seq = Shard(1) if sp else Replicate()
    top: dict[str, ParallelStyle] = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if model.norm is not None and sp:
        top["norm"] = SequenceParallel()
    if model.output is not None:
        vocab_sharded = loss_parallel and not chunked_head
        top["output"] = ColwiseParallel(
            input_layouts=seq,
            output_layouts=Shard(-1) if vocab_sharded else Replicate(),
            use_local_output=not vocab_sharded,
        )
    tied = (
        model.tok_embeddings is not None
        and model.output is not None
        and model.output.weight is model.tok_embeddings.weight
    )
    if tied and model.tok_embeddings.weight.shape[0] % tp_mesh.size():
        raise ValueError(
            f"tp={tp_mesh.size()} does not divide vocab_size={model.tok_embeddings.weight.shape[0]} of a model with "
            "tied embeddings (the embedding and the head share one vocabulary-sharded tensor); use a vocab_size "
            "that is a multiple of tp"
        )
    if top:
        parallelize_module(model, tp_mesh, top)
    if tied:
        # The embedding (row-wise: vocabulary rows split, Shard(0)) and the head (column-wise:
        # output features = vocabulary rows, Shard(0)) shard [vocab, dim] the same way; each
        # style distributed the weight into a Parameter of its own: keep the embedding's for both
        emb, head = model.tok_embeddings.weight, model.output.weight
        if emb.placements != head.placements:
            raise RuntimeError(f"tied embeddings: embedding sharded {emb.placements}, head {head.placements}")
        model.output.weight = emb
    if model.tok_embeddings is not None and sp:
        model.tok_embeddings.register_forward_hook(_own_storage)
    # Pipeline stages exchange the blocks' own layout: this rank's sequence shard under SP
    # (the first block's SequenceParallel norm takes it as received).
    model.boundary_seq_shards = tp_mesh.size() if sp else 1

    tp_group = tp_mesh.get_group()
    for block in model.blocks():
        plan: dict[str, ParallelStyle] = _role_plan(block, sp)
        if sp:
            plan["attention_norm"] = SequenceParallel()
            plan["ffn_norm"] = SequenceParallel()
        plan.update(_prefixed("attention", _attention_plan(block.attention, sp)))
        for name in block.attention.tp_grad_syncs:
            setattr(block.attention, name, lambda t, g=tp_group: AllReduceBackward.apply(t, g))
        if not block.moe_enabled:
            plan.update(_prefixed("feed_forward", _feed_forward_plan(block.feed_forward, 1, sp)))
        else:
            moe = block.moe
            if not sp:
                raise ValueError(
                    "A MoE model with tp > 1 needs sequence parallel (every tp rank routes its "
                    "own tokens); set parallelism.enable_sequence_parallel = true"
                )
            # the MoE routes the local tokens of this rank: take its input as a local tensor
            plan["moe"] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_output=True
            )
            plan["moe.router.gate"] = _ReplicatedOnShards(Shard(0))
            # the sequence aux loss counts each sequence's picks over all its tokens: sum the
            # per-sequence counts of the tp ranks' slices
            moe.add_aux_count_reduction(AllReduceCounts(tp_mesh))
            if moe.shared_experts is not None:
                # MoE flattens tokens to [bs * s_local, dim] before the shared experts.
                plan.update(_prefixed("moe.shared_experts", _feed_forward_plan(moe.shared_experts, 0, sp)))
        parallelize_module(block, tp_mesh, plan)
        if sp:
            for name, role in getattr(block, "tp_roles", {}).items():
                if role == "embedding":
                    block.get_submodule(name).register_forward_hook(_own_storage)


def loss_parallel_context(enabled: bool):
    """Context for computing (and back-propagating) cross entropy on vocab-sharded logits."""
    return loss_parallel() if enabled else contextlib.nullcontext()
