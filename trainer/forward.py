"""One forward + loss for training and validation, whatever the layout.

Training (``Trainer.train_step``) and evaluation (``Validator``) run the same code for one local
batch: the context-parallel shard of inputs and labels (the load-balanced sequence chunks this
cp rank holds), the pipeline schedule or the plain model, the loss-parallel context under
tensor parallelism, and the loss convention of docs/design.md section 5 (``loss_fn`` returns
the SUM of token losses; it is divided by the step's global token count here, so the parts add
up to the step loss on every layout). Training adds the backward pass (and the MoE sequence
auxiliary loss); evaluation runs the pipeline's forward-only path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from models.common.sequence import load_balanced_shard
from models.parallel.tensor_parallel import loss_parallel_context
from parallel_dims import ParallelDims
from parallel_dims.torch_compat import per_rank, per_rank_int

if TYPE_CHECKING:
    # the pipeline runtime is imported where pp > 1 uses it (see trainer/trainer.py)
    from models.parallel.pipeline import Pipeline
    from trainer.mtp import MTPLoss

__all__ = [
    "ModelForward",
    "chunked_loss_line",
    "cross_entropy_sum",
    "full_tensor",
    "loss_functions",
    "memory_lines",
    "token_loss_sum",
]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The trainer's loss function: the SUM of the token cross-entropies (float32 logits)."""
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum")


def token_loss_sum(token_losses: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The loss function of the chunked loss (``training.loss_chunk_tokens``): the model's head
    already returned each token's float32 cross-entropy (0 at ignored targets,
    ``models/common/chunked_loss.py``); their SUM, as :func:`cross_entropy_sum` returns."""
    if tuple(token_losses.shape) != tuple(labels.shape[:2]) or token_losses.dtype != torch.float32:
        raise ValueError(
            f"chunked loss: expected per-token float32 losses of shape {tuple(labels.shape[:2])}, got "
            f"{tuple(token_losses.shape)} {token_losses.dtype}"
        )
    return token_losses.sum()


def loss_functions(cfg, mtp_depth: int) -> tuple[Callable, Callable, MTPLoss | None]:
    """The training loss, validation's, and the MTP loss (None without MTP depths). With
    ``training.loss_chunk_tokens`` the head and the cross-entropy run chunk by chunk inside the
    model's head (models/common/chunked_loss.py, eager: each chunk is one head matmul) and the
    loss only sums the per-token losses, so compiling it would buy nothing; else the plain
    cross-entropy, compiled when ``compile.components`` has ``loss``. DeepSeek-V3's MTP
    (trainer/mtp.py) adds its depths' loss with ``training.mtp_loss_weight``; validation
    reports the main next-token loss (weight 0)."""
    from trainer.mtp import MTPLoss

    loss_fn = cross_entropy_sum
    if cfg.training.loss_chunk_tokens:
        loss_fn = token_loss_sum
    elif cfg.compile.enable and "loss" in cfg.compile.components:
        loss_fn = torch.compile(cross_entropy_sum)
    if not mtp_depth:
        return loss_fn, loss_fn, None
    mtp = MTPLoss(loss_fn, mtp_depth, cfg.training.mtp_loss_weight)
    return mtp, MTPLoss(loss_fn, mtp_depth, 0.0), mtp


def memory_lines(plan, pd: ParallelDims, model_parts, pipeline: Pipeline | None, cfg) -> list[str]:
    """The start-up lines of the memory options the job chose (docs/memory.md): what CPU and
    activation offload save (models/parallel/offload.py), the chunked loss's peak saving and
    what ``optimizer.state_dtype`` saves (trainer/optim/low_precision.py ``state_dtype_saving``:
    the line comes before the optimizer is built, so it is counted from the trainable shards)."""
    from models.parallel.offload import memory_options_line
    from trainer.optim.low_precision import state_bytes_fn, state_dtype_saving

    lines = [line] if (line := memory_options_line(model_parts, plan, state_bytes_fn(cfg.optimizer))) else []
    if cfg.training.loss_chunk_tokens:
        lines.append(chunked_loss_line(plan, pd, pipeline, cfg.training.loss_chunk_tokens))
    if cfg.optimizer.state_dtype != "float32":
        saved = state_dtype_saving(model_parts, cfg.optimizer)
        lines.append(
            f"optimizer state in {cfg.optimizer.state_dtype}: saves {saved / 2**20:,.1f} MiB ({saved:,} bytes) of "
            "optimizer state per rank against float32 (optimizer.state_dtype, docs/memory.md)"
        )
    return lines


def chunked_loss_line(plan, pd: ParallelDims, pipeline: Pipeline | None, chunk: int) -> str:
    """Start-up line of the chunked loss (``plan``: the job's ``JobPlan``): what one head call's
    logits would have held on this rank, and the saving ``chunked_loss_saving_bytes`` predicts
    at the plain loss backward's start (the plain step's peak phase when the logits dominate;
    the whole step's saving is the planner's, tools/planner/phases.py; docs/memory.md)."""
    from models.common.chunked_loss import chunked_loss_saving_bytes

    args, batch = plan.model.args, plan.batch
    rows = batch.local_batch_size
    if pipeline is not None:
        rows = pipeline.local_batch_size // pipeline.n_microbatches
    tokens = rows * (batch.seq_len // pd.cp) * (1 + getattr(args, "mtp_layers", 0))
    compute_bytes = 2 if plan.parallelize.param_dtype == "bfloat16" else 4
    vocab = -(-args.vocab_size // pd.tp)
    saving = chunked_loss_saving_bytes(tokens, args.vocab_size, args.dim, chunk, tp=pd.tp, compute_bytes=compute_bytes)
    return (
        f"chunked loss: the head and cross-entropy {chunk} tokens at a time; one head call holds {tokens} tokens x "
        f"{vocab} vocabulary rows on this rank: predicted saving {saving / 2**20:,.1f} MiB per micro-batch at the "
        "loss backward (the step's peak falls by less where another phase then peaks: python -m tools.planner "
        "--fit prices the whole step; training.loss_chunk_tokens, docs/memory.md)"
    )


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (a collective over its mesh); a plain tensor as it is."""
    return t.full_tensor() if isinstance(t, DTensor) else t


