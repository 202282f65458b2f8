"""One training step under a layout vs a single-process reference on the same weights/batch.

Used by the model-parallelism proof tests. Each rank also computes the reference itself (the
debug models are tiny), so no tensors travel between processes for the comparison.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models.common.sequence import load_balanced_shard
from models.parallelize import ParallelizeOptions, check_model_fits_layout, parallelize_model
from models.parallel.tensor_parallel import loss_parallel_context
from models.registry import build_model, get_model_spec
from parallel_dims import ParallelDims
from trainer.grad_clip import clip_grad_norm_, finalize_grads

SEED = 1234
LR = 1e-3


def small_overrides(model_name: str) -> dict:
    if model_name == "llama3":
        return dict(n_layers=2, vocab_size=512, max_seq_len=64)
    return dict(n_layers=3, vocab_size=512, max_seq_len=64)


def make_batch(global_bs: int, seq_len: int, vocab: int):
    g = torch.Generator().manual_seed(SEED + 1)
    tokens = torch.randint(0, vocab, (global_bs, seq_len + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _optimizer(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1, foreach=False)


def reference_step(model_name: str, global_bs: int, seq_len: int, max_norm: float):
    torch.manual_seed(0)
    model = build_model(model_name, "debugmodel", device="cpu", **small_overrides(model_name))
    model.init_weights(SEED)
    inputs, labels = make_batch(global_bs, seq_len, model.args.vocab_size)
    logits = model(inputs)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum") / labels.numel()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    # float64 norm: torch's float32 clip_grad_norm_ is itself ~3e-6 off on these models
    norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters()))
    scale = min(1.0, max_norm / (norm.item() + 1e-6))
    for p in model.parameters():
        p.grad.mul_(scale)
    _optimizer(model.parameters()).step()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return loss.item(), norm.item(), grads, weights


def parallel_step(rank, world_size, model_name, degrees, opts_kwargs, global_bs, seq_len, max_norm):
    torch.manual_seed(0)
    pd = ParallelDims(world_size=world_size, **degrees)
    pd.build_mesh("cpu")
    opts = ParallelizeOptions(**opts_kwargs)
    spec_args = get_model_spec(model_name, "debugmodel").args
    model = build_model(model_name, "debugmodel", device="meta", **small_overrides(model_name))
    check_model_fits_layout(model.args, pd, seq_len=seq_len, sequence_parallel=opts.sequence_parallel)
    parallelize_model(model, pd, opts)
    model.to_empty(device="cpu")
    model.init_weights(SEED)

    inputs, labels = make_batch(global_bs, seq_len, model.args.vocab_size)
    per_rank = global_bs // pd.size("batch")
    b = pd.coordinate("batch")
    inputs, labels = inputs[b * per_rank : (b + 1) * per_rank], labels[b * per_rank : (b + 1) * per_rank]
    cp_rank, cp = pd.coordinate("cp"), pd.size("cp")
    inputs = load_balanced_shard(inputs, 1, cp_rank, cp)
    labels = load_balanced_shard(labels, 1, cp_rank, cp)
    n_tokens = global_bs * seq_len

    with loss_parallel_context(pd.tp > 1 and opts.loss_parallel):
        logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum") / n_tokens
        loss.backward()
    from torch.distributed.tensor import DTensor
    import torch.distributed as dist

    local_loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
    total = local_loss.detach().clone()
    loss_mesh = pd.get_optional_mesh("loss")
    if loss_mesh is not None:
        dist.all_reduce(total, group=loss_mesh.get_group())
    finalize_grads(model.parameters())
    grads = {}
    for n, p in model.named_parameters():
        g = p.grad
        grads[n] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone()
    norm = clip_grad_norm_(list(model.parameters()), max_norm, pd.get_optional_mesh("pp"))
    _optimizer(model.parameters()).step()
    weights = {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in model.named_parameters()
    }
    if rank != 0:
        return None
    ref_loss, ref_norm, ref_grads, ref_weights = reference_step(model_name, global_bs, seq_len, max_norm)
    report = {"loss": (total.item(), ref_loss), "norm": (norm.item(), ref_norm)}
    grad_err = {n: ((grads[n] - ref_grads[n]).abs().max() / ref_grads[n].abs().max().clamp_min(1e-12)).item() for n in ref_grads}
    weight_err = {n: (weights[n] - ref_weights[n]).abs().max().item() for n in ref_weights}
    report["grad_rel_err"] = grad_err
    report["weight_abs_err"] = weight_err
    report["names"] = sorted(grads) == sorted(ref_grads)
    return report
