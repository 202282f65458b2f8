import glob
import json
import os

import pytest

from trainer.config import load_config
from trainer.reporting.metrics import PRECISIONS, MetricsLogger, find_gpu, model_flops_per_token, peak_flops


def cfg(*args):
    return load_config(["--config", "llama3.toml", *args])


def test_rank0_writes_jsonl_tensorboard_and_console(tmp_path, capsys):
    with MetricsLogger(str(tmp_path), 0, cfg(), world_size=2, flops_per_token=1e6) as m:
        for step in (1, 2, 3):
            rec = m.log(step, loss=4.0 / step, grad_norm=1.5, lr=1e-3, num_tokens=2048)
            # jsonl is flushed per line: readable while the logger is still open
            lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
            assert len(lines) == step and json.loads(lines[-1])["step"] == step
        m.log(4, loss=float("nan"), grad_norm=0.0, lr=0.0, num_tokens=1)
    first = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert first["loss"] == 4.0 and first["grad_norm"] == 1.5 and first["lr"] == 1e-3
    assert first["tps"] > 0 and first["cpu_rss_gib"] > 0 and "tflops" in first
    assert "mfu_pct" not in first  # no MFU on CPU
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])["loss"] is None
    assert rec["tflops"] == pytest.approx(1e6 * rec["tps"] / 1e12)
    out = capsys.readouterr().out
    assert "step      1  loss   4.0000  grad_norm   1.5000  lr 1.000e-03" in out
    assert glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*"))


def test_tensorboard_scalars_are_readable(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(str(tmp_path), 0, cfg()) as m:
        m.log(1, loss=3.0, grad_norm=1.0, lr=1e-4, num_tokens=10)
        m.log(2, loss=2.0, grad_norm=1.0, lr=1e-4, num_tokens=10)
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("loss")] == [3.0, 2.0]


def test_other_ranks_and_disabled_outputs_write_nothing(tmp_path, capsys):
    with MetricsLogger(str(tmp_path / "r1"), 1, cfg()) as m:
        assert m.log(1, loss=1.0, grad_norm=1.0, lr=1.0, num_tokens=1) is None
    assert not os.path.exists(tmp_path / "r1") and capsys.readouterr().out == ""
    off = cfg("--metrics.enable_tensorboard", "false", "--metrics.enable_jsonl", "false")
    with MetricsLogger(str(tmp_path / "r0"), 0, off) as m:
        m.log(1, loss=1.0, grad_norm=1.0, lr=1.0, num_tokens=1)
    assert os.listdir(tmp_path / "r0") == []


def test_should_log():
    m = MetricsLogger("/unused", 1, cfg("--metrics.log_freq", "10"))
    assert [s for s in range(1, 31) if m.should_log(s)] == [1, 10, 20, 30]


def test_flops_per_token_formula():
    # 6N for the matmuls (embedding excluded) + 12 * L * d * T attention
    assert model_flops_per_token(1000, 2, 8, 16, num_embedding_params=100) == 6 * 900 + 12 * 2 * 8 * 16


# torch.cuda.get_device_name() strings -> (part, dense TFLOP/s: IEEE fp32, tf32, bf16, fp16, fp8)
DEVICE_CASES = [
    ("NVIDIA H100 80GB HBM3", "H100 SXM", (67, 494.5, 989, 989, 1979)),
    ("NVIDIA H100", "H100 SXM", (67, 494.5, 989, 989, 1979)),
    ("NVIDIA H100 PCIe", "H100 PCIe", (51, 378, 756, 756, 1513)),
    ("NVIDIA H100 NVL", "H100 NVL", (60, 417.5, 835, 835, 1670)),  # not the SXM figures (~15% off)
    ("NVIDIA H200", "H200 SXM", (67, 494.5, 989, 989, 1979)),
    ("NVIDIA H200 NVL", "H200 NVL", (60, 417.5, 835, 835, 1670)),
    ("NVIDIA GH200 480GB", "GH200", (67, 494.5, 989, 989, 1979)),  # its own word, not "h200"
    ("NVIDIA A100-SXM4-80GB", "A100 SXM", (19.5, 156, 312, 312, None)),  # no FP8 on Ampere
    ("NVIDIA A100-SXM4-40GB", "A100 SXM", (19.5, 156, 312, 312, None)),
    ("NVIDIA A100-PCIE-40GB", "A100 PCIe", (19.5, 156, 312, 312, None)),
    ("NVIDIA A100 80GB PCIe", "A100 PCIe", (19.5, 156, 312, 312, None)),
    ("NVIDIA B200", "B200", (75, 1125, 2250, 2250, 4500)),
    ("NVIDIA L40S", "L40S", (91.6, 183, 362.05, 362.05, 733)),
]


@pytest.mark.parametrize("name, part, tflops", DEVICE_CASES, ids=[c[0] for c in DEVICE_CASES])
def test_peak_table_by_device_name(name, part, tflops):
    assert find_gpu(name).part == part
    for precision, value in zip(PRECISIONS, tflops):
        got = peak_flops(name, precision)
        assert got == (None if value is None else pytest.approx(value * 1e12, rel=1e-12)), precision
    assert peak_flops(name) == peak_flops(name, "bfloat16")  # the default precision
    # IEEE fp32 < TF32 < bf16 on every part: pricing at the wrong one is a 2x (L40S) to 15x (B200) MFU error
    assert peak_flops(name, "float32") < peak_flops(name, "tf32") < peak_flops(name, "bfloat16")


@pytest.mark.parametrize(
    "name", ["Tesla V100-SXM2-16GB", "NVIDIA L40", "NVIDIA GeForce RTX 4090", "AMD Instinct MI300X", "NVIDIA GB200", ""]
)
def test_unknown_device_has_no_peak(name):
    assert find_gpu(name) is None
    assert all(peak_flops(name, p) is None for p in PRECISIONS)


