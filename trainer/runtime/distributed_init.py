"""Joining the job: the process group (real, one process, or the fake backend), the timeouts
every group runs under, the step watchdog, and printing from one rank.

``init_distributed`` runs before the job plan (it needs only ``[comm]`` and ``[job]``): the
job's store, a roll call of the ranks in it (``_join``: ranks that never come are named in
one line within ``comm.init_timeout_seconds``), then the group; ``apply_train_timeout`` after
the first step; ``start_watchdog`` as the loop starts.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys

import torch
import torch.distributed as dist

from parallel_dims import default_backend, default_device_type
from trainer.config import Comm, ConfigError, JobConfig
from trainer.runtime.cli_errors import dcp_failures
from trainer.runtime.comm_watchdog import (
    EXIT_COMM_TIMEOUT,
    JobWatchdog,
    NullWatchdog,
    apply_flight_recorder_env,
    dump_prefix,
    pg_timeout_seconds,
    write_flight_recorder_dump,
)
from trainer.simulation.run_mode import RunMode

__all__ = [
    "GroupNotFormed",
    "apply_train_timeout",
    "init_distributed",
    "is_collective_timeout",
    "log",
    "report_collective_timeout",
    "require_writable_folder",
    "start_watchdog",
    "wait_until_every_rank_joined",
]


def log(msg: str) -> None:
    """Print on rank 0 (a fake-backend or local_tensor run is one process: it prints)."""
    if not dist.is_initialized() or RunMode.simulating() or dist.get_rank() == 0:
        print(msg, flush=True)


def init_distributed(cfg: JobConfig) -> torch.device:
    """Join the torchrun job (or make a 1-process group for ``python train.py``)."""
    device_type = default_device_type()
    if device_type == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        # a simulated run makes its own default group: one rank of comm.fake_world_size on the
        # fake backend (trainer/simulation/fake_backend.py) or every rank of the job in this
        # process (trainer/simulation/local_tensor.py); a real run joins its job below
        RunMode.from_config(cfg).start_process_group()
    if not dist.is_initialized():
        backend = default_backend(device_type)
        # NCCL's flight recorder reads its environment when the first group is created
        apply_flight_recorder_env(backend, cfg.job.dump_folder, cfg.comm.trace_buf_size)
        # every group gets it: ParallelDims.build_mesh gives its groups WORLD's timeout
        timeout = datetime.timedelta(seconds=pg_timeout_seconds(backend, cfg.comm.init_timeout_seconds))
        if "WORLD_SIZE" not in os.environ:  # plain `python train.py`: a world of one
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = _restart_store(timeout)
        if store is None:
            store = _env_store(rank, world, timeout, cfg.comm.init_timeout_seconds)
        _join(store, rank, world, cfg.comm.init_timeout_seconds)
        dist.init_process_group(backend=backend, timeout=timeout, store=store, rank=rank, world_size=world)
        wait_until_every_rank_joined()
    return device


def _restart_store(timeout: datetime.timedelta):
    """Under torch's elastic agent, workers started again after a failure (``--max_restarts``,
    TORCHELASTIC_RESTART_COUNT > 0) share the agent's store with the workers before them: its
    TCPStore lives on across restarts and torch's ``env://`` adds no prefix per attempt, so a
    new rank would read a gone peer's address and fail to connect. Their store is the agent's
    under a prefix of their attempt (None: ``env://`` as usual)."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if attempt <= 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"/worker/attempt_{attempt}", store)


class GroupNotFormed(RuntimeError):
    """The workers of a start could not form their group: some ranks did not join in time.
    ``speaks``: this rank prints the job's one line (the lowest rank that joined)."""

    def __init__(self, message: str, speaks: bool = True):
        super().__init__(message)
        self.speaks = speaks


def _join(store, rank: int, world: int, seconds: int) -> None:
    """Before a worker joins its process group (every start of a job of several ranks: the
    first, a restart, the survivors of a lost node): every rank of the start writes its
    key and counts itself in, then waits up to ``seconds`` (``comm.init_timeout_seconds``) for
    the count to reach ``world``. A rank that never comes (hung while starting, its node gone)
    would otherwise leave the others in ``init_process_group`` with no word of who is missing;
    here they end with :class:`GroupNotFormed` naming the ranks that did not join. The count is
    polled (one store request per poll, at most one a second per rank), not waited on with the
    store's own timeout, whose expiry c10d reports in warnings of its own."""
    import time

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    store.set(f"joined/{rank}", socket.gethostname())
    store.add("joined", 1)
    deadline, pause = time.monotonic() + seconds, 0.02
    while store.add("joined", 0) < world:
        if time.monotonic() >= deadline:
            missing = [r for r in range(world) if not store.check([f"joined/{r}"])]
            if not missing:  # every rank came as the time ran out
                return
            present = [r for r in range(world) if r not in missing]
            many, names = len(missing) > 1, ", ".join(map(str, missing))
            raise GroupNotFormed(
                f"error: the workers' {f'start after restart {attempt}' if attempt else 'first start'} could not "
                "form its group: "
                f"rank{'s' if many else ''} {names} of {world} did not join within comm.init_timeout_seconds = "
                f"{seconds} s (hung or gone while starting: see {'their' if many else 'its'} output); "
                f"rank{'s' if len(present) > 1 else ''} {', '.join(map(str, present))} waited",
                speaks=bool(present) and rank == present[0],
            )
        time.sleep(pause)
        pause = min(pause * 2, 1.0)


def _env_store(rank: int, world: int, timeout: datetime.timedelta, seconds: int):
    """The job's store as ``env://`` makes it (MASTER_ADDR / MASTER_PORT; rank 0 hosts it unless
    the elastic agent's is shared), its failure to connect within the timeout as one line."""
    try:
        store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timeout))
    except (RuntimeError, dist.DistStoreError) as exc:
        where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        raise GroupNotFormed(
            f"error: rank {rank}: could not reach the job's store at {where} within comm.init_timeout_seconds = "
            f"{seconds} s, so the {world} ranks cannot form their group (the rank that hosts it, rank 0, or its node "
            f"is gone); ({str(exc).splitlines()[0][:160]})"
        ) from None
    store.set_timeout(timeout)
    return store


