"""The one-rank training path (no data parallelism, no pipeline): what it computes and when it syncs.

* Mixed precision by compute copies (models/parallel/mixed_precision.py) trains bit for bit like
  FSDP2's policy on the size-1 mesh (what ran there before): the same casts of the same
  parameters, fp32 gradient accumulation over micro-batches in the same order. Bitwise is the
  right check although the two paths differ: a dtype conversion is exactly defined (fp32 -> bf16
  rounds to nearest even, bf16 -> fp32 is exact), so which kernel casts (one foreach copy, or
  FSDP2's per-tensor copies) cannot change a bit, and every other op runs the same kernels on the
  same shapes on both sides. Both models (two
  layers: DeepSeek's dense layer and one MoE layer), bf16, two micro-batches per step (the
  accumulation), selective activation checkpointing (the recomputation reads the copies), two
  steps (the second starts from weights the first updated). Negative control: compute copies
  that do not cast the blocks' floating-point inputs (FSDP2's ``cast_forward_inputs``, the RoPE
  tables) already differ at step 1, so the comparison sees a real difference.
* Bytes moved per parameter per step (benchmarks/param_traffic.py's census of every ATen op of
  one step): the trainer within 1.1x of a hand-written mixed-precision loop (fp32 masters, one
  foreach cast, fused AdamW; measured 1.0001x), where FSDP2 on the size-1 mesh, the old path,
  measures 1.18x (1.31x with its gradient divide factor set): the census sees those copies.
* The step's one host sync (``trainer.step.read_step_scalars``) comes after the fused AdamW
  kernel is queued; with the foreach implementation (which cannot skip a step on the device)
  before it. And a non-finite step is skipped on the device: the run stops naming the step with
  the weights and AdamW's state exactly as before it; so is a chat step whose whole batch holds
  no target token (with either implementation: foreach stops before the optimizer).

One forked process for all of it (tools/forkserver.py), the trainer built in it as train.py builds it.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from tools.forkserver import run_distributed

pytestmark = pytest.mark.distributed

ARGS = [
    "--model.n_layers", "2", "--training.seq_len", "32", "--training.local_batch_size", "2",
    "--training.global_batch_size", "4", "--checkpoint.enable", "false", "--metrics.enable_tensorboard", "false",
    "--parallelism.mixed_precision_param", "bfloat16", "--activation_checkpoint.mode", "selective",
]  # fmt: skip


def _trainer(model: str, folder: str, *extra: str):
    from trainer.config import load_config
    from trainer.trainer import Trainer

    return Trainer(load_config(["--config", f"{model}.toml", "--job.dump_folder", folder, *ARGS, *extra]))


def _digest(module: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in module.named_parameters():
        t = p.detach()
        t = t.full_tensor() if hasattr(t, "full_tensor") else t  # FSDP's size-1 DTensors
        h.update(name.encode())
        h.update(t.float().numpy().tobytes())
    return h.hexdigest()


def _train(model: str, path: str, folder: str, cast_inputs: bool = True) -> dict:
    import models.parallelize as parallelize
    from models.parallel.mixed_precision import ComputeCopies

    parallelize.ONE_RANK_MIXED_PRECISION = path
    original = ComputeCopies._cast_inputs
    if not cast_inputs:
        ComputeCopies._cast_inputs = lambda self, module, args, kwargs: (args, kwargs)
    try:
        trainer = _trainer(model, folder, "--training.steps", "2", "--optimizer.implementation", "fused")
        model_part = trainer.model_parts[0]
        results = []
        for _ in range(2):
            r = trainer.train_step(trainer.data.next_step())
            trainer.step += 1
            results.append([r.loss, r.grad_norm])
        masters = {p.dtype for p in model_part.parameters()}
        return {
            "steps": results,
            "digest": _digest(model_part),
            "class": type(model_part).__name__,
            "compute_copies": hasattr(model_part, "compute_copies"),
            "installed_after_step": getattr(getattr(model_part, "compute_copies", None), "installed", False),
            "master_dtypes": sorted(str(d) for d in masters),
        }
    finally:
        ComputeCopies._cast_inputs = original
        parallelize.ONE_RANK_MIXED_PRECISION = "compute_copies"


def _sync_order(folder: str, implementation: str) -> list[str]:
    """The step's events in order: the optimizer's kernels and the host reads."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import trainer.trainer as train_module

    events: list[str] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if "adamw" in name or name == "_local_scalar_dense":
                events.append(name)
            return func(*args, **(kwargs or {}))

    read = train_module.read_step_scalars

    def recorded_read(scalars):
        events.append("read_step_scalars")
        return read(scalars)

    train_module.read_step_scalars = recorded_read
    try:
        trainer = _trainer("llama3", folder, "--training.steps", "2", "--optimizer.implementation", implementation)
        trainer.train_step(trainer.data.next_step())  # DTensor/optimizer first-use work out of the way
        trainer.step += 1
        step = trainer.optimizer.step

        def recorded_step(**kwargs):
            events.append("optimizer.step")
            return step(**kwargs)

        trainer.optimizer.step = recorded_step
        events.clear()
        with Record():
            trainer.train_step(trainer.data.next_step())
    finally:
        train_module.read_step_scalars = read
    return events


