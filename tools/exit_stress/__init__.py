"""``python -m tools.exit_stress``: many short ``train.py`` runs under CPU load, every one must exit 0
with complete outputs (the command and its description: __main__.py). A command only: nothing
imports it.
"""
