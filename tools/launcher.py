"""Run a function on N local CPU processes over gloo: the tier-2 tests and the benchmarks use it.

Children come from a forkserver that has already imported torch, so each rank starts in a
fraction of a second instead of paying ``import torch`` again. A failing rank's traceback is
re-raised in the test process, and a hang is cut off by ``timeout``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

_CTX = None


def _context():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        # everything a rank imports anyway: paid once in the server instead of once per rank
        _CTX.set_forkserver_preload(
            [
                "torch",
                "torch.distributed",
                "torch.distributed.tensor",
                "torch.distributed.pipelining",
                "models.registry",
                "models.parallelize",
                "trainer.grad_clip",
            ]
        )
    return _CTX


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world_size, port, args, queue, env):
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        queue.put((rank, True, result))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 300.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the per-rank
    results in rank order. ``fn`` and ``args`` must be picklable (module-level function)."""
    ctx = _context()
    queue = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world_size, port, args, queue, env or {})) for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failures: list[str] = []
    try:
        for _ in range(world_size):
            rank, ok, payload = queue.get(timeout=timeout)
            if ok:
                results[rank] = payload
            else:
                failures.append(f"--- rank {rank} ---\n{payload}")
                break  # the other ranks are likely stuck in a collective
    except Exception as exc:  # queue.Empty on timeout
        failures.append(f"timed out after {timeout}s waiting for ranks: {exc!r}")
    finally:
        for p in procs:
            if failures:
                p.kill()
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if failures:
        raise RuntimeError("distributed test failed:\n" + "\n".join(failures))
    return [results[r] for r in range(world_size)]
