"""Train an LLM: ``torchrun --nproc_per_node=N train.py --config train_configs/llama3.toml``.

Every config key can be overridden on the command line (``--parallelism.tp 2``); run
``python train.py --help`` for the list.
"""

# first: a Ctrl-C while torch imports is one line, not a traceback (trainer/start_signals.py)
from trainer.start_signals import quiet_start

quiet_start()

import gc  # noqa: E402

# Start-up (every rank pays it): importing torch and the trainer creates about a million
# objects that live as long as the process. The cyclic garbage collector would scan them over
# and over during the imports, and once more at interpreter exit, without freeing any: it is
# paused for the imports, which then go to the permanent generation (gc.freeze) that no
# collection scans. About 1.5 s less CPU per process; collection is unchanged for everything
# the run itself creates.
gc.disable()
try:
    from trainer.entry import main
finally:
    gc.freeze()
    gc.enable()

if __name__ == "__main__":
    # not sys.exit: torch's communication threads can outlive the process groups and call into
    # a finalizing interpreter (a finished run would abort at exit); trainer/shutdown.py
    import sys

    from trainer.launch import main as launch

    # python train.py --nproc_per_node N ...: the launcher (trainer/launch.py), which starts
    # train.py workers without its flags; without them, this process trains
    code = launch(sys.argv[1:])
    if code is not None:
        sys.exit(code)
    from trainer.shutdown import run_and_exit
    from trainer.start_signals import hand_over

    hand_over()  # from here a Ctrl-C is trainer/entry.py's (one line; at a step in the loop)
    run_and_exit(main)
