import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from trainer.config import load_config
from trainer.optim.optimizers import build_lr_scheduler, build_optimizer, lr_multiplier, param_groups


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(16, 8)
        self.norm = nn.LayerNorm(8)
        self.proj = nn.Linear(8, 8, bias=True)
        self.output = nn.Linear(8, 16, bias=False)

    def forward(self, x):
        return self.output(self.proj(self.norm(self.tok_embeddings(x))))


def cfg(*args):
    return load_config(["--config", "llama3.toml", *args])


@pytest.fixture
def gloo(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp_path, "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_weight_decay_groups():
    model = Tiny()
    opt = build_optimizer([model], cfg("--optimizer.weight_decay", "0.05"))
    (adamw,) = opt.optimizers
    names = {id(p): n for n, p in model.named_parameters()}
    groups = {g["weight_decay"]: sorted(names[id(p)] for p in g["params"]) for g in adamw.param_groups}
    assert groups == {
        0.05: ["output.weight", "proj.weight", "tok_embeddings.weight"],
        0.0: ["norm.bias", "norm.weight", "proj.bias"],
    }
    # CPU parameters: auto picks the foreach kernels
    assert adamw.defaults["foreach"] is True and adamw.defaults["fused"] is False
    assert adamw.defaults["betas"] == (0.9, 0.95)


def test_one_optimizer_per_model_part_steps_all():
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    opt = build_optimizer([a, b], cfg())
    before = [a.weight.clone(), b.weight.clone()]
    (a(torch.ones(1, 4)).sum() + b(torch.ones(1, 4)).sum()).backward()
    opt.step()
    opt.zero_grad()
    assert len(opt.optimizers) == 2 and a.weight.grad is None
    assert not torch.equal(before[0], a.weight) and not torch.equal(before[1], b.weight)
    with pytest.raises(TypeError, match="list of model parts"):
        build_optimizer(a, cfg())


def _mixed_layout_module():
    """Plain, dp-sharded, dp-replicated and ep-sharded parameters in one module: the mix FSDP,
    TP and EP produce, which one foreach/fused call over all of them rejects."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dp = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    ep = init_device_mesh("cpu", (1,), mesh_dim_names=("ep",))
    m = nn.Module()
    m.plain = nn.Parameter(torch.randn(4, 4))
    m.bias = nn.Parameter(torch.randn(4))
    m.dp_shard = nn.Parameter(distribute_tensor(torch.randn(4, 4), dp, [Shard(0)]))
    m.dp_repl = nn.Parameter(distribute_tensor(torch.randn(4, 4), dp, [Replicate()]))
    m.ep_shard = nn.Parameter(distribute_tensor(torch.randn(4, 4), ep, [Shard(0)]))
    return m


def test_param_groups_split_by_layout(gloo):
    m = _mixed_layout_module()
    groups = param_groups(m, 0.1)
    names = {id(p): n for n, p in m.named_parameters()}
    got = [(g["weight_decay"], [names[id(p)] for p in g["params"]]) for g in groups]
    # one group per (decay, layout); decayed first, module order inside
    assert got == [(0.1, ["plain"]), (0.1, ["dp_shard"]), (0.1, ["dp_repl"]), (0.1, ["ep_shard"]), (0.0, ["bias"])]


@pytest.mark.parametrize("implementation", ["foreach", "fused", "for-loop"])
def test_every_implementation_steps_mixed_layouts_like_the_for_loop(gloo, implementation):
    """The multi-tensor kernels run on the layout mix (one call per group) and give the same
    update as the reference for-loop AdamW on plain copies of the same tensors."""
    from torch.distributed.tensor import DTensor

    m = _mixed_layout_module()
    ref = {
        n: nn.Parameter(p.full_tensor() if isinstance(p, DTensor) else p.detach().clone())
        for n, p in m.named_parameters()
    }
    opt = build_optimizer([m], cfg("--optimizer.implementation", implementation))
    assert opt.implementation == implementation
    (adamw,) = opt.optimizers
    assert adamw.defaults["foreach"] is (implementation == "foreach")
    assert adamw.defaults["fused"] is (implementation == "fused")
    ref_opt = torch.optim.AdamW(
        [
            {"params": [ref[n] for n in ("plain", "dp_shard", "dp_repl", "ep_shard")], "weight_decay": 0.1},
            {"params": [ref["bias"]], "weight_decay": 0.0},
        ],
        lr=8e-4,
        betas=(0.9, 0.95),
        eps=1e-8,
        foreach=False,
        fused=False,
    )
    for step in range(3):
        for n, p in m.named_parameters():
            g = torch.full(p.shape, 0.1 * (step + 1)) + torch.arange(p.numel()).view(p.shape) * 1e-3
            ref[n].grad = g.clone()
            p.grad = _like(p, g) if isinstance(p, DTensor) else g.clone()
        opt.step()
        ref_opt.step()
    for n, p in m.named_parameters():
        got = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        torch.testing.assert_close(got, ref[n].detach(), rtol=1e-6, atol=1e-7, msg=n)


def _like(p, full):
    """``full`` laid out like the DTensor parameter ``p``."""
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, p.device_mesh, p.placements)


def test_auto_implementation():
    from trainer.optim.optimizers import resolve_implementation

    cpu = [torch.zeros(2)]
    assert resolve_implementation("auto", cpu) == "foreach"
    assert resolve_implementation("fused", cpu) == "fused"
    meta = [torch.empty(2, device="meta")]
    assert resolve_implementation("auto", meta) == "foreach"  # only all-GPU params get fused


def _lrs(decay, steps=50, warmup=5, min_ratio=0.1):
    model = nn.Linear(2, 2)
    c = cfg(
        "--training.steps",
        str(steps),
        "--lr_scheduler.warmup_steps",
        str(warmup),
        "--lr_scheduler.decay_style",
        decay,
        "--lr_scheduler.min_lr_ratio",
        str(min_ratio),
    )
    opt = build_optimizer([model], c)
    sched = build_lr_scheduler(opt, c)
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])  # lr used by this optimizer step
        assert all(g["lr"] == lrs[-1] for g in opt.param_groups)
        opt.step()
        sched.step()
    return lrs


def test_cosine_schedule_key_points():
    lrs = _lrs("cosine")
    peak = 8e-4
    assert lrs[0] == pytest.approx(peak / 5)  # step 1 of 5 warmup steps
    assert lrs[2] == pytest.approx(peak * 3 / 5)
    assert lrs[4] == pytest.approx(peak)  # last warmup step reaches the peak
    # decay runs from step index 4 (peak) to 49 (floor): index 26 is 22/45 of the way
    assert lrs[26] == pytest.approx(peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 22 / 45))))
    assert lrs[-1] == pytest.approx(0.1 * peak)  # final step ends on the floor
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:]))


def test_linear_and_constant_schedules():
    lin = _lrs("linear", steps=11, warmup=1, min_ratio=0.0)
    assert lin[0] == pytest.approx(8e-4) and lin[5] == pytest.approx(4e-4) and lin[-1] == pytest.approx(0.0)
    const = _lrs("constant", steps=10, warmup=2)
    assert const[0] == pytest.approx(4e-4) and all(v == pytest.approx(8e-4) for v in const[1:])


def test_no_warmup_starts_at_peak_and_long_warmup_is_clamped():
    assert lr_multiplier(0, warmup_steps=0, total_steps=10, decay_style="cosine", min_lr_ratio=0.0) == 1.0
    assert _lrs("cosine", steps=4, warmup=4) == pytest.approx([2e-4, 4e-4, 6e-4, 8e-4])
    assert _lrs_clamped() == pytest.approx([2e-4, 4e-4, 6e-4, 8e-4])  # warmup 10 > 4 steps


def _lrs_clamped():
    model = nn.Linear(2, 2)
    c = cfg("--training.steps", "4", "--lr_scheduler.warmup_steps", "10")
    opt = build_optimizer([model], c)
    sched = build_lr_scheduler(opt, c)
    out = []
    for _ in range(4):
        out.append(sched.get_last_lr())
        opt.step()
        sched.step()
    return out


def test_scheduler_state_roundtrip_restores_lr():
    c = cfg()
    opt = build_optimizer([nn.Linear(2, 2)], c)
    sched = build_lr_scheduler(opt, c)
    for _ in range(7):
        opt.step()
        sched.step()
    state = sched.state_dict()
    opt2 = build_optimizer([nn.Linear(2, 2), nn.Linear(2, 2)], c)  # different number of parts
    sched2 = build_lr_scheduler(opt2, c)
    sched2.load_state_dict(state)
    assert sched2.last_step == 7
    assert all(g["lr"] == pytest.approx(opt.param_groups[0]["lr"]) for g in opt2.param_groups)
    opt.step(), sched.step(), opt2.step(), sched2.step()
    assert sched2.get_last_lr() == pytest.approx(sched.get_last_lr())


def test_optimizer_state_dict_is_flat_fqn_keyed():
    model = Tiny()
    opt = build_optimizer([model], cfg())
    model(torch.tensor([[1, 2]])).sum().backward()
    opt.step()
    sd = opt.state_dict()
    assert "state.proj.weight.exp_avg" in sd and "param_groups.proj.weight.lr" in sd
    model2 = Tiny()
    opt2 = build_optimizer([model2], cfg())
    opt2.load_state_dict(sd)
    assert torch.equal(
        opt2.optimizers[0].state[model2.proj.weight]["exp_avg"], opt.optimizers[0].state[model.proj.weight]["exp_avg"]
    )


@pytest.mark.parametrize("decay, warmup", [("linear", 2), ("constant", 2), ("cosine", 0)])
def test_the_logged_lr_is_the_rate_each_step_ran_at(tmp_path, decay, warmup):
    """The trainer's lr column (metrics.jsonl's ``lr``) for every step equals the schedule's
    closed form at that step's index (step s ran at lr x lr_multiplier(s - 1)): with and
    without warm-up, each decay shape. (Before, the column held the next step's rate: with 5
    warm-up steps step 1 showed 2/5 of the peak.) One process, one tiny layer, 5 steps."""
    import json

    from trainer.lifecycle.rank import run_rank as main

    steps, lr, floor = 5, 1e-3, 0.1
    argv = ["--config", "llama3.toml", "--model.n_layers", "1", "--training.seq_len", "16",
            "--training.global_batch_size", "2", "--training.local_batch_size", "2", "--training.steps", str(steps),
            "--optimizer.lr", str(lr), "--lr_scheduler.warmup_steps", str(warmup), "--lr_scheduler.decay_style", decay,
            "--lr_scheduler.min_lr_ratio", str(floor), "--checkpoint.enable", "false", "--metrics.log_freq", "1",
            "--metrics.enable_tensorboard", "false", "--parallelism.dp_shard", "1", "--job.dump_folder", str(tmp_path)]  # fmt: skip
    try:
        assert main(argv) == 0
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    with open(tmp_path / "metrics.jsonl") as f:
        logged = {r["step"]: r["lr"] for r in map(json.loads, f) if "loss" in r}
    expected = {
        s: lr * lr_multiplier(s - 1, warmup_steps=warmup, total_steps=steps, decay_style=decay, min_lr_ratio=floor)
        for s in range(1, steps + 1)
    }
    assert logged == pytest.approx(expected, rel=1e-12)
    if warmup:
        assert logged[1] == pytest.approx(lr / warmup, rel=1e-12)  # the first warm-up step's rate, not the second's