def test_peak_of_an_unknown_precision_is_an_error():
    with pytest.raises(ValueError, match="unknown matmul precision 'fp32'"):
        peak_flops("NVIDIA H100 80GB HBM3", "fp32")


@pytest.fixture
def fake_cuda(monkeypatch):
    """A CUDA device as MetricsLogger sees it, on a CPU-only host."""
    import torch

    name = {"value": "NVIDIA H100 80GB HBM3"}
    tf32 = {"value": False}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name["value"])
    monkeypatch.setattr("trainer.reporting.metrics.cuda_tf32_enabled", lambda: tf32["value"])
    return name, tf32


@pytest.mark.parametrize(
    "param_dtype, tf32, precision",
    [("float32", False, "float32"), ("float32", True, "tf32"), ("bfloat16", False, "bfloat16"),
     ("bfloat16", True, "bfloat16")],
)  # fmt: skip
def test_mfu_uses_the_peak_of_the_precision_that_runs(fake_cuda, param_dtype, tf32, precision):
    name, flag = fake_cuda
    flag["value"] = tf32
    c = cfg("--parallelism.mixed_precision_param", param_dtype)
    m = MetricsLogger(
        "/unused", 1, c, flops_per_token=1e9, device="cuda", param_dtype=c.parallelism.mixed_precision_param
    )
    assert m.peak_flops == peak_flops(name["value"], precision)
    assert f"dense {precision} peak" in m.peak_note and name["value"] in m.peak_note
    if precision == "float32":  # the hint at the faster settings
        assert "--training.enable_tf32 true" in m.peak_note and "494.5 TFLOP/s" in m.peak_note


def test_mfu_is_omitted_for_an_unknown_gpu_and_on_cpu(fake_cuda):
    name, _ = fake_cuda
    name["value"] = "Tesla V100-SXM2-16GB"
    c = cfg()
    m = MetricsLogger(
        "/unused", 1, c, flops_per_token=1e9, device="cuda", param_dtype=c.parallelism.mixed_precision_param
    )
    assert m.peak_flops is None and "omitted" in m.peak_note and "not in the table" in m.peak_note
    name["value"] = "NVIDIA H100 80GB HBM3"
    cpu = MetricsLogger("/unused", 1, cfg(), flops_per_token=1e9, device="cpu")
    assert cpu.peak_flops is None and cpu.peak_note is None


def test_mfu_percentage_against_the_chosen_peak(tmp_path, fake_cuda, monkeypatch):
    from trainer.reporting import metrics as metrics_mod

    monkeypatch.setattr(metrics_mod, "memory_gib", lambda device: ("cuda_max_alloc", 1.0))
    clock = iter([0.0, 2.0])  # __init__, then the log: 2 s
    monkeypatch.setattr(metrics_mod.time, "perf_counter", lambda: next(clock))
    c = cfg("--parallelism.mixed_precision_param", "float32", "--metrics.enable_tensorboard", "false")
    with MetricsLogger(
        str(tmp_path), 0, c, flops_per_token=67e9, device="cuda", param_dtype=c.parallelism.mixed_precision_param
    ) as m:
        rec = m.log(1, loss=1.0, grad_norm=1.0, lr=1e-3, num_tokens=2000)
    # 1000 tokens/s x 67 GFLOP = 67 TFLOP/s: 100% of the H100's IEEE fp32 peak
    assert rec["mfu_pct"] == pytest.approx(100.0)


def test_training_flops_per_token_of_real_flavors():
    from models.registry import build_model
    from trainer.reporting.metrics import training_flops_per_token

    llama = build_model("llama3", "8B", device="meta")
    non_embedding = sum(p.numel() for p in llama.parameters()) - llama.tok_embeddings.weight.numel()
    assert training_flops_per_token(llama, 8192) == 6 * non_embedding + 12 * 32 * 4096 * 8192
    # DeepSeek-V2-Lite-sized 16B: ~15.7B parameters of which ~2.4B are active per token
    ds = build_model("deepseek_v3", "16B", device="meta")
    attention = 12 * 27 * 16 * (128 + 64) * 4096
    active = (training_flops_per_token(ds, 4096) - attention) / 6 + ds.tok_embeddings.weight.numel()
    assert 2.2e9 < active < 2.9e9, active


def test_step_of_total_and_time_left(tmp_path, capsys, monkeypatch):
    from trainer.reporting import metrics as metrics_mod
    from trainer.reporting.metrics import format_duration

    clock = iter([0.0, 100.0, 110.0, 130.0, 150.0])  # __init__, then one reading per log
    monkeypatch.setattr(metrics_mod.time, "perf_counter", lambda: next(clock))
    with MetricsLogger(str(tmp_path), 0, cfg("--metrics.enable_tensorboard", "false"), total_steps=100) as m:
        first = m.log(1, loss=1.0, grad_norm=1.0, lr=1e-3, num_tokens=10)  # t=100: start-up
        second = m.log(11, loss=1.0, grad_norm=1.0, lr=1e-3, num_tokens=10)  # 10 steps in 10 s
        third = m.log(21, loss=1.0, grad_norm=1.0, lr=1e-3, num_tokens=10)  # 20 steps in 30 s
    assert "eta_s" not in first  # no pace known after the first (start-up) step
    assert second["eta_s"] == 89 * 1.0
    assert third["eta_s"] == 79 * 1.5
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("step   1/100  loss")
    assert out[1].startswith("step  11/100") and out[1].endswith("eta 1m29s")
    assert out[2].endswith("eta 1m58s")
    assert [format_duration(s) for s in (5, 65, 3600 + 7 * 60 + 20)] == ["5s", "1m05s", "1h07m"]
