"""Every test carries the marker of its tier (its folder), so lanes select by marker:
``pytest -m unit`` (one process, seconds), ``-m distributed`` (gloo, 2-8 ranks), ``-m e2e``
(train.py end to end). Files run most costly first (tests/suite_budget.py's cost table)."""

from __future__ import annotations

import atexit
import gc
import os
import sys
from pathlib import Path

import pytest

# One OpenMP thread per test process, unless the caller chose a number. `make test` runs two
# pytest workers on a 2-core host, each spawning training processes: torch's default (a thread per
# core) puts two threads per core in every worker, and OpenMP's idle threads spin-wait for work
# under that load instead of sleeping. Measured on 2 cores, beside a loaded machine:
# test_moe_kernels.py + test_models.py 10.1 CPU s by default, 7.3 with one thread (the training
# processes the tests start already get one: tests/e2e/helpers.py, tools/forkserver.py).
os.environ.setdefault("OMP_NUM_THREADS", "1")
if "torch" in sys.modules:  # already read by the OpenMP runtime: set it the way it still takes
    sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# Inductor's caches (the FX graph cache, the compiled kernels) are keyed without the vector ISA
# it generates C++ for, and it follows ATEN_CPU_CAPABILITY: a run under ``default`` (the kernel
# lane) found the vectorized kernels a native run had cached and failed to build them against
# the scalar headers ("'at::vec' has not been declared"). A session that sets the capability
# gets a cache folder of its own, named after it, inherited by every process it starts
# (tests/distributed/inductor_probe.py; a folder the caller chose is kept).
from tests.distributed.inductor_probe import capability_cache_dir

if capability_cache_dir() and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = capability_cache_dir()

pytest_plugins = ["tests.suite_budget"]  # the per-test cost table printed after every run

TIERS = ("unit", "distributed", "e2e")


def _tier(item) -> str:
    return Path(str(item.fspath)).parent.name


def _fake_backend_refusal() -> str | None:
    """Why this torch cannot run ``comm.mode = "fake_backend"`` (the trainer's own config check),
    or None."""
    import torch

    from trainer.config.validate import _fake_backend_torch

    ok, message = _fake_backend_torch(torch.__version__)
    return None if ok else message


def pytest_collection_modifyitems(config, items):
    refusal = _fake_backend_refusal() if any(item.get_closest_marker("fake_backend") for item in items) else None
    for item in items:
        tier = _tier(item)
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, tier))
        if refusal and item.get_closest_marker("fake_backend"):
            item.add_marker(pytest.mark.skip(reason=refusal))
    # Run order: `make test` runs the files on pytest-xdist workers (--dist loadfile
    # --no-loadscope-reorder), which take the files in collection order, each worker the next file
    # as it runs out of work. Ordered by their measured cost, most costly first (tests/test_costs.json;
    # a file not in it by its tier's default), the long files start first and the seconds-long unit
    # files fill in at the end, so the workers finish together instead of one long file starting
    # last and running alone.
    order = {name: i for i, name in enumerate(run_order({_repo_path(item) for item in items}))}
    items.sort(key=lambda item: order[_repo_path(item)])


@pytest.hookimpl(hookwrapper=True)
def pytest_collection(session):
    """Collection imports torch, the trainer and the test modules: about a million objects that
    live as long as this process. As train.py does for its own imports, the garbage collector is
    paused while they are created (it would scan them over and over without freeing any) and they
    then go to its permanent generation (``gc.freeze``), which no later collection walks. Measured
    on the Intel Xeon AMX host: a pytest process running six unit files (test_models,
    test_moe_kernels, test_optim, test_config, test_layout, test_planner) spent 5.6 of its 37.7 CPU
    s in the collector, 4.2 of them in 24 full collections that walked those objects each time.
    Collection alone (``pytest --collect-only tests``): 13.6 CPU s before, 8.6 after. Objects the
    tests create are collected as before."""
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        # at this process's exit, give them back: left frozen, extension modules that count their
        # live objects at interpreter shutdown (triton's nanobind) report them as leaked on stderr
        atexit.register(gc.unfreeze)
        gc.enable()


def _repo_path(item) -> str:
    """The item's file as the cost table names it ("tests/unit/test_x.py")."""
    root = Path(__file__).resolve().parents[1]
    path = Path(str(item.fspath)).resolve()
    return path.relative_to(root).as_posix() if path.is_relative_to(root) else path.as_posix()


def run_order(files) -> list[str]:
    """Test files, most costly first (ties: by name)."""
    from tests.suite_budget import file_cost

    return sorted(files, key=lambda name: (-file_cost(name), name))


@pytest.fixture(autouse=True)
def _no_process_group_left_behind():
    """A test that leaves torch.distributed's default group initialized fails, by name: the next
    test in the same pytest worker would run in it (a fake-backend Trainer took that group's world
    of 1 for its own: ``pp=2 does not divide world_size=1``, seen only when the files were dealt to
    three workers, whose order put test_dpo_trl.py first: TRL's DPOTrainer, through accelerate,
    makes a gloo group of one and keeps it). A group the test found is left alone."""
    import torch.distributed as dist

    before = dist.is_available() and dist.is_initialized()
    yield
    if not before and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail(
            "this test left torch.distributed's default process group initialized (destroyed now): later tests in this worker would join it; destroy it where it is made"
        )
