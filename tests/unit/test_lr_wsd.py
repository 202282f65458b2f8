"""The warmup-stable-decay schedule (``lr_scheduler.decay_style = "wsd"``) against its closed
form at the phase boundaries, for each decay shape, through the config, the optimizer and the
LambdaLRs the trainer builds; and extending a run (resuming with more ``training.steps``) keeps
the rate of every step already taken and lengthens the stable phase.

Closed form (steps indexed from 0, index s = the step that runs after s completed ones), with
W warmup steps, T steps, D = round(decay_ratio x T) decay steps, floor m: s < W: (s+1)/W;
W <= s <= T-1-D: 1; s > T-1-D: m + (1-m) f((s-(T-1-D))/D) with f(p) = 1-p, (1+cos(pi p))/2
or 1-sqrt(p). Values are float64 arithmetic on both sides: compared with rel 1e-12.
"""

from __future__ import annotations

import math

import pytest
import torch.nn as nn

from trainer.config import ConfigError, load_config
from trainer.optim.lr_schedule import lr_multiplier
from trainer.optim.optimizers import build_lr_scheduler, build_optimizer

PEAK = 1e-3
SHAPES = {
    "linear": lambda p: 1.0 - p,
    "cosine": lambda p: 0.5 * (1.0 + math.cos(math.pi * p)),
    "1-sqrt": lambda p: 1.0 - math.sqrt(p),
}


def _cfg(steps, warmup, ratio, shape, floor):
    return load_config(
        ["--config", "llama3.toml", "--optimizer.lr", str(PEAK), "--training.steps", str(steps)]
        + ["--lr_scheduler.decay_style", "wsd", "--lr_scheduler.warmup_steps", str(warmup)]
        + ["--lr_scheduler.decay_ratio", str(ratio), "--lr_scheduler.decay_shape", shape]
        + ["--lr_scheduler.min_lr_ratio", str(floor)]
    )


def _run(c, steps, state=None):
    """The lr each optimizer step ran at, for ``steps`` steps (after restoring ``state``)."""
    opt = build_optimizer([nn.Linear(2, 2)], c)
    sched = build_lr_scheduler(opt, c)
    if state is not None:
        sched.load_state_dict(state)
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        assert lrs[-1] == pytest.approx(sched.get_last_lr(), rel=1e-15)
        opt.step()
        sched.step()
    return lrs, sched


@pytest.mark.parametrize("shape", list(SHAPES))
def test_wsd_phase_boundaries_closed_form(shape):
    T, W, ratio, m = 40, 4, 0.25, 0.05  # D = 10: stable 4..29, decay 30..39
    D = 10
    lrs, _ = _run(_cfg(T, W, ratio, shape, m), T)
    f = SHAPES[shape]
    assert lrs[0] == pytest.approx(PEAK / W, rel=1e-12)  # first warmup step
    assert lrs[W - 1] == pytest.approx(PEAK, rel=1e-12)  # warmup reaches the peak
    assert lrs[W] == pytest.approx(PEAK, rel=1e-12)  # stable starts
    last_stable = T - 1 - D
    assert lrs[last_stable] == pytest.approx(PEAK, rel=1e-12)  # stable ends at the peak
    assert all(v == pytest.approx(PEAK, rel=1e-12) for v in lrs[W : last_stable + 1])
    for s in (last_stable + 1, last_stable + 5, T - 1):  # first, middle and last decay step
        expected = PEAK * (m + (1 - m) * f((s - last_stable) / D))
        assert lrs[s] == pytest.approx(expected, rel=1e-12), (shape, s)
    assert lrs[-1] == pytest.approx(PEAK * m, rel=1e-12)  # ends exactly on the floor
    assert lrs[last_stable + 1] < PEAK  # every decay step is below the peak
    assert all(a >= b for a, b in zip(lrs[W - 1 :], lrs[W:]))  # never rises after warmup


def test_wsd_without_warmup_and_with_decay_longer_than_the_run():
    assert lr_multiplier(0, warmup_steps=0, total_steps=10, decay_style="wsd", min_lr_ratio=0.0, decay_ratio=0.5) == 1.0
    # decay_ratio 1 with 2 warmup steps: the decay is clamped to the 8 steps after warmup
    lrs = [
        lr_multiplier(
            s,
            warmup_steps=2,
            total_steps=10,
            decay_style="wsd",
            min_lr_ratio=0.0,
            decay_ratio=1.0,
            decay_shape_name="linear",
        )
        for s in range(10)
    ]
    assert lrs == pytest.approx([0.5, 1.0] + [1 - k / 8 for k in range(1, 9)], rel=1e-12)
    # decay_ratio 0: warmup then constant
    assert [lr_multiplier(s, warmup_steps=1, total_steps=5, decay_style="wsd", min_lr_ratio=0.0, decay_ratio=0.0)
            for s in range(5)] == [1.0] * 5  # fmt: skip


def test_extending_a_wsd_run_keeps_the_steps_taken_and_lengthens_the_stable_phase():
    """A 40-step run checkpointed at step 25 (still stable), resumed with training.steps = 80:
    steps 1..25 ran at the same rates as in an uninterrupted 80-step run, the resumed run's
    steps equal that run's bitwise, and its decay starts at index 71 (D = 8) instead of 35."""
    short = _cfg(40, 4, 0.1, "1-sqrt", 0.0)
    long = _cfg(80, 4, 0.1, "1-sqrt", 0.0)
    taken, sched = _run(short, 25)
    reference, _ = _run(long, 80)
    assert taken == reference[:25]  # the same rates, bitwise
    resumed, _ = _run(long, 55, state=sched.state_dict())
    assert taken + resumed == reference
    assert resumed[35 - 25] == PEAK  # index 35 would have decayed in the 40-step run ...
    assert _run(short, 40)[0][36] < PEAK  # ... (it does there)
    assert reference[71] == PEAK and reference[72] < PEAK  # the long run's stable phase ends at 71


def test_wsd_config_values_are_checked():
    with pytest.raises(ConfigError, match="decay_ratio must be in"):
        _cfg(10, 1, 1.5, "linear", 0.0)
    with pytest.raises(ConfigError, match="decay_shape must be one of"):
        _cfg(10, 1, 0.2, "sqrt", 0.0)
