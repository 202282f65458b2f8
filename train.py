"""Train an LLM: ``torchrun --nproc_per_node=N train.py --config train_configs/llama3.toml``.

Every config key can be overridden on the command line (``--parallelism.tp 2``); run
``python train.py --help`` for the list. What happens next: trainer/lifecycle/main.py
(launcher flags -> launch, else run this rank); the launcher's node-range check gets the
layout planner's memory estimate from here (:func:`planner_memory`).
"""

# first: a Ctrl-C while torch imports is one line, not a traceback (trainer/lifecycle/start_signals.py)
from trainer.lifecycle.start_signals import quiet_start

quiet_start()

# a launcher's worker ends with it, even when it is SIGKILLed (trainer/lifecycle/parent_death.py)
from trainer.lifecycle.parent_death import die_with_launcher  # noqa: E402

die_with_launcher()

import gc  # noqa: E402

# Start-up (every rank pays it): importing torch and the trainer creates about a million
# objects that live as long as the process. The cyclic garbage collector would scan them over
# and over during the imports, and once more at interpreter exit, without freeing any: it is
# paused for the imports, which then go to the permanent generation (gc.freeze) that no
# collection scans. About 1.5 s less CPU per process; collection is unchanged for everything
# the run itself creates.
gc.disable()
try:
    from trainer.lifecycle.main import main
finally:
    gc.freeze()
    gc.enable()


def planner_memory(plan, gpus_per_node: int) -> float:
    """The layout planner's device memory of the busiest rank of a planned job, in bytes
    (tools/planner/from_config.py ``peak_bytes``): the launcher prices every node count of
    ``--nnodes MIN:MAX`` with it (trainer/lifecycle/elastic_fit.py). The entry point hands it
    in because the trainer does not import the tools; imported when called, so a worker rank
    does not pay for the planner."""
    from tools.planner.from_config import peak_bytes

    return peak_bytes(plan, gpus_per_node)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:], memory_estimator=planner_memory)
