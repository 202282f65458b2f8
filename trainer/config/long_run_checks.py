"""The config checks of bad steps, fault drills and stragglers (docs/long_runs.md), called by
:func:`trainer.config.validate.validate_config`."""

from __future__ import annotations

__all__ = ["validate_long_run"]


def validate_long_run(cfg, need) -> None:
    """Bad steps, fault drills and stragglers (docs/long_runs.md)."""
    from trainer.config.long_run_specs import parse_faults, parse_skip_samples

    t, m = cfg.training, cfg.metrics
    parse_faults(cfg.debug.fault)
    parse_skip_samples(t.skip_samples)
    need(
        t.max_consecutive_skips >= 1,
        f"training.max_consecutive_skips must be >= 1, got {t.max_consecutive_skips}",
    )
    need(
        t.loss_spike_factor == 0 or t.loss_spike_factor > 1,
        f"training.loss_spike_factor must be > 1 (a loss that many times the recent median) or 0 (off), "
        f"got {t.loss_spike_factor}",
    )
    need(t.loss_spike_window >= 1, f"training.loss_spike_window must be >= 1, got {t.loss_spike_window}")
    need(
        t.on_nonfinite != "rollback" or cfg.checkpoint.enable,
        "training.on_nonfinite = rollback reloads the newest checkpoint: set checkpoint.enable = true "
        "(and a checkpoint.interval short enough to lose little), or use on_nonfinite = skip",
    )
    need(
        t.on_nonfinite != "rollback" or cfg.comm.mode == "default",
        f"training.on_nonfinite = rollback needs comm.mode = default, not {cfg.comm.mode!r}: use 'skip' or 'stop'",
    )
    need(m.straggler_interval >= 0, f"metrics.straggler_interval must be >= 0, got {m.straggler_interval}")
    need(m.straggler_threshold > 0, f"metrics.straggler_threshold must be > 0, got {m.straggler_threshold}")
