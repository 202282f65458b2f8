"""What a running rank leans on, below the training loop: the process group and its watchdog,
stop signals, one-line errors and console output, and the files a run writes.

distributed_init.py  joining the job (``init_distributed``), group timeouts, the step watchdog's
                     start, collective-timeout and gone-peer diagnosis, writable folders
comm_watchdog.py     the step watchdog: a hung collective becomes one line naming the step
stop.py              SIGINT / SIGTERM during training: the ranks agree to stop at a step
cli_errors.py        bad input as one ``error:`` line and exit code 2
console.py           what a rank prints besides its own lines: every message once
precision.py         how the matmuls run (TF32 or IEEE fp32, deterministic kernels), set first
files.py             atomic writes: the one way a file someone else reads is written

It may import ``trainer.config`` and ``trainer.simulation`` (the run mode decides how the
default group is made), ``parallel_dims``; nothing else in the trainer. The checkpoint, the
instruments, the loop and the process's way in (trainer/lifecycle/) import it.
"""
