"""The specs of long-run options, parsed where the config is checked (config/long_run_checks.py)
and read by the runtime: ``debug.fault`` (trainer/faults.py injects them) and
``training.skip_samples`` (the data loader skips them; trainer/bad_steps.py names them at a
rollback). Docs: docs/long_runs.md."""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainer.config.errors import ConfigError

__all__ = ["FAULT_KINDS", "Fault", "parse_faults", "parse_skip_samples"]

FAULT_KINDS = ("nan_loss", "kill", "hang", "slow")
_KEYS = {
    "nan_loss": ("rank", "restart"),
    "kill": ("rank", "restart"),
    "hang": ("rank", "restart"),
    "slow": ("rank", "factor", "restart"),
}
_FORMS = "'nan_loss@5', 'kill@7:rank=2', 'hang@4:rank=1', 'slow:rank=3:factor=2'"


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int | None  # None: slow from step 1
    rank: int | None  # None: every rank
    factor: float = 1.0
    # only in the workers' start number ``restart`` (0: the first; TORCHELASTIC_RESTART_COUNT,
    # set by torch's elastic agent); None: in every start, so a kill fires again after a restart
    restart: int | None = None


def _bad(spec: str, why: str) -> ConfigError:
    return ConfigError(f"debug.fault {spec!r}: {why}; the forms are {_FORMS} (docs/long_runs.md)")


def _parse_one(spec: str) -> Fault:
    head, *pairs = spec.split(":")
    kind, at, step_text = head.partition("@")
    if kind not in FAULT_KINDS:
        raise _bad(spec, f"unknown fault {kind!r} (one of {', '.join(FAULT_KINDS)})")
    step = None
    if at:
        lowest = 0 if kind == "hang" else 1  # hang@0: before the rank joins its group
        if not step_text.isdigit() or int(step_text) < lowest:
            raise _bad(spec, f"the step after '@' must be an integer >= {lowest}, got {step_text!r}")
        step = int(step_text)
    elif kind != "slow":
        raise _bad(spec, f"'{kind}' needs the step it happens at: '{kind}@STEP'")
    values: dict[str, str] = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or key not in _KEYS[kind]:
            raise _bad(spec, f"{pair!r} is not a key=value of '{kind}' (keys: {', '.join(_KEYS[kind])})")
        if key in values:
            raise _bad(spec, f"{key} is given twice")
        values[key] = value
    rank = None
    if "rank" in values:
        if not values["rank"].isdigit():
            raise _bad(spec, f"rank must be an integer >= 0, got {values['rank']!r}")
        rank = int(values["rank"])
    restart = None
    if "restart" in values:
        if not values["restart"].isdigit():
            raise _bad(
                spec, f"restart must be an integer >= 0 (the workers' start: 0 is the first), got {values['restart']!r}"
            )
        restart = int(values["restart"])
    if step == 0 and not restart:
        raise _bad(
            spec, "'hang@0' (before the rank joins its group) fires in a restarted start only: add restart=N, N >= 1"
        )
    factor = 1.0
    if kind == "slow":
        if "factor" not in values:
            raise _bad(spec, "'slow' needs factor=F (F > 1: the rank's steps take F times as long)")
        try:
            factor = float(values["factor"])
        except ValueError:
            factor = math.nan
        if not (math.isfinite(factor) and factor > 1):
            raise _bad(spec, f"factor must be a number > 1, got {values['factor']!r}")
    return Fault(kind, step, rank, factor, restart)


def parse_faults(specs: list[str], world_size: int | None = None) -> list[Fault]:
    """The faults of ``debug.fault`` (:class:`ConfigError` for a bad spec); with ``world_size``,
    a rank outside the job is refused too."""
    faults = []
    for spec in specs:
        spec = spec.strip()
        if not spec:
            raise _bad(spec, "an empty fault")
        fault = _parse_one(spec)
        if world_size is not None and fault.rank is not None and fault.rank >= world_size:
            raise _bad(spec, f"rank {fault.rank} is not in this job of {world_size} ranks")
        faults.append(fault)
    return faults


def parse_skip_samples(items: list[str]) -> list[tuple[int, int]]:
    """``training.skip_samples``: ``START:END`` global sample ranges (END excluded)."""
    ranges = []
    for item in items:
        start, colon, end = item.strip().partition(":")
        if not (colon and start.isdigit() and end.isdigit() and int(start) < int(end)):
            raise ConfigError(
                f"training.skip_samples entry {item!r} is not START:END with 0 <= START < END (global sample "
                "indices, END excluded), e.g. '40:48' as a rollback names them"
            )
        ranges.append((int(start), int(end)))
    return ranges
