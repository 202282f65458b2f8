"""The elastic world size's rule and its errors (trainer/lifecycle/elastic.py): which degree
absorbs a lost node, what a node range ``--nnodes MIN:MAX`` is checked for before any worker
starts, and the restarted workers' roll call (trainer/runtime/distributed_init.py). The drill
itself (two launchers, one SIGKILLed): tests/e2e/test_elastic.py."""

from __future__ import annotations

import datetime
import time

import pytest
import torch.distributed as dist

from trainer.config import ConfigError, load_config
from trainer.lifecycle.elastic import check_node_range, node_worlds
from trainer.plan import plan_job

pytestmark = pytest.mark.unit

BASE = ["--config", "llama3.toml", "--model.n_layers", "2", "--training.seq_len", "64",
        "--training.local_batch_size", "2", "--training.global_batch_size", "8"]  # fmt: skip


def _check(*args: str, nodes=(1, 2), nproc=2):
    cfg = load_config([*BASE, *args])
    worlds = []

    def plan(c, world):
        worlds.append(world)
        return plan_job(c, world, device_type="cpu")

    check_node_range(cfg, *nodes, nproc, plan)
    return worlds


def test_every_node_count_is_planned_and_dp_shard_absorbs_the_change():
    assert node_worlds(1, 3, 2) == [(1, 2), (2, 4), (3, 6)]
    assert _check() == [2, 4]  # dp_shard = -1: 2 on one node, 4 on two; accumulation 2 and 1
    cfg = load_config(BASE)
    small, full = plan_job(cfg, 2, device_type="cpu"), plan_job(cfg, 4, device_type="cpu")
    assert (small.batch.global_batch_size, small.batch.grad_accum_steps) == (8, 2)
    assert (full.batch.global_batch_size, full.batch.grad_accum_steps) == (8, 1)
    assert _check("--parallelism.tp", "2") == [2, 4]  # fixed tp = 2 fits 1 node of 2: dp_shard 1 there
    assert _check(nodes=(2, 2)) == []  # a fixed node count: nothing more than the usual check


@pytest.mark.parametrize(
    "args, nodes, message",
    [
        (
            ["--parallelism.data_parallel_shard_degree", "4"],
            (1, 2),
            "--nnodes 1:2: parallelism.data_parallel_shard_degree = 4 is fixed, so the job fits only one world size, "
            "but the world may be 2 to 4 ranks; set --parallelism.data_parallel_shard_degree -1 (the degree that "
            "absorbs a lost node; every other degree stays as set)",
        ),
        (
            ["--training.global_batch_size", "-1"],
            (1, 2),
            "--nnodes 1:2: training.global_batch_size = -1 (local batch x batch degree) would shrink with the world; "
            "set it (e.g. --training.global_batch_size 8, its value on 2 nodes)",
        ),
        (  # a fixed degree that one node cannot hold
            ["--parallelism.tp", "4"],
            (1, 2),
            "--nnodes 1:2: no valid layout on 1 node (2 ranks), which a lost node would run on: ",
        ),
        (  # the global batch does not split over 3 nodes' batch ranks
            [],
            (1, 3),
            "--nnodes 1:3: no valid layout on 3 nodes (6 ranks), which the full job would run on: "
            "global_batch_size=8 is not divisible by the batch degree dp_replicate*dp_shard = 6",
        ),
    ],
)
def test_a_node_range_the_layout_cannot_follow_is_one_line(args, nodes, message):
    with pytest.raises(ConfigError) as exc:
        _check(*args, nodes=nodes)
    assert str(exc.value).startswith(message), str(exc.value)
    assert "\n" not in str(exc.value)


def test_a_job_wrong_on_every_world_gets_its_own_error():
    with pytest.raises(ValueError) as exc:
        _check("--parallelism.tp", "3")  # on no world: the plan's own words, no node count
    assert "--nnodes" not in str(exc.value)


def test_the_launcher_refuses_a_bad_range_before_any_worker(capsys):
    from trainer.lifecycle.launch import main

    code = main(["--nnodes", "1:2", "--nproc_per_node", "2", *BASE, "--parallelism.tp", "4"])
    err = capsys.readouterr().err
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --nnodes 1:2: no valid layout on 1 node (2 ranks)"), err


