"""Compare loss curves across parallelism layouts: ``python -m tools.compare_loss`` (or the
``meshtrain-compare-loss`` console script); see :mod:`tools.compare_loss.cli` for the usage.

    layouts   layout syntax, parsing, validation against the config and model (preflight)
    runner    the runs: plan, seed checkpoint, torchrun launches, streaming, progress, timeouts
    compare   metrics.jsonl reading, tolerances, per-layout verdicts and summary rows
    report    the table, summary.json and the plot
    diagnose  per-parameter gradient comparison (--diagnose), launching grad_dump
    grad_dump the torchrun entry that dumps one step's gradients
    cli       argument parsing and main

Importing the package imports nothing heavy: ``grad_dump`` runs under torchrun as
``-m tools.compare_loss.grad_dump``.
"""
