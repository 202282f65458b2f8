"""The checkpoint interval that loses the least time to failures, and the goodput it leaves.

The model (docs/long_runs.md#choosing-the-checkpoint-interval): failures of the job arrive as a
Poisson process with mean time between failures ``M`` = the node MTBF / the job's nodes; each
one costs the restart time ``R`` plus the work done since the newest complete checkpoint; a save
holds training for ``C`` seconds (the synchronous part: the whole save with
``checkpoint.async_mode = "disabled"``, the staging copy with ``async``). ``tau`` is the training
time between saves, so a segment of wall time is ``tau + C``.

- Young (1974): minimising the first-order loss rate ``C / tau + tau / (2 M)`` gives
  ``tau = sqrt(2 C M)``.
- Daly (2006, "A higher order estimate of the optimum checkpoint interval for restart dumps",
  FGCS 22): the exact expected wall time of ``T`` seconds of work under exponential failures is
  ``T_w = M e^(R/M) (e^((tau + C)/M) - 1) T / tau``; its minimiser is approximately
  ``sqrt(2 C M) [1 + sqrt(C / 2M) / 3 + (C / 2M) / 9] - C`` for ``C < 2 M`` (``M`` otherwise).
- Goodput (the fraction of wall time spent on steps that count) = ``T / T_w``.

A background (async) save is complete only ``W`` seconds after it starts (its write): a failure
inside that window falls back to the save before it, which costs on average ``W`` more seconds
per failure. That adds to ``R`` in the model, and the interval is kept at least ``W - C`` (a
save due while one is still writing waits for it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "FailureModel",
    "daly_interval",
    "first_order_loss",
    "goodput",
    "job_mtbf_s",
    "parse_failure_args",
    "plan_checkpoints",
    "young_interval",
]

DAY_S = 86400.0


def job_mtbf_s(node_failures_per_day: float, nodes: int) -> float:
    """The job's mean time between failures in seconds: a node's MTBF over the job's nodes
    (independent nodes, any node's failure stops the job)."""
    return DAY_S / (node_failures_per_day * nodes)


def young_interval(save_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum: ``sqrt(2 C M)`` seconds of training between saves."""
    return math.sqrt(2.0 * save_s * mtbf_s)


def daly_interval(save_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum (his eq. 37): ``M`` when the save takes ``2 M`` or more."""
    if save_s >= 2.0 * mtbf_s:
        return mtbf_s
    x = save_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * save_s * mtbf_s) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - save_s


def first_order_loss(tau: float, save_s: float, mtbf_s: float, restart_s: float = 0.0) -> float:
    """The fraction of time lost in Young's model: saves ``C / tau``, rework ``tau / 2M`` and
    restarts ``R / M`` (Young's interval minimises it exactly)."""
    return save_s / tau + tau / (2.0 * mtbf_s) + restart_s / mtbf_s


def goodput(tau: float, save_s: float, mtbf_s: float, restart_s: float) -> float:
    """Useful work over wall time in Daly's exact model: ``tau / (M e^(R/M) (e^((tau+C)/M) - 1))``."""
    return tau / (mtbf_s * math.exp(restart_s / mtbf_s) * math.expm1((tau + save_s) / mtbf_s))


@dataclass(frozen=True)
class FailureModel:
    node_failures_per_day: float
    save_s: float  # C: the seconds a save holds training
    restart_s: float  # R: failure to the first step after the restart
    write_s: float = 0.0  # W: an async save's start to its last byte (0: synchronous saves)


def plan_checkpoints(f: FailureModel, nodes: int, step_s: float) -> dict:
    """The interval (seconds and steps of ``step_s``) and its goodput for a job of ``nodes``."""
    mtbf = job_mtbf_s(f.node_failures_per_day, nodes)
    restart = f.restart_s + f.write_s  # an async save's write window falls back one save
    young, daly = young_interval(f.save_s, mtbf), daly_interval(f.save_s, mtbf)
    # no save waits for the previous one's write (at least W - C between saves); a step at least
    steps = max(1, round(daly / step_s), math.ceil((f.write_s - f.save_s) / step_s))
    tau = steps * step_s
    g = goodput(tau, f.save_s, mtbf, restart)
    failures_per_day = DAY_S / mtbf
    return {
        "node_failures_per_day": f.node_failures_per_day,
        "nodes": nodes,
        "job_mtbf_hours": round(mtbf / 3600.0, 4),
        "job_failures_per_day": round(failures_per_day, 4),
        "save_stall_s": f.save_s,
        "save_write_s": f.write_s,
        "restart_s": f.restart_s,
        "step_s": step_s,
        "young_interval_s": round(young, 3),
        "daly_interval_s": round(daly, 3),
        "interval_steps": steps,
        "interval_s": round(tau, 3),
        "goodput": round(g, 6),
        # the first-order split of the lost time at that interval, per day of wall time
        "lost_hours_per_day": {
            "saves": round(24.0 * f.save_s / (tau + f.save_s), 4),
            "rework": round(failures_per_day * (tau + f.save_s) / 2.0 / 3600.0, 4),
            "restarts": round(failures_per_day * f.restart_s / 3600.0, 4),
            "unfinished_writes": round(failures_per_day * f.write_s / 3600.0, 4),
        },
    }


def _number(flag: str, text: str | None, minimum: float, strict: bool) -> float | None:
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{flag} must be a number, got {text!r}") from None
    if not math.isfinite(value) or value < minimum or (strict and value == minimum):
        raise ValueError(f"{flag} must be a finite number {'>' if strict else '>='} {minimum:g}, got {text}")
    return value


def parse_failure_args(args) -> FailureModel | None:
    """The failure options of the planner's command line (strings, checked here so a bad value
    is one line and exit 2): None when no failure rate is given."""
    rate = _number("--node-failures-per-day", args.node_failures_per_day, 0.0, True)
    mtbf_h = _number("--node-mtbf-hours", args.node_mtbf_hours, 0.0, True)
    save = _number("--save-seconds", args.save_seconds, 0.0, True)
    restart = _number("--restart-seconds", args.restart_seconds, 0.0, False)
    write = _number("--save-write-seconds", args.save_write_seconds, 0.0, False)
    if rate is not None and mtbf_h is not None:
        raise ValueError(
            "give --node-failures-per-day or --node-mtbf-hours, not both (--node-mtbf-hours is 24 / --node-failures-per-day)"
        )
    if rate is None and mtbf_h is None:
        given = [n for n, v in (("--save-seconds", save), ("--restart-seconds", restart),
                                ("--save-write-seconds", write)) if v is not None]  # fmt: skip
        if given:
            raise ValueError(
                f"{given[0]} plans the checkpoint interval, which needs a failure rate: add "
                "--node-failures-per-day RATE (or --node-mtbf-hours HOURS)"
            )
        return None
    missing = [n for n, v in (("--save-seconds", save), ("--restart-seconds", restart)) if v is None]
    if missing:
        raise ValueError(
            f"the checkpoint interval needs {' and '.join(missing)}: the save's stall is checkpoint_stall_s "
            "in metrics.jsonl of a short run with checkpoint.interval set; the restart is the failure's "
            "detection (comm.train_timeout_seconds) plus a resumed run's start to its first step "
            "(docs/long_runs.md#choosing-the-checkpoint-interval)"
        )
    if write and write < save:
        raise ValueError(
            f"--save-write-seconds {write:g} is shorter than --save-seconds {save:g}: the write of an async "
            "save (checkpoint_write_s) runs from the save's start to its last byte, so it includes the stall"
        )
    rate = rate if rate is not None else 24.0 / mtbf_h
    return FailureModel(rate, save, restart, write or 0.0)


def describe(plan: dict) -> list[str]:
    """The text lines of :func:`plan_checkpoints`' answer, for the planner's output."""
    p, lost = plan, plan["lost_hours_per_day"]
    save = f"save stall {p['save_stall_s']:g} s" + (
        f" (its background write {p['save_write_s']:g} s)" if p["save_write_s"] else ""
    )
    return [
        f"checkpoint interval for the winner: {p['node_failures_per_day']:g} failures per node per day x "
        f"{p['nodes']} nodes = a failure every {p['job_mtbf_hours']:.2f} h ({p['job_failures_per_day']:.2f} a day); "
        f"{save}, restart {p['restart_s']:g} s",
        f"  Young sqrt(2 C M) = {p['young_interval_s']:,.0f} s, Daly = {p['daly_interval_s']:,.0f} s of training "
        f"between saves -> checkpoint.interval = {p['interval_steps']} steps of {p['step_s']:.3f} s "
        f"({p['interval_s']:,.0f} s)",
        f"  expected goodput {p['goodput']:.4f}: per day of wall time, saves {lost['saves']:.2f} h + rework "
        f"(half an interval per failure) {lost['rework']:.2f} h + restarts {lost['restarts']:.2f} h"
        + (f" + unfinished background writes {lost['unfinished_writes']:.2f} h" if p["save_write_s"] else "")
        + " lost",
    ]