def _diverged_step_is_skipped(folder: str) -> dict:
    from trainer.step import TrainingDiverged

    trainer = _trainer(
        "llama3", folder, "--training.steps", "8", "--optimizer.implementation", "fused",
        "--optimizer.lr", "1e12", "--lr_scheduler.warmup_steps", "1", "--training.max_norm", "0",
    )  # fmt: skip
    part = trainer.model_parts[0]
    opt = trainer.optimizer.optimizers[0]
    for _ in range(8):
        before = _digest(part)
        state_before = hashlib.sha256(
            b"".join(
                t.detach().float().numpy().tobytes() for s in opt.state.values() for t in s.values() if t.dim() > 0
            )
        ).hexdigest()
        steps_before = sorted({float(s["step"]) for s in opt.state.values()})
        try:
            trainer.train_step(trainer.data.next_step())
        except TrainingDiverged as exc:
            state_after = hashlib.sha256(
                b"".join(
                    t.detach().float().numpy().tobytes() for s in opt.state.values() for t in s.values() if t.dim() > 0
                )
            ).hexdigest()
            return {
                "message": str(exc),
                "step": trainer.step + 1,
                "weights_unchanged": _digest(part) == before,
                "state_unchanged": state_after == state_before,
                "steps_unchanged": sorted({float(s["step"]) for s in opt.state.values()}) == steps_before,
            }
        trainer.step += 1
    return {"message": None}


def _no_target_step_is_not_applied(folder: str, implementation: str) -> dict:
    """One chat step with targets (AdamW's moments are then non-zero, so an applied step would
    move the weights even at gradient 0), then a step whose labels are all ignored: the run stops
    (trainer/step.py check_targets) with the weights and AdamW's state as they were."""
    import os

    from tests.chat_data import conversations, write_jsonl
    from trainer.step import NoTargets

    path = write_jsonl(os.path.join(folder, "chat.jsonl"), conversations(40))
    trainer = _trainer(
        "llama3", folder, "--training.steps", "2", "--optimizer.implementation", implementation,
        "--training.dataset", "chat", "--training.dataset_path", path, "--model.attn_mask_type", "block_causal",
    )  # fmt: skip
    part, opt = trainer.model_parts[0], trainer.optimizer.optimizers[0]

    def state() -> tuple[str, str]:
        moments = b"".join(t.detach().float().numpy().tobytes() for s in opt.state.values() for t in s.values())
        return _digest(part), hashlib.sha256(moments).hexdigest()

    trainer.train_step(trainer.data.next_step())
    trainer.step += 1
    before = state()
    try:
        trainer.train_step([(x, torch.full_like(y, -100)) for x, y in trainer.data.next_step()])
    except NoTargets as exc:
        return {"message": str(exc), "unchanged": state() == before}
    return {"message": None}


