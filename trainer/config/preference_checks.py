"""The config checks of preference data (``training.dataset = "preference"``, a mixture's
``kind = "preference"``: trainer/data/preference.py), called by
:func:`trainer.config.validate.validate_config`: a (chosen, rejected) pair fills two adjacent
windows (global samples 2k, 2k + 1), which must stay in one micro-batch on one batch rank."""

from __future__ import annotations

__all__ = ["validate_preference"]


def _even_rows(rows: int, key: str, cfg, need) -> None:
    """``rows`` (a local batch) holds whole pairs, and so does each pipeline micro-batch of it."""
    need(
        rows % 2 == 0,
        f"{key} ({rows}) must be even with preference data: each (chosen, rejected) pair fills two adjacent rows of "
        f"one micro-batch; set it to {rows + 1}",
    )
    p = cfg.parallelism
    if p.pipeline_parallel_degree > 1 and rows % p.pipeline_microbatches() == 0:
        m = p.pipeline_microbatches()
        need(
            (rows // m) % 2 == 0,
            f"{key} ({rows}) / the pipeline microbatch count {m} = {rows // m} rows per pipeline micro-batch, which "
            f"must be even with preference data (a (chosen, rejected) pair in one micro-batch); set {key} to "
            f"{2 * m} (or a multiple) or lower parallelism.pipeline_parallel_microbatches",
        )


def validate_preference(cfg, need) -> None:
    from trainer.config.long_run_specs import parse_skip_samples

    t, v = cfg.training, cfg.validation
    kinds = [src["kind"] for src in t.sources] or [t.dataset]
    if "preference" in kinds:
        others = sorted({k for k in kinds if k != "preference"})
        need(
            not others,
            f"training.sources mixes 'preference' with {', '.join(repr(k) for k in others)}: a preference pair fills "
            "two adjacent windows that must stay together and a preference objective needs every window to be one "
            "of a pair; mix only 'preference' sources",
        )
        _even_rows(t.local_batch_size, "training.local_batch_size", cfg, need)
        for start, end in parse_skip_samples(t.skip_samples):
            need(
                end % 2 == 0,
                f"training.skip_samples entry '{start}:{end}' ends at an odd sample: with preference data samples "
                f"2k and 2k + 1 are one pair; end it at {end + 1}",
            )
    if v.enable and v.dataset == "preference":
        _even_rows(v.local_batch_size, "validation.local_batch_size", cfg, need)
