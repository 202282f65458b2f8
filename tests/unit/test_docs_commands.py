"""Every shell command shown in README.md and docs/*.md runs as written on a fresh clone.

The commands of every fenced ```bash / ```sh / ```shell / ```console block (in console blocks,
the lines after a ``$`` prompt) are checked without doing their work:

* ``python -m X ...`` (also ``.venv/bin/python``, ``python3``) and ``python scripts/x.py ...``: the
  module or script resolves, and its own argparse parser accepts the options: the command runs
  in this process until its parser returns, then stops (``argparse.ArgumentParser.parse_args``
  is wrapped to raise), so nothing after parsing runs. A module whose source has neither
  ``argparse`` nor a ``main(`` is refused rather than run. ``pytest`` and ``tests.kernel_lane``
  (which hands its arguments to pytest): the paths exist and ``-m`` names a declared marker.
  ``python -c CODE``: the code compiles. ``python -m tools.compare_loss ... -- OVERRIDES``: the
  overrides after ``--`` go to every run's train.py, so the config loader checks them.
* ``train.py ...`` (with python or through ``torchrun``): the trainer's config loader parses the
  options (``trainer.config.load_config``: ``--config`` resolves, every ``--section.key value``
  is a known key with a valid value); torchrun's own options (also given to ``python train.py``,
  the launcher) go through torchrun's parser.
* ``make TARGET [VAR=value]``: ``make -n`` of the target succeeds as a top-level make (in a copy
  of the Makefile), and the python / torchrun commands the recipe would run are checked as above
  (so ``ARGS='...'`` reaches the right parser).
* ``sbatch ... SCRIPT ARGS`` and ``bash SCRIPT``: the script and any config named exist.
* Everywhere: ``--config X`` resolves like the trainer's ``--config``, and arguments naming a
  file of this repository (``train_configs/``, ``scripts/``, ``tests/``, ``docs/``, ``*.toml``)
  exist.

Skipped, by a stated rule: a command with a ``...`` argument or a ``<placeholder>`` is an
illustration, not a command (``python -m tools.compare_loss ... --diagnose``); the pages have none
today, and at most three are allowed. Any other program
fails the test, so a new kind of command gets a rule here.

The same test checks that every relative link of those pages resolves (file, and the heading
anchor when one is given).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import os
import re
import runpy
import shlex
import shutil
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_LANGS = {"bash", "sh", "shell", "console"}
PYTHONS = {"python", "python3", ".venv/bin/python", "$(PY)"}
PYTEST_LIKE = {"pytest", "tests.kernel_lane"}


@dataclass
class Command:
    page: str
    line: int
    text: str

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.text}"


class _Parsed(Exception):
    """Raised by the wrapped parse_args once a command's options parsed: its work never runs."""


class _Exited(BaseException):
    pass


# ------------------------------------------------------------------ extraction


def extract_commands(path: Path, root: Path = ROOT) -> list[Command]:
    """The shell commands of the fenced shell blocks of one page, continuation lines joined."""
    lines = path.read_text().splitlines()
    out: list[Command] = []
    lang = None
    pending, start = "", 0
    for i, line in enumerate(lines, 1):
        fence = re.match(r"^\s*```(\w*)\s*$", line)
        if fence:
            lang = None if lang is not None else (fence.group(1) or "text")
            continue
        if lang not in SHELL_LANGS:
            continue
        if lang == "console":
            if not pending:
                if not line.startswith("$ "):
                    continue  # output
                line = line[2:]
        text = line.rstrip()
        if not pending:
            start = i
        if text.endswith("\\"):
            pending += text[:-1] + " "
            continue
        full = (pending + text).strip()
        pending = ""
        try:
            tokens = shlex.split(full, comments=True)
        except ValueError as exc:
            raise AssertionError(f"{path.name}:{start}: cannot split {full!r}: {exc}") from None
        if tokens:
            out.append(Command(str(path.relative_to(root)), start, shlex.join(tokens)))
    return out


def all_commands() -> list[Command]:
    return [c for page in PAGES for c in extract_commands(page)]


# ------------------------------------------------------------------ checking


def is_illustration(tokens: list[str]) -> bool:
    return "..." in tokens or re.search(r"<[^<>\s][^<>]*>", " ".join(tokens)) is not None


def _repo_file_args(tokens: list[str]) -> list[str]:
    """Arguments that name a file of this repository: they must exist on a fresh clone."""
    missing = []
    for t in tokens:
        value = t.split("=", 1)[1] if t.startswith("--") and "=" in t else t
        if value.startswith("-") or "://" in value:
            continue
        if (
            re.match(r"^(train_configs|scripts|tests|docs|benchmarks|tools|assets)/", value)
            and not (ROOT / value).exists()
        ):
            missing.append(value)
    return missing


