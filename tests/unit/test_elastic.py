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


# The model's memory at every node count (trainer/lifecycle/elastic_fit.py). The debug model
# (2 layers, seq 64, micro-batch 2, 2 micro-batches per step on 2 ranks) needs 43.5 MiB per rank
# on 2 ranks and 25.5 MiB on 4 by the planner's estimate (its peak phase: the blocks' backward,
# with the first micro-batch's gradients accumulated unsharded; tools/planner/phases.py): a
# stated device of 40 MiB fits 2 nodes of 2 and not 1.
MIB = 2**20
FITS_FULL_ONLY = str(40 / 1024)  # job.device_memory_gib: 40 MiB


def _check_memory(*args: str, memory=None, estimator=None):
    from tools.planner.from_config import peak_bytes
    from trainer.lifecycle.elastic_fit import device_memory

    cfg = load_config([*BASE, *args])
    check_node_range(
        cfg, 1, 2, 2, lambda c, w: plan_job(c, w, device_type="cpu"), memory=memory or device_memory(cfg),
        estimator=estimator or peak_bytes,
    )  # fmt: skip


def test_a_node_count_the_model_does_not_fit_is_refused_naming_it():
    from tools.planner.from_config import estimate_from_config
    from tools.planner.hardware import load_hardware

    with pytest.raises(ConfigError) as exc:
        _check_memory("--job.device_memory_gib", FITS_FULL_ONLY)
    msg = str(exc.value)
    # the planner's own figure for this config on 2 ranks (what python -m tools.planner prices)
    cfg = load_config(BASE)
    vocab = plan_job(cfg, 2, device_type="cpu").model_args.vocab_size
    need = estimate_from_config(cfg, 2, load_hardware("h100"), gpus_per_node=2, tokenizer_vocab=vocab).memory["total"]
    assert f"{need / MIB:.1f}" == "43.5"
    assert msg.startswith(
        "--nnodes 1:2: on 1 node (2 ranks), which a lost node would run on, the job needs about 43.5 MiB per rank "
        "(planner estimate), more than the 40.0 MiB set by job.device_memory_gib; start with --nnodes 2:2 (the "
        "fewest nodes it fits) or make it fit with the memory options (training.cpu_offload, "
    ), msg
    assert "\n" not in msg
    with pytest.raises(ConfigError, match=r"on 1 node \(2 ranks\), which a lost node .* 43.5 MiB .*; make it fit"):
        _check_memory(
            memory=(25 * MIB, "of one test device")
        )  # 25.5 MiB on 2 nodes: fits on no node count: no --nnodes advice


def test_a_model_that_fits_every_node_count_passes_and_no_accelerator_checks_nothing(capsys):
    _check_memory(memory=(44 * MIB, "of one test device"))  # 43.5 MiB on 1 node, 25.5 on 2: fits
    _check_memory("--training.cpu_offload", "true", "--job.device_memory_gib", FITS_FULL_ONLY)  # 27.5 MiB on 1
    _check_memory()  # negative control: the refused job with no device memory stated, on a CPU host
    assert capsys.readouterr().err == ""
    with pytest.raises(ConfigError, match="job.device_memory_gib must be >= 0"):
        load_config([*BASE, "--job.device_memory_gib", "-1"])