def wait_until_every_rank_joined(group: dist.ProcessGroup | None = None) -> None:
    """Return only once every rank of ``group`` (default WORLD) has finished creating every
    process group it created so far: a barrier over ``group`` when it is a gloo group of several
    processes. Called after ``init_process_group`` and after the meshes are built (WORLD), and
    after the background checkpoint writer's two gloo groups are created (over the second),
    the places where gloo connects.

    Why: a gloo group connects all its ranks' sockets while it is created, and a rank is done
    connecting as soon as its own sockets are, which may be before a peer's (of each pair, the
    active side connects and writes its sequence number and is done; the passive side takes the
    connection from its listener when it gets to it, and fails if the socket is closed by then).
    A rank that then stops on bad input (a config error found by the job plan, right after
    joining; a ``checkpoint.load_step`` that is not in the folder, right after the checkpoint
    writer's groups) and exits closes its sockets under a peer that is still connecting: the
    peer's ``init_process_group`` (or ``new_group``) fails with gloo's "Connection closed by
    peer", a traceback instead of the one line of the rank that found the error (seen under CPU
    load with 2 ranks and ``--parallelism.cp 2 --training.seq_len 66``). After this barrier
    every rank has joined, so a rank that ends leaves no peer half-connected. NCCL connects at a
    group's first collective (no barrier there; the checkpoint writer's groups are gloo on every
    job); a process without peers has nothing to wait for."""
    if not dist.is_initialized() or RunMode.simulating() or dist.get_world_size(group) == 1:
        return
    if dist.get_backend(group) != "gloo":
        return
    dist.barrier(group=group)


# groups whose collectives legitimately wait for a long operation on a peer (a background
# checkpoint write): they keep the timeout they were created with
_LONG_WAIT_GROUPS: set = set()


def keep_creation_timeout(group) -> None:
    """Exempt ``group`` from :func:`apply_train_timeout` (trainer/checkpoint/async_save.py: the
    background write's collectives wait for the slowest rank's write, which may take longer than
    a training step's deadline)."""
    _LONG_WAIT_GROUPS.add(group)


