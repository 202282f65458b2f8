"""Every process group the mesh creates runs with the job's timeout, read back from the group
(issue 24 item 2: subgroups used to get the backend's default, 10 min on NCCL, 30 min on gloo,
whatever comm.init_timeout_seconds said), and apply_train_timeout reaches every one of them."""

from __future__ import annotations

import datetime

import pytest
import torch.distributed as dist

from parallel_dims import ParallelDims
from parallel_dims.process_groups import process_group_timeout
from tools.forkserver import run_distributed

INIT_S, TRAIN_S, EXPLICIT_S = 123, 7, 45


def _real_groups() -> list[dist.ProcessGroup]:
    return [g for g in dist.distributed_c10d._world.pg_map if dist.get_backend(g) != "fake"]


def _timeouts(groups) -> dict[str, float]:
    return {g.group_name: process_group_timeout(g).total_seconds() for g in groups}


def _check_group_timeouts(rank, world_size, degrees):
    from trainer.runtime.distributed_init import apply_train_timeout

    # the job's init timeout on WORLD, as init_distributed gives it (the launcher's group has
    # gloo's default)
    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=INIT_S))
    # negative control: a group made the way _new_group used to make them has torch's default
    plain = dist.new_group(list(range(world_size)))
    default = process_group_timeout(plain).total_seconds()
    assert default != INIT_S, default

    pd = ParallelDims(world_size=world_size, **degrees)
    pd.build_mesh("cpu")
    if pd.dp_shard > 1 and pd.tp > 1:
        pd.flatten(["dp_shard", "tp"], "dp_tp")  # a later flatten gets the same timeout
    made = [g for g in _real_groups() if g is not plain]
    mesh_groups = {m.get_group().group_name for m in pd.get_all_one_dimensional_meshes().values()}
    after_build = _timeouts(made)
    assert pd.groups_created >= 1
    assert after_build == {n: INIT_S for n in after_build}, after_build

    # an explicit timeout for the mesh's groups (WORLD keeps its own)
    pd2 = ParallelDims(world_size=world_size, **degrees)
    before = set(dist.distributed_c10d._world.pg_map)
    pd2.build_mesh("cpu", timeout=datetime.timedelta(seconds=EXPLICIT_S))
    new = [g for g in _real_groups() if g not in before]
    assert len(new) == pd2.groups_created >= 1
    assert set(_timeouts(new).values()) == {EXPLICIT_S}
    assert process_group_timeout().total_seconds() == INIT_S

    # an async checkpointer's two groups wait for the slowest rank's background write: they
    # keep the (long) timeout they were made with
    from trainer.checkpoint.async_save import BackgroundSaver

    saver = BackgroundSaver("async", timeout_s=INIT_S)
    long_wait = {saver.write_pg.group_name, saver.status_pg.group_name}

    # after the first step: every other real group of the process, WORLD and the mesh's included
    apply_train_timeout(TRAIN_S)
    after_train = _timeouts(_real_groups())
    assert {n: t for n, t in after_train.items() if n in long_wait} == {n: INIT_S for n in long_wait}
    assert set(t for n, t in after_train.items() if n not in long_wait) == {TRAIN_S}, after_train
    return sorted(mesh_groups & set(after_build)), len(after_build), default


LAYOUTS = [
    dict(dp_shard=2, tp=2),
    dict(dp_replicate=2, cp=2, ep=2),
    dict(pp=2, dp_shard=2, ep=2),
]


@pytest.mark.parametrize("degrees", LAYOUTS, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_every_group_gets_the_init_then_the_train_timeout(degrees):
    results = run_distributed(_check_group_timeouts, 4, degrees)
    for checked_mesh_groups, n_groups, default in results:
        assert checked_mesh_groups, "no subgroup of the mesh was checked"
        assert n_groups >= 2  # WORLD and at least one subgroup
        assert default == 1800  # gloo's default, what the subgroups had before


# ----------------------------------------------------------------------------- the watchdog across ranks

_RANK_SCRIPT = """
import datetime, os, sys, time
import torch, torch.distributed as dist
from trainer.runtime.comm_watchdog import JobWatchdog, pg_timeout_seconds

rank, limit, dump_folder = int(os.environ["RANK"]), int(sys.argv[1]), sys.argv[2]
torch.set_num_threads(1)
# NCCL's ordering on gloo: the group times out `grace` after the watchdog's deadline
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=pg_timeout_seconds("nccl", limit)))
wd = JobWatchdog(rank, "nccl", train_timeout_seconds=limit, init_timeout_seconds=120, dump_folder=dump_folder)
with wd:
    for step in range(1, 100):
        wd.step(step, first=step == 1)
        if rank == 1 and step == 4:
            print("hanging", flush=True)
            time.sleep(300)  # hung outside any collective; rank 0 waits in step 4's all_reduce
        t = torch.ones(1)
        dist.all_reduce(t)
        t.tolist()  # the step's host sync
        wd.disarm()
print("not reached", flush=True)
"""


def test_watchdog_ends_every_rank_of_a_hung_job_with_one_line_and_a_dump(tmp_path):
    """Two gloo ranks with NCCL's ordering (the watchdog at the limit, the group's timeout 30 s
    later): rank 1 hangs in step 4 outside any collective, rank 0 waits for it in step 4's
    all_reduce. Both end at the limit (+ the dump) with exit code 3 and one line each; rank 0's
    flight-recorder dump shows the all_reduce it waits in, rank 1's that it never issued it."""
    import os
    import pickle
    import socket
    import subprocess
    import sys
    import time

    from trainer.runtime.comm_watchdog import DUMP_WAIT_SECONDS, EXIT_COMM_TIMEOUT

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    limit = 3
    procs = []
    for rank in range(2):
        env = dict(
            os.environ,
            OMP_NUM_THREADS="1",
            PYTHONPATH=repo,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE="2",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", _RANK_SCRIPT, str(limit), str(tmp_path)],
                env=env,
                cwd=repo,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    try:
        assert procs[1].stdout.readline().strip() == "hanging"
        hung = time.monotonic()
        outs = [p.communicate(timeout=120) for p in procs]
        elapsed = time.monotonic() - hung
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == EXIT_COMM_TIMEOUT, (rank, p.returncode, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1, err
        assert lines[0].startswith(f"error: rank {rank}: step 4 did not finish within comm.train_timeout_seconds = 3 s")
        assert "not reached" not in out
    # the limit, at most the dump's wait, and slack for process exit on a loaded box; far below
    # the group's own timeout (limit + 30 s) plus its wait
    assert elapsed < limit + DUMP_WAIT_SECONDS + 15, elapsed
    entries = {}
    for rank in range(2):
        path = tmp_path / "comm_traces" / f"rank_{rank}"
        assert f"flight-recorder dump: {path}" in outs[rank][1]
        entries[rank] = pickle.loads(path.read_bytes())["entries"]
    # rank 0 issued step 4's all_reduce (not completed), rank 1 stopped after step 3's
    assert max(e["collective_seq_id"] for e in entries[0]) == 4
    assert max(e["collective_seq_id"] for e in entries[1]) == 3
    last = max(entries[0], key=lambda e: e["collective_seq_id"])
    assert last["state"] != "completed" and "all_reduce" in last["profiling_name"], last
