"""Fault specs (trainer/faults.py), the bad-step options and the skipped sample ranges
(trainer/bad_steps.py, trainer/data/batching.py), in process: a bad spec or value is one
``error:`` line and exit 2 from train.py's ``main`` (before any process group); the loader's
skipped ranges give exactly the batches of a loader that read past them. The runs themselves:
tests/distributed/test_bad_steps.py, tests/e2e/test_long_runs.py."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.bad_steps import BadSteps
from trainer.config import ConfigError, load_config
from trainer.config.long_run_specs import Fault, parse_faults, parse_skip_samples

pytestmark = pytest.mark.unit


def test_the_documented_forms_parse():
    got = parse_faults(["nan_loss@5", "kill@7:rank=2", "hang@4:rank=1", "slow:rank=3:factor=2", "slow@3:factor=1.5"])
    assert got == [
        Fault("nan_loss", 5, None),
        Fault("kill", 7, 2),
        Fault("hang", 4, 1),
        Fault("slow", None, 3, 2.0),
        Fault("slow", 3, None, 1.5),
    ]
    # restart=N: only in the workers' start N (trainer/lifecycle/restarts.py); default every start
    assert parse_faults(["kill@7:rank=2:restart=0"]) == [Fault("kill", 7, 2, restart=0)]


def test_hang_before_joining_fires_in_its_restarted_start_only(monkeypatch):
    """``hang@0:restart=N``: the rank hangs before it joins its group in start N (a drill of
    restarted workers that cannot form their group, tests/e2e/test_restarts.py); in any other
    start, or on another rank, it returns at once."""
    from trainer import faults as faults_module

    assert parse_faults(["hang@0:rank=1:restart=1"]) == [Fault("hang", 0, 1, restart=1)]

    class Hung(Exception):
        pass

    def sleep(_seconds):
        raise Hung

    monkeypatch.setattr(faults_module.time, "sleep", sleep)
    for start, rank, hangs in (("0", 1, False), ("1", 0, False), ("1", 1, True), ("2", 1, False)):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", start)
        try:
            faults_module.before_joining(["hang@0:rank=1:restart=1", "kill@3"], rank, 2)
            hung = False
        except Hung:
            hung = True
        assert hung == hangs, (start, rank)


def test_a_fault_with_restart_fires_only_in_that_start(monkeypatch):
    from trainer.faults import Faults

    for start, kinds in (("0", ["kill", "hang"]), ("1", ["hang"])):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", start)
        faults = Faults(["kill@4:restart=0", "hang@5"], rank=0, world_size=2)
        assert [f.kind for f in faults.faults] == kinds, start


@pytest.mark.parametrize(
    "spec, words",
    [
        ("nan@5", "unknown fault 'nan'"),
        ("kill", "needs the step"),
        ("kill@0", "integer >= 1"),
        ("hang@0:rank=1", "add restart=N, N >= 1"),
        ("hang@0:restart=0", "add restart=N, N >= 1"),
        ("kill@x", "integer >= 1"),
        ("kill@7:rank=-1", "rank must be an integer"),
        ("kill@7:ranks=2", "not a key=value of 'kill'"),
        ("kill@7:restart=x", "restart must be an integer"),
        ("kill@7:rank=2:rank=3", "given twice"),
        ("nan_loss@5:factor=2", "not a key=value of 'nan_loss'"),
        ("slow:rank=1", "needs factor=F"),
        ("slow:factor=1", "a number > 1"),
        ("slow:factor=nan", "a number > 1"),
        ("", "an empty fault"),
    ],
)
def test_a_bad_spec_is_refused_naming_it(spec, words):
    with pytest.raises(ConfigError) as info:
        parse_faults([spec])
    assert words in str(info.value) and "docs/long_runs.md" in str(info.value), info.value


def test_a_rank_outside_the_job_is_refused():
    with pytest.raises(ConfigError, match="rank 4 is not in this job of 4 ranks"):
        parse_faults(["kill@2:rank=4"], world_size=4)


def _main_error(capsys, *args: str) -> str:
    from trainer.lifecycle.rank import run_rank as main

    rc = main(["--config", "llama3.toml", *args])
    err = capsys.readouterr().err
    assert rc == 2, (rc, err)
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@pytest.mark.parametrize(
    "args, words",
    [
        (["--debug.fault", "kill@7:rank=x"], "debug.fault 'kill@7:rank=x': rank must be an integer"),
        (["--training.on_nonfinite", "retry"], "training.on_nonfinite"),
        (["--training.on_nonfinite", "rollback", "--checkpoint.enable", "false"], "set checkpoint.enable = true"),
        (["--training.skip_samples", "8:4"], "training.skip_samples entry '8:4'"),
        (["--training.max_consecutive_skips", "0"], "max_consecutive_skips must be >= 1"),
        (["--training.loss_spike_factor", "0.5"], "loss_spike_factor must be > 1"),
        (["--metrics.straggler_threshold", "0"], "straggler_threshold must be > 0"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, args, words):
    assert words in _main_error(capsys, *args)


def test_skip_ranges_read_on_from_their_end():
    """A loader told to skip global samples 8:16 (step 2 of G = 8) gives, as its steps 2 and 3,
    exactly a plain loader's steps 3 and 4; on a batch rank of two (its own slice of each
    step); and a range inside a step's start moves the step to the range's end."""
    from trainer.data.loader import build_dataloader
    from trainer.data.tokenizer import load_tokenizer

    cfg = load_config(["--config", "llama3.toml", "--training.seq_len", "16", "--training.global_batch_size", "8",
                       "--training.local_batch_size", "2"])  # fmt: skip

    def steps(skip: list[str], n: int, rank: int) -> list[torch.Tensor]:
        cfg.training.skip_samples = skip
        loader = build_dataloader(cfg, load_tokenizer(""), batch_rank=rank, batch_degree=2)
        return [torch.cat([x for x, _ in loader.next_step()]) for _ in range(n)]

    for rank in (0, 1):
        plain = steps([], 4, rank)
        skipped = steps(["8:16"], 3, rank)
        assert torch.equal(skipped[0], plain[0]) and torch.equal(skipped[1], plain[2])
        assert torch.equal(skipped[2], plain[3])
        assert not torch.equal(skipped[1], plain[1])  # negative control: the range changed something
    assert parse_skip_samples(["40:48", " 0:8 "]) == [(40, 48), (0, 8)]


def test_the_loss_spike_rule_waits_for_its_window_then_judges():
    cfg = load_config(["--config", "llama3.toml", "--training.on_nonfinite", "skip",
                       "--training.loss_spike_factor", "2", "--training.loss_spike_window", "20"])  # fmt: skip
    bad = BadSteps(cfg, log=lambda line: None)
    for _ in range(9):
        assert not bad.judge(100.0, 1.0, 1)  # fewer than 10 good steps: no median yet
        bad.good(3.0)
    bad.good(3.0)
    assert bad.spike_threshold() == 6.0
    assert not bad.judge(5.9, 1.0, 11) and bad.judge(6.1, 1.0, 11) and bad.judge(math.nan, 1.0, 11)
    flag = bad.no_step(torch.tensor([6.1, 1.0]), None)
    assert flag.item() == 1.0 and bad.no_step(torch.tensor([5.0, 1.0]), None).item() == 0.0
    stop = BadSteps(load_config(["--config", "llama3.toml", "--training.loss_spike_factor", "2"]), log=print)
    for _ in range(10):
        stop.good(3.0)
    from trainer.step import TrainingDiverged

    with pytest.raises(TrainingDiverged, match="loss spike at step 12"):
        stop.judge(7.0, 1.0, 12)