def test_a_config_the_planner_cannot_price_is_said_and_goes_on(capsys):
    def unpriced(plan, gpus_per_node):
        raise NotImplementedError("no memory model for this layer kind")

    _check_memory("--job.device_memory_gib", FITS_FULL_ONLY, estimator=unpriced)  # not refused
    _check_memory("--job.device_memory_gib", FITS_FULL_ONLY, estimator=lambda plan, gpus_per_node: None)
    cfg = load_config([*BASE, "--job.device_memory_gib", FITS_FULL_ONLY])
    check_node_range(cfg, 1, 2, 2, lambda c, w: plan_job(c, w, device_type="cpu"), memory=(MIB, "of one test device"))
    tail = "; whether the job fits every node count is not checked"
    assert capsys.readouterr().err.splitlines() == [
        "note: --nnodes 1:2: could not estimate the device memory per rank on 1 node (2 ranks) with the planner "
        "(NotImplementedError: no memory model for this layer kind)" + tail,
        "note: --nnodes 1:2: could not estimate the device memory per rank on 1 node (2 ranks) with the planner "
        "(no estimate for this config)" + tail,
        "note: --nnodes 1:2: no device memory estimator was given to the launcher (train.py gives the planner's)"
        + tail,  # the check called without one: the launcher other than through train.py
    ]


def test_train_py_refuses_a_world_the_model_does_not_fit_before_any_worker(monkeypatch, capsys):
    """The wiring: train.py's own ``__main__`` (run in this process) hands the planner's estimate
    through trainer/lifecycle/main.py and launch.py to the node-range check, which refuses the
    range before any worker starts: one line, exit code 2."""
    import gc
    import runpy
    import sys
    from pathlib import Path

    import trainer.startup

    def no_workers(cfg, world_size):  # past the check: the range was let through
        raise AssertionError("the node range was not refused: the launcher went on to its preflight")

    monkeypatch.setattr(trainer.startup, "preflight", no_workers)
    monkeypatch.setattr(sys, "argv", ["train.py", "--nnodes", "1:2", "--nproc_per_node", "2", *BASE, "--job.device_memory_gib", FITS_FULL_ONLY])  # fmt: skip
    try:
        with pytest.raises(SystemExit) as exc:
            runpy.run_path(str(Path(__file__).resolve().parents[2] / "train.py"), run_name="__main__")
    finally:
        gc.unfreeze()  # train.py's gc.freeze() at its imports, undone for the rest of the session
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --nnodes 1:2: on 1 node (2 ranks), which a lost node"), err


@pytest.mark.parametrize("args", [[], ["--parallelism.tp", "2"], ["--parallelism.pp", "2"]])
def test_the_check_prices_what_the_planner_prices(args):
    """Without memory options the check's figure is the planner's estimate of the config, the
    pipeline's first and last stage included (tools.planner.from_config.estimate_from_config)."""
    from tools.planner.from_config import estimate_from_config, peak_bytes
    from tools.planner.hardware import load_hardware

    cfg = load_config([*BASE, *args])
    plan = plan_job(cfg, 4, device_type="cpu")
    want = estimate_from_config(
        cfg, 4, load_hardware("h100"), gpus_per_node=2, tokenizer_vocab=plan.model_args.vocab_size
    )
    assert peak_bytes(plan, 2) == want.memory["total"]


