"""The config checks of bad steps, fault drills and stragglers (docs/long_runs.md), called by
:func:`trainer.config.validate.validate_config`."""

from __future__ import annotations

__all__ = ["check_node_range_config", "nodes_text", "validate_long_run"]

DP_SHARD_KEY = "parallelism.data_parallel_shard_degree"


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
    need(
        cfg.job.device_memory_gib >= 0,
        f"job.device_memory_gib must be >= 0 (0: the GPU's own), got {cfg.job.device_memory_gib}",
    )
    need(m.straggler_interval >= 0, f"metrics.straggler_interval must be >= 0, got {m.straggler_interval}")
    need(m.straggler_threshold > 0, f"metrics.straggler_threshold must be > 0, got {m.straggler_threshold}")


def nodes_text(n: int) -> str:
    return f"{n} node{'s' if n != 1 else ''}"


def check_node_range_config(cfg, min_nodes: int, max_nodes: int, nproc_per_node: int) -> None:
    """The config's part of a node range's check (``--nnodes MIN:MAX``, trainer/lifecycle/elastic.py):
    ``dp_shard = -1`` absorbs the change of world, and a set global batch keeps the data order."""
    from trainer.config.errors import ConfigError

    flag = f"--nnodes {min_nodes}:{max_nodes}"
    dp_shard = cfg.parallelism.data_parallel_shard_degree
    if dp_shard != -1:
        raise ConfigError(
            f"{flag}: {DP_SHARD_KEY} = {dp_shard} is fixed, so the job fits only one world size, but the "
            f"world may be {min_nodes * nproc_per_node} to {max_nodes * nproc_per_node} ranks; set "
            f"--{DP_SHARD_KEY} -1 (the degree that absorbs a lost node; every other degree stays as set)"
        )
    t = cfg.training
    if t.global_batch_size == -1:
        raise ConfigError(
            f"{flag}: training.global_batch_size = -1 (local batch x batch degree) would shrink with the "
            f"world; set it (e.g. --training.global_batch_size {t.local_batch_size * max_nodes * nproc_per_node}, "
            f"its value on {nodes_text(max_nodes)}) so a lost node keeps the global batch and the data order "
            f"(gradient accumulation grows instead)"
        )
