"""trainer/lifecycle/launch.py's pieces that need no job: which arguments are the launcher's (torchrun's
flags) and which the trainer's, and what the launcher says of a failed job. (The launcher end
to end: tests/e2e/test_train_launcher.py.)"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from trainer.lifecycle.launch import _failure_line, _parse_launch, launcher_argv


def test_torchrun_flags_are_the_launchers_and_the_rest_the_trainers():
    assert launcher_argv(["--config", "llama3.toml", "--training.steps", "5"]) is None  # plain python train.py
    assert launcher_argv(["--help"]) is None
    assert launcher_argv(["--nproc_per_node", "4", "--config", "llama3.toml", "--training.steps=5"]) == (
        ["--nproc_per_node", "4"],
        ["--config", "llama3.toml", "--training.steps=5"],
    )
    # anywhere on the line, = or a separate value, dashes or underscores, flags without a value
    argv = ["--config", "x.toml", "--nnodes=2", "--standalone", "--rdzv-endpoint", "h:1", "--parallelism.tp", "2"]
    assert launcher_argv(argv) == (
        ["--nnodes=2", "--standalone", "--rdzv-endpoint", "h:1"],
        ["--config", "x.toml", "--parallelism.tp", "2"],
    )


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--nproc_per_node", "0"], "--nproc_per_node must be >= 1, got 0"),
        (["--nproc_per_node", "many"], "--nproc_per_node must be a number of processes, gpu, cpu or auto, got 'many'"),
        (["--nproc_per_node", "2", "--nnodes", "a:b"], "--nnodes must be N or MIN:MAX, got 'a:b'"),
        (["--nproc_per_node", "2", "--max_restarts", "many"], "argument --max-restarts"),
    ],
)
def test_bad_launcher_flags_are_one_line(flags, message):
    with pytest.raises(ValueError, match="torchrun's flags") as exc:
        _parse_launch(flags)
    assert message in str(exc.value)


def test_world_size_is_nodes_times_processes_at_the_smallest_node_count():
    from torch.distributed.run import determine_local_world_size

    assert _parse_launch(["--nproc_per_node", "4", "--nnodes", "2"])[1] == 8
    assert _parse_launch(["--nproc_per_node", "8", "--nnodes", "2:4"])[1] == 16
    # torchrun's names too (cpu: the usable cores, as torchrun counts them)
    args, world = _parse_launch(["--nproc_per_node", "cpu", "--nnodes", "2"])
    assert world == 2 * determine_local_world_size("cpu") and args.nproc_per_node == str(world // 2)


def _failed(code: int):
    failure = SimpleNamespace(exitcode=code, pid=4242, timestamp=0)
    return SimpleNamespace(get_first_failure=lambda: (3, failure), failures={3: failure})


def test_what_the_launcher_says_of_a_failed_job():
    # the workers said it (a user error's line, a stop's line): nothing more, their exit code
    assert _failure_line(_failed(2)) == (None, 2)
    assert _failure_line(_failed(130)) == (None, 130)
    assert _failure_line(_failed(143)) == (None, 143)
    line, code = _failure_line(_failed(-9))
    assert code == 137 and line.startswith("error: rank 3 (pid 4242) was ended by SIGKILL")
    line, code = _failure_line(_failed(1))
    assert code == 1 and line.startswith("rank 3 (pid 4242) exited with code 1")


def _job(*failures):
    """A failed job of ``(rank, exit code, timestamp)`` failures, torch's first by timestamp."""
    found = {rank: SimpleNamespace(exitcode=code, pid=1000 + rank, timestamp=t) for rank, code, t in failures}
    first = min(found, key=lambda r: found[r].timestamp)
    return SimpleNamespace(failures=found, get_first_failure=lambda: (first, found[first]))


def test_the_launcher_names_the_cause_not_the_ranks_that_ended_after_it():
    """Rank 1 met bad input only it reads (its line printed) and rank 0's collective then
    failed on the gone peer (exit 4, quiet), in the same second: the job ends with rank 1's
    code 2 and no line of the launcher's, whichever torch lists first. A crash is still named,
    ahead of the ranks stopped or left without their peer."""
    assert _failure_line(_job((0, 4, 100), (1, 2, 100))) == (None, 2)
    assert _failure_line(_job((0, 143, 100), (1, 2, 101))) == (None, 2)
    line, code = _failure_line(_job((0, -15, 100), (1, -9, 100), (2, 143, 100)))
    assert code == 137 and line.startswith("error: rank 1 (pid 1001) was ended by SIGKILL")
    line, code = _failure_line(_job((0, 4, 99), (1, 1, 100)))
    assert code == 1 and line.startswith("rank 1 (pid 1001) exited with code 1")


def test_a_collective_that_failed_on_a_gone_peer_is_told_apart_from_a_bug():
    import torch.distributed as dist

    from trainer.runtime.distributed_init import is_peer_gone

    gloo = "[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:33965. This is typically caused"
    assert is_peer_gone(RuntimeError(gloo)) and is_peer_gone(dist.DistBackendError(gloo))
    assert is_peer_gone(RuntimeError("[pair.cc:598] Read error [127.0.0.1]:1: Connection reset by peer"))
    assert not is_peer_gone(RuntimeError("shape mismatch in all_reduce"))  # a bug keeps its traceback
    assert not is_peer_gone(ValueError(gloo))  # bad input is its own line


