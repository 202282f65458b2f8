"""``python -m tools.ckpt_kill_drill``: SIGKILL torch's checkpoint process (``checkpoint.async_mode =
async_with_pinned_mem``, CUDA only) mid-save and check the job restarts or ends in one line, leaves
no orphan and resumes bitwise (the command and its description: __main__.py; what it reads and
judges, testable on CPU: checks.py).
"""