class ModelForward:
    """Forward and loss of one local batch on this rank's model parts.

    ``pipeline``: the built schedule over ``model_parts`` (pp > 1), else None and
    ``model_parts`` is the one whole model. ``loss_parallel``: the logits are vocab-sharded
    DTensors (tp > 1 with loss parallelism)."""

    def __init__(
        self,
        pd: ParallelDims,
        model_parts: Sequence[nn.Module],
        loss_fn: LossFn,
        device: torch.device,
        *,
        loss_parallel: bool,
        pipeline: Pipeline | None = None,
    ) -> None:
        self.pd, self.model_parts, self.loss_fn, self.device = pd, list(model_parts), loss_fn, device
        self.loss_parallel, self.pipeline = loss_parallel, pipeline
        # chunked loss: the model takes the labels and returns per-token losses (the pipeline
        # passes them to its last stage itself)
        self.head_labels = getattr(self.model_parts[0], "loss_chunk_tokens", 0) > 0
        # DeepSeek-V3 multi-token prediction (trainer/mtp.py): the depths' inputs and targets are
        # built on the whole rows, before the cp shard; block-causal attention keeps each
        # target inside its position's document
        args = self.model_parts[0].args
        self.mtp_depth = getattr(args, "mtp_layers", 0)
        self.mtp_eos = args.eos_id if args.attn_mask_type == "block_causal" else None

    def shard_for_cp(self, t: torch.Tensor) -> torch.Tensor:
        """This cp rank's load-balanced part of a ``[batch, seq]`` tensor."""
        # under comm.mode = local_tensor, every simulated rank's own cp coordinate and slice
        cp_rank = per_rank_int(lambda rank: self.pd.coordinate("cp", rank))
        return per_rank(load_balanced_shard)(t, 1, cp_rank, self.pd.size("cp"))

    def __call__(
        self,
        inputs: torch.Tensor,
        labels: torch.Tensor,
        global_tokens: int,
        *,
        backward: bool,
        aux_loss_sequences: int | None = None,
        moes: Sequence[nn.Module] = (),
    ) -> torch.Tensor | None:
        """This batch's share of the step loss (token losses / ``global_tokens``), detached, as
        a float32 scalar; None on a pp rank without the last stage (unless its stages' MoE
        layers added an aux loss: then that part).

        ``backward``: also run the backward pass (gradients accumulate into the parameters);
        without it, evaluation (call under ``torch.no_grad()``; the pipeline runs forward-only).
        ``aux_loss_sequences``: with ``moes``, each MoE layer's sequence auxiliary loss counts
        divided by this many sequences (the step's global batch): the layers get the divisor
        before the forward and give their aux loss its gradient in the backward themselves
        (``models/common/moe.py``, ``_AuxLossGrad``); the returned loss includes it, under pp
        the part of this rank's stages."""
        extra = {}
        if self.mtp_depth:
            from trainer.mtp import mtp_batch

            mtp_tokens, labels = mtp_batch(inputs, labels, self.mtp_depth, self.mtp_eos)
            extra["mtp_tokens"] = self.shard_for_cp(mtp_tokens).to(self.device, non_blocking=True)
        inputs = self.shard_for_cp(inputs).to(self.device, non_blocking=True)
        labels = self.shard_for_cp(labels).to(self.device, non_blocking=True)
        aux_moes = [m for m in moes if m.aux_loss_coeff > 0] if aux_loss_sequences is not None else []
        for moe in aux_moes:
            moe.aux_loss_sequences = aux_loss_sequences
            moe.aux_loss_total.zero_()
        if self.pipeline is not None:
            # the schedule splits the local batch into pipeline micro-batches and, with
            # backward, syncs FSDP gradients on its last backward
            from models.parallel.pipeline import pipeline_step

            part = pipeline_step(self.pipeline, inputs, labels, global_tokens, forward_only=not backward, **extra)
            reported = None if part is None else full_tensor(part.detach()).float()
        else:
            with loss_parallel_context(self.loss_parallel):
                if self.head_labels:
                    extra["labels"] = labels
                logits = self.model_parts[0](inputs, **extra)
                loss = self.loss_fn(logits, labels) / global_tokens
                if backward:
                    loss.backward()
            reported = full_tensor(loss.detach()).float()
        if aux_moes:
            # what the layers' aux losses added to the loss: on every pipeline stage that holds
            # MoE layers (the trainer sums the step loss over pp and over the loss mesh)
            aux = sum(moe.aux_loss_total for moe in aux_moes) / aux_loss_sequences
            tp_mesh = self.pd.get_optional_mesh("tp")
            if tp_mesh is not None:
                # each tp rank routed its own slice of every sequence (sequence parallelism)
                # and holds that slice's share of the loss
                dist.all_reduce(aux, group=tp_mesh.get_group())
            reported = aux if reported is None else reported + aux
        return reported