def _run_folder(tmp_path, last_step: int):
    """A config's view of a run folder whose metrics.jsonl ends at ``last_step`` (and a last
    line cut short by a kill), checkpoints off."""
    rows = [json.dumps({"step": s, "loss": 1.0}) for s in range(1, last_step + 1)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(rows) + '\n{"step": ')
    return SimpleNamespace(
        job=SimpleNamespace(dump_folder=str(tmp_path)),
        metrics=SimpleNamespace(log_freq=1),
        checkpoint=SimpleNamespace(enable=False),
    )


def test_restarts_spent_end_in_one_gave_up_line_and_bad_input_is_never_restarted(tmp_path):
    """Under --max_restarts K > 0 (trainer/lifecycle/restarts.py): a failure the agent restarts
    on ends the job, once K restarts are spent, with one line naming the rank, the step and the
    checkpoint left; bad input and a stop keep today's ending (the workers' own line)."""
    cfg = _run_folder(tmp_path, 6)
    line, code = _failure_line(_job((0, 4, 100), (2, -9, 100)), cfg, 2, 0)
    assert (
        code == 137
        and line == "gave up after 0 restarts: rank 2 died (SIGKILL) at step 7; no checkpoint (its output is above)"
    )
    line, code = _failure_line(_job((1, 3, 100)), cfg, 1, 0)
    assert code == 3 and line.startswith("gave up after 0 restarts: rank 1 exited with code 3 at step 7;")
    assert _failure_line(_job((0, 4, 100), (1, 2, 100)), cfg, 2) == (None, 2)
    assert _failure_line(_job((0, 143, 100)), cfg, 2) == (None, 143)
    # the failure of the last start is named: start 1 wrote its restart row and step 5, start 2
    # none (it failed while starting)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write(
            "\n"
            + "\n".join(json.dumps(r) for r in ({"step": 4, "restart": 1, "resumed_from": 4}, {"step": 5, "loss": 1.0}))
        )
        f.write("\n")
    line, _ = _failure_line(_job((0, 4, 100), (2, -9, 100)), cfg, 2, 1)
    assert line.startswith("gave up after 1 restart: rank 2 died (SIGKILL) at step 6;"), line
    line, _ = _failure_line(_job((0, 1, 100)), cfg, 2, 2)
    assert line.startswith("gave up after 2 restarts: rank 0 exited with code 1 before its first step;"), line


def test_the_agents_own_sigterm_to_the_survivors_is_not_a_stop():
    """Once a rank fails, torch's agent SIGTERMs the others before it reports them: a rank still
    running ends with 143 (its stop handler) or -15. The failure seen in the drill (rank 2
    killed, rank 0 at 143, rank 3 at -15) is restarted; a group whose cause is a stop or bad
    input is not. Negative control: deciding on *any* stop code in the group (the reverted
    code's rule) would not restart it."""
    from trainer.lifecycle.restarts import NOT_RESTARTED, cause, restartable

    seen = _job((2, -9, 100), (0, 143, 100), (1, 4, 100), (3, -15, 100)).failures
    assert restartable(seen) and cause(seen)[0] == 2
    assert any(f.exitcode in NOT_RESTARTED for f in seen.values())  # the old rule's verdict: no restart
    assert not restartable(_job((0, 143, 100), (1, -15, 100)).failures)  # a stop
    assert not restartable(_job((0, 2, 101), (1, -9, 100), (2, 143, 100)).failures)  # bad input
    assert restartable(_job((0, 3, 100), (1, 4, 100)).failures)  # the watchdog's exit


def test_a_restarted_worker_writes_a_restart_row_counting_the_redone_steps(tmp_path, monkeypatch):
    from trainer.reporting.restart_row import restart_row

    cfg = _run_folder(tmp_path, 7)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert restart_row(cfg, 6) is None  # a first start (or a plain resume): no row
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert restart_row(cfg, 4) == {"restart": 2, "resumed_from": 4, "redone_steps": 3}
    assert restart_row(cfg, None) == {"restart": 2, "resumed_from": 0, "redone_steps": 7}


def test_restarted_workers_that_cannot_form_their_group_name_who_is_missing():
    """trainer/runtime/distributed_init.py ``_join`` on an in-process store: ranks 0 and 1 of 3
    come, rank 2 never does; both end after the timeout naming rank 2, and only rank 0 speaks.
    With every rank there it returns at once."""
    import threading
    import time

    import torch.distributed as dist

    from trainer.runtime.distributed_init import GroupNotFormed, _join

    store, ended = dist.HashStore(), {}

    def rank(r: int) -> None:
        try:
            _join(store, r, 3, 1)
            ended[r] = None
        except GroupNotFormed as exc:
            ended[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(isinstance(ended[r], GroupNotFormed) for r in (0, 1)), ended
    assert "rank 2 of 3 did not join within comm.init_timeout_seconds = 1 s" in str(ended[0])
    assert "ranks 0, 1 waited" in str(ended[0]) and ended[0].speaks and not ended[1].speaks

    store = dist.HashStore()
    threads = [threading.Thread(target=_join, args=(store, r, 2, 30)) for r in (0, 1)]
    began = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert time.monotonic() - began < 5 and not any(t.is_alive() for t in threads)
