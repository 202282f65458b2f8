"""trainer/instruments: the step-hook interface, the order the loop calls hooks in, and the files
the recorder and the census write (through trainer/runtime/files.py)."""

from __future__ import annotations

import json

import pytest
import torch

from trainer.instruments import HookBase, Instruments, StepHook
from trainer.instruments.comm_record import CommRecordHook
from trainer.instruments.matmul_census import MatmulCensusHook
from trainer.instruments.profiler import StepProfiler

META = {"rank": 0, "world_size": 1, "comm_mode": "gloo", "degrees": {"dp_shard": 1}}


class _Trace(HookBase):
    def __init__(self, name: str, calls: list) -> None:
        super().__init__()
        self.name, self.calls = name, calls

    def on_step_start(self, step):
        self.calls.append(("start", self.name, step))

    def on_grads_ready(self, params):
        self.calls.append(("grads", self.name, len(params)))

    def on_step_end(self, step, result):
        self.calls.append(("end", self.name, step))
        return {f"{self.name}_seen": result}

    def close(self, exc=None):
        self.calls.append(("close", self.name, type(exc).__name__ if exc else None))


def test_hooks_wrap_a_step_like_nested_blocks():
    calls: list = []
    with Instruments([_Trace("outer", calls), _Trace("inner", calls)]) as hooks:
        result, extra = hooks.run_step(3, lambda x: x * 2, 21)
        hooks.grads_ready([1, 2])
    assert result == 42 and extra == {"outer_seen": 42, "inner_seen": 42}
    assert calls == [
        ("start", "outer", 3),
        ("start", "inner", 3),
        ("end", "inner", 3),
        ("end", "outer", 3),
        ("grads", "outer", 2),
        ("grads", "inner", 2),
        ("close", "inner", None),
        ("close", "outer", None),
    ]


def test_a_failing_step_closes_the_hooks_once_with_its_exception():
    calls: list = []

    def boom():
        raise torch.OutOfMemoryError("out of memory")

    with pytest.raises(torch.OutOfMemoryError), Instruments([_Trace("a", calls), _Trace("b", calls)]) as hooks:
        hooks.run_step(1, boom)
    assert calls == [
        ("start", "a", 1),
        ("start", "b", 1),
        ("close", "b", "OutOfMemoryError"),
        ("close", "a", "OutOfMemoryError"),
    ]  # no end, and closed once although the with block closes again


def test_every_instrument_is_a_step_hook(tmp_path):
    from trainer.config import load_config

    cfg = load_config(["--config", "llama3.toml"])
    hooks = [
        CommRecordHook(1, None, str(tmp_path), META, print),
        MatmulCensusHook(1, str(tmp_path), META, print),
        StepProfiler(cfg.profiling, str(tmp_path), 0, torch.device("cpu"), first_step=0),
    ]
    for hook in hooks:
        assert isinstance(hook, StepHook), type(hook)
        hook.close()
    assert not isinstance(object(), StepHook)  # negative control: the protocol is checked


def test_census_and_recorder_write_their_step_only(tmp_path):
    logged: list[str] = []
    hooks = Instruments(
        [
            CommRecordHook(2, None, str(tmp_path), META, logged.append),
            MatmulCensusHook(2, str(tmp_path), META, logged.append),
        ]
    )
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    for step in (1, 2, 3):
        hooks.run_step(step, torch.mm, a, b)
    hooks.close()
    census = json.loads((tmp_path / "matmul_census_rank0.json").read_text())
    assert census["step"] == 2 and census["total_flops"] == 2 * 4 * 8 * 3  # one step's mm, not three
    assert list(census)[:5] == ["step", "rank", "world_size", "comm_mode", "degrees"]
    record = json.loads((tmp_path / "comm_rank0.json").read_text())
    assert record["step"] == 2 and record["records"] == [] and record["degrees"] == {"dp_shard": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "comm_rank0.json",
        "matmul_census_rank0.json",
    ]  # no temp files
    assert len(logged) == 2 and all("step 2" in line for line in logged)
