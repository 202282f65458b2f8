"""meshtrain's trainer: config -> job plan -> the training loop.

At this folder's top is the loop itself: trainer.py (``Trainer``), step.py, bad_steps.py,
forward.py, validation.py, mtp.py, build.py, startup.py, faults.py (faults injected at a step), and the job plan it is built from (plan.py,
plan_report.py, model_spec.py). Each concern around it is a package whose docstring says what it
owns and may import: config/ (the bottom), data/, simulation/, runtime/, optim/, checkpoint/,
reporting/, instruments/, and lifecycle/ (the top: the way in, ``python train.py``). Folders
import one way (docs/design.md section 1; tests/unit/test_imports.py checks that no two folders
import each other); the trainer may import ``models`` and ``parallel_dims``, never ``tools``.
"""