def apply_train_timeout(seconds: int) -> None:
    """From the first completed step on, every collective of every process group must finish
    within ``comm.train_timeout_seconds`` (start-up, the first step and compilation ran under
    ``comm.init_timeout_seconds``): a dead or hung peer then ends the job in that time, not
    after the long start-up timeout. Placeholder groups (size-1 axes) have no communicator;
    groups passed to :func:`keep_creation_timeout` keep theirs.
    NCCL groups get ``seconds`` + the watchdog's grace: the step watchdog speaks at ``seconds``
    (trainer/runtime/comm_watchdog.py)."""
    if not dist.is_initialized():
        return
    dist.barrier()  # every rank finished its first step: nothing is in flight under the old timeout
    for group in list(dist.distributed_c10d._world.pg_map):
        backend = dist.get_backend(group)
        if backend != "fake" and group not in _LONG_WAIT_GROUPS:
            timeout = datetime.timedelta(seconds=pg_timeout_seconds(backend, seconds))
            dist.distributed_c10d._set_pg_timeout(timeout, group)


def start_watchdog(c: Comm, dump_folder: str, mode: RunMode, rank: int, world_size: int) -> JobWatchdog | NullWatchdog:
    """The step watchdog of a run with peers (``[comm]``'s timeouts, flight-recorder dumps into
    ``dump_folder``); nothing for one process or the fake backend."""
    if not mode.has_peers(world_size):
        return NullWatchdog()
    return JobWatchdog(
        rank,
        dist.get_backend(),
        train_timeout_seconds=c.train_timeout_seconds,
        init_timeout_seconds=c.init_timeout_seconds,
        dump_folder=dump_folder,
    )


def report_collective_timeout(c: Comm, dump_folder: str, exc: Exception, phase: str) -> int:
    """The one line a rank prints when a collective ran past its timeout (``phase``: what the
    run was doing, from the watchdog), with a flight-recorder dump; the exit code."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    backend = dist.get_backend() if dist.is_initialized() else ""
    # without the Python stacks (seconds to symbolize the first time); the entries' states and
    # sequence numbers say which collective each rank waits in
    dump = write_flight_recorder_dump(rank, backend, dump_prefix(), dump_folder, stack_traces=False)
    print(
        f"error: rank {rank}: {phase + ': ' if phase else ''}a collective did not finish within "
        f"comm.train_timeout_seconds = {c.train_timeout_seconds} s (comm.init_timeout_seconds = "
        f"{c.init_timeout_seconds} s until the first step): another rank is hung or "
        f"dead, see its log; if steps legitimately take that long, raise the timeout; "
        f"flight-recorder dump: {dump}. ({str(exc).splitlines()[0][:200]})",
        file=sys.stderr,
        flush=True,
    )
    return EXIT_COMM_TIMEOUT


def is_collective_timeout(exc: BaseException) -> bool:
    text = str(exc)
    return isinstance(exc, (RuntimeError, dist.DistBackendError)) and (
        "Timed out" in text or "timed out" in text or "Watchdog caught collective operation timeout" in text
    )


# gloo's words when the other end of a pair is gone (trainer/lifecycle/rank.py: a peer's exit, not this
# rank's failure); NCCL's peers are watched by the step watchdog instead
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
# a rank whose collective failed because a peer rank had ended first (its own line says why)
EXIT_PEER_GONE = 4


def is_peer_gone(exc: BaseException) -> bool:
    """Whether ``exc`` (or every exception DCP's wrapper holds) is a collective that failed
    because the process at the other end is gone."""
    return all(isinstance(f, RuntimeError) and any(words in str(f) for words in PEER_GONE) for f in dcp_failures(exc))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def require_writable_folder(folder: str, option: str) -> None:
    """Create ``folder`` if needed and check it can be written, before anything is built: a
    run that cannot write its outputs must not train for hours first."""
    try:
        os.makedirs(folder, exist_ok=True)
        probe = os.path.join(folder, f".write_test.{os.getpid()}")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as exc:
        raise ConfigError(
            f"{option} '{folder}' cannot be used ({exc.strerror or exc}: {exc.filename or folder}); "
            f"choose a writable folder with --{option} PATH"
        ) from None