def _check_config_options(tokens: list[str]) -> None:
    from trainer.config.loader import resolve_config_path

    for i, t in enumerate(tokens):
        if t == "--config" and i + 1 < len(tokens):
            resolve_config_path(tokens[i + 1])  # ConfigError (a ValueError) when it does not exist
        elif t.startswith("--config="):
            resolve_config_path(t.split("=", 1)[1])


@contextlib.contextmanager
def _in_process(argv0: str, args: list[str]):
    """sys.argv set, output captured, parse_args stopping the command, exits never leaving."""
    real_parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        ns = real_parse(self, args, namespace)
        raise _Parsed(ns)

    def no_exit(code=0):
        raise _Exited(code)

    env = dict(os.environ)
    out, err = io.StringIO(), io.StringIO()
    old_argv = sys.argv
    sys.argv = [argv0, *args]
    try:
        with (
            mock.patch.object(argparse.ArgumentParser, "parse_args", parse_then_stop),
            mock.patch.object(os, "_exit", no_exit),
            warnings.catch_warnings(),
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(err),
        ):
            # runpy warns when the module was imported before (by an earlier command)
            warnings.simplefilter("ignore", RuntimeWarning)
            yield err
    finally:
        sys.argv = old_argv
        os.environ.clear()
        os.environ.update(env)


def _run_parser(kind: str, target: str, args: list[str]) -> None:
    """Run a module (-m) or a script until its argparse parser has parsed ``args``."""
    if kind == "module":
        spec = importlib.util.find_spec(target)
        if spec is None:
            raise AssertionError(f"no module named {target!r}")
        source_path = spec.origin
        if spec.submodule_search_locations:  # a package: python -m runs its __main__
            main_spec = importlib.util.find_spec(target + ".__main__")
            if main_spec is None:
                raise AssertionError(f"package {target!r} has no __main__")
            source_path = main_spec.origin
    else:
        source_path = str(ROOT / target)
        if not Path(source_path).is_file():
            raise AssertionError(f"no script {target}")
    source = Path(source_path).read_text()
    if "argparse" not in source and "main(" not in source:
        raise AssertionError(f"{target}: no argument parser to check the options with (it would do its work)")
    with _in_process(target, args) as err:
        try:
            if kind == "module":
                runpy.run_module(target, run_name="__main__", alter_sys=False)
            else:
                runpy.run_path(source_path, run_name="__main__")
        except _Parsed:
            return
        except (SystemExit, _Exited) as exc:
            code = exc.code if isinstance(exc, SystemExit) else exc.args[0]
            if code in (0, None):
                return  # --help
            raise AssertionError(f"{target} {shlex.join(args)}: exit {code}: {err.getvalue().strip()}") from None
    raise AssertionError(f"{target} ran to the end without parsing its options")


def _check_train(args: list[str]) -> None:
    from trainer.config import load_config

    if "-h" in args or "--help" in args:
        return
    load_config(args)  # ConfigError (ValueError) on an unknown key, a bad value, a missing --config


def _check_pytest(args: list[str]) -> None:
    markers = _declared_markers()
    i = 0
    while i < len(args):
        a = args[i]
        if a == "-m" and i + 1 < len(args):
            for word in re.findall(r"\w+", args[i + 1]):
                if word not in {"and", "or", "not"} and word not in markers:
                    raise AssertionError(f"pytest marker {word!r} is not declared in pyproject.toml")
            i += 2
            continue
        looks_like_path = a.startswith("tests") or "/" in a or a.endswith(".py")
        if not a.startswith("-") and looks_like_path and not (ROOT / a.split("::")[0]).exists():
            raise AssertionError(f"pytest path {a} does not exist")
        i += 1


def _declared_markers() -> set[str]:
    text = (ROOT / "pyproject.toml").read_text()
    block = re.search(r"markers = \[(.*?)\]", text, re.S)
    return set(re.findall(r'"(\w+):', block.group(1))) if block else set()


def _check_python(args: list[str]) -> None:
    if not args:
        raise AssertionError("a bare python")
    if args[0] == "-c":
        compile(args[1], "<python -c>", "exec")
        return
    if args[0] == "-m":
        module, rest = args[1], args[2:]
        if module in PYTEST_LIKE:
            if importlib.util.find_spec(module) is None:
                raise AssertionError(f"no module named {module!r}")
            _check_pytest(rest)
            return
        extra: list[str] = []
        if module == "tools.compare_loss" and "--" in rest:  # train.py overrides for every run
            cut = rest.index("--")
            rest, extra = rest[:cut], rest[cut + 1 :]
        _run_parser("module", module, rest)
        if extra:
            config = rest[rest.index("--config") + 1]  # required by its parser
            _check_train(["--config", config, *extra])
        return
    script, rest = args[0], args[1:]
    if script == "train.py":
        from trainer.lifecycle.launch import launcher_argv

        split = launcher_argv(rest)  # torchrun's flags: the launcher (trainer/lifecycle/launch.py)
        if split is not None:
            launch, rest = split
            _check_torchrun([*launch, "train.py"])
        _check_train(rest)
        return
    _run_parser("script", script, rest)


