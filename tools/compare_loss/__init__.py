"""Compare loss curves across parallelism layouts: ``python -m tools.compare_loss`` (or the
``meshtrain-compare-loss`` console script); see :mod:`tools.compare_loss.cli` for the usage.

    layouts   layout syntax, parsing, the run plan (each layout's train.py argv), validation
              against the config and model (preflight)
    runner    the runs: seed checkpoint, torchrun or forked launches, streaming, progress, timeouts
    compare   run results, metrics.jsonl reading, tolerances, per-layout verdicts, summary rows
    report    the table, summary.json and the plot
    diagnose  per-parameter gradient comparison (--diagnose), launching grad_dump
    grad_dump the torchrun entry that dumps one step's gradients
    cli       argument parsing and main

Importing the package imports nothing heavy: ``grad_dump`` runs under torchrun as
``-m tools.compare_loss.grad_dump``.
"""