def _all(rank: int, world_size: int, folder: str) -> dict:
    out = {}
    for model in ("llama3", "deepseek_v3"):
        out[model] = {path: _train(model, path, folder) for path in ("compute_copies", "fsdp")}
    out["no_input_cast"] = _train("llama3", "compute_copies", folder, cast_inputs=False)
    out["order_fused"] = _sync_order(folder, "fused")
    out["order_foreach"] = _sync_order(folder, "foreach")
    out["diverged"] = _diverged_step_is_skipped(folder)
    out["no_target"] = {impl: _no_target_step_is_not_applied(folder, impl) for impl in ("fused", "foreach")}
    from benchmarks.param_traffic import census

    out["census"] = census("llama3", folder)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_distributed(_all, 1, str(tmp_path_factory.mktemp("one_gpu")))[0]


@pytest.mark.parametrize("model", ["llama3", "deepseek_v3"])
def test_compute_copies_train_bitwise_like_fsdp_on_one_rank(results, model):
    copies, fsdp = results[model]["compute_copies"], results[model]["fsdp"]
    assert copies["compute_copies"] and not copies["class"].startswith("FSDP"), copies
    assert fsdp["class"].startswith("FSDP") and not fsdp["compute_copies"], fsdp
    assert copies["master_dtypes"] == ["torch.float32"] and not copies["installed_after_step"], copies
    assert copies["steps"] == fsdp["steps"], (copies["steps"], fsdp["steps"])
    assert copies["digest"] == fsdp["digest"]


def test_the_comparison_sees_a_missing_input_cast(results):
    wrong, fsdp = results["no_input_cast"], results["llama3"]["fsdp"]
    assert wrong["steps"][0][0] != fsdp["steps"][0][0], (wrong["steps"], fsdp["steps"])


def test_the_host_reads_after_the_fused_optimizer_is_queued(results):
    events = results["order_fused"]
    assert events.count("read_step_scalars") == 1, events
    last_adamw = max(i for i, e in enumerate(events) if "adamw" in e)
    assert events.index("optimizer.step") < last_adamw < events.index("read_step_scalars"), events
    # no other read of a device value during the step (the host read is .tolist())
    reads = [i for i, e in enumerate(events) if e == "_local_scalar_dense"]
    assert all(i > events.index("read_step_scalars") for i in reads), events


def test_without_the_fused_kernel_the_host_reads_before_the_optimizer(results):
    events = results["order_foreach"]
    assert events.count("read_step_scalars") == 1, events
    assert events.index("read_step_scalars") < events.index("optimizer.step"), events


def test_a_non_finite_step_is_skipped_on_the_device_and_stops_the_run(results):
    d = results["diverged"]
    assert d["message"] is not None, "an absurd learning rate without clipping never diverged in 8 steps"
    assert "non-finite" in d["message"] and f"at step {d['step']}" in d["message"], d
    assert d["weights_unchanged"] and d["state_unchanged"] and d["steps_unchanged"], d


@pytest.mark.parametrize("implementation", ["fused", "foreach"])
def test_a_step_without_any_target_is_not_applied_and_stops_the_run(results, implementation):
    """Fused: skipped on the device (found_inf), then stopped; foreach: stopped before it."""
    d = results["no_target"][implementation]
    assert d["message"] is not None and d["message"].startswith("step 2: the whole global batch holds no target"), d
    assert d["unchanged"], d


def test_the_trainer_moves_what_a_mixed_precision_loop_moves(results):
    c = results["census"]
    assert c["trainer_over_reference"] <= c["goal_trainer_over_reference"], c
    # negative controls: the census sees FSDP2's extra copies on the size-1 mesh, and the
    # division a gradient divide factor adds
    assert c["trainer_fsdp_size1_over_reference"] > c["goal_trainer_over_reference"], c
    assert c["trainer_fsdp_size1_divide_bytes_per_param"] > c["trainer_fsdp_size1_bytes_per_param"] + 7, c