def test_the_device_memory_is_the_smallest_gpu_of_the_host(monkeypatch):
    """On a GPU host (torch.cuda stood in for here): the smallest device's total_memory and its name."""
    from types import SimpleNamespace

    import torch

    from trainer.lifecycle.elastic_fit import device_memory

    gpus = [SimpleNamespace(total_memory=95 * 2**30, name="big"), SimpleNamespace(total_memory=int(79.1 * 2**30), name="NVIDIA H100 80GB HBM3")]  # fmt: skip
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: gpus[i])
    assert device_memory(load_config(BASE)) == (int(79.1 * 2**30), "of one NVIDIA H100 80GB HBM3")
    assert device_memory(load_config([*BASE, "--job.device_memory_gib", "40"])) == (
        40 * 2**30,
        "set by job.device_memory_gib",
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device_memory(load_config(BASE)) is None  # no accelerator: no limit to check


# plain torchrun (trainer/lifecycle/torchrun_range.py): the workers read the node range from their
# agent's command line and make the launcher's checks; the e2e side is tests/e2e/test_elastic.py
TORCHRUN = ["/venv/bin/python", "/venv/bin/torchrun", "--nnodes", "1:2", "--nproc_per_node", "2", "--rdzv_backend",
            "c10d", "--rdzv_endpoint", "head:29400", "--max_restarts", "3", "train.py", "--config", "llama3.toml"]  # fmt: skip
WORKER = {"TORCHELASTIC_RUN_ID": "job", "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_USE_AGENT_STORE": "False"}


def test_plain_torchrun_s_node_range_is_read_from_the_agent_s_command_line():
    import os
    import sys

    from trainer.lifecycle.parent_death import LAUNCHER_PID
    from trainer.lifecycle.torchrun_range import parent_cmdline, torchrun_node_range

    assert torchrun_node_range(WORKER, TORCHRUN) == (1, 2, 2)
    module = ["python", "-m", "torch.distributed.run", "--nnodes=2:4", "--nproc-per-node=2", "train.py"]
    assert torchrun_node_range(WORKER, module) == (2, 4, 2)
    fixed = [part if part != "1:2" else "2" for part in TORCHRUN]
    assert torchrun_node_range(WORKER, fixed) is None  # a fixed node count: nothing to check
    ours = ["/venv/bin/python", "train.py", "--nnodes", "1:2", "--nproc_per_node", "2", "--config", "llama3.toml"]
    assert torchrun_node_range(WORKER, ours) is None  # not torchrun's command line
    assert torchrun_node_range({**WORKER, LAUNCHER_PID: "1"}, TORCHRUN) is None  # our launcher's worker: it checked
    assert torchrun_node_range({"LOCAL_WORLD_SIZE": "2"}, TORCHRUN) is None  # no elastic agent
    assert torchrun_node_range(WORKER, None) is None  # the parent's command line unreadable
    assert parent_cmdline(os.getpid())[: len(sys.orig_argv)] == sys.orig_argv  # /proc's form, as read


@pytest.mark.parametrize(
    "args, worker, message",
    [
        ([], WORKER, None),  # dp_shard = -1, the global batch set: it starts
        (["--parallelism.data_parallel_shard_degree", "4"], {**WORKER, "TORCHELASTIC_RESTART_COUNT": "1"},
         "--nnodes 1:2: parallelism.data_parallel_shard_degree = 4 is fixed, so the job fits only one world size"),
        (["--parallelism.tp", "4"], WORKER,
         "--nnodes 1:2: no valid layout on 1 node (2 ranks), which a lost node would run on: tp=4 does not divide"),
        (["--job.device_memory_gib", "0.0390625"], WORKER,
         "--nnodes 1:2: on 1 node (2 ranks), which a lost node would run on, the job needs about 60.0 MiB per rank"),
        ([], {**WORKER, "TORCHELASTIC_USE_AGENT_STORE": "True"},
         "torchrun --nnodes 1:2 shares its rendezvous store with the workers, and on torch "),
    ],
)  # fmt: skip
def test_plain_torchrun_workers_refuse_what_the_launcher_refuses(args, worker, message):
    """At every start (a restarted one too): the launcher's lines for a range the layout or the
    memory cannot follow (the estimator is train.py's, stood in for: 60 MiB on 1 node, 30 on 2),
    and the shared store in one line naming the fix. Control: our launcher's worker checks
    nothing (the launcher did), whatever the config."""
    from trainer.lifecycle.parent_death import LAUNCHER_PID
    from trainer.lifecycle.torchrun_range import check_torchrun_range

    cfg = load_config([*BASE, *args])

    def estimator(plan, gpus_per_node):
        return 120 * 2**20 / plan.world_size

    check = lambda env: check_torchrun_range(cfg, env, TORCHRUN, estimator=estimator, device_type="cpu")  # noqa: E731
    if message is None:
        check(worker)
    else:
        with pytest.raises(ValueError) as exc:
            check(worker)
        assert str(exc.value).startswith(message), str(exc.value)
    check({**worker, LAUNCHER_PID: "1"})
