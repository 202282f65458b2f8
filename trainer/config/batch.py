"""The batch-size arithmetic every layout shares: the global batch a config asks for
(``training.global_batch_size``, or -1 for local batch x batch degree) and the micro-batches
each rank runs per optimizer step, with the legal values in the error."""

from __future__ import annotations

from trainer.config.errors import ConfigError


def resolve_global_batch_size(global_batch_size: int, local_batch_size: int, batch_degree: int) -> int:
    if batch_degree < 1:
        raise ConfigError(f"batch degree must be >= 1, got {batch_degree}")
    if global_batch_size == -1:
        return local_batch_size * batch_degree
    return global_batch_size


def gradient_accumulation_steps(global_batch_size: int, local_batch_size: int, batch_degree: int) -> int:
    """Micro-batches each rank runs per optimizer step.

    The global batch G is split into D contiguous per-rank slices of G/D samples, each
    consumed as micro-batches of local_batch_size, so G must be a multiple of
    D * local_batch_size.
    """
    g = resolve_global_batch_size(global_batch_size, local_batch_size, batch_degree)
    unit = batch_degree * local_batch_size
    if g <= 0 or g % unit != 0:
        legal = ", ".join(str(unit * k) for k in range(1, 5))
        msg = (
            f"training.global_batch_size ({g}) must be a positive multiple of batch degree "
            f"({batch_degree}) x training.local_batch_size ({local_batch_size}) = {unit}; "
            f"legal values: {legal}, ..."
        )
        if g > 0 and g % batch_degree == 0:
            per_rank = g // batch_degree
            divisors = [d for d in range(1, per_rank + 1) if per_rank % d == 0]
            msg += f"; or keep it and set training.local_batch_size to one of {divisors}"
        raise ConfigError(msg)
    return g // unit
