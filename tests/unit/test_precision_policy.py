"""training.enable_tf32 and training.deterministic (trainer/runtime/precision.py): the config -> torch
calls, by device, with the torch functions recorded (no GPU here: "cuda" is a device-type string
and the CUDA-only flags are global switches a CPU build also holds); the order in Trainer.__init__
(before the process group and any CUDA work); and a census of the aten ops a train step of each
model runs, against the ops torch refuses on CUDA in deterministic mode."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from trainer.config import load_config
from trainer.runtime import precision
from trainer.runtime.precision import (
    CUBLAS_WORKSPACE_VAR,
    apply_precision_policy,
    ensure_cublas_workspace_config,
    matmul_precision,
)


def cfg(*args):
    return load_config(["--config", "llama3.toml", *args])


@pytest.fixture
def torch_flags(monkeypatch):
    """Record use_deterministic_algorithms; restore every global flag the policy sets."""
    calls: list[bool] = []
    monkeypatch.setattr(torch, "use_deterministic_algorithms", lambda mode, **kw: calls.append(mode))
    monkeypatch.delenv(CUBLAS_WORKSPACE_VAR, raising=False)
    cudnn = torch.backends.cudnn
    saved = (torch.backends.cuda.matmul.allow_tf32, cudnn.allow_tf32, cudnn.deterministic, cudnn.benchmark)
    torch.backends.cuda.matmul.allow_tf32, cudnn.allow_tf32 = False, True  # torch's defaults
    cudnn.deterministic, cudnn.benchmark = False, False
    yield calls
    torch.backends.cuda.matmul.allow_tf32, cudnn.allow_tf32, cudnn.deterministic, cudnn.benchmark = saved


def test_defaults_keep_ieee_fp32_and_nondeterministic_kernels():
    t = cfg().training
    assert t.enable_tf32 is False and t.deterministic is False


@pytest.mark.parametrize(
    "param_dtype, tf32, expected",
    [("float32", False, "float32"), ("float32", True, "tf32"), ("bfloat16", False, "bfloat16"),
     ("bfloat16", True, "bfloat16"), ("float16", True, "float16")],
)  # fmt: skip
def test_matmul_precision_is_the_compute_dtype_with_float32_split_by_tf32(param_dtype, tf32, expected):
    assert matmul_precision(param_dtype, tf32) == expected


def test_tf32_on_cuda_uses_the_legacy_flags_that_every_getter_reads_back(torch_flags):
    apply_precision_policy(cfg("--training.enable_tf32", "true"), "cuda")
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    # both of torch 2.13's APIs agree (the new setter would make this getter raise), and the
    # CPU (oneDNN) matmul precision is untouched
    assert torch.backends.cuda.matmul.fp32_precision == "tf32"
    assert torch.get_float32_matmul_precision() == "high"
    assert torch.backends.mkldnn.matmul.fp32_precision == "none"
    assert precision.cuda_tf32_enabled()
    apply_precision_policy(cfg("--training.enable_tf32", "false"), "cuda")
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    assert torch.get_float32_matmul_precision() == "highest" and not precision.cuda_tf32_enabled()
    assert torch_flags == []  # not deterministic: no call


def test_nothing_changes_on_cpu(torch_flags):
    notes = apply_precision_policy(cfg("--training.enable_tf32", "true"), "cpu")
    assert notes == [] and torch_flags == []
    assert not torch.backends.cuda.matmul.allow_tf32 and torch.get_float32_matmul_precision() == "highest"
    assert CUBLAS_WORKSPACE_VAR not in os.environ


def test_deterministic_on_cuda(torch_flags):
    notes = apply_precision_policy(cfg("--training.deterministic", "true"), "cuda")
    assert notes == [] and torch_flags == [True]
    assert os.environ[CUBLAS_WORKSPACE_VAR] == ":4096:8"
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert not torch.backends.cuda.matmul.allow_tf32  # independent options


def test_deterministic_on_cpu_only_turns_on_torchs_checks(torch_flags):
    apply_precision_policy(cfg("--training.deterministic", "true"), "cpu")
    assert torch_flags == [True]
    assert not torch.backends.cudnn.deterministic


def test_cublas_workspace_config(monkeypatch):
    monkeypatch.delenv(CUBLAS_WORKSPACE_VAR, raising=False)
    assert ensure_cublas_workspace_config() is None and os.environ[CUBLAS_WORKSPACE_VAR] == ":4096:8"
    monkeypatch.setenv(CUBLAS_WORKSPACE_VAR, ":16:8")  # the other reproducible setting: kept
    assert ensure_cublas_workspace_config() is None and os.environ[CUBLAS_WORKSPACE_VAR] == ":16:8"
    monkeypatch.setenv(CUBLAS_WORKSPACE_VAR, ":4096:2:16:8")  # torch's default, not reproducible
    note = ensure_cublas_workspace_config()
    assert os.environ[CUBLAS_WORKSPACE_VAR] == ":4096:8" and "':4096:2:16:8' is not one of" in note


class _ProcessGroupWouldStartHere(Exception):
    pass


def test_trainer_applies_the_policy_before_the_process_group(torch_flags, monkeypatch, tmp_path):
    """Everything is in place when init_distributed (torch.cuda.set_device, NCCL) would start."""
    import trainer.trainer as train_mod

    seen = {}

    def init_distributed(_cfg):
        seen.update(
            env=os.environ.get(CUBLAS_WORKSPACE_VAR),
            deterministic=list(torch_flags),
            tf32=torch.backends.cuda.matmul.allow_tf32,
        )
        raise _ProcessGroupWouldStartHere

    monkeypatch.setattr(train_mod, "default_device_type", lambda: "cuda")
    monkeypatch.setattr(train_mod, "init_distributed", init_distributed)
    c = cfg("--training.deterministic", "true", "--training.enable_tf32", "true", "--job.dump_folder", str(tmp_path))
    with pytest.raises(_ProcessGroupWouldStartHere):
        train_mod.Trainer(c)
    assert seen == {"env": ":4096:8", "deterministic": [True], "tf32": True}


# ------------------------------------------------------------- ops vs deterministic mode on CUDA

# aten ops that raise under torch.use_deterministic_algorithms(True) on CUDA (torch 2.13's
# documentation of use_deterministic_algorithms, "will throw a RuntimeError"); cumsum only for
# floating-point dtypes, nll_loss2d only with a reduction
_RAISE_ON_CUDA = {
    "avg_pool3d_backward", "adaptive_avg_pool2d_backward", "adaptive_avg_pool3d_backward",
    "adaptive_max_pool2d_backward", "fractional_max_pool2d_backward", "fractional_max_pool3d_backward",
    "max_unpool2d", "max_unpool3d", "upsample_linear1d_backward", "upsample_bilinear2d_backward",
    "upsample_bicubic2d_backward", "upsample_trilinear3d_backward", "reflection_pad1d_backward",
    "reflection_pad2d_backward", "reflection_pad3d_backward", "nll_loss2d_forward", "ctc_loss",
    "_embedding_bag_backward", "put", "put_", "histc", "bincount", "median", "grid_sampler_2d_backward",
    "grid_sampler_3d_backward",
}  # fmt: skip
# ops whose CUDA kernels use atomics and that deterministic mode switches to deterministic ones
_SWITCHED_ON_CUDA = {"index_add", "index_add_", "scatter_add", "scatter_add_", "index_put_", "_index_put_impl_"}


class _OpCensus(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: set[tuple[str, torch.dtype | None]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        self.ops.add((func._schema.name.removeprefix("aten::"), first.dtype if first is not None else None))
        if func._schema.name == "aten::scatter_reduce" or func._schema.name == "aten::scatter_reduce_":
            self.ops.add(("scatter_reduce." + str(args[3] if len(args) > 3 else kwargs.get("reduce")), None))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", ["llama3", "deepseek_v3"])
def test_a_train_step_uses_no_op_that_deterministic_mode_refuses_on_cuda(name):
    """Forward, the trainer's loss and backward of each debug model on CPU: the aten ops are the
    ones CUDA would run (dispatch below aten picks the kernel), so none may be on the list that
    raises in deterministic mode; the atomics-based ones the MoE uses are on the switched list."""
    from models.registry import build_model
    from trainer.forward import cross_entropy_sum

    torch.manual_seed(0)
    model = build_model(name, "debugmodel", device="cpu")
    model.init_weights(0)
    tokens = torch.randint(0, 2048, (2, 32))
    census = _OpCensus()
    with census:
        loss = cross_entropy_sum(model(tokens), tokens)
        loss.backward()
    names = {op for op, _ in census.ops}
    assert not names & _RAISE_ON_CUDA, names & _RAISE_ON_CUDA
    float_cumsum = {
        (op, dt) for op, dt in census.ops if op.startswith("cumsum") and dt is not None and dt.is_floating_point
    }
    assert not float_cumsum
    assert not {op for op in names if op.startswith("scatter_reduce.prod")}
    assert {"nll_loss_forward", "nll_loss_backward"} <= names  # the 2-D loss, not nll_loss2d; backward seen
    if name == "deepseek_v3":  # the MoE counts and combine: atomics on CUDA unless deterministic
        assert names & _SWITCHED_ON_CUDA >= {"scatter_add_", "index_add"}, names & _SWITCHED_ON_CUDA


def test_cross_entropy_of_2d_logits_is_not_nll_loss2d():
    census = _OpCensus()
    logits, labels = torch.randn(2, 5, 7), torch.randint(0, 7, (2, 5))
    with census:
        F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1), reduction="sum")
    assert "nll_loss2d_forward" not in {op for op, _ in census.ops}
    with census:  # the negative control: 3-D logits would take the refused kernel
        F.cross_entropy(logits.transpose(1, 2), labels, reduction="sum")
    assert "nll_loss2d_forward" in {op for op, _ in census.ops}
