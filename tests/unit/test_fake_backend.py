"""comm.mode = fake_backend's config rules and run folder, what torch's fake backend leaves in
collective outputs (what the fake-backend mode relies on), and the collective recorder's kinds
and bytes for the collectives the trainer does not exercise on every layout (all-to-all with
uneven splits, send/recv, broadcast, size-1 groups)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from trainer.config import ConfigError, load_config
from trainer.simulation.fake_backend import prepare_fake_config

BASE = ["--config", "llama3.toml"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--comm.mode", "fake_backend"], "needs comm.fake_world_size"),
        (
            ["--comm.mode", "fake_backend", "--comm.fake_world_size", "8", "--comm.fake_rank", "8"],
            "comm.fake_rank (8) must be a rank of the simulated job: 0 .. 7",
        ),
        (["--comm.fake_world_size", "8"], "add --comm.mode fake_backend, or remove them"),
        (["--comm.fake_rank", "2"], "used only with comm.mode = 'fake_backend'"),
        (["--comm.mode", "fake"], "did you mean 'fake_backend'?"),
        (["--comm.record_step", "-1"], "comm.record_step must be >= 0"),
        (["--comm.record_step", "51"], "comm.record_step (51) is after the last step (training.steps = 50)"),
        (
            ["--comm.mode", "fake_backend", "--comm.fake_world_size", "8", "--checkpoint.create_seed_checkpoint"],
            "cannot run with comm.mode = 'fake_backend'",
        ),
    ],
)
def test_comm_config_errors_name_the_field_and_the_fix(args, message):
    with pytest.raises(ConfigError) as info:
        load_config(BASE + args)
    assert message in str(info.value)


@pytest.mark.fake_backend
def test_fake_run_writes_to_its_own_folder_without_checkpoint_io(tmp_path):
    cfg = load_config(
        BASE
        + ["--comm.mode", "fake_backend", "--comm.fake_world_size", "64", "--comm.fake_rank", "17"]
        + ["--job.dump_folder", str(tmp_path), "--checkpoint.initial_load_path", "/nowhere"]
    )
    assert cfg.checkpoint.enable  # llama3.toml checkpoints
    notes = prepare_fake_config(cfg)
    assert cfg.job.dump_folder == os.path.join(str(tmp_path), "fake_backend", "world64_rank17")
    assert not cfg.checkpoint.enable and cfg.checkpoint.initial_load_path == ""
    assert any("checkpoint.enable, checkpoint.initial_load_path ignored" in n for n in notes)
    prepare_fake_config(cfg)  # idempotent
    assert cfg.job.dump_folder == os.path.join(str(tmp_path), "fake_backend", "world64_rank17")


@pytest.mark.parametrize("version, refused", [("2.11.0+cu130", True), ("2.12.1", True), ("2.13.0+cpu", False)])
def test_fake_backend_on_a_torch_that_leaves_reduce_scatter_unwritten_is_refused(version, refused):
    """torch < 2.13's FakeProcessGroup does not write a reduce-scatter's output (measured on
    2.11.0), which FSDP2 allocates uninitialized: the config check refuses such a torch."""
    from trainer.config.validate import _fake_backend_torch

    ok, message = _fake_backend_torch(version)
    assert ok is not refused
    assert f"needs torch >= 2.13 (found {version})" in message and 'pip install "torch>=2.13,<2.16"' in message


def test_fake_backend_config_error_on_an_old_torch(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.11.0")
    with pytest.raises(ConfigError, match=r"comm.mode = 'fake_backend' needs torch >= 2.13 \(found 2.11.0\)"):
        load_config([*BASE, "--comm.mode", "fake_backend", "--comm.fake_world_size", "8"])


@pytest.fixture
def fake_world():
    from trainer.simulation.fake_backend import init_fake_process_group

    if dist.is_initialized():
        dist.destroy_process_group()
    init_fake_process_group(4, 1)
    yield
    dist.destroy_process_group()


@pytest.mark.fake_backend
def test_what_the_fake_backend_returns(fake_world):
    """The semantics trainer/simulation/fake_backend.py documents (torch's FakeProcessGroup)."""
    # all-reduce: the local value
    t = torch.tensor([3.0])
    dist.all_reduce(t)
    assert t.item() == 3.0
    # all-gather: the local input in every slot; reduce-scatter: this rank's chunk
    out = torch.zeros(8)
    getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(out, torch.tensor([1.0, 2.0]))
    assert out.tolist() == [1.0, 2.0] * 4
    rs = torch.zeros(2)
    getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(rs, torch.arange(8.0))
    assert rs.tolist() == [2.0, 3.0]  # rank 1's chunk
    # EP's count exchange (equal splits): the counts this rank sends come back
    counts = torch.tensor([5, 0, 2, 7, 1, 1, 3, 4])
    recv = torch.empty_like(counts)
    dist.all_to_all_single(recv, counts)
    assert recv.tolist() == counts.tolist()
    # so the token all-to-all's receive splits equal its send splits: as many rows come back
    send = counts.view(4, 2).sum(1).tolist()
    x = torch.randn(sum(send), 3)
    y = torch.empty_like(x)
    dist.all_to_all_single(y, x, output_split_sizes=send, input_split_sizes=send)
    assert y.shape == x.shape and torch.isfinite(y).all()


def test_recorder_kinds_and_bytes(fake_world):
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    from parallel_dims.comm_record import record_comms

    single = dist.new_group([1], backend="fake")
    with record_comms() as rec:
        x = torch.randn(6, 4)  # 96 B
        out = torch.empty(10, 4)  # 160 B
        dist.all_to_all_single(out, x, output_split_sizes=[1, 2, 3, 4], input_split_sizes=[3, 1, 1, 1])
        y = all_to_all_single_autograd(x.requires_grad_(), [4, 4, 4, 4], [3, 1, 1, 1], dist.group.WORLD)
        y.sum().backward()  # the reverse all-to-all: 64 rows in (1024 B), 6 rows out
        dist.broadcast(torch.zeros(5, dtype=torch.float64), src=0)
        dist.send(torch.zeros(3), dst=2)
        dist.recv(torch.zeros(7), src=0)
        dist.all_reduce(torch.ones(100), group=single)  # a size-1 group moves nothing
    kinds = [(r.kind, r.mesh, r.bytes, r.out_bytes, r.direction, r.group_size) for r in rec.records]
    assert kinds == [
        ("all_to_all", "world", 96, 160, None, 4),
        ("all_to_all", "world", 96, 256, None, 4),
        ("all_to_all", "world", 256, 96, None, 4),
        ("broadcast", "world", 40, None, None, 4),
        ("send_recv", "world", 12, None, "send", 4),
        ("send_recv", "world", 28, None, "recv", 4),
    ]
    assert rec.summary()[("all_to_all", "world")] == {"count": 3, "bytes": 448}
    assert rec.summary()[("send_recv", "world")] == {"count": 2, "bytes": 40}
    assert {"kind": "all_to_all", "mesh": "world", "bytes": 96, "count": 2} in rec.calls()
    assert sum(c["count"] for c in rec.calls()) == len(rec.records)


def test_compare_loss_refuses_the_fake_backend():
    from tools.compare_loss.layouts import UsageError, check_extra_overrides

    with pytest.raises(UsageError, match="fake-backend run's losses are meaningless"):
        check_extra_overrides(["--comm.mode", "fake_backend"])
