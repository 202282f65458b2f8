"""The collective recorder on real gloo ranks: it sees what was issued, on which mesh, with the
exact bytes of the convention (parallel_dims/comm_record.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tools.forkserver import run_distributed


def _controlled(rank, world_size):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from parallel_dims import ParallelDims
    from parallel_dims.comm_record import record_comms

    pd = ParallelDims(dp_shard=2, tp=2, world_size=world_size)
    pd.build_mesh("cpu")
    torch.manual_seed(0)
    # FSDP2 over fsdp (2 ranks): a 6x4 fp32 weight (96 B) and 6 bias floats (24 B); each rank
    # keeps 3 rows, the all-gather outputs the whole 120 B, the reduce-scatter inputs 120 B
    lin = torch.nn.Linear(4, 6)
    fully_shard(lin, mesh=pd.get_mesh("fsdp"), reshard_after_forward=True)
    x = torch.randn(5, 4)
    with record_comms(pd) as rec:
        # 40 B on the loss mesh, whose group is the fsdp group here: the mesh the caller holds
        # names the role
        loss_mesh = pd.get_mesh("loss")
        dist.all_reduce(torch.ones(10, dtype=torch.float32), group=loss_mesh.get_group())
        dist.all_reduce(torch.ones(3, dtype=torch.int64), group=pd.get_mesh("tp").get_group())
        lin(x).sum().backward()
        # a DTensor redistribution (functional collective) on tp: Shard(0) -> Replicate of
        # an 8x2 float64 tensor gathers 128 B
        d = DTensor.from_local(torch.ones(4, 2, dtype=torch.float64), pd.get_mesh("tp"), [Shard(0)])
        d.redistribute(pd.get_mesh("tp"), [Replicate()]).to_local()
    return rec.summary(), [(r.kind, r.mesh, r.bytes, r.op, tuple(r.aliases)) for r in rec.records]


def test_recorder_sees_exact_collectives_on_named_meshes():
    results = run_distributed(_controlled, 4, timeout=120)
    for summary, records in results:
        assert summary[("all_reduce", "loss")] == {"count": 1, "bytes": 40}, records
        assert summary[("all_reduce", "tp")] == {"count": 1, "bytes": 24}, records
        # reshard_after_forward: all-gathered in forward and again in backward, then one
        # gradient reduce-scatter, each of the full 120 B
        assert summary[("all_gather", "fsdp")] == {"count": 2, "bytes": 240}, records
        assert summary[("reduce_scatter", "fsdp")] == {"count": 1, "bytes": 120}, records
        assert summary[("all_gather", "tp")] == {"count": 1, "bytes": 128}, records
        # the loss group is the fsdp group here (dp_replicate = cp = 1): the role decides
        loss_aliases = {a for kind, mesh, _, _, a in records if mesh == "loss" for a in a}
        assert {"fsdp", "loss"} <= loss_aliases
        assert set(summary) == {
            ("all_reduce", "loss"),
            ("all_reduce", "tp"),
            ("all_gather", "fsdp"),
            ("reduce_scatter", "fsdp"),
            ("all_gather", "tp"),
        }, records


# fsdp 2 x tp 2, two layers (FSDP wraps each block: a resharded block and the last one), short
# sequences: every mesh of the layout issues its collectives all the same
_ARGV = [
    *("--config", "llama3.toml", "--model.n_layers", "2", "--training.seq_len", "32"),
    *("--training.global_batch_size", "4", "--training.local_batch_size", "2", "--training.steps", "1"),
    *("--parallelism.tp", "2", "--comm.record_step", "1", "--checkpoint.enable", "false"),
    *("--metrics.enable_tensorboard", "false"),
]


def _train_and_record(rank, world_size, folder):
    import json

    from trainer.config import load_config
    from trainer.trainer import Trainer

    Trainer(load_config([*_ARGV, "--job.dump_folder", folder])).train()
    with open(f"{folder}/comm_rank{rank}.json") as f:
        return json.load(f)


@pytest.mark.fake_backend
def test_trainer_dumps_every_ranks_collectives_and_a_fake_rank_issues_the_same(tmp_path):
    """comm.record_step on 4 gloo ranks (fsdp 2 x tp 2): every rank writes its step-1 records,
    with collectives on fsdp, tp and loss; ranks holding the same shapes issue the same ones; and
    a fake-backend run of rank 1 of the same layout (``train.py`` on a process of its own,
    forked from tools/forkserver.py's server, running alongside the gloo ranks) records exactly
    rank 1's (kind, mesh, count, bytes)."""
    import json

    from tools.forkserver import ForkedTrain

    fake = tmp_path / "fake"
    log_path = tmp_path / "fake.log"
    fake_argv = [*_ARGV, "--job.dump_folder", str(fake)]
    fake_argv += ["--comm.mode", "fake_backend", "--comm.fake_world_size", "4", "--comm.fake_rank", "1"]
    with open(log_path, "wb") as log:
        proc = ForkedTrain(1, fake_argv, stdout_fd=log.fileno(), stderr_fd=log.fileno())
    try:
        dumps = run_distributed(_train_and_record, 4, str(tmp_path / "real"), timeout=240)
    finally:
        returncode = proc.wait(240)
    for rank, d in enumerate(dumps):
        assert d["rank"] == rank and d["step"] == 1 and d["world_size"] == 4 and d["comm_mode"] == "default"
        summary = {(e["kind"], e["mesh"]): e for e in d["summary"]}
        for key in [("all_gather", "fsdp"), ("reduce_scatter", "fsdp"), ("all_gather", "tp"), ("all_reduce", "loss")]:
            assert summary[key]["count"] > 0 and summary[key]["bytes"] > 0, (rank, key, sorted(summary))
        # the gradient norm's partial sums are reduced over each mesh dimension of the grads
        assert summary[("all_reduce", "tp")]["count"] > 0
    assert dumps[0]["summary"] == dumps[2]["summary"] and dumps[1]["summary"] == dumps[3]["summary"]

    assert returncode == 0, log_path.read_text()[-3000:]
    fake_dump = json.loads((fake / "fake_backend" / "world4_rank1" / "comm_rank1.json").read_text())
    assert fake_dump["comm_mode"] == "fake_backend"
    assert fake_dump["summary"] == dumps[1]["summary"]
