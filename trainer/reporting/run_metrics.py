"""The run's metrics logger, opened as the training loop starts (moved out of trainer/trainer.py)."""

from __future__ import annotations

from trainer.reporting.metrics import MetricsLogger
from trainer.reporting.wandb_log import agree_on_start

__all__ = ["open_metrics"]


def open_metrics(trainer, resumed: bool, log) -> MetricsLogger:
    """The :class:`MetricsLogger` of ``trainer``'s run (``resumed``: W&B continues the run of
    the checkpoint folder's id). Rank 0's W&B run that refuses to start stops every rank with
    it (one int, max over the ranks)."""
    cfg = trainer.cfg
    started: ValueError | None = None
    try:
        metrics = MetricsLogger(
            cfg.job.dump_folder,
            trainer.mode.metrics_rank(trainer.rank),
            cfg,
            world_size=trainer.world_size,
            # TFLOPs/MFU only mean something on accelerators
            flops_per_token=trainer.flops_per_token if trainer.device.type == "cuda" else None,
            device=trainer.device,
            total_steps=cfg.training.steps,
            param_dtype=trainer.plan.parallelize.param_dtype,
            resumed=resumed,
        )
    except ValueError as exc:  # rank 0's W&B run refused to start
        started = exc
    if cfg.metrics.enable_wandb:  # ... then every rank stops with it (one int, max over the ranks)
        agree_on_start(started, trainer.device, trainer.mode.has_peers(trainer.world_size))
    elif started is not None:
        raise started
    if metrics.peak_note:  # on CUDA: the part and precision MFU is priced at
        log(metrics.peak_note)
    return metrics
