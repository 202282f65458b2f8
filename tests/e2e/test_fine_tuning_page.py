"""docs/fine_tuning.md's first example, run from the page itself: its four commands (a base model
trained and exported, a chat parquet file written, the fine-tune from the export, generation
with transformers alone) run as the page writes them, and every line the page quotes as "what
the run printed" has the form of a line the current code prints (numbers, paths and column
padding aside). So the page cannot drift from the code: a renamed field, a dropped note or a new
part of the ``data:`` line fails here.

The runs are shrunk to stay inside the suite's budget (docs/testing.md): the two ``torchrun``
commands run on forked ranks (tests/e2e/helpers.py ``run_forked``; the same ranks, stdout and
files as torchrun) with ``--model.n_layers 2 --training.seq_len 32 --training.global_batch_size 4
--training.local_batch_size 2`` appended (the
last value of a key wins), which changes no line's form: 8.5 CPU s for the test (Intel Xeon, 2
shared cores), where the unshrunk commands took 50 s wall. The page's own figures come from the full commands:

    MESHTRAIN_REGENERATE_DOCS=1 .venv/bin/python -m pytest -q tests/e2e/test_fine_tuning_page.py

runs them unshrunk and writes the quoted lines (and the generated text) back into the page.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
from pathlib import Path

from .helpers import ROOT, run_forked

PAGE = ROOT / "docs" / "fine_tuning.md"
HEADING = "## From a Hugging Face folder to a fine-tuned Hugging Face folder"
REGENERATE = os.environ.get("MESHTRAIN_REGENERATE_DOCS") == "1"
SHRINK = (
    []
    if REGENERATE
    else [
        "--model.n_layers",
        "2",
        "--training.seq_len",
        "32",
        "--training.global_batch_size",
        "4",
        "--training.local_batch_size",
        "2",
    ]
)
# the lines the page quotes, by how they start; the step lines are quoted up to the lr
QUOTED = ("dataset:", "data:", "step  1/", "step 20/")


def _section() -> str:
    text = PAGE.read_text()
    start = text.index(HEADING)
    return text[start : text.index("\n## ", start + len(HEADING))]


def _commands() -> list[str]:
    """The example's bash block: one string per command (continuation lines joined, comments
    dropped)."""
    block = re.search(r"```bash\n(.*?)```", _section(), re.S).group(1)
    joined = block.replace("\\\n", " ")
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def _quoted_block() -> str:
    return re.search(r"What the run printed[^\n]*\n\n```text\n(.*?)```", _section(), re.S).group(1)


def _form(line: str) -> str:
    """A line with its numbers, paths and runs of spaces made neutral."""
    line = re.sub(r"\S*/\S*", "PATH", line)
    line = re.sub(r"\d[\d,]*(\.\d+)?(e[-+]\d+)?", "N", line)
    return re.sub(r"\s+", " ", line).strip()


def _run_torchrun(command: str, outputs: Path) -> str:
    """A ``torchrun --nproc_per_node=N train.py ARGS`` command of the page on N forked ranks,
    its ``outputs/`` paths under ``outputs``; its stdout."""
    argv = shlex.split(command.replace("outputs/", f"{outputs}/"))
    nproc = int(next(a.split("=", 1)[1] for a in argv if a.startswith("--nproc_per_node=")))
    args = argv[argv.index("train.py") + 1 :]
    res = run_forked(nproc, *args, *SHRINK, timeout=600)
    assert res.returncode == 0, (command, res.stdout[-3000:], res.stderr[-3000:])
    return res.stdout


def _run_python(command: str, workdir: Path) -> str:
    """A ``python -c CODE`` command of the page, run in this process (its imports are
    transformers / pyarrow, which need no interpreter of their own) in ``workdir``; its stdout."""
    argv = shlex.split(command)
    assert argv[0].endswith("python") and argv[1] == "-c", command
    out = io.StringIO()
    cwd = os.getcwd()
    os.chdir(workdir)
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(argv[2], "<docs/fine_tuning.md>", "exec"), {"__name__": "__main__"})
    finally:
        os.chdir(cwd)
    return out.getvalue()


def _printed_lines(stdout: str) -> dict[str, str]:
    """The run's lines the page quotes: the first line starting with each of QUOTED."""
    lines = {}
    for line in stdout.splitlines():
        for start in QUOTED:
            if line.startswith(start) and start not in lines:
                lines[start] = line
    return lines


def _regenerate(printed: dict[str, str], generated: str, outputs: Path) -> None:
    """Write the full run's lines into the page (the step lines up to the lr, as quoted; paths
    as the page's commands write them)."""

    def cut(line: str) -> str:
        return line[: line.index(" lr ") + len(" lr 1.000e-04")] + "  ..." if line.startswith("step") else line

    text = PAGE.read_text()
    old = _quoted_block()
    lines = (cut(printed[s]).replace(f"{outputs}/", "outputs/") for s in QUOTED)
    text = text.replace(old, "".join(line + "\n" for line in lines), 1)
    text = re.sub(r"and command 3 printed `[^`]*`", f"and command 3 printed `{generated}`", text, count=1)
    PAGE.write_text(text)


def test_the_pages_commands_run_and_its_quoted_lines_are_what_the_code_prints(tmp_path):
    commands = _commands()
    assert [c.split()[0].rsplit("/", 1)[-1] for c in commands] == ["torchrun", "python", "torchrun", "python"], commands
    workdir = tmp_path
    outputs = workdir / "outputs"
    outputs.mkdir()

    _run_torchrun(commands[0], outputs)  # the base model, exported
    assert (outputs / "ft_base/checkpoint/step-10-hf/config.json").is_file()
    _run_python(commands[1], workdir)  # the chat parquet file
    assert (outputs / "ft_chat.parquet").is_file()
    printed = _printed_lines(_run_torchrun(commands[2], outputs))  # the fine-tune
    assert sorted(printed) == sorted(QUOTED), printed
    generated = _run_python(commands[3], workdir).strip()  # transformers alone, on the export
    assert re.fullmatch(r"'.*'", generated), generated  # one repr of the generated text

    if REGENERATE:
        _regenerate(printed, generated, outputs)
    quoted = [line for line in _quoted_block().splitlines() if line.strip()]
    assert len(quoted) == len(QUOTED), quoted
    for line, start in zip(quoted, QUOTED, strict=True):
        assert line.startswith(start), (line, start)
        real = printed[start]
        if line.endswith("  ..."):  # a step line quoted up to its lr
            assert _form(real).startswith(_form(line[: -len("  ...")])), (line, real)
        else:
            assert _form(line) == _form(real), (line, real)
