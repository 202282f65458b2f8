"""What a run reports: the per-step metrics, the run's summary, Weights & Biases, data progress.

metrics.py       ``MetricsLogger``: the step line, ``metrics.jsonl``, MFU against the device's
                 peak for the precision the matmuls run in
run_summary.py   the lines a run ends with (time, steps, tokens, loss, checkpoints, metrics)
wandb_log.py     the optional Weights & Biases sink (``[metrics] wandb``)
data_progress.py the epoch (complete passes over the data) and target tokens per source
run_metrics.py   the metrics logger, opened as the loop starts
stragglers.py    every rank's step time, and a rank slower than the median named

It may import ``trainer.config`` and ``trainer.runtime`` (the precision the matmuls run in),
``models`` and ``parallel_dims``; nothing else in the trainer. The loop writes to it.
"""