def test_a_fault_for_the_first_start_may_name_a_rank_the_smaller_world_lacks(monkeypatch):
    from trainer.faults import Faults

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # after the lost node: 2 ranks left
    assert Faults(["hang@4:rank=2:restart=0"], rank=0, world_size=2).faults == []
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    with pytest.raises(ConfigError, match="rank 2 is not in this job of 2 ranks"):
        Faults(["hang@4:rank=2:restart=0"], rank=0, world_size=2)


def test_ranks_that_never_join_the_first_start_are_named_within_the_timeout(monkeypatch):
    """The roll call before every start's group (trainer/runtime/distributed_init.py ``_join``;
    its restarted-start wording and the one rank that speaks: tests/unit/test_launch.py): on the
    first start, alone or with some peers, the ranks that never came are named within the
    timeout, not waited for inside the backend's connect."""
    from trainer.runtime.distributed_init import GroupNotFormed, _join

    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=30))
    _join(store, 0, 1, 1)  # one rank: nothing to wait for
    store = dist.HashStore()
    start = time.monotonic()
    with pytest.raises(GroupNotFormed) as exc:
        _join(store, 1, 4, 1)  # rank 1 of 4: ranks 0, 2, 3 never come
    assert time.monotonic() - start < 10
    assert str(exc.value).startswith(
        "error: the workers' first start could not form its group: ranks 0, 2, 3 of 4 did not join within "
        "comm.init_timeout_seconds = 1 s"
    ), str(exc.value)
    assert exc.value.speaks  # the lowest rank that came
    store = dist.HashStore()
    for r in (0, 3):
        store.set(f"joined/{r}", "host")
        store.add("joined", 1)
    with pytest.raises(GroupNotFormed, match="rank 2 of 4 did not join") as exc:
        _join(store, 1, 4, 1)
    assert not exc.value.speaks  # rank 0 came: it speaks


def test_a_joining_node_spends_no_restart_and_a_new_world_is_one_line(tmp_path, capsys):
    """The launcher's agent (trainer/lifecycle/restarts.py) on torch's two restarts: a healthy
    group restarted to admit a waiting node, and a failed group, each followed by the world the
    rendezvous gathered. A stand-in for torch's agent: its stop and its rendezvous-and-start (no
    metrics rows: each start failed before its first step)."""
    from types import SimpleNamespace

    from torch.distributed.elastic.agent.server.api import WorkerState

    from trainer.lifecycle.restarts import restarting_agent

    class Torch:
        def _stop_workers(self, group):
            pass

        def _initialize_workers(self, group):  # the rendezvous gathers ``group.next``: (nodes, ranks)
            group.group_world_size, group.workers = group.next[0], [SimpleNamespace(world_size=group.next[1])]

    cfg = load_config([*BASE, "--job.dump_folder", str(tmp_path)])
    agent = restarting_agent(cfg, Torch)()
    group = SimpleNamespace(state=WorkerState.HEALTHY, group_world_size=1, workers=[SimpleNamespace(world_size=2)],
                            spec=SimpleNamespace(max_restarts=2), next=(2, 4))  # fmt: skip
    agent._restart_workers(group)
    tail = "; the layout is planned for it (docs/long_runs.md)"
    assert capsys.readouterr().err.splitlines() == [
        "a node is joining: restarting the workers to take it in before its first step; no checkpoint: starting from step 0",
        "elastic: the job goes on with 2 nodes (4 ranks), was 1 (2 ranks)" + tail,
    ]
    assert agent.restarts == 0
    group.state, group.next = WorkerState.FAILED, (1, 2)
    type(agent).failures = {3: SimpleNamespace(exitcode=-9, pid=1, timestamp=0)}
    agent._restart_workers(group)
    assert capsys.readouterr().err.splitlines() == [
        "restart 1/2: rank 3 died (SIGKILL) before its first step; no checkpoint: starting from step 0",
        "elastic: the job goes on with 1 node (2 ranks), was 2 (4 ranks)" + tail,
    ]
    group.next = (1, 2)
    agent._restart_workers(group)  # the same world again: no world line
    assert capsys.readouterr().err.splitlines() == [
        "restart 2/2: rank 3 died (SIGKILL) before its first step; no checkpoint: starting from step 0"
    ]
