"""Activation checkpointing per transformer block, without renaming parameters.

The block's ``forward`` is replaced on the instance, so FQNs (and with them seeded init, state
dicts and checkpoints) are the same with and without checkpointing.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import (
    SAC_IGNORED_OPS,
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

__all__ = ["apply_activation_checkpointing"]

# Outputs of these ops are expensive to recompute and comparatively small: keep them. Every
# attention kernel SDPA may pick (on H100 it can choose cuDNN's), the MoE experts' grouped
# GEMMs, which carry most of an MoE layer's FLOPs, and their float8 forms (the float8 experts'
# per-expert _scaled_mm and torchao's _scaled_grouped_mm: without them selective AC ran every
# float8 expert GEMM twice, test_float8_experts.py). Ops a torch lacks are skipped.
_SAVE_OPS = {
    getattr(torch.ops.aten, name).default
    for name in (
        "mm",
        "addmm",
        "bmm",
        "_grouped_mm",
        "_scaled_mm",
        "_scaled_grouped_mm",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_fused_attention_overrideable",
    )
    if hasattr(torch.ops.aten, name)
}
# FlexAttention (model.attn_type = flex) is a higher-order op, not an aten one.
_flex_op = getattr(torch.ops.higher_order, "flex_attention", None)
if _flex_op is not None:
    _SAVE_OPS.add(_flex_op)
# Collectives are never recomputed (recomputing would re-communicate).
for _name in ("reduce_scatter_tensor", "all_reduce", "all_gather_into_tensor", "all_to_all_single"):
    _op = getattr(torch.ops._c10d_functional, _name, None)
    if _op is not None:
        _SAVE_OPS.add(_op.default)


# Profiler annotations are not tensor computation, yet selective checkpointing replays every
# op by (op, call index) and fails when the recomputation makes more calls of one op than the
# forward did. FSDP2's hooks on a module nested in a checkpointed block (the MoE experts, which
# are sharded on their own mesh) annotate more in the recomputation than in the forward: during
# backward no FSDP state is this iteration's forward root, so the nested state opens an extra
# "FSDP::root_pre_forward" range ("profiler._record_function_enter_new.default invocation index
# 3 encountered during backward but not found in storage" on deepseek_v3 with EP x ETP). Torch's
# own set of ops that selective checkpointing passes through untouched (public, exported by
# torch.utils.checkpoint since before 2.11; newer torch adds these ops to it itself) gets the
# profiler's range ops, so annotations run in both passes and never enter the replay storage.
for _name in ("_record_function_enter", "_record_function_enter_new", "_record_function_exit"):
    _packet = getattr(torch.ops.profiler, _name, None)
    if _packet is not None:
        SAC_IGNORED_OPS.update(getattr(_packet, overload) for overload in _packet.overloads())


def _op_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    return create_selective_checkpoint_contexts(_op_policy)


def _checkpoint_block(block: nn.Module, context_fn=None) -> None:
    inner = block.forward
    kwargs = {"use_reentrant": False}
    if context_fn is not None:
        kwargs["context_fn"] = context_fn

    def forward(*args, **kw):
        return checkpoint(inner, *args, **kw, **kwargs)

    block.forward = forward


def _checkpoint_block_offloaded(block: nn.Module, offload) -> None:
    """Per-op selective AC whose kept outputs ``offload`` moves to host memory: a recorder per
    forward (models/parallel/activation_offload.py ``SavedOutputs``) sees every output the policy
    keeps, frees them once the block's forward returns and restores them when the backward
    recomputes the block (the checkpointed function's second call)."""
    inner = block.forward

    def forward(*args, **kw):
        saved = offload.saved_outputs()

        def policy(ctx, op, *a, **k):
            decision = _op_policy(ctx, op, *a, **k)
            if decision == CheckpointPolicy.MUST_SAVE:
                saved.keep(ctx.op_output)
            return decision

        # the block's inputs, which the checkpoint saves under the offload hooks, bring the kept
        # outputs back when the backward unpacks them for the recomputation
        offload.restoring = saved
        try:
            out = checkpoint(
                inner, *args, **kw, use_reentrant=False, context_fn=lambda: create_selective_checkpoint_contexts(policy)
            )
        finally:
            offload.restoring = None
        saved.forward_done(out)
        return out

    block.forward = forward


def apply_activation_checkpointing(model: nn.Module, mode: str, selective_option: str = "op", offload=None) -> None:
    """``mode``: none | full | selective. ``selective_option``: ``op`` (save matmul and
    attention outputs, recompute the rest) or an integer N (fully checkpoint every N-th block).
    ``offload``: the model's activation offload (models/parallel/activation_offload.py), which
    per-op selective AC hands the outputs it keeps to."""
    if mode == "none":
        return
    # our decoders list their blocks (MTP depths included); a model without ``blocks()``
    # (torchtitan's Transformer in the GPU benchmark's reference loop) has its ``layers``
    blocks = model.blocks() if hasattr(model, "blocks") else list(model.layers.values())
    if mode == "full":
        for block in blocks:
            _checkpoint_block(block)
        return
    if mode != "selective":
        raise ValueError(f"activation_checkpoint.mode={mode!r}; legal values: none, full, selective")
    option = str(selective_option)
    if option == "op":
        for block in blocks:
            _checkpoint_block_offloaded(block, offload) if offload is not None else _checkpoint_block(
                block, _selective_context
            )
        return
    if not option.isdigit() or int(option) < 1:
        raise ValueError(
            f"activation_checkpoint.selective_ac_option={selective_option!r}; legal values: "
            f"'op' or a positive integer N (checkpoint every N-th block)"
        )
    every = int(option)
    for i, block in enumerate(blocks):
        if i % every == 0:
            _checkpoint_block(block)