def _check_torchrun(args: list[str]) -> None:
    from torch.distributed.run import get_args_parser

    with contextlib.redirect_stderr(io.StringIO()) as err:
        try:
            ns = get_args_parser().parse_args(args)
        except SystemExit:
            raise AssertionError(f"torchrun options: {err.getvalue().strip()}") from None
    if ns.module:
        _check_python(["-m", ns.training_script, *ns.training_script_args])
    else:
        _check_python([ns.training_script, *ns.training_script_args])


def _make_dry_run(target_args: list[str], env: dict[str, str]) -> str:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    skip = ("SYSTEM_TORCH", "MAKEFLAGS", "MFLAGS", "MAKELEVEL")  # a clean top-level make
    base = {k: v for k, v in os.environ.items() if k not in skip}
    res = subprocess.run(
        ["make", "--no-print-directory", "-n", "-f", str(ROOT / "Makefile"), *target_args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**base, **env},
        timeout=60,
    )
    if res.returncode != 0:
        raise AssertionError(f"make -n {shlex.join(target_args)}: {res.stderr.strip()}")
    return res.stdout


def _check_make(args: list[str], env: dict[str, str]) -> None:
    targets = [a for a in args if "=" not in a and not a.startswith("-")]
    if not targets:
        raise AssertionError("make without a target: name the target")
    out = _make_dry_run(args, env)
    # the commands the recipe runs: check each python / torchrun line like a documented command
    for line in out.splitlines():
        if not re.match(r"^(\S*/)?(python3?|torchrun)\s", line):
            continue
        try:
            tokens = shlex.split(line)
        except ValueError:  # a multi-line shell recipe (python -c code), not a documented command
            continue
        if tokens and "pip" not in tokens and "-c" not in tokens[1:2]:
            check_tokens(tokens, {})


def check_tokens(tokens: list[str], env: dict[str, str] | None = None) -> str:
    """Check one command's tokens; returns 'ok' or 'skipped (why)'; raises AssertionError."""
    env = dict(env or {})
    while tokens and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", tokens[0]):
        k, v = tokens[0].split("=", 1)
        env[k] = v
        tokens = tokens[1:]
    if not tokens:
        raise AssertionError("an empty command")
    if is_illustration(tokens):
        return "skipped (an illustration: '...' or a <placeholder>)"
    missing = _repo_file_args(tokens)
    if missing:
        raise AssertionError(f"names files that do not exist: {missing}")
    _check_config_options(tokens)
    prog, args = tokens[0], tokens[1:]
    if prog in PYTHONS:
        _check_python(args)
    elif prog in (".venv/bin/torchrun", "torchrun"):
        _check_torchrun(args)
    elif prog == "train.py":
        _check_train(args)
    elif prog == "make":
        _check_make(args, env)
    elif prog == "sbatch":
        files = [a for a in args if not a.startswith("-")]
        if not files or not (ROOT / files[0]).is_file():
            raise AssertionError(f"sbatch: no script {files[:1]}")
        for f in files[1:]:
            if f.endswith(".toml") and not (ROOT / f).is_file():
                raise AssertionError(f"sbatch: no config {f}")
    elif prog == "bash":
        if not args or not (ROOT / args[0]).is_file():
            raise AssertionError(f"bash: no script {args[:1]}")
    else:
        raise AssertionError(f"no rule for the program {prog!r}: add one to tests/unit/test_docs_commands.py")
    return "ok"


def check_command(text: str) -> str:
    return check_tokens(shlex.split(text, comments=True))


# ------------------------------------------------------------------ tests


def test_docs_show_commands():
    commands = all_commands()
    pages = {c.page for c in commands}
    assert len(commands) >= 40 and "README.md" in pages and "docs/training.md" in pages, pages


def test_every_documented_command_runs_as_written(monkeypatch):
    monkeypatch.chdir(ROOT)
    failures, skipped = [], []
    for cmd in all_commands():
        try:
            verdict = check_command(cmd.text)
        except (AssertionError, ValueError) as exc:
            failures.append(f"{cmd}\n    -> {exc}")
            continue
        if verdict != "ok":
            skipped.append(cmd)
    assert not failures, "documented commands that would not run as written:\n" + "\n".join(failures)
    # the skip rule stays an exception: illustrations are few
    assert len(skipped) <= 3, "\n".join(map(str, skipped))


