"""What the launcher's forkserver (tools/forkserver.py) imports once, before it forks any rank.

The server imports this module alone; it imports everything a rank would otherwise import
itself, then hands the imported objects to the permanent generation of the garbage collector
(``gc.freeze``), as train.py does for its own imports:

* the imports create about a million objects that live as long as the server and every rank
  forked from it. With the collector running, it scans them over and over while they are being
  created (measured on the Intel Xeon AMX host: the server's start 1.6-2.0 CPU s less with it
  paused, about 9.5 instead of 11.2 CPU s for a server plus eight 3-step llama3 ranks);
* frozen, no collection in a forked rank walks them either (a walk would also write to every
  object's header and so copy the server's memory page by page into the rank): a rank that
  compiles allocates a lot and collects often (test_parallel_features.py's
  test_compile_matches_single_process: 27.6 CPU s before, 10.0 after).

``RANK_IMPORTS`` is what a rank imports: torch's distributed, tensor and pipelining packages,
the model registry and the trainer (train.py's own imports, through trainer.lifecycle.main),
and ``torch._dynamo``, which torch imports lazily at the first call of a function it keeps out
of compilation (the optimizer's step and zero_grad among them). The last lines are what a
3-step llama3 rank still imported after the fork (measured: the step instruments, the tokenizer
library and torch's serialization config, about 20 modules). A module that cannot be imported
here is skipped, as the forkserver skips a preload module it cannot import: the rank then
imports it itself and meets the same error where it would have without a server.

The float8 lines (issue 49): a rank with ``model.converters`` float8 imported torchao and, at
its first step, functorch's compile package and part of inductor (about 570 modules) after the
fork. Measured on the Intel Xeon AMX host, old and new server side by side, one step, 2
layers: a 1-rank llama3 float8 run 1.1-1.3 -> 0.5 CPU s, a 2-rank tp=2 one 3.8-4.7 -> 2.6, a
1-rank deepseek_v3 run with float8 experts 1.4-1.7 -> 0.8 (metrics bitwise the same); the
server's start 2.1 -> 2.6 CPU s. Only imports: torchao's inductor patch is applied by
``convert_to_float8_training``, in the rank, as before; inductor's and dynamo's configs are
unchanged by these imports (checked), and the server still starts no thread.
"""

from __future__ import annotations

import atexit
import gc
import importlib

RANK_IMPORTS = (
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch.distributed.pipelining",
    "models.registry",
    "models.parallelize",
    "trainer.optim.grad_clip",
    "trainer.lifecycle.main",
    "torch._dynamo",
    # imported by a training rank after the fork, before this list held them
    "trainer.instruments.comm_record",
    "trainer.instruments.fake_meter",
    "trainer.instruments.matmul_census",
    "trainer.instruments.profiler",
    "torch.utils.serialization",
    "tokenizers",
    # what a float8 rank imports after the fork (issue 49): torchao's float8 and MoE training
    # packages, and what its first step pulls in (functorch's compile package: the partitioner,
    # networkx, inductor's code cache)
    "torchao.float8",
    "torchao.prototype.moe_training",
    "functorch.compile",
    "torch._dynamo.backends.debugging",
    "torch._inductor.async_compile",
    "torch._inductor.scheduler",
    "torch._inductor.codegen.triton",
    "torch._dynamo.repro.after_aot",
    "torchao.float8.float8_ops",
    "torchao.float8._inductor_patch",
    # a run_distributed rank unpickles its function, so imports the test module it comes from,
    # and so pytest (measured: 0.10 -> 0.03 CPU s a rank with it here; skipped where pytest is
    # not installed)
    "pytest",
)


def _preload() -> None:
    gc.disable()
    try:
        for name in RANK_IMPORTS:
            try:
                importlib.import_module(name)
            except ImportError:
                pass
    finally:
        gc.freeze()
        # at the server's own exit, give the frozen objects back to the collector: left frozen,
        # extension modules that count their live objects at interpreter shutdown (triton's
        # nanobind) report them as leaked on stderr
        atexit.register(gc.unfreeze)
        gc.enable()


_preload()
