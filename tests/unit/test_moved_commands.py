"""The two commands that moved out of ``python -m parallel_dims`` (parallel_dims/moved_commands.py):
the old forms print one ``note:`` line on stderr naming the new command, then give exactly the new
command's output and exit code.

    python -m parallel_dims plan ...        ->  python -m tools.planner ...
    python -m parallel_dims --config X ...  ->  python -m trainer.plan_report --config X ...
"""

from __future__ import annotations

import json

from tests.distributed.run_json import run_module_on_own_process

# the layout planner's small search (tests/unit/test_planner.py)
PLANNER = ["--model", "llama3", "--flavor", "debugmodel", "--world-size", "8", "--gpus-per-node", "4",
           "--seq-len", "256", "--global-batch", "16", "--top", "2"]  # fmt: skip
JOB_PLAN = ["--config", "llama3.toml", "--world-size", "4", "--tp", "2", "--rank", "1"]


def _one_note(err: str, new: str) -> str:
    """The old form's stderr starts with one note line naming the new command; the rest."""
    first, _, rest = err.partition("\n")
    assert first.startswith("note: ") and f"`{new}" in first, err[-2000:]
    assert "note:" not in rest
    return rest


def test_old_planner_command_notes_and_forwards(capsys):
    from parallel_dims.__main__ import main as old_main
    from tools.planner.cli import main as new_main

    for extra in (["--json"], []):
        assert new_main([*PLANNER, *extra]) == 0
        new = capsys.readouterr()
        assert old_main(["plan", *PLANNER, *extra]) == 0
        old = capsys.readouterr()
        assert new.err == ""
        assert _one_note(old.err, "python -m tools.planner") == ""
        if extra:
            assert json.loads(old.out) == json.loads(new.out)
        else:  # the text differs only in the search's own time
            strip = [line.split(", searched in")[0] for line in new.out.splitlines()]
            assert [line.split(", searched in")[0] for line in old.out.splitlines()] == strip
            assert "layout plan: llama3/debugmodel on 8 x h100" in old.out
    # bad input: the planner's own error line and exit code after the note
    assert new_main([*PLANNER, "--gpu", "nope"]) == 2
    new = capsys.readouterr()
    assert old_main(["plan", *PLANNER, "--gpu", "nope"]) == 2
    old = capsys.readouterr()
    assert _one_note(old.err, "python -m tools.planner") == new.err and new.err.startswith("error: ")


def test_old_job_plan_command_notes_and_forwards():
    """On processes forked from tools/forkserver.py's server (the dry run initializes a fake
    process group): the same JSON and text, and the same error on a layout the plan refuses. The
    old form's ``--gpus-per-node`` (never used by the job plan) is still accepted."""
    for extra in (["--json"], []):
        new = run_module_on_own_process("trainer.plan_report", *JOB_PLAN, *extra)
        old = run_module_on_own_process("parallel_dims", *JOB_PLAN, "--gpus-per-node", "8", *extra)
        assert new.returncode == old.returncode == 0, old.stderr[-2000:] + new.stderr[-2000:]
        assert old.stdout == new.stdout and new.stdout
        assert new.stderr == "" and _one_note(old.stderr, "python -m trainer.plan_report") == ""
        if extra:
            assert json.loads(old.stdout)["rank"] == 1
        else:
            assert old.stdout.startswith("job plan: llama3/debugmodel on world_size=4")
    bad = ["--config", "llama3.toml", "--world-size", "4", "--tp", "3"]
    new = run_module_on_own_process("trainer.plan_report", *bad)
    old = run_module_on_own_process("parallel_dims", *bad)
    assert new.returncode == old.returncode == 2
    assert "a valid choice for world_size=4" in new.stderr and "Traceback" not in old.stderr
    assert _one_note(old.stderr, "python -m trainer.plan_report") == new.stderr
    assert old.stdout == new.stdout == ""


def test_describe_is_not_forwarded(capsys):
    """``python -m parallel_dims`` without ``plan`` / ``--config`` still describes the layout
    itself, with no note."""
    from parallel_dims.__main__ import main

    assert main(["--world-size", "8", "--tp", "2"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and out.startswith("degrees: world_size=8")
