"""A process's way in and out: which process this is, how it starts and how it ends.

main.py           ``main(argv)``, what ``train.py`` runs: launcher flags -> launch, else run
                  this rank
launch.py         the launcher (``python train.py --nproc_per_node N ...``): torch's elastic
                  agent in this process, the job checked before any worker starts
elastic.py        ``--nnodes MIN:MAX``: which degree absorbs a lost node, the range checked at
                  every node count before the start, the rendezvous setting a range needs
rank.py           ``run_rank``: one rank of the job, config -> exit code (every way a run ends
                  as its code and at most one line)
restarts.py       ``--max_restarts``: one line per restart, bad input and stops never restarted
seed.py           ``--checkpoint.create_seed_checkpoint``: the job plan's model, written once
shutdown.py       the exit of a process that may hold process groups (no interpreter teardown)
start_signals.py  SIGINT / SIGTERM while a process starts: one line, no traceback
torchrun_range.py plain ``torchrun --nnodes MIN:MAX``: the launcher's range checks made by the
                  workers (the node range read from the agent's command line)

The top of the trainer: it may import every other part of it (the Trainer, the plan, the
checkpoint, runtime/, simulation/, config/), and nothing in the trainer imports it; the root
``train.py`` and the tools that run training in-process do.
"""