@pytest.mark.parametrize(
    "command, why",
    [
        (".venv/bin/python -m tools.compare_loss --config train_configs/llama3.toml --no-such-option 3", "exit 2"),
        (".venv/bin/python -m no_such_module_here --help", "no module named"),
        (".venv/bin/python -m parallel_dims --world-size 8 --tpp 2", "exit 2"),
        (".venv/bin/python scripts/no_such_script.py --out x", "do not exist"),
        (".venv/bin/torchrun --nproc_per_node=4 train.py --config llama3.toml --training.stesp 3", "training.steps"),
        (".venv/bin/python train.py --config no_such_config.toml", "no_such_config"),
        ("make no-such-target", "make -n"),
        ("make bench-gpu ARGS='--modes sideways'", "exit 2"),
        ("sbatch --nodes=2 scripts/slurm_train.sh train_configs/nope.toml", "nope.toml"),
        ("frobnicate --now", "no rule for the program"),
        (".venv/bin/python -m benchmarks.run --only no_such_section", "exit 2"),
        (
            ".venv/bin/python -m tools.compare_loss --config llama3.toml --layouts fsdp=2 -- --training.nope 1",
            "training.nope",
        ),
    ],
)
def test_checker_rejects_what_would_not_run(command, why, monkeypatch):
    """Negative controls: a made-up option, module, script, key, config, target or program."""
    monkeypatch.chdir(ROOT)
    with pytest.raises((AssertionError, ValueError), match=re.escape(why)):
        check_command(command)


def test_checker_skips_only_illustrations():
    assert check_command(".venv/bin/python -m tools.compare_loss ... --diagnose").startswith("skipped")
    assert check_command("train.py --config <your config>").startswith("skipped")


def test_extraction_joins_continuations_and_reads_console_prompts(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "```bash\nmake test   # comment\n.venv/bin/python -m x --a 1 \\\n    --b 2\n```\n"
        "```console\n$ make lint\nsome output\n```\n```python\nprint('not shell')\n```\n"
    )
    texts = [c.text for c in extract_commands(page, root=tmp_path)]
    assert texts == ["make test", ".venv/bin/python -m x --a 1 --b 2", "make lint"]


# ------------------------------------------------------------------ links


def github_anchor(heading: str) -> str:
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return "".join(c for c in text if c.isalnum() or c in " -_").replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found, in_code = set(), False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            in_code = not in_code
        elif not in_code and (m := re.match(r"^#{1,6}\s+(.*)$", line)):
            found.add(github_anchor(m.group(1)))
    return found


def relative_links(path: Path) -> list[tuple[int, str]]:
    links, in_code = [], False
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_code = not in_code
            continue
        if in_code:
            continue
        for target in re.findall(r"\]\(([^)\s]+)\)", re.sub(r"`[^`]*`", "", line)):
            if not re.match(r"^[a-z]+:", target):
                links.append((i, target))
    return links


def test_every_relative_link_resolves():
    broken = []
    for page in PAGES:
        for line, target in relative_links(page):
            file, _, frag = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}:{line}: {target} (no such file)")
            elif frag and dest.suffix == ".md" and frag not in anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}:{line}: {target} (no heading #{frag})")
    assert not broken, "\n".join(broken)


def test_docs_pages_start_with_a_title_and_a_summary():
    for page in PAGES:
        lines = page.read_text().splitlines()
        assert lines[0].startswith("# "), page
        body = [line for line in lines[1:] if line.strip() and not line.startswith("<!--")]
        assert body and not body[0].startswith(("#", "```", "|", "-")), f"{page}: no summary paragraph"


def test_readme_is_a_front_door():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


def test_readme_parallel_dims_example_runs():
    """The README's ParallelDims snippet is a real program: it runs as shown (one process, the
    fake backend), in a fresh interpreter so its process group stays out of this one; so do the
    calls docs/parallel_dims.md lists."""
    readme = re.search(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert readme and "ParallelDims(" in readme.group(1)
    # docs/parallel_dims.md's API tour, inside a 16-rank fake group as its text says
    api = re.search(r"```python\n(.*?)```", (ROOT / "docs" / "parallel_dims.md").read_text(), re.S)
    assert api and "world_size=16" in api.group(1)
    fake_group = "dist.init_process_group('fake', store=FakeStore(), rank=3, world_size=16)\n"
    code = readme.group(1) + fake_group + api.group(1)
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "DeviceMesh((dp_replicate=2, fsdp=4)" in res.stdout and "None" in res.stdout
