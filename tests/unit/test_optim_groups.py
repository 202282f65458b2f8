"""Parameter groups (``[[optimizer.param_groups]]``): each group's effective lr and weight
decay observed in the optimizer and in the parameters after a step, first match wins, a
pattern that gets no parameter is an error naming it, the start-up summary, and a resume under
another grouping refused in one line (reset with ``checkpoint.exclude_from_loading``).

How the effective rates are observed: AdamW's first step moves a parameter by
-lr (wd p + g / (|g| + eps')) with m_hat = g, v_hat = g^2 (bias-corrected), so with a zero
gradient the step is exactly p (1 - lr wd) (decay alone), and with g = 1 it is
p (1 - lr wd) - lr / (1 + eps): both identify the group's lr and wd. Compared with rel 1e-6
(float32 parameters, one rounding of each product).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from trainer.config import load_config
from trainer.optim.groups import GROUPING_KEY
from trainer.optim.optimizers import build_lr_scheduler, build_optimizer

GROUPS = (
    "[{pattern = '^tok_embeddings', lr_mult = 0.5, weight_decay = 0.0},"
    " {pattern = 'norm', lr_mult = 2.0, weight_decay = 0.3, betas = [0.8, 0.9], eps = 1e-6},"
    " {pattern = 'proj|norm', lr_mult = 3.0}]"  # norm is taken by the group before: first match wins
)
LR, WD = 1e-2, 0.1


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(16, 8)
        self.norm = nn.LayerNorm(8)
        self.proj = nn.Linear(8, 8, bias=True)
        self.output = nn.Linear(8, 16, bias=False)


def cfg(*args):
    return load_config(
        ["--config", "llama3.toml", "--optimizer.lr", str(LR), "--optimizer.weight_decay", str(WD)]
        + ["--lr_scheduler.warmup_steps", "0", "--lr_scheduler.decay_style", "constant", *args]
    )


def _by_name(opt, model):
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: g for g in opt.param_groups for p in g["params"]}


# name -> (lr, weight decay) each parameter must get
EXPECTED = {
    "tok_embeddings.weight": (0.5 * LR, 0.0),
    "norm.weight": (2.0 * LR, 0.3),  # a group's weight_decay applies to 1-D parameters too
    "norm.bias": (2.0 * LR, 0.3),
    "proj.weight": (3.0 * LR, WD),  # no weight_decay in the group: the default rule
    "proj.bias": (3.0 * LR, 0.0),
    "output.weight": (LR, WD),  # no group: default
}


def test_each_groups_lr_and_weight_decay_after_a_step():
    torch.manual_seed(0)
    model = Tiny()
    opt = build_optimizer([model], cfg("--optimizer.param_groups", GROUPS))
    sched = build_lr_scheduler(opt, cfg("--optimizer.param_groups", GROUPS))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():  # g = 1 on even rows, 0 on the others
        p.grad = torch.zeros_like(p)
        p.grad[::2] = 1.0
    opt.step()
    sched.step()
    groups = _by_name(opt, model)
    for name, (lr, wd) in EXPECTED.items():
        g = groups[name]
        assert g["lr"] == pytest.approx(lr, rel=1e-12) and g["weight_decay"] == wd, name
        p, p0 = dict(model.named_parameters())[name].detach(), before[name]
        decayed = p0 * (1 - lr * wd)
        torch.testing.assert_close(p[1::2], decayed[1::2], rtol=1e-6, atol=0, msg=name)  # g = 0: decay only
        step = lr / (1 + g["eps"])
        torch.testing.assert_close(p[::2], decayed[::2] - step, rtol=1e-6, atol=1e-9, msg=name)
    assert groups["norm.weight"]["betas"] == (0.8, 0.9) and groups["norm.weight"]["eps"] == 1e-6
    assert groups["proj.weight"]["betas"] == (0.9, 0.95) and groups["proj.weight"]["eps"] == 1e-8
    # negative control: without the groups every lr is the base one and the embedding decays
    plain = _by_name(build_optimizer([model], cfg()), model)
    assert plain["tok_embeddings.weight"]["lr"] == LR and plain["tok_embeddings.weight"]["weight_decay"] == WD


def test_the_start_up_summary_counts_each_group():
    opt = build_optimizer([Tiny()], cfg("--optimizer.param_groups", GROUPS))
    assert opt.summary == [
        "optimizer group param_groups[0] '^tok_embeddings': AdamW, 1 tensors, 128 parameters, lr 0.005 (x0.5), "
        "weight_decay 0",
        "optimizer group param_groups[1] 'norm': AdamW, 2 tensors, 16 parameters, lr 0.02 (x2), weight_decay 0.3",
        "optimizer group param_groups[2] 'proj|norm': AdamW, 1 tensors, 8 parameters, lr 0.03 (x3), weight_decay 0",
        "optimizer group param_groups[2] 'proj|norm': AdamW, 1 tensors, 64 parameters, lr 0.03 (x3), weight_decay 0.1",
        "optimizer group default: AdamW, 1 tensors, 128 parameters, lr 0.01 (x1), weight_decay 0.1",
    ]


def test_a_pattern_that_gets_no_parameter_is_an_error_naming_it():
    with pytest.raises(ValueError, match=r"param_groups\[1\].pattern 'wq': it matches no parameter"):
        build_optimizer([Tiny()], cfg("--optimizer.param_groups", "[{pattern = 'proj'}, {pattern = 'wq'}]"))
    with pytest.raises(ValueError, match=r"param_groups\[1\].pattern 'proj.bias': every parameter it matches"):
        build_optimizer([Tiny()], cfg("--optimizer.param_groups", "[{pattern = 'proj'}, {pattern = 'proj.bias'}]"))
    # the check is against the whole model (all pipeline stages), not this rank's part
    whole = [("tok_embeddings.weight", (16, 8)), ("layers.7.wq.weight", (8, 8))]
    build_optimizer([Tiny()], cfg("--optimizer.param_groups", "[{pattern = 'wq'}]"), all_params=whole)


def test_a_resume_under_another_grouping_is_refused_in_one_line():
    model = Tiny()
    opt = build_optimizer([model], cfg("--optimizer.param_groups", GROUPS))
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    sd = opt.state_dict()
    assert GROUPING_KEY in sd
    # same grouping, other hyperparameters: restored (state) and the config's values kept
    same = build_optimizer([Tiny()], cfg("--optimizer.param_groups", GROUPS.replace("0.5", "0.25")))
    same.load_state_dict(sd)
    assert same.optimizers[0].state and same.param_groups[0]["weight_decay"] == 0.0
    other = build_optimizer([Tiny()], cfg("--optimizer.param_groups", "[{pattern = 'proj'}]"))
    with pytest.raises(ValueError) as e:
        other.load_state_dict(sd)
    msg = str(e.value)
    assert "\n" not in msg and "another parameter grouping" in msg and 'exclude_from_loading = ["optimizer"]' in msg
    legacy = {k: v for k, v in build_optimizer([Tiny()], cfg()).state_dict().items() if k != GROUPING_KEY}
    build_optimizer([Tiny()], cfg()).load_state_dict(legacy)  # a checkpoint from before groups: plain AdamW
    with pytest.raises(ValueError, match="another parameter grouping"):
        build_optimizer([Tiny()], cfg("--optimizer.name", "Muon")).load_state_dict(legacy)


# ------------------------------------------------------------------ LoRA+ through the trainer

LORA_ARGV = [
    "--config", "llama3.toml", "--model.n_layers", "2", "--model.converters", "lora",
    "--training.seq_len", "32", "--training.global_batch_size", "4", "--training.local_batch_size", "2",
    "--training.steps", "1", "--training.prefetch", "false",
    "--metrics.enable_tensorboard", "false", "--checkpoint.enable", "false",
    "--parallelism.pp", "2", "--parallelism.dp_shard", "2", "--parallelism.pipeline_parallel_schedule", "GPipe",
    "--comm.mode", "fake_backend", "--comm.fake_world_size", "4", "--comm.fake_rank", "1",
]  # fmt: skip


def _lora_trainer(tmp_path, groups: str):
    import torch.distributed as dist

    import trainer.trainer as train_mod

    c = load_config([*LORA_ARGV, "--optimizer.param_groups", groups, "--job.dump_folder", str(tmp_path)])
    try:
        return train_mod.Trainer(c)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.fake_backend
def test_lora_plus_groups_the_adapters_built_by_the_converter(tmp_path):
    """LoRA+ (``pattern = 'lora_b'``, its own lr): the trainer checks and summarises the groups over
    the parameters after the converters, so the pattern is accepted, every ``lora_b`` of this rank
    (pp stage 0 of 2 under dp_shard 2, fake backend) sits in an optimizer group at 16 x lr and
    ``lora_a`` at lr, no frozen parameter is in any group, and the summary counts the whole model's
    adapters (both stages), not the frozen base. A pattern matching frozen weights only is refused
    naming why. Before, the groups were checked against the unconverted model: 'lora_b' matched
    nothing, and the summary described the frozen base."""
    lr = load_config(LORA_ARGV).optimizer.lr
    t = _lora_trainer(tmp_path, "[{pattern = 'lora_b', lr_mult = 16.0}]")
    names = {id(p): n for part in t.model_parts for n, p in part.named_parameters()}
    grouped = {names[id(p)]: g["lr"] for g in t.optimizer.param_groups for p in g["params"]}
    assert any(".lora_b" in n for n in grouped) and any(".lora_a" in n for n in grouped)
    for name, group_lr in grouped.items():
        assert group_lr == pytest.approx((16.0 if name.endswith("lora_b") else 1.0) * lr, rel=1e-12), name
    assert all(n.endswith(("lora_a", "lora_b")) for n in grouped)  # the frozen base is in no group
    # the whole model's adapters: 2 blocks x 7 linears, rank 8; debug dims 256, ffn hidden from the model
    from models.parallel.lora import LoRAOptions, convert_to_lora
    from models.registry import build_model

    whole = build_model("llama3", "debugmodel", device="meta", n_layers=2)
    convert_to_lora(whole, LoRAOptions())
    b = sum(p.numel() for n, p in whole.named_parameters() if n.endswith("lora_b"))
    a = sum(p.numel() for n, p in whole.named_parameters() if n.endswith("lora_a"))
    frozen = sum(p.numel() for p in whole.parameters() if not p.requires_grad)
    assert t.optimizer.summary[0].startswith(f"optimizer group param_groups[0] 'lora_b': AdamW, 14 tensors, {b:,} par")
    assert t.optimizer.summary[1].startswith(f"optimizer group default: AdamW, 14 tensors, {a:,} parameters")
    assert f"optimizer: {a + b:,} trainable parameters" in t.optimizer.summary[2]
    assert f"{frozen:,} parameters, in no group" in t.optimizer.summary[2]
    with pytest.raises(ValueError, match=r"param_groups\[0\].pattern 'norm': it matches frozen parameters only"):
        _lora_trainer(tmp_path / "frozen", "[{pattern = 'norm'}]")
